"""The demo backend over real HTTP: `requests` for ordinary exchanges, raw sockets for framing details."""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from lxml import etree

from gateway.control.ports import free_ports
from gateway.tools import demo_backend

SOAP11 = "http://schemas.xmlsoap.org/soap/envelope/"
SOAP12 = "http://www.w3.org/2003/05/soap-envelope"
DEMO = "urn:wsgate:demo"
CT11 = "text/xml; charset=utf-8"
CT12 = "application/soap+xml; charset=utf-8"
ROOT = Path(__file__).resolve().parents[2]


def envelope(version: str, body: str) -> bytes:
    soap = SOAP12 if version == "1.2" else SOAP11
    return f'<s:Envelope xmlns:s="{soap}" xmlns:d="{DEMO}"><s:Body>{body}</s:Body></s:Envelope>'.encode()


def query(count: int | str, version: str = "1.1") -> bytes:
    return envelope(version, f"<d:query><d:count>{count}</d:count></d:query>")


ECHO_INNER = 'hello <d:item n="1">one</d:item><o:x xmlns:o="urn:other">two<d:deep>three</d:deep></o:x> tail'


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """The backend on a free loopback port, served by its own event loop in a background thread."""
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(demo_backend.start("127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield server.sockets[0].getsockname()[1]

    async def shutdown() -> None:
        server.close()
        # Keep-alive connections outlive the listening socket: end their handlers too.
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()

    asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


@pytest.fixture
def url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def post(url: str, body: bytes, version: str = "1.1", path: str = "/service") -> requests.Response:
    return requests.post(url + path, data=body, headers={"Content-Type": CT12 if version == "1.2" else CT11})


def body_child(resp: requests.Response, soap: str) -> etree._Element:
    root = etree.fromstring(resp.content)
    assert root.tag == f"{{{soap}}}Envelope"
    body = root.find(f"{{{soap}}}Body")
    assert body is not None and len(body) == 1
    return body[0]


def c14n(el: etree._Element) -> bytes:
    """Exclusive c14n: equal for equal content, whatever the surrounding envelope declares."""
    return etree.tostring(el, method="c14n", exclusive=True)


def fault_parts(resp: requests.Response, version: str) -> tuple[str, str]:
    """(code, message) of a fault response."""
    soap = SOAP12 if version == "1.2" else SOAP11
    fault = body_child(resp, soap)
    assert fault.tag == f"{{{soap}}}Fault"
    assert fault.findtext(f".//{{{DEMO}}}origin") == "demo-backend"
    if version == "1.2":
        return fault.findtext(f"{{{soap}}}Code/{{{soap}}}Value", ""), fault.findtext(f".//{{{soap}}}Text", "")
    return fault.findtext("faultcode", ""), fault.findtext("faultstring", "")


# ---- raw HTTP helpers


class Conn:
    """One raw keep-alive connection that reads responses framed by Content-Length."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.file = self.sock.makefile("rb")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        status_line = self.file.readline()
        assert status_line.startswith(b"HTTP/1.1 "), status_line
        headers: dict[str, str] = {}
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        return int(status_line.split()[1]), headers, self.file.read(length)

    def closed_by_server(self) -> bool:
        return self.file.read(1) == b""

    def close(self) -> None:
        self.file.close()
        self.sock.close()


@pytest.fixture
def conn(port: int) -> Iterator[Conn]:
    c = Conn(port)
    yield c
    c.close()


def request(body: bytes, *, path: str = "/service", headers: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: backend\r\nContent-Type: {CT11}\r\n{headers}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def chunked(body: bytes, sizes: tuple[int, ...], *, headers: str = "") -> bytes:
    """A chunked request of `body` cut at `sizes` (the rest as the last data chunk), with an extension."""
    out = f"POST /chunked HTTP/1.1\r\nHost: backend\r\nTransfer-Encoding: chunked\r\n{headers}\r\n".encode()
    pos = 0
    for size in (*sizes, len(body) - sum(sizes)):
        out += f"{size:x};ext=1\r\n".encode() + body[pos : pos + size] + b"\r\n"
        pos += size
    return out + b"0\r\nX-Trailer: yes\r\n\r\n"


# ---- SOAP behaviour


def test_health(url: str) -> None:
    resp = requests.get(url + "/health")
    assert resp.status_code == 200
    assert resp.text == "ok"


@pytest.mark.parametrize(("version", "soap", "ctype"), [("1.1", SOAP11, CT11), ("1.2", SOAP12, CT12)])
def test_echo_copies_children_and_text(url: str, version: str, soap: str, ctype: str) -> None:
    resp = post(url, envelope(version, f"<d:echo>{ECHO_INNER}</d:echo>"), version)
    assert resp.status_code == 200
    assert resp.headers["Content-Type"] == ctype
    out = body_child(resp, soap)
    assert out.tag == f"{{{DEMO}}}echoResponse"
    # The copy is the request's content, namespaces included, even those declared on the request's Envelope.
    expected = etree.fromstring(f'<d:echo xmlns:d="{DEMO}">{ECHO_INNER}</d:echo>')
    assert out.text == expected.text == "hello "
    assert [c14n(c) for c in out] == [c14n(c) for c in expected]
    assert out.find(f"{{{DEMO}}}item").get("n") == "1"
    assert out.findtext(f"{{urn:other}}x/{{{DEMO}}}deep") == "three"


def test_echo_declares_the_envelopes_namespaces_once_not_on_every_child(url: str) -> None:
    """A fair demo: the answer is about the request's size, whatever namespaces the request declares above it."""
    decls = "".join(f' xmlns:p{i}="urn:ns:{i}"' for i in range(30))
    children = "".join(f'<p{i % 30}:n p{(i + 1) % 30}:a="{i}"/>' for i in range(3000))
    body = envelope("1.1", f"<d:echo>{children}</d:echo>").replace(b"<s:Envelope", f"<s:Envelope{decls}".encode())
    resp = post(url, body, "1.1")
    assert resp.status_code == 200
    assert resp.content.count(b"xmlns") <= body.count(b"xmlns")
    assert len(resp.content) < len(body) * 1.1
    expected = etree.fromstring(body).find(f".//{{{DEMO}}}echo")
    assert [c14n(c) for c in body_child(resp, SOAP11)] == [c14n(c) for c in expected]


@pytest.mark.parametrize(("count", "low", "high"), [(4, 900, 1500), (100, 25_000, 35_000), (3500, 900_000, 1_100_000)])
def test_query_size_and_rows(url: str, count: int, low: int, high: int) -> None:
    resp = post(url, query(count))
    assert resp.status_code == 200
    assert low <= len(resp.content) <= high, len(resp.content)
    out = body_child(resp, SOAP11)
    assert out.tag == f"{{{DEMO}}}queryResponse"
    assert out.get("count") == str(count)
    quakes = out.findall(f"{{{DEMO}}}quake")
    assert len(quakes) == count
    fields = ["id", "time", "lat", "lon", "depth", "magnitude", "method", "status", "region"]
    assert [etree.QName(c).localname for c in quakes[0]] == fields
    assert [q.findtext(f"{{{DEMO}}}id") for q in quakes[:2]] == ["quake-000001", "quake-000002"]
    times = [q.findtext(f"{{{DEMO}}}time") for q in quakes]
    assert times == sorted(times)  # a catalogue in date order
    assert all(-90 <= float(q.findtext(f"{{{DEMO}}}lat") or "nan") <= 90 for q in quakes)


def test_query_is_deterministic_and_versioned(url: str) -> None:
    first = post(url, query(50)).content
    assert post(url, query(50)).content == first
    resp12 = post(url, query(50, "1.2"), "1.2")
    assert resp12.headers["Content-Type"] == CT12
    rows11 = etree.fromstring(first).find(f".//{{{DEMO}}}queryResponse")
    rows12 = body_child(resp12, SOAP12)
    assert c14n(rows11) == c14n(rows12)
    assert post(url, query(0)).status_code == 200  # an empty result is a result


@pytest.mark.parametrize("count", ["100001", "-1", "lots", ""])
def test_query_bad_count_is_a_client_fault(url: str, count: str) -> None:
    resp = post(url, query(count))
    assert resp.status_code == 500
    code, message = fault_parts(resp, "1.1")
    assert code == "soap:Client"
    assert "d:count" in message


@pytest.mark.parametrize(("version", "status", "code"), [("1.1", 500, "soap:Server"), ("1.2", 500, "env:Receiver")])
def test_fault_operation(url: str, version: str, status: int, code: str) -> None:
    resp = post(url, envelope(version, "<d:fault/>"), version)
    assert resp.status_code == status
    assert resp.headers["Content-Type"] == (CT12 if version == "1.2" else CT11)
    assert fault_parts(resp, version) == (code, "the demo backend failed as requested")


@pytest.mark.parametrize(("version", "status", "code"), [("1.1", 500, "soap:Client"), ("1.2", 400, "env:Sender")])
def test_unknown_operation_is_a_client_fault(url: str, version: str, status: int, code: str) -> None:
    resp = post(url, envelope(version, "<d:launchRockets/>"), version)
    assert resp.status_code == status
    got_code, message = fault_parts(resp, version)
    assert got_code == code
    assert message == f"unknown operation: {{{DEMO}}}launchRockets"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"<s:Envelope xmlns:s='" + SOAP11.encode() + b"'><s:Body><d:echo>", "malformed XML"),
        (b"", "malformed XML"),
        (b"<notsoap/>", "not a SOAP envelope"),
        (envelope("1.1", ""), "no operation in the SOAP Body"),
    ],
)
def test_bad_messages_are_client_faults(url: str, body: bytes, message: str) -> None:
    resp = post(url, body)
    assert resp.status_code == 500
    code, got = fault_parts(resp, "1.1")
    assert code == "soap:Client"
    assert got.startswith(message)


def test_malformed_soap12_request_gets_a_soap12_fault(url: str) -> None:
    resp = post(url, b"<broken", "1.2")
    assert resp.status_code == 400
    assert resp.headers["Content-Type"] == CT12
    assert fault_parts(resp, "1.2")[0] == "env:Sender"


def test_entities_are_not_expanded(url: str) -> None:
    body = b'<!DOCTYPE s:Envelope [<!ENTITY inner "EXPANDED"><!ENTITY outer SYSTEM "file:///etc/passwd">]>' + envelope(
        "1.1", "<d:echo><d:a>&inner;</d:a><d:b>&outer;</d:b></d:echo>"
    )
    resp = post(url, body)
    assert resp.status_code == 200
    assert b"EXPANDED" not in resp.content
    assert b"root:" not in resp.content


# ---- HTTP framing


def test_chunked_request(conn: Conn) -> None:
    body = envelope("1.1", f"<d:echo>{ECHO_INNER}</d:echo>")
    conn.send(chunked(body, (1, 40, 7)))
    status, headers, payload = conn.response()
    assert status == 200
    assert headers["content-type"] == CT11
    assert int(headers["content-length"]) == len(payload)
    assert etree.fromstring(payload).find(f".//{{{DEMO}}}echoResponse/{{{DEMO}}}item").text == "one"


def test_keep_alive_then_connection_close(conn: Conn) -> None:
    conn.send(request(query(4)))
    status, headers, _ = conn.response()
    assert status == 200 and "connection" not in headers
    conn.send(chunked(envelope("1.2", "<d:echo>again</d:echo>"), (10,)))
    status, headers, second = conn.response()
    assert status == 200 and headers["content-type"] == CT12
    assert b"<d:echoResponse" in second and b"again" in second
    conn.send(request(query(1), headers="Connection: close\r\n"))
    status, headers, _ = conn.response()
    assert status == 200 and headers["connection"] == "close"
    assert conn.closed_by_server()


def test_pipelined_requests_answer_in_order(conn: Conn) -> None:
    conn.send(request(query(1)) + request(query(2)) + request(query(3)))
    rows = [etree.fromstring(conn.response()[2]).findall(f".//{{{DEMO}}}quake") for _ in range(3)]
    assert [len(r) for r in rows] == [1, 2, 3]


def test_http10_closes_unless_keep_alive(port: int) -> None:
    body = query(1)
    head = f"POST / HTTP/1.0\r\nContent-Length: {len(body)}\r\n"
    plain = Conn(port)
    plain.send(f"{head}\r\n".encode() + body)
    assert plain.response()[0] == 200
    assert plain.closed_by_server()
    plain.close()
    kept = Conn(port)
    for _ in range(2):
        kept.send(f"{head}Connection: keep-alive\r\n\r\n".encode() + body)
        status, headers, _ = kept.response()
        assert (status, headers["connection"]) == (200, "keep-alive")
    kept.close()


def test_expect_100_continue(conn: Conn) -> None:
    body = query(2)
    conn.send(f"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: {len(body)}\r\n\r\n".encode())
    assert conn.file.readline() == b"HTTP/1.1 100 Continue\r\n"
    assert conn.file.readline() == b"\r\n"
    conn.send(body)
    assert conn.response()[0] == 200


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"NONSENSE\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nBad Header\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n", 400),
        (b"POST / HTTP/2.0\r\n\r\n", 505),
        (b"POST / HTTP/1.1\r\nContent-Length: 12x\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXX0\r\n\r\n", 400),
        (f"POST / HTTP/1.1\r\nContent-Length: {64 * 1024 * 1024 + 1}\r\n\r\n".encode(), 413),
        (b"POST / HTTP/1.1\r\nX-Big: " + b"a" * (70 * 1024) + b"\r\n\r\n", 431),
    ],
)
def test_bad_http_gets_an_error_and_a_close(conn: Conn, raw: bytes, status: int) -> None:
    conn.send(raw)
    got, headers, _ = conn.response()
    assert got == status
    assert headers["connection"] == "close"
    assert conn.closed_by_server()


def test_chunked_body_over_the_limit_is_refused(conn: Conn) -> None:
    too_big = demo_backend.MAX_BODY + 1
    conn.send(f"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n{too_big:x}\r\n".encode())
    assert conn.response()[0] == 413


def test_other_methods_are_refused(url: str, conn: Conn) -> None:
    resp = requests.get(url + "/service")
    assert resp.status_code == 405
    assert resp.headers["Allow"] == "POST"
    conn.send(b"HEAD /service HTTP/1.1\r\nHost: backend\r\n\r\n")
    status, headers, _ = conn.response()
    assert (status, headers["connection"]) == (405, "close")


# ---- the debugging aid


def test_received_records_the_last_posts(url: str, conn: Conn) -> None:
    assert requests.delete(url + "/_received").status_code == 204
    assert requests.get(url + "/_received").json() == []
    first = envelope("1.1", "<d:echo>first</d:echo>")
    requests.post(url + "/svc/a?x=1", data=first, headers={"X-Test": "one", "Content-Type": CT11})
    second = envelope("1.2", "<d:echo>chunked</d:echo>")
    conn.send(chunked(second, (5,), headers="X-Test: two\r\n"))
    conn.response()

    records = requests.get(url + "/_received").json()
    assert [r["path"] for r in records] == ["/svc/a?x=1", "/chunked"]
    assert records[0]["headers"]["x-test"] == "one"
    assert records[0]["headers"]["content-type"] == CT11
    assert records[0]["body"] == first.decode()
    assert records[1]["headers"]["transfer-encoding"] == "chunked"
    assert records[1]["body"] == second.decode()  # the decoded body, not the chunk framing

    for i in range(55):
        requests.post(url + f"/n/{i}", data=query(1))
    records = requests.get(url + "/_received").json()
    assert len(records) == 50
    assert [records[0]["path"], records[-1]["path"]] == ["/n/5", "/n/54"]
    requests.delete(url + "/_received")
    assert requests.get(url + "/_received").json() == []


# ---- the command line


def test_module_runs_as_a_command() -> None:
    free = free_ports(1)[0]
    command = [sys.executable, "-m", "gateway.tools.demo_backend", "--listen", f"127.0.0.1:{free}"]
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        try:
            deadline = time.monotonic() + 15
            while True:
                try:
                    resp = requests.post(f"http://127.0.0.1:{free}/x", data=query(4), timeout=2)
                    break
                except requests.ConnectionError:
                    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                    assert time.monotonic() < deadline, "the backend did not start in 15 s"
                    time.sleep(0.1)
            assert resp.status_code == 200
            assert len(etree.fromstring(resp.content).findall(f".//{{{DEMO}}}quake")) == 4
        finally:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.mark.parametrize(
    ("value", "expected"), [("0.0.0.0:8081", ("0.0.0.0", 8081)), ("[::1]:9", ("::1", 9)), ("h:65535", ("h", 65535))]
)
def test_parse_listen(value: str, expected: tuple[str, int]) -> None:
    assert demo_backend.parse_listen(value) == expected


@pytest.mark.parametrize("value", ["8081", ":8081", "host:", "host:99999", "host:http"])
def test_parse_listen_refuses(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        demo_backend.parse_listen(value)
