"""A real Apache WSS4J 4.0.1 (tests/interop/wss4j, built by `make wss4j`) as a long-lived Java process: JSON lines
on its stdin and stdout, one JVM for the whole test session. `secure` builds a request with WSS4J's WSSec*
classes, `verify` runs WSS4J's WSSecurityEngine (Basic Security Profile enforcement on) over a reply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.java_process import JsonLineProcess

JAR = Path(__file__).parents[1] / "interop" / "wss4j" / "target" / "wss4j-harness.jar"

SOAP11 = "http://schemas.xmlsoap.org/soap/envelope/"
SOAP12 = "http://www.w3.org/2003/05/soap-envelope"
WSA = "http://www.w3.org/2005/08/addressing"
DS = "http://www.w3.org/2000/09/xmldsig#"
WSU = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-wssecurity-utility-1.0.xsd"
WSSE = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-wssecurity-secext-1.0.xsd"


class Wss4jError(Exception):
    """WSS4J refused (its own error text), or the harness could not do what was asked."""


class Wss4j(JsonLineProcess):
    """One `java -jar wss4j-harness.jar` process; calls are serialized (one request line, one answer line)."""

    name = "the WSS4J harness"
    make_target = "wss4j"

    def __init__(self, jar: Path = JAR) -> None:
        super().__init__(jar)

    def refused(self, error: str, trace: str) -> Exception:
        """WSS4J's refusal, with WSS4J's message."""
        return Wss4jError(error + ("\n" + trace if trace else ""))

    def secure(
        self, xml: bytes, steps: list[dict[str, Any]], layout: str = "prepend", attachments: list[Any] | None = None
    ) -> dict[str, Any]:
        """`attachments`: [{"id", "headers", "body" (base64)}] for WSS4J's AttachmentCallbackHandler (a step's
        "attachments": "Element" or "Content" signs or encrypts them all); the answer has them as WSS4J left them."""
        return self.call("secure", xml=xml.decode(), steps=steps, layout=layout, attachments=attachments or [])

    def verify(self, xml: bytes, **params: Any) -> dict[str, Any]:
        return self.call("verify", xml=xml.decode(), **params)

    def sc_issue(self, identifier: str, entropy: str, key_bits: int) -> dict[str, Any]:
        """A context's secret, WS-Trust's ComputedKey: WSS4J's P_SHA1 of the requestor's `entropy` (base64) and
        fresh issuer entropy (the answer's "entropy"). The secret stays in the JVM, under `identifier`."""
        return self.call("sc_issue", identifier=identifier, entropy=entropy, key_bits=key_bits)

    def sc_cancel(self, identifier: str) -> None:
        self.call("sc_cancel", identifier=identifier)


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
