"""Eclipse Metro 4.0.4 (tests/interop/metro, built by `make metro`) as a long-lived Java process: JSON lines on its
stdin and stdout, one JVM for the whole test session. `call` has Metro read the gateway's published WSDL and its
WS-SecurityPolicy as they are, and send payloads on one Dispatch: the client's keys and trust are the only
configuration (tests/interop/metro/src/main/java/wsgate/metro/ClientConfig.java)."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path
from typing import Any, BinaryIO

from tests.support.java_process import JsonLineProcess

JAR = Path(__file__).parents[1] / "interop" / "metro" / "target" / "metro-client.jar"


class MetroError(Exception):
    """Metro refused or failed (its own error text and causes); `trace` is the Java stack trace."""

    def __init__(self, message: str, trace: str = "") -> None:
        super().__init__(message)
        self.trace = trace


class Metro(JsonLineProcess):
    """One `java -jar metro-client.jar` process; calls are serialized (one request line, one answer line)."""

    name = "the Metro client"
    make_target = "metro"

    def __init__(self, log: BinaryIO | int = subprocess.DEVNULL, jar: Path = JAR) -> None:
        super().__init__(jar, log)

    def refused(self, error: str, trace: str) -> Exception:
        return MetroError(error, trace)

    def invoke(self, wsdl: str, service: str, port: str, payloads: list[str], **params: Any) -> list[str]:
        """Metro's replies to `payloads`, sent in turn on one Dispatch of `port` built from the WSDL at `wsdl`."""
        return self.call("call", wsdl=wsdl, service=service, port=port, payloads=payloads, **params)["replies"]

    def mtom_echo(self, endpoint: str, data: bytes, soap12: bool = False, **params: Any) -> bytes:
        """The demo echo of `data` as Metro sends it with MTOM (an XOP attachment) and reads its reply's;
        `params`: tls_trust (PEM files) for HTTPS."""
        reply = self.call("mtom", endpoint=endpoint, data=base64.b64encode(data).decode(), soap12=soap12, **params)
        return base64.b64decode(reply["data"])
