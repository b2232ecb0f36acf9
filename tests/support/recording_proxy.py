"""A recording HTTP proxy on a loopback port, between a client we did not write and the gateway: what went each way,
byte for byte, for the tests that replay or tamper with a real client's messages."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import requests

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


@dataclass
class Exchange:
    path: str
    headers: dict[str, str]
    request: bytes
    status: int = 0
    response: bytes = b""


@dataclass
class RecordingProxy:
    """Forwards every POST to `upstream` (scheme, host and port) after `tamper` (None: as it came)."""

    upstream: str
    tamper: Callable[[bytes], bytes] | None = None
    exchanges: list[Exchange] = field(default_factory=list)

    def __post_init__(self) -> None:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                ex = Exchange(self.path, headers, body)
                proxy.exchanges.append(ex)
                sent = proxy.tamper(body) if proxy.tamper else body
                got = requests.post(proxy.upstream + self.path, data=sent, headers=headers, timeout=30)
                ex.status, ex.response = got.status_code, got.content
                self.send_response(got.status_code)
                self.send_header("content-type", got.headers.get("content-type", "text/xml"))
                self.send_header("content-length", str(len(got.content)))
                self.end_headers()
                self.wfile.write(got.content)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
