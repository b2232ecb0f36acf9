"""Routes taking attachments have their bodies streamed by Envoy (ext_proc FULL_DUPLEX_STREAMED): the frame holds
every chunk, and only once the engine has passed the whole message does it answer the held headers and send the
body back. Promise 1 still holds, through the running gateway (real Envoy, filter workers) against a backend that
records every byte it is sent: a message refused at its last byte sends nothing on, not a connection's headers,
and the client (or for a reply, the client) gets only the SOAP fault."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from filters.engine.mime import package as mime
from gateway.policy import Attachments
from tests.support import mime as build
from tests.support.harness import GatewayFactory, LiveGateway, fault_code
from tests.support.wss_helpers import echo, route_doc

# Large enough that Envoy streams it in many chunks; its last bytes are the ones bent.
ATTACHMENT = bytes(range(256)) * 12 * 1024  # 3 MiB
ACCEPT = {"accept": True, "max_part_bytes": 4 * 1024 * 1024}
LIMIT = 4 * 1024 * 1024


class Recorder:
    """A backend that records every byte it is sent and answers each request with `reply` (raw HTTP) once its
    headers arrived, or never (None): a request that reached it at all is seen here, complete or not."""

    def __init__(self, reply: bytes | None = None) -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.received = bytearray()
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            answered = False
            while data := conn.recv(65536):
                self.received += data
                if self.reply is not None and not answered and b"\r\n\r\n" in self.received:
                    conn.sendall(self.reply)
                    answered = True

    def clear(self) -> None:
        self.received.clear()
        self.connections = 0


def _package(close: bytes = b"--\r\n") -> tuple[str, bytes]:
    """An MTOM package of ATTACHMENT; `close`: what follows its last delimiter (well formed: `--\r\n`)."""
    content_type, body = build.mtom({"a@test": ATTACHMENT})
    return content_type, body[: -len(b"--\r\n")] + close


@pytest.fixture(scope="module")
def silent() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def bent_reply() -> Recorder:
    """A backend answering a package whose closing delimiter, its last bytes, is missing."""
    content_type, body = _package(close=b"\r\n")
    head = f"HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
    return Recorder(head + body)


@pytest.fixture(scope="module")
def accepted() -> Recorder:
    """A backend answering 202 with no body, as one-way operations do."""
    return Recorder(b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n")


@pytest.fixture(scope="module")
def gw(
    module_gateway: GatewayFactory, pki: Path, silent: Recorder, bent_reply: Recorder, accepted: Recorder
) -> LiveGateway:
    def xml(name: str, upstream: str, **attachments: bool) -> dict:
        return {"name": name, "match": {"path_prefix": f"/{name}/"}, "upstream": {"address": upstream},
                "profile": "xml", "attachments": {**ACCEPT, **attachments}, "limits": {"max_body_bytes": LIMIT},
                "response_limits": {"max_body_bytes": LIMIT}}  # fmt: skip

    rsa = route_doc(pki, "rsa", name="rsa", attachments=ACCEPT)
    rsa["upstream"] = {"address": silent.address}
    routes = [xml("xml", silent.address), xml("reply", bent_reply.address), xml("oneway", accepted.address), rsa,
              xml("legacy", silent.address, streamed=False)]  # fmt: skip
    return module_gateway(routes, workers=1)


@pytest.fixture(autouse=True)
def _clear(silent: Recorder) -> Iterator[None]:
    silent.clear()
    yield


def _post(
    gw: LiveGateway, route: str, content_type: str, body: bytes | Iterator[bytes], timeout: float = 60
) -> requests.Response:
    return gw.post(route, body, headers={"content-type": content_type}, timeout=timeout)  # type: ignore[arg-type]


def test_a_package_refused_at_its_last_bytes_sends_nothing_to_the_backend(gw: LiveGateway, silent: Recorder) -> None:
    r = _post(gw, "xml", *_package(close=b"\r\n"))  # no closing delimiter: known only at the end
    assert r.status_code == 500 and fault_code(r) == "Client", r.text[:300]
    assert r.headers["content-type"].startswith("text/xml") and ATTACHMENT[:64] not in r.content
    assert (silent.connections, bytes(silent.received)) == (0, b"")


def test_a_signed_attachment_changed_in_its_last_byte_sends_nothing_to_the_backend(
    gw: LiveGateway, silent: Recorder
) -> None:
    client = gw.client("rsa")
    root = echo(f'<xop:Include xmlns:xop="{build.XOP}" href="cid:a@test"/>')
    parts = mime.parse(*build.mtom({"a@test": ATTACHMENT}, root=root), Attachments(**ACCEPT)).attachments
    secured, _ = client.secure(root, parts)  # signed over the attachment as it was
    changed = ATTACHMENT[:-1] + bytes([ATTACHMENT[-1] ^ 1])
    r = _post(gw, "rsa", *build.mtom({"a@test": changed}, root=secured))
    assert r.status_code == 500 and fault_code(r) == "FailedCheck" and ATTACHMENT[:64] not in r.content, r.text[:300]
    assert (silent.connections, bytes(silent.received)) == (0, b"")
    # The same package unchanged passes (the refusal was that byte's): it reaches the backend, whole.
    with contextlib.suppress(requests.exceptions.Timeout):  # the recorder never answers
        _post(gw, "rsa", *build.mtom({"a@test": ATTACHMENT}, root=secured), timeout=3)
    deadline = time.monotonic() + 10
    while ATTACHMENT[-4096:] not in silent.received and time.monotonic() < deadline:
        time.sleep(0.05)
    assert silent.connections == 1 and ATTACHMENT[-4096:] in silent.received


def test_a_chunked_package_over_the_routes_limit_is_refused_before_the_backend(
    gw: LiveGateway, silent: Recorder
) -> None:
    # No content-length: Envoy streams it and the frame counts what arrives against the route's limit.
    content_type, body = build.mtom({"a@test": ATTACHMENT + ATTACHMENT})
    r = _post(gw, "xml", content_type, iter([body[i : i + 65536] for i in range(0, len(body), 65536)]))
    assert r.status_code == 413 and fault_code(r) == "Client", r.text[:300]
    assert (silent.connections, bytes(silent.received)) == (0, b"")


def test_a_reply_refused_at_its_last_bytes_reaches_the_client_only_as_a_fault(gw: LiveGateway) -> None:
    r = _post(gw, "reply", *_package())
    assert r.status_code == 502 and fault_code(r) == "Server", r.text[:300]
    assert r.headers["content-type"].startswith("text/xml") and ATTACHMENT[:64] not in r.content


def test_a_reply_without_a_body_is_passed_at_once(gw: LiveGateway, accepted: Recorder) -> None:
    # Nothing to hold for a verdict: held, the client would wait for a body that never comes.
    content_type, body = _package()
    r = _post(gw, "oneway", content_type, body, timeout=10)
    assert (r.status_code, r.content) == (202, b"")
    assert ATTACHMENT[-4096:] in accepted.received  # the request went on whole


def test_a_backend_that_needs_a_length_gets_content_length_on_a_route_not_streamed(
    gw: LiveGateway, silent: Recorder
) -> None:
    # `attachments.streamed: false`: Envoy buffers the package as on other routes, and the frame sets its length.
    content_type, body = _package()
    with contextlib.suppress(requests.exceptions.Timeout):  # the recorder never answers
        _post(gw, "legacy", content_type, body, timeout=3)
    deadline = time.monotonic() + 10
    while ATTACHMENT[-4096:] not in silent.received and time.monotonic() < deadline:
        time.sleep(0.05)
    head = bytes(silent.received).split(b"\r\n\r\n", 1)[0].lower()
    assert f"content-length: {len(body)}".encode() in head and b"transfer-encoding" not in head, head
    assert bytes(silent.received).endswith(body)
