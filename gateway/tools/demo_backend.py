"""The demo backend: a plain SOAP 1.1/1.2 service that knows nothing of WS-Security.

It stands for the existing service behind the gateway, modelled on the earthquake query service of Sosnoski's
"The high cost of (WS-)Security" measurements. Operations (namespace urn:wsgate:demo), chosen by the first
element in soap:Body:

    <d:echo>...</d:echo>                  -> <d:echoResponse> with the same children and text
    <d:query><d:count>N</d:count></d:query> -> <d:queryResponse count="N">, N <d:quake> rows of ~290 bytes
    <d:fault/>                            -> a Server/Receiver fault, HTTP 500
    anything else                         -> a Client/Sender fault "unknown operation"

Debugging aids: GET /health, GET /_received (the last 50 POSTs as JSON), DELETE /_received.

The HTTP/1.1 server is a small asyncio one (uvloop when importable) rather than http.server: the load tests
need a backend that is never the bottleneck, with keep-alive and chunked request bodies (Envoy sends chunked
when the filter replaced a body)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import logging
import random
import re
import threading
from collections.abc import Callable
from copy import deepcopy
from datetime import UTC, datetime, timedelta
from typing import NamedTuple
from xml.sax.saxutils import escape

from lxml import etree

from filters.engine import faults, ns
from filters.engine.mime import package as mime
from filters.engine.xml import xmlsupport
from gateway.policy import MAX_BODY_BYTES, Attachments

log = logging.getLogger("wsgate.demo_backend")

DEMO_NS = "urn:wsgate:demo"
MAX_BODY = 64 * 1024 * 1024
MAX_HEAD = 64 * 1024  # request line and headers together; also bounds a chunk-size or trailer line
MAX_COUNT = 100_000
RECEIVED_KEEP = 50
RECEIVED_BODY_LIMIT = 1024 * 1024  # bytes kept per recorded body: 50 huge bodies must not pin gigabytes

_VERSIONS = {ns.SOAP11: "1.1", ns.SOAP12: "1.2"}
_CONTENT_TYPES = {"1.1": "text/xml; charset=utf-8", "1.2": "application/soap+xml; charset=utf-8"}
_ENVELOPE_OPEN = {
    "1.1": f'<soap:Envelope xmlns:soap="{ns.SOAP11}"><soap:Body>'.encode(),
    "1.2": f'<env:Envelope xmlns:env="{ns.SOAP12}"><env:Body>'.encode(),
}
_ENVELOPE_CLOSE = {"1.1": b"</soap:Body></soap:Envelope>", "1.2": b"</env:Body></env:Envelope>"}

# No entity expansion, no DTD loading, no network: a request body is data, never instructions.
_PARSER = xmlsupport.parser()

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_REASONS = {
    100: "Continue", 200: "OK", 204: "No Content", 400: "Bad Request", 405: "Method Not Allowed",
    413: "Content Too Large", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
    501: "Not Implemented", 505: "HTTP Version Not Supported",
}  # fmt: skip


class HttpError(Exception):
    """A request the server cannot frame or accept; answered as text and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# ---- the fake earthquake catalogue

_REGIONS = (
    ("NORTH ISLAND, NEW ZEALAND", -39.0, 176.0),
    ("OFF E. COAST OF N. ISLAND, N.Z.", -37.7, 178.5),
    ("KURIL ISLANDS", 46.5, 151.5),
    ("SOUTHERN CALIFORNIA", 34.0, -117.0),
    ("NEAR COAST OF CENTRAL CHILE", -33.5, -72.0),
    ("HINDU KUSH REGION, AFGHANISTAN", 36.5, 70.8),
    ("SOUTHERN SUMATERA, INDONESIA", -4.5, 102.0),
    ("NEAR EAST COAST OF HONSHU, JAPAN", 38.0, 142.5),
    ("CENTRAL MID-ATLANTIC RIDGE", 0.5, -25.0),
    ("FIJI ISLANDS REGION", -18.0, -178.5),
)


class _Catalogue:
    """Quake rows, generated once in order by a fixed-seed generator: row i is the same in every process."""

    def __init__(self) -> None:
        self._rows: list[bytes] = []
        self._rng = random.Random(20090707)
        self._time = datetime(2001, 1, 1, tzinfo=UTC)
        self._lock = threading.Lock()  # servers on several event loops (tests) share the one catalogue

    def rows(self, count: int) -> list[bytes]:
        if len(self._rows) < count:
            with self._lock:
                while len(self._rows) < count:
                    self._rows.append(self._next_row(len(self._rows)))
        return self._rows[:count]

    def _next_row(self, index: int) -> bytes:
        rng = self._rng
        self._time += timedelta(seconds=rng.randint(60, 36_000), milliseconds=rng.randint(0, 999))
        region, lat, lon = _REGIONS[rng.randrange(len(_REGIONS))]
        return (
            f"<d:quake><d:id>quake-{index + 1:06d}</d:id>"
            f"<d:time>{self._time.isoformat(timespec='milliseconds').replace('+00:00', 'Z')}</d:time>"
            f"<d:lat>{lat + rng.uniform(-2, 2):.5f}</d:lat><d:lon>{lon + rng.uniform(-2, 2):.5f}</d:lon>"
            f"<d:depth>{rng.uniform(1, 600):.1f}</d:depth>"
            f"<d:magnitude>{rng.uniform(2.5, 7.5):.1f}</d:magnitude>"
            f"<d:method>{rng.choice(('ML', 'MB', 'MS', 'MW'))}</d:method>"
            f"<d:status>{rng.choice(('reviewed', 'automatic'))}</d:status>"
            f"<d:region>{region}</d:region></d:quake>"
        ).encode()


_CATALOGUE = _Catalogue()


# ---- SOAP


def _fault(version: str, sender: bool, message: str) -> tuple[int, bytes]:
    """A SOAP fault envelope and its HTTP status (SOAP 1.2's HTTP binding: Sender 400, Receiver 500).

    The detail names the demo backend so tests can tell its faults from the gateway's."""
    msg = escape(message)
    origin = f'<d:origin xmlns:d="{DEMO_NS}">demo-backend</d:origin>'
    if version == "1.2":
        code = "env:Sender" if sender else "env:Receiver"
        fault = (
            f"<env:Fault><env:Code><env:Value>{code}</env:Value></env:Code>"
            f'<env:Reason><env:Text xml:lang="en">{msg}</env:Text></env:Reason>'
            f"<env:Detail>{origin}</env:Detail></env:Fault>"
        )
        return (400 if sender else 500), _ENVELOPE_OPEN[version] + fault.encode() + _ENVELOPE_CLOSE[version]
    code = "soap:Client" if sender else "soap:Server"
    fault = (
        f"<soap:Fault><faultcode>{code}</faultcode><faultstring>{msg}</faultstring>"
        f"<detail>{origin}</detail></soap:Fault>"
    )
    return 500, _ENVELOPE_OPEN[version] + fault.encode() + _ENVELOPE_CLOSE[version]


def _version_from_content_type(content_type: str) -> str:
    return "1.2" if "application/soap+xml" in content_type.lower() else "1.1"


def handle_soap(body: bytes, content_type: str = "") -> tuple[int, str, bytes]:
    """One SOAP exchange: (HTTP status, content type, response body)."""
    version, status, payload = _exchange(body, content_type)
    return status, _CONTENT_TYPES[version], payload


# Whatever the gateway lets through: the gateway's checks are under test, not the backend's.
_PACKAGE_LIMITS = Attachments(accept=True, max_parts=1000, max_part_bytes=MAX_BODY_BYTES)


def handle_package(body: bytes, content_type: str) -> tuple[int, str, bytes]:
    """An MTOM or SwA exchange: the root part answered as `handle_soap` answers it, the attachments sent back as
    they came (an echo's xop:Include or cid: reference still names its part)."""
    version = _version_from_content_type(content_type)
    try:
        package = mime.parse(content_type, body, _PACKAGE_LIMITS)
    except faults.Fault as fault:
        status, refusal = _fault(version, True, fault.reason)
        return status, _CONTENT_TYPES[version], refusal
    status, soap_type, answer = handle_soap(bytes(package.root.body), content_type)
    if status != 200:
        return status, soap_type, answer
    root = mime.with_content(package.root, answer)
    return status, content_type, mime.serialize(package._replace(root=root))


def _exchange(body: bytes, content_type: str) -> tuple[str, int, bytes]:
    try:
        root = etree.fromstring(body, _PARSER)
    except etree.XMLSyntaxError as exc:
        version = _version_from_content_type(content_type)
        return version, *_fault(version, True, f"malformed XML: {exc.msg}")
    except xmlsupport.ExternalResourceRefused:
        version = _version_from_content_type(content_type)
        return version, *_fault(version, True, "external resources are not loaded")
    qn = etree.QName(root)
    version = _VERSIONS.get(qn.namespace or "")
    if version is None or qn.localname != "Envelope":
        version = _version_from_content_type(content_type)  # the best guess for a body that is not SOAP
        return version, *_fault(version, True, "not a SOAP envelope")
    soap_body = root.find(ns.q(qn.namespace or "", "Body"))
    op = None if soap_body is None else next((c for c in soap_body if isinstance(c.tag, str)), None)
    if op is None:
        return version, *_fault(version, True, "no operation in the SOAP Body")
    if op.tag == ns.q(DEMO_NS, "echo"):
        return version, 200, _wrap(version, _echo(op))
    if op.tag == ns.q(DEMO_NS, "query"):
        count = _count(op)
        if count is None:
            return version, *_fault(version, True, f"d:count must be an integer 0..{MAX_COUNT}")
        return version, 200, _wrap(version, _query(count))
    if op.tag == ns.q(DEMO_NS, "fault"):
        return version, *_fault(version, False, "the demo backend failed as requested")
    return version, *_fault(version, True, f"unknown operation: {op.tag[:200]}")


def _wrap(version: str, payload: bytes) -> bytes:
    return _ENVELOPE_OPEN[version] + payload + _ENVELOPE_CLOSE[version]


def _echo(op: etree._Element) -> bytes:
    # One copy of the operation: the namespaces its content uses from outside are declared once, on the copy,
    # not again on every child (which would make a 300 KB request under 30 namespaces a 1 MB answer).
    out = deepcopy(op)
    out.tag = ns.q(DEMO_NS, "echoResponse")
    out.attrib.clear()
    out.tail = None
    return etree.tostring(out, encoding="utf-8", xml_declaration=False)


def _count(op: etree._Element) -> int | None:
    el = op.find(ns.q(DEMO_NS, "count"))
    text = (el.text or "").strip() if el is not None else ""
    if not text.isascii() or not text.isdigit():
        return None
    count = int(text)
    return count if count <= MAX_COUNT else None


def _query(count: int) -> bytes:
    start = f'<d:queryResponse xmlns:d="{DEMO_NS}" count="{count}">'.encode()
    return b"".join((start, *_CATALOGUE.rows(count), b"</d:queryResponse>"))


# ---- HTTP/1.1


def _response(status: int, content_type: str, body: bytes, keep_alive: bool, http10: bool) -> bytes:
    head = f"HTTP/1.1 {status} {_REASONS[status]}\r\nServer: wsgate-demo-backend\r\n"
    if status != 204:  # RFC 9110: no Content-Length on 204
        head += f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
    if status == 405:
        head += "Allow: POST\r\n"  # any path takes a SOAP POST; only the debugging paths also take GET/DELETE
    if not keep_alive:
        head += "Connection: close\r\n"
    elif http10:
        head += "Connection: keep-alive\r\n"  # HTTP/1.0 closes unless told otherwise
    return head.encode("latin-1") + b"\r\n"


async def _line(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.readuntil(b"\r\n")
    except asyncio.LimitOverrunError:
        raise HttpError(400, "chunk-size or trailer line too long") from None


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        line = await _line(reader)
        size_text = line[:-2].split(b";", 1)[0].strip()  # chunk extensions are ignored
        if not _HEX.fullmatch(size_text):
            raise HttpError(400, "bad chunk size")
        size = int(size_text, 16)
        if size == 0:
            break
        total += size
        if total > MAX_BODY:
            raise HttpError(413, f"body over {MAX_BODY} bytes")
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise HttpError(400, "chunk not followed by CRLF")
    trailers = 0
    while (line := await _line(reader)) != b"\r\n":
        trailers += len(line)
        if trailers > MAX_HEAD:
            raise HttpError(431, "trailers too large")
    return b"".join(parts)


class Received(NamedTuple):
    path: str
    headers: dict[str, str]
    body: bytes  # at most RECEIVED_BODY_LIMIT bytes
    sha256: str  # of the whole body: tests compare binary bodies (attachments) byte for byte
    length: int

    def as_json(self) -> dict[str, object]:
        return {"path": self.path, "headers": self.headers, "body": self.body.decode("utf-8", "replace"),
                "sha256": self.sha256, "length": self.length}  # fmt: skip


class DemoBackend:
    """One server's state: the recorded requests. `handle` serves one connection."""

    def __init__(self) -> None:
        self.received: collections.deque[Received] = collections.deque(maxlen=RECEIVED_KEEP)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one(reader, writer):
                pass
        except HttpError as exc:
            body = f"{exc}\n".encode()
            writer.write(_response(exc.status, "text/plain; charset=utf-8", body, False, False) + body)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away mid-request: nobody to answer
        finally:
            writer.close()  # flushes what was written, then closes

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the connection is to be closed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial.strip():
                raise HttpError(400, "incomplete request head") from None
            return False  # a clean close between requests
        except asyncio.LimitOverrunError:
            raise HttpError(431, f"request head over {MAX_HEAD} bytes") from None
        head = head.lstrip(b"\r\n")  # RFC 9112 2.2: ignore empty lines before a request line
        if not head:
            return True
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not parts[1]:
            raise HttpError(400, "malformed request line")
        method, target, version = (p.decode("latin-1") for p in parts)
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            raise HttpError(505, "only HTTP/1.0 and HTTP/1.1")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(b":")
            if not sep or not _TOKEN.fullmatch(name):  # also refuses obs-fold and space before the colon
                raise HttpError(400, "malformed header line")
            key, val = name.decode("latin-1").lower(), value.strip(b" \t").decode("latin-1")
            headers[key] = f"{headers[key]}, {val}" if key in headers else val

        http10 = version == "HTTP/1.0"
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        keep_alive = "keep-alive" in tokens if http10 else "close" not in tokens

        body = await self._body(reader, writer, headers, http10)
        path = target.split("?", 1)[0]
        status, ctype, payload = self._dispatch(method, target, path, headers, body)
        if status == 405:
            keep_alive = False  # a HEAD client would not read the body: close rather than desynchronize
        writer.write(_response(status, ctype, payload, keep_alive, http10))
        if status != 204:
            writer.write(payload)
        await writer.drain()
        return keep_alive

    @staticmethod
    async def _body(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, headers: dict[str, str], http10: bool
    ) -> bytes:
        te, cl = headers.get("transfer-encoding"), headers.get("content-length")
        if te is None and cl is None:
            return b""
        if te is not None and cl is not None:
            raise HttpError(400, "both Transfer-Encoding and Content-Length")  # the request-smuggling shape
        if cl is not None and not (cl.isascii() and cl.isdigit()):
            raise HttpError(400, "bad Content-Length")
        if te is not None and te.lower() != "chunked":
            raise HttpError(501, f"unsupported Transfer-Encoding: {te[:60]}")
        if cl is not None and int(cl) > MAX_BODY:
            raise HttpError(413, f"body over {MAX_BODY} bytes")
        if not http10 and headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return await reader.readexactly(int(cl)) if cl is not None else await _read_chunked(reader)

    def _dispatch(
        self, method: str, target: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, str, bytes]:
        if method == "POST":
            digest = hashlib.sha256(body).hexdigest()
            self.received.append(Received(target, headers, body[:RECEIVED_BODY_LIMIT], digest, len(body)))
            content_type = headers.get("content-type", "")
            if mime.is_multipart(content_type):
                return handle_package(body, content_type)
            return handle_soap(body, content_type)
        if path == "/health" and method == "GET":
            return 200, "text/plain; charset=utf-8", b"ok"
        if path == "/_received" and method == "GET":
            return 200, "application/json", json.dumps([r.as_json() for r in self.received]).encode()
        if path == "/_received" and method == "DELETE":
            self.received.clear()
            return 204, "", b""
        return 405, "text/plain; charset=utf-8", b"POST a SOAP envelope\n"


# ---- running it


async def start(host: str, port: int) -> asyncio.Server:
    """Start serving on host:port (0: any free port) in the running loop; the caller owns the server."""
    backend = DemoBackend()
    # A deep backlog: load tests open hundreds of connections at once.
    return await asyncio.start_server(backend.handle, host, port, limit=MAX_HEAD, backlog=1024)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def serve(host: str, port: int) -> None:
    """Serve until interrupted (blocking)."""

    async def run() -> None:
        server = await start(host, port)
        bound = ", ".join(f"{s.getsockname()[0]}:{s.getsockname()[1]}" for s in server.sockets)
        log.info("demo backend listening on %s", bound)
        async with server:
            await server.serve_forever()

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(run())


def parse_listen(value: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="wsgate backend", description="The demo SOAP backend (no WS-Security).")
    p.add_argument("--listen", type=parse_listen, default=("127.0.0.1", 8081), help="HOST:PORT")
    args = p.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        serve(*args.listen)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
