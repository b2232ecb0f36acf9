"""No parser in the gateway opens a file or a socket (every parse path, every encoding, in process and through the
running gateway); the content-type the next hop gets names the encoding of the bytes it gets."""

from __future__ import annotations

import base64
import http.server
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from lxml import etree

from filters.engine import faults, ns
from filters.engine.engine import Exchange, RoutePipeline, build_pipeline
from filters.engine.wss import encryption
from filters.engine.xml import c14n, charset, threat_protection, xmlsupport
from filters.stores.factory import RouteStores
from gateway.policy import Limits, Route
from gateway.tools import demo_backend
from gateway.tools.client import Client, ClientConfig, ClientError
from loadtest import messages
from tests.support.fifo_probe import DECLARES_DTD, FifoProbe, encodings, fifo_probe, hostile_documents
from tests.support.harness import GatewayFactory, LiveGateway
from tests.support.wss_helpers import DEMO, echo, route_doc

SMALL_ELEMENTS = Limits(max_elements=40)  # a few dozen elements more take the incremental parse
PADDING = "<p/>" * 50


@pytest.fixture
def probe(tmp_path: Path) -> Iterator[FifoProbe]:
    with fifo_probe(tmp_path) as p:
        yield p


def _documents(url: str) -> Iterator[tuple[str, bool, bytes]]:
    for kind, text in hostile_documents(url).items():
        for padded in (False, True):
            body = text.replace("<soap:Body>", "<soap:Body>" + PADDING) if padded else text
            for enc, data in encodings(body).items():
                yield f"{kind}, {enc}{', padded' if padded else ''}", kind in DECLARES_DTD, data


def _outcome(run: Callable[[], object]) -> str | None:
    try:
        run()
    except (faults.Fault, ClientError, xmlsupport.ExternalResourceRefused, etree.XMLSyntaxError) as exc:
        return type(exc).__name__
    return None


def test_the_probe_sees_a_parser_that_opens_the_file(probe: FifoProbe) -> None:
    # What the gateway's parsers were before: lxml's hardening options, and collect_ids=False opens the subset.
    naive = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False, collect_ids=False)
    etree.fromstring(hostile_documents(probe.url)["external DTD"].encode(), naive)
    assert probe.opened > 0


# --- every parser the gateway makes, fed the bytes as they come (libxml2 detects the encoding itself) -------

PARSERS: dict[str, Callable[[], etree.XMLParser]] = {
    "threat protection, whole": lambda: threat_protection._WHOLE,
    "threat protection, incremental": threat_protection._parser,
    "c14n re-read": lambda: c14n._PARSER,
    "demo backend": lambda: demo_backend._PARSER,
    "load test": lambda: messages._PARSER,
    "xmlsupport, ids collected": xmlsupport.parser,
    "xmlsupport, huge trees": lambda: xmlsupport.parser(huge_tree=True, collect_ids=False),
}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_no_parser_opens_a_file_an_xml_document_names(probe: FifoProbe, name: str) -> None:
    for case, _, data in _documents(probe.url):
        parser = PARSERS[name]()
        if isinstance(parser, etree.XMLPullParser):
            _outcome(lambda p=parser, d=data: (p.feed(d), p.close()))
        else:
            _outcome(lambda p=parser, d=data: etree.fromstring(d, p))
        assert probe.opened == 0, case


# --- every parse path, as the gateway calls it ---------------------------------------------------------------


def _route(pki: Path, profile: str) -> Route:
    if profile == "xml":
        return Route.model_validate({"name": "xml", "match": {"path_prefix": "/"}, "profile": "xml",
                                     "upstream": {"address": "127.0.0.1:1"}, "limits": SMALL_ELEMENTS.model_dump(),
                                     "response_limits": SMALL_ELEMENTS.model_dump()})  # fmt: skip
    extra = {}
    if profile == "secureconversation":
        extra["secureconversation"] = {"store": "sealed", "master_keys_file": str(pki / "sct-master-keys.yaml")}
    doc = route_doc(pki, profile, limits=SMALL_ELEMENTS.model_dump(), response_limits=SMALL_ELEMENTS.model_dump(),
                    **extra)  # fmt: skip
    doc["upstream"] = {"address": "127.0.0.1:1"}
    return Route.model_validate(doc)


def test_no_parse_path_opens_a_file_and_a_dtd_is_refused_on_each(
    probe: FifoProbe, pki: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipelines = {p: build_pipeline(_route(pki, p), RouteStores()) for p in ("xml", "hmac", "rsa", "secureconversation")}
    client = Client(_route(pki, "hmac"), ClientConfig(certs=pki))
    strategies: set[str] = set()
    whole, incremental = threat_protection._parse_whole, threat_protection._parse_incremental
    monkeypatch.setattr(threat_protection, "_parse_whole", lambda *a: strategies.add("whole") or whole(*a))
    monkeypatch.setattr(
        threat_protection, "_parse_incremental", lambda *a, **kw: strategies.add("incremental") or incremental(*a, **kw)
    )
    fragments: set[str] = set()  # decrypted content takes both ways too (padded documents: the incremental one)
    f_whole, f_incremental = threat_protection._fragment_whole, threat_protection._fragment_incremental
    monkeypatch.setattr(threat_protection, "_fragment_whole", lambda *a: fragments.add("whole") or f_whole(*a))
    monkeypatch.setattr(
        threat_protection, "_fragment_incremental", lambda *a: fragments.add("incremental") or f_incremental(*a)
    )
    paths: dict[str, Callable[[bytes], object]] = {
        "parse_envelope": lambda d: threat_protection.parse_envelope(d, SMALL_ELEMENTS),
        # The parsers themselves, as if the DOCTYPE check had missed: the resolver still refuses.
        "whole parse": lambda d: whole(charset.decode(d).utf8, SMALL_ELEMENTS),
        "incremental parse": lambda d: incremental(charset.decode(d).utf8, SMALL_ELEMENTS),
        "decrypted content": lambda d: threat_protection.parse_fragment([d], {}, SMALL_ELEMENTS, 2),
        "decrypted EncryptedData": lambda d: encryption.decrypt_data(*_sealed(d), ["aes128-gcm"], SMALL_ELEMENTS),
        "client reading a gateway reply": lambda d: client.open(d, client.secure(echo())[1]),
        "demo backend": _demo_backend,
    }
    for profile, pipeline in pipelines.items():
        paths[f"{profile} request"] = lambda d, p=pipeline: p.request(d, {}, Exchange(route=p.route))
        if profile != "secureconversation":  # its responses take the same path as hmac's and rsa's
            paths[f"{profile} response"] = lambda d, p=pipeline: p.response(d, _exchange(p, pki))
    for name, path in paths.items():
        for case, declares_dtd, data in _documents(probe.url):
            got = _outcome(lambda path=path, data=data: path(data))
            assert got is not None or not declares_dtd, f"{name}: {case} accepted"
            assert probe.opened == 0, f"{name}: {case}"
    assert strategies == fragments == {"whole", "incremental"}


def _exchange(pipeline: RoutePipeline, pki: Path) -> Exchange:
    """An exchange whose request the pipeline took (a secured one where the route needs it)."""
    ex = Exchange(route=pipeline.route)
    request = echo()
    if pipeline.route.profile != "xml":
        request = Client(pipeline.route, ClientConfig(certs=pki)).secure(request)[0]
    pipeline.request(request, {}, ex)
    return ex


def _sealed(plaintext: bytes) -> tuple[etree._Element, bytes]:
    """An EncryptedData (in a Body) that decrypts to `plaintext`, and its key."""
    key, iv = os.urandom(16), os.urandom(12)
    root = etree.fromstring(echo())
    body = root.find(ns.q(ns.SOAP11, "Body"))
    del body[:]
    ed = etree.SubElement(body, ns.q(ns.XENC, "EncryptedData"), Type=encryption.TYPE_CONTENT)
    etree.SubElement(ed, ns.q(ns.XENC, "EncryptionMethod"), Algorithm=encryption.DATA_ALGORITHMS["aes128-gcm"])
    value = etree.SubElement(etree.SubElement(ed, ns.q(ns.XENC, "CipherData")), ns.q(ns.XENC, "CipherValue"))
    value.text = base64.b64encode(iv + AESGCM(key).encrypt(iv, plaintext, None)).decode()
    return ed, key


def _demo_backend(data: bytes) -> None:
    status, _, _ = demo_backend.handle_soap(data, "text/xml")
    if status != 200:
        raise faults.client(f"demo backend answered {status}")


# --- through the running gateway ----------------------------------------------------------------------------

TEXT = "caf\u00e9 \u20ac \u4e2d"  # non-ASCII: a label naming the wrong encoding reads other characters


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A backend that records what it gets, raw, and answers `reply` (default: the demo backend's answer)."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self._read()
        server = self.server
        server.received.append((self.headers["content-type"], body))  # type: ignore[attr-defined]
        reply = server.reply  # type: ignore[attr-defined]
        status, ctype, answer = (200, *reply) if reply else demo_backend.handle_soap(body, self.headers["content-type"])
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def _read(self) -> bytes:
        if self.headers["content-length"]:
            return self.rfile.read(int(self.headers["content-length"]))
        parts = []
        while size := int(self.rfile.readline().split(b";")[0], 16):
            parts.append(self.rfile.read(size))
            self.rfile.readline()
        self.rfile.readline()
        return b"".join(parts)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def recorder() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.received, server.reply = [], None  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path, recorder: http.server.ThreadingHTTPServer) -> LiveGateway:
    backend = f"127.0.0.1:{recorder.server_address[1]}"
    sc = {"store": "sealed", "master_keys_file": str(pki / "sct-master-keys.yaml")}
    routes = [
        {"name": "xml", "match": {"path_prefix": "/xml/"}, "upstream": {"address": backend}, "profile": "xml"},
        {**route_doc(pki, "hmac", name="hmac"), "upstream": {"address": backend}},
        {**route_doc(pki, "rsa", name="rsa"), "upstream": {"address": backend}},
        {**route_doc(pki, "secureconversation", name="sc", secureconversation=sc), "upstream": {"address": backend}},
    ]
    return module_gateway(routes)


def test_no_parser_in_the_running_gateway_opens_a_file(gw, recorder, tmp_path: Path) -> None:
    recorder.received.clear()
    with fifo_probe(tmp_path) as probe:
        for route in ("xml", "hmac", "rsa", "sc"):
            for kind in DECLARES_DTD:
                for enc, data in encodings(hostile_documents(probe.url)[kind]).items():
                    r = gw.post(route, data)
                    assert r.status_code in (400, 500) and b"Fault" in r.content, (route, kind, enc)
        assert recorder.received == []
        # The backend's reply, on the way back.
        for route in ("xml", "hmac"):
            for kind in DECLARES_DTD:
                for enc, data in encodings(hostile_documents(probe.url)[kind]).items():
                    recorder.reply = ("text/xml", data)
                    request = echo() if route == "xml" else gw.client(route).secure(echo())[0]
                    try:
                        r = gw.post(route, request)
                    finally:
                        recorder.reply = None
                    assert r.status_code == 502 and b"Fault" in r.content, (route, kind, enc)
        assert probe.opened == 0


def _charset(ctype: str) -> str:
    return next(p.split("=", 1)[1].strip('"') for p in ctype.split(";") if p.strip().lower().startswith("charset="))


def _read_as_labelled(ctype: str, body: bytes) -> str:
    """The d:text the bytes hold for a reader that believes the label (and no BOM or declaration)."""
    text = body.decode(_charset(ctype)).removeprefix("\ufeff")
    if text.startswith("<?xml"):
        text = text[text.index("?>") + 2 :]
    root = etree.fromstring(text)
    return root.findtext(f".//{{{DEMO}}}text")


def _as(data: bytes, form: str) -> bytes:
    """`data` (UTF-8, no declaration) re-encoded."""
    text = data.decode()
    return {
        "utf-8": data,
        "utf-16le bom": b"\xff\xfe" + text.encode("utf-16-le"),
        "utf-16be bom": b"\xfe\xff" + text.encode("utf-16-be"),
        "utf-16le declared": ('<?xml version="1.0" encoding="UTF-16"?>' + text).encode("utf-16-le"),
    }[form]


LABELS = ["text/xml; charset=iso-8859-1", "text/xml; charset=utf-8", "text/xml", None,
          'application/soap+xml; charset=ISO-8859-1; action="urn:a;b"']  # fmt: skip


@pytest.mark.parametrize("form", ["utf-8", "utf-16le bom", "utf-16be bom", "utf-16le declared"])
@pytest.mark.parametrize("route", ["xml", "hmac", "rsa"])
def test_backend_gets_a_content_type_naming_the_bytes_encoding(gw, recorder, route: str, form: str) -> None:
    for label in LABELS:
        version = "1.2" if label and "soap+xml" in label else "1.1"
        plain = echo(TEXT, version)
        sent = _as(plain if route == "xml" else gw.client(route).secure(plain)[0], form)
        recorder.received.clear()
        r = gw.post(route, sent, headers={"content-type": label})  # None: sent without one
        assert r.status_code == 200, (label, r.content[:300])
        [(ctype, body)] = recorder.received
        assert _read_as_labelled(ctype, body) == TEXT, (label, ctype)
        if route == "xml":
            assert body == sent  # passed on untouched, so the label is the body's own encoding
        else:
            assert _charset(ctype) == "utf-8"  # re-serialized by the gateway
        if label and label.startswith("application/soap+xml"):
            assert ctype.startswith("application/soap+xml;") and 'action="urn:a;b"' in ctype
        assert ctype.count("charset=") == 1


@pytest.mark.parametrize("form", ["utf-16le bom", "utf-16be bom", "utf-16le declared"])
@pytest.mark.parametrize("route", ["xml", "hmac"])
def test_client_gets_a_content_type_naming_the_reply_encoding(gw, recorder, route: str, form: str) -> None:
    reply = _as(demo_backend.handle_soap(echo(TEXT), "text/xml")[2], form)
    client = gw.client("hmac")
    request, pending = (echo(), None) if route == "xml" else client.secure(echo())
    recorder.reply = ("text/xml; charset=utf-8", reply)  # a backend with the wrong label
    try:
        r = gw.post(route, request)
    finally:
        recorder.reply = None
    assert r.status_code == 200
    assert _read_as_labelled(r.headers["content-type"], r.content) == TEXT
    if route == "xml":
        assert r.content == reply
    else:
        assert _charset(r.headers["content-type"]) == "utf-8"
        assert client.open(r.content, pending).body.findtext(f".//{{{DEMO}}}text") == TEXT
