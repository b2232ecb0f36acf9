"""A recording HTTP proxy on a loopback port, between a client we did not write and the gateway: what went each way,
byte for byte, for the tests that replay or tamper with a real client's messages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import requests

from tests.support.harness import LoopbackHttp

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


@dataclass
class Exchange:
    path: str
    headers: dict[str, str]
    request: bytes
    status: int = 0
    response: bytes = b""


class RecordingProxy(LoopbackHttp):
    """Forwards every request to `upstream` (scheme, host and port) after `tamper` (None: as it came)."""

    protocol_version = "HTTP/1.1"

    def __init__(self, upstream: str, tamper: Callable[[bytes], bytes] | None = None) -> None:
        self.upstream = upstream
        self.tamper = tamper
        self.exchanges: list[Exchange] = []
        super().__init__()

    def respond(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        headers = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}
        ex = Exchange(path, headers, body)
        self.exchanges.append(ex)
        sent = self.tamper(body) if self.tamper else body
        got = requests.post(self.upstream + path, data=sent, headers=headers, timeout=30)
        ex.status, ex.response = got.status_code, got.content
        return got.status_code, got.headers.get("content-type", "text/xml"), got.content
