"""A real Apache WSS4J 4.0.1 (tests/interop/wss4j, built by `make wss4j`) as a long-lived Java process: JSON lines
on its stdin and stdout, one JVM for the whole test session. `secure` builds a request with WSS4J's WSSec*
classes, `verify` runs WSS4J's WSSecurityEngine (Basic Security Profile enforcement on) over a reply."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

JAR = Path(__file__).parents[1] / "interop" / "wss4j" / "target" / "wss4j-harness.jar"

SOAP11 = "http://schemas.xmlsoap.org/soap/envelope/"
SOAP12 = "http://www.w3.org/2003/05/soap-envelope"
WSA = "http://www.w3.org/2005/08/addressing"
DS = "http://www.w3.org/2000/09/xmldsig#"
WSU = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-wssecurity-utility-1.0.xsd"
WSSE = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-wssecurity-secext-1.0.xsd"


class Wss4jError(Exception):
    """WSS4J refused (its own error text), or the harness could not do what was asked."""


class Wss4j:
    """One `java -jar wss4j-harness.jar` process; calls are serialized (one request line, one answer line)."""

    def __init__(self, jar: Path = JAR) -> None:
        java = shutil.which("java")
        if java is None:
            raise RuntimeError("java is needed for the WSS4J interop tests: apt-get install -y openjdk-17-jre-headless")
        if not jar.exists():
            raise RuntimeError(f"{jar} is missing: build it with `make wss4j` (Maven, Java 17)")
        # C1 only: a test session is short, and the JIT's start-up is most of its Java time.
        self.proc = subprocess.Popen(
            [java, "-XX:TieredStopAtLevel=1", "-jar", str(jar)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            encoding="utf-8",
        )
        self.lock = threading.Lock()
        self.call("ping")

    def call(self, op: str, **params: Any) -> dict[str, Any]:
        """The answer's fields; WSS4J's refusal raises Wss4jError with WSS4J's message."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write(json.dumps({"op": op, **params}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the WSS4J harness exited ({self.proc.poll()})")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise Wss4jError(answer["error"] + ("\n" + answer["trace"] if "trace" in answer else ""))
        return answer

    def secure(self, xml: bytes, steps: list[dict[str, Any]], layout: str = "prepend") -> dict[str, Any]:
        return self.call("secure", xml=xml.decode(), steps=steps, layout=layout)

    def verify(self, xml: bytes, **params: Any) -> dict[str, Any]:
        return self.call("verify", xml=xml.decode(), **params)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def part(local: str, namespace: str, modifier: str = "Element") -> str:
    """A WSS4J part name: {Element|Content}{namespace}localName."""
    return f"{{{modifier}}}{{{namespace}}}{local}"


def soap_ns(version: str) -> str:
    return SOAP12 if version == "1.2" else SOAP11


# WS-Addressing headers as CXF, Metro and WCF send them, and what WSS4J signs of them.
ADDRESSING_HEADERS = ("To", "Action", "MessageID", "ReplyTo")
ANONYMOUS = f"{WSA}/anonymous"


def addressed(text: str, version: str, to: str, action: str, message_id: str) -> bytes:
    """A plain echo request with wsa:To, wsa:Action, wsa:MessageID and wsa:ReplyTo (WS-Addressing 1.0)."""
    header = (
        f"<wsa:To>{to}</wsa:To><wsa:Action>{action}</wsa:Action><wsa:MessageID>{message_id}</wsa:MessageID>"
        f"<wsa:ReplyTo><wsa:Address>{ANONYMOUS}</wsa:Address></wsa:ReplyTo>"
    )
    return (
        f'<soap:Envelope xmlns:soap="{soap_ns(version)}" xmlns:wsa="{WSA}"><soap:Header>{header}</soap:Header>'
        f'<soap:Body><d:echo xmlns:d="urn:wsgate:demo"><d:text>{text}</d:text></d:echo></soap:Body></soap:Envelope>'
    ).encode()


def signed_parts(version: str, *extra: str, addressing: bool = True) -> list[str]:
    """Body, Timestamp and (as CXF signs them) the WS-Addressing headers, plus `extra` parts."""
    wsa = [part(h, WSA) for h in ADDRESSING_HEADERS] if addressing else []
    return [part("Body", soap_ns(version)), part("Timestamp", WSU), *wsa, *extra]


def x509_sign(pki: Path, parts: list[str], stem: str = "client") -> dict[str, Any]:
    """WSS4J's X.509 signature: the certificate in a BinarySecurityToken, RSA-SHA256, SHA-256 digests."""
    return {"do": "sign", "with": "x509", "key": str(pki / f"{stem}.key"), "cert": str(pki / f"{stem}.pem"),
            "parts": parts}  # fmt: skip


def encrypt_to_gateway(pki: Path, parts: list[str]) -> dict[str, Any]:
    """WSS4J's encryption action: AES-256-GCM under a fresh key, RSA-OAEP to the gateway's certificate (SKI)."""
    return {"do": "encrypt", "with": "x509", "cert": str(pki / "gateway-enc.pem"), "parts": parts}
