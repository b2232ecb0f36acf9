"""Large messages end to end: bodies up to a route's limit (the default 10 MiB) pass both ways through the real
Envoy and filter workers, intact and, on a secured route, signed; one byte over is a SOAP fault that never
reaches the backend; each route's own limit holds even where Envoy's buffer is larger; the workers' body budget
and Envoy's heap limit refuse what does not fit with a 503 SOAP fault instead of growing."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from lxml import etree

from gateway.control.supervisor import Gateway, Options
from gateway.policy import PolicyError, Route
from gateway.tools.client import Client, ClientConfig
from loadtest.large import echo
from tests.harness import content_type, envelope, running_gateway, write_policies
from tests.wss_helpers import DEMO, echo_response, route_doc

MIB = 1024 * 1024
SMALL = 300_000  # the `small` route's limit, both ways


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[Gateway]:
    routes = [
        {"name": "xml", "match": {"path_prefix": "/xml/"}, "upstream": {"address": "BACKEND"}, "profile": "xml"},
        {"name": "small", "match": {"path_prefix": "/small/"}, "upstream": {"address": "BACKEND"}, "profile": "xml",
         "limits": {"max_body_bytes": SMALL}, "response_limits": {"max_body_bytes": SMALL}},
        route_doc(pki, "rsa", name="rsa", replay={"store": "auto"}),
    ]  # fmt: skip
    with running_gateway(tmp_path_factory.mktemp("large"), routes, pki, workers=2, metrics=True) as g:
        yield g


def post(gw: Gateway, path: str, body: bytes | Iterator[bytes], version: str = "1.1") -> requests.Response:
    return requests.post(f"http://127.0.0.1:{gw.opts.http_port}{path}", data=body,
                         headers={"content-type": content_type(version)}, timeout=120)  # fmt: skip


def received(gw: Gateway) -> list[dict]:
    return requests.get(f"http://{gw.backend_addr}/_received", timeout=5).json()  # type: ignore[attr-defined]


def clear(gw: Gateway) -> None:
    requests.delete(f"http://{gw.backend_addr}/_received", timeout=5)  # type: ignore[attr-defined]


def fault_of(resp: requests.Response) -> tuple[str, str]:
    root = etree.fromstring(resp.content)
    code = root.findtext(".//faultcode") or root.findtext(".//{*}Code/{*}Value")
    text = root.findtext(".//faultstring") or root.findtext(".//{*}Reason/{*}Text")
    return code or "", text or ""


def exactly(size: int, version: str = "1.1") -> bytes:
    """An echo request of exactly `size` bytes: texts of 1 MB (under max_text_length) and one for the rest."""
    tag = len("<d:text></d:text>")
    remaining = size - len(envelope(f'<d:echo xmlns:d="{DEMO}"></d:echo>', version)) - tag
    texts = []
    while remaining >= 1_000_000 + tag:
        texts.append("x" * 1_000_000)
        remaining -= 1_000_000 + tag
    texts.append("y" * remaining)
    body = envelope(f'<d:echo xmlns:d="{DEMO}">' + "".join(f"<d:text>{t}</d:text>" for t in texts) + "</d:echo>",
                    version)  # fmt: skip
    assert len(body) == size, (len(body), size)
    return body


def sender_fault(version: str) -> str:
    return "env:Sender" if version == "1.2" else "soap:Client"


def receiver_fault(version: str) -> str:
    return "env:Receiver" if version == "1.2" else "soap:Server"


def test_xml_route_passes_a_body_at_the_default_limit_intact(gw: Gateway) -> None:
    body = exactly(10 * MIB - 16)  # its echo is 16 bytes longer: exactly 10 MiB back
    clear(gw)
    r = post(gw, "/xml/demo", body)
    assert r.status_code == 200, r.text[:500]
    assert r.content == echo_response(body)  # every byte there and back
    got = received(gw)[-1]
    assert got["headers"]["content-length"] == str(len(body))
    assert body.decode().startswith(got["body"])


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_one_byte_over_the_default_limit_is_refused(gw: Gateway, version: str) -> None:
    clear(gw)
    r = post(gw, "/xml/demo", exactly(10 * MIB + 1, version), version)
    assert r.status_code == 413
    assert r.headers["content-type"].startswith(content_type(version).split(";")[0])
    assert fault_of(r) == (sender_fault(version), "Message too large")
    assert received(gw) == []


def test_backend_response_over_the_limit_is_a_502_fault(gw: Gateway) -> None:
    clear(gw)
    r = post(gw, "/xml/demo", exactly(10 * MIB))  # allowed in; its echo is 16 bytes over the response limit
    assert r.status_code == 502  # from the filter (declared length) or Envoy (buffer full), whichever is first
    assert fault_of(r) == ("soap:Server", "The gateway could not process the message")
    assert len(received(gw)) == 1


def test_rsa_route_verifies_and_signs_10mb_both_ways(gw: Gateway, pki: Path) -> None:
    doc = route_doc(pki, "rsa", name="rsa", replay={"store": "auto"})
    client = Client(Route.model_validate({**doc, "upstream": {"address": "127.0.0.1:1"}}), ClientConfig(certs=pki))
    plain, texts = echo(10 * MIB - 8 * 1024, "signed-")  # room for the Security header
    secured, pending = client.secure(plain)
    assert 10 * MIB - 8 * 1024 < len(secured) <= 10 * MIB
    clear(gw)
    r = post(gw, "/rsa/demo", secured)
    assert r.status_code == 200, r.text[:500]
    assert b"ds:Signature" in r.content[:20_000]  # the ~10 MB response came back signed
    reply = client.open(r.content, pending)  # and the signature verifies
    assert [t.text for t in reply.body.iter(f"{{{DEMO}}}text")] == texts
    got = received(gw)[-1]
    assert got["headers"]["x-wsgate-subject"] == "CN=Demo Client,O=WSGate Demo"
    assert "Security" not in got["body"] and int(got["headers"]["content-length"]) == len(plain)


def test_a_smaller_route_limit_holds_where_envoy_buffers_more(gw: Gateway) -> None:
    assert post(gw, "/small/demo", exactly(SMALL - 16)).status_code == 200
    clear(gw)
    r = post(gw, "/small/demo", exactly(SMALL + 1))
    assert r.status_code == 413 and fault_of(r) == ("soap:Client", "Message too large")
    # Without a content-length (chunked), the body is refused once it is seen whole.
    body = exactly(SMALL + 1)
    r = post(gw, "/small/demo", (body[i : i + 65536] for i in range(0, len(body), 65536)))
    assert r.status_code == 413 and fault_of(r)[0] == "soap:Client"
    assert received(gw) == []
    # The larger route on the same listener still takes what the small one refuses.
    assert post(gw, "/xml/demo", body).status_code == 200


class _ChunkedBackend(http.server.BaseHTTPRequestHandler):
    """Answers every POST with a chunked SOAP reply of `size` bytes: no content-length to refuse it early by."""

    protocol_version = "HTTP/1.1"
    size = 2 * SMALL

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        body = exactly(self.size)
        self.send_response(200)
        self.send_header("content-type", "text/xml")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i in range(0, len(body), 65536):
            chunk = body[i : i + 65536]
            self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: object) -> None:
        pass


# Envoy buffers the reply whole and the filter refuses it; or it is over the route's stream buffer and Envoy does.
@pytest.mark.parametrize("request_limit", [10 * MIB, SMALL])
@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_chunked_backend_response_over_the_limit_is_a_502_fault(
    tmp_path: Path, pki: Path, version: str, request_limit: int
) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ChunkedBackend)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    routes = [{"name": "small", "match": {"path_prefix": "/"}, "profile": "xml",
               "upstream": {"address": f"127.0.0.1:{server.server_address[1]}"},
               "limits": {"max_body_bytes": request_limit}, "response_limits": {"max_body_bytes": SMALL}}]  # fmt: skip
    try:
        with running_gateway(tmp_path, routes, pki, backend=False) as g:
            r = post(g, "/demo", exactly(1000, version), version)
            assert r.status_code == 502
            assert r.headers["content-type"].startswith(content_type(version).split(";")[0])
            assert fault_of(r) == (receiver_fault(version), "The gateway could not process the message")
    finally:
        server.shutdown()


def in_flight(gw: Gateway) -> float:
    text = requests.get(gw.metrics_urls()[0], timeout=5).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("wsgate_body_bytes_in_flight")))


class _HoldingBackend(http.server.BaseHTTPRequestHandler):
    """Takes a request, then holds its answer until `release` is set: the exchange stays in flight meanwhile."""

    protocol_version = "HTTP/1.1"
    release = threading.Event()
    seen: list[int] = []  # the body size of every request that reached it

    def do_POST(self) -> None:
        self.seen.append(len(self.rfile.read(int(self.headers["content-length"]))))
        self.release.wait(30)
        body = envelope("<ok/>")
        self.send_response(200)
        self.send_header("content-type", "text/xml")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_body_budget_refuses_what_does_not_fit_and_frees_on_completion(tmp_path: Path, pki: Path) -> None:
    limit = 600_000  # two of these do not fit a 1 MiB budget
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HoldingBackend)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    routes = [{"name": "xml", "match": {"path_prefix": "/"}, "profile": "xml",
               "upstream": {"address": f"127.0.0.1:{server.server_address[1]}"},
               "limits": {"max_body_bytes": limit}, "response_limits": {"max_body_bytes": limit}}]  # fmt: skip
    body = exactly(limit - 16)
    _HoldingBackend.release.clear()
    _HoldingBackend.seen.clear()
    try:
        with running_gateway(tmp_path, routes, pki, metrics=True, body_budget_mb=1, backend=False) as g:
            # A declared length reserves nothing: a client that declared its body and sent half of it holds none.
            slow = socket.create_connection(("127.0.0.1", g.opts.http_port))
            slow.sendall(f"POST /demo HTTP/1.1\r\nhost: x\r\ncontent-type: text/xml\r\ncontent-length: {len(body)}"
                         "\r\n\r\n".encode() + body[: len(body) // 2])  # fmt: skip
            time.sleep(0.5)
            assert in_flight(g) == 0
            slow.close()
            # A body the filter passed on holds its reservation until its exchange ends (here: the backend holds).
            first = threading.Thread(target=lambda: results.append(post(g, "/demo", body)))
            results: list[requests.Response] = []
            first.start()
            deadline = time.monotonic() + 10
            while in_flight(g) != len(body):
                assert time.monotonic() < deadline, "the first request never reached the filter"
                time.sleep(0.05)
            for version in ("1.1", "1.2"):
                r = post(g, "/demo", exactly(limit - 16, version), version)
                assert r.status_code == 503
                assert fault_of(r) == (receiver_fault(version), "Service unavailable")
            assert _HoldingBackend.seen == [len(body)]  # refused, not queued
            metrics = requests.get(g.metrics_urls()[0], timeout=5).text
            assert 'wsgate_faults_total{profile="xml",reason="busy",route="xml"} 2.0' in metrics
            assert 'wsgate_frame_refusals_total{reason="busy"} 2.0' in metrics
            # The first request completes; its reservation is released and the next one fits.
            _HoldingBackend.release.set()
            first.join(30)
            assert results[0].status_code == 200
            deadline = time.monotonic() + 10
            while in_flight(g) != 0:  # the exchange ends just after its reply left
                assert time.monotonic() < deadline, "the reservation was never released"
                time.sleep(0.05)
            assert post(g, "/demo", body).status_code == 200
    finally:
        _HoldingBackend.release.set()
        server.shutdown()


def test_policies_whose_bodies_exceed_the_budget_are_refused(tmp_path: Path, pki: Path) -> None:
    routes = [{"name": "xml", "match": {"path_prefix": "/"}, "upstream": {"address": "127.0.0.1:1"}, "profile": "xml"}]
    opts = Options.on_free_ports(1, policies=write_policies(tmp_path / "p", routes), certs=pki,
                                 run_dir=tmp_path / "run", body_budget_mb=8)  # fmt: skip
    gw = Gateway(opts)
    with pytest.raises(PolicyError, match="route xml: bodies of up to 10485760 bytes do not fit"):
        gw.start()
    gw.stop()


def test_envoy_over_its_heap_limit_refuses_new_requests(tmp_path: Path, pki: Path) -> None:
    routes = [{"name": "xml", "match": {"path_prefix": "/xml/"}, "upstream": {"address": "BACKEND"}, "profile": "xml"},
              {"name": "plain", "match": {"path_prefix": "/plain/"}, "upstream": {"address": "BACKEND"},
               "profile": "none"}]  # fmt: skip
    with running_gateway(tmp_path, routes, pki, envoy_max_heap_mb=1) as g:  # below what Envoy needs idle
        stat = f"http://127.0.0.1:{g.opts.admin_port}/stats?filter=stop_accepting_requests.active$"
        deadline = time.monotonic() + 10
        while not requests.get(stat, timeout=5).text.strip().endswith(": 1"):
            assert time.monotonic() < deadline, "the overload manager never saw the heap"
            time.sleep(0.1)
        clear(g)
        for path in ("/xml/demo", "/plain/demo"):
            for version in ("1.1", "1.2"):
                r = post(g, path, exactly(1000, version), version)
                assert r.status_code == 503
                assert fault_of(r) == (receiver_fault(version), "Service unavailable")
        assert received(g) == []
