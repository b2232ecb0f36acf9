"""Threats at the edge (issue #10), through the real Envoy, filter workers and demo backend, on raw sockets (an HTTP
library would normalize the very paths and headers under test):

- path confusion: no spelling of a path reaches the backend at a path that a decoding backend reads as another
  route, for every pair of profiles and over HTTP and HTTPS; the backend gets exactly the path Envoy routed on;
- identity and forwarding headers from the client never reach the backend, in any case, dash or underscore
  spelling, on every profile; x-forwarded-proto is Envoy's (a WS-Trust Issue over HTTP is not confidential);
- idle and slow clients hold nothing the next client needs, and Envoy's timeouts close them."""

from __future__ import annotations

import functools
import os
import re
import select
import socket
import ssl
import time
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import unquote

import pytest
import requests
from lxml import etree

from filters.engine.conversation import ws_trust
from filters.engine.wss import secure_conversation as sc
from gateway.tools.client import Client, ClientConfig
from tests.support.harness import GatewayFactory, LiveGateway, envelope
from tests.support.wss_helpers import DEMO, echo, make_route, route_doc

BODY = echo("probe")
SUBJECT = "CN=Demo Client,O=WSGate Demo"


def _routes(pki: Path) -> list[dict]:
    plain = {"upstream": {"address": "BACKEND"}}
    return [
        {"name": "plain", "match": {"path_prefix": "/plain/"}, "profile": "none", **plain},
        {"name": "xml", "match": {"path_prefix": "/xml/"}, "profile": "xml", **plain},
        {"name": "tls", "match": {"path_prefix": "/tls/"}, "profile": "tls", **plain},
        {"name": "mtls", "match": {"path_prefix": "/mtls/"}, "profile": "tls", **plain,
         "tls": {"require_client_certificate": True, "subject_header": "x-client-subject"}},
        route_doc(pki, "rsa", name="rsa"),
        route_doc(pki, "hmac", name="hmac"),
        route_doc(pki, "hmac", name="username", signature={"parts": ["body", "timestamp", "username_token"]},
                  username_token={"required": True, "users_file": str(pki / "users.yaml"), "protection": "encrypted"}),
        route_doc(pki, "secureconversation", name="sc", encryption={"encrypt_response": True},
                  secureconversation={"store": "sealed", "master_keys_file": str(pki / "sct-master-keys.yaml")}),
    ]  # fmt: skip


ROUTES = ["plain", "xml", "tls", "mtls", "rsa", "hmac", "username", "sc"]
# What an unsigned request without a client certificate may reach, per listener.
OPEN = {False: {"plain", "xml"}, True: {"plain", "xml", "tls"}}


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path) -> LiveGateway:
    return module_gateway(_routes(pki))


@functools.cache
def _tls_context(pki: Path, client_cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    ctx.check_hostname = False
    if client_cert:
        ctx.load_cert_chain(pki / "client.pem", pki / "client.key")
    return ctx


def send(
    gw: LiveGateway, target: bytes, pki: Path, *, tls: bool, headers: bytes = b"", body: bytes = BODY,
    client_cert: bool = False,
) -> tuple[int, bytes]:  # fmt: skip
    """One request on a fresh connection, byte for byte as given: (status, response body)."""
    sock = socket.create_connection(("127.0.0.1", gw.opts.https_port if tls else gw.opts.http_port), timeout=10)
    if tls:
        sock = _tls_context(pki, client_cert).wrap_socket(sock, server_hostname="localhost")
    head = (b"POST " + target + b" HTTP/1.1\r\nhost: gateway\r\ncontent-type: text/xml; charset=utf-8\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n" + headers + b"\r\n")  # fmt: skip
    with sock:
        sock.sendall(head + body)
        return _read_response(sock)


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body), reading no further than the response (waiting for the close costs Envoy's delayed close)."""
    data = b""
    while b"\r\n\r\n" not in data and (chunk := sock.recv(65536)):
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
    done = (lambda b: b.endswith(b"0\r\n\r\n")) if b"content-length" not in fields else (
        lambda b: len(b) >= int(fields[b"content-length"]))  # fmt: skip
    while not done(rest) and (chunk := sock.recv(65536)):
        rest += chunk
    return int(head.split(b" ", 2)[1]), rest


def backend_view(path: str) -> str:
    """The most lenient backend's reading of a path: percent-decoding until nothing changes, `\\` as `/`, `;`
    parameters dropped (Tomcat), dot segments removed, slashes merged, case ignored (IIS)."""
    while (decoded := unquote(path)) != path:
        path = decoded
    path = path.lower()
    segments: list[str] = []
    for seg in path.replace("\\", "/").split("/"):
        seg = seg.split(";", 1)[0]
        if seg == "..":
            if segments:
                segments.pop()
        elif seg not in ("", "."):
            segments.append(seg)
    return "/" + "/".join(segments)


def route_of(path: str) -> str | None:
    return next((r for r in ROUTES if path.lower().startswith(f"/{r}/")), None)


# Each form walks from route {a} to route {b}; mixes of encodings, separators and dot spellings.
CONFUSIONS = [
    "/{a}/../{b}/demo", "/{a}/./../{b}/demo", "/{a}/x/../../{b}/demo", "/{a}//..//{b}/demo", "/{a}/../../{b}/demo",
    "/{a}/%2e%2e/{b}/demo", "/{a}/%2E%2E/{b}/demo", "/{a}/.%2e/{b}/demo", "/{a}/%2e./{b}/demo", "/{a}/%2e/../{b}/demo",
    "/{a}/..%2f{b}/demo", "/{a}/..%2F{b}/demo", "/{a}/%2e%2e%2f{b}/demo", "/{a}/x%2f..%2f..%2f{b}/demo",
    "/{a}/..\\{b}/demo", "/{a}/x\\..\\..\\{b}/demo", "/{a}/..%5c{b}/demo", "/{a}/..%5C{b}/demo", "/{a}/.%2e%5c{b}/demo",
    "/{a}/..;/{b}/demo", "/{a}/..;x=1/{b}/demo", "/{a}/%2e%2e;/{b}/demo", "/{a}/x;/../../{b}/demo",
    "/{a}/%252e%252e/{b}/demo", "/{a}/%252e%252e%252f{b}/demo", "/{a}/%c0%ae%c0%ae/{b}/demo", "/{a}/%e0%80%ae./{b}/demo",
    "/{a}/%2e%2e/%2e%2e/{a}/%2e./{b}/demo", "http://gateway/{a}/../{b}/demo", "/{a}/./%2e%2e\\.%2e/{b}/demo",
    "/{a}/../{B}/demo", "/{a}/%2E%2e/{Bb}/demo", "/{A}/..%2F{B}/demo",
]  # fmt: skip


def confusion(form: str, a: str, b: str) -> bytes:
    return form.format(a=a, b=b, A=a.upper(), B=b.upper(), Bb=b[0].upper() + b[1:]).encode()


PAIRS = [(a, b) for a in ROUTES for b in ROUTES if a != b]


@pytest.mark.parametrize(("a", "b"), PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_path_confusion_cannot_reach_a_secured_route(gw: LiveGateway, pki: Path, a: str, b: str) -> None:
    """Whatever reaches the backend is on a route an unsigned request may use, and a backend that decodes and
    normalizes everything reads it as the very route Envoy chose."""
    for tls in (False, True):
        gw.clear()
        statuses = {}
        for i, form in enumerate(CONFUSIONS):
            target = confusion(form, a, b)
            statuses[form] = send(gw, target, pki, tls=tls, headers=f"x-probe: {i}\r\n".encode())[0]
        got = gw.received()
        for r in got:
            path = r["path"].split("?", 1)[0]
            form = CONFUSIONS[int(r["headers"]["x-probe"])]
            seen, routed = route_of(backend_view(path)), route_of(path)
            assert seen == routed, f"{form}: backend got {path!r}, which it reads as route {seen}, not {routed}"
            assert routed in OPEN[tls], f"{form}: unsigned request reached {routed} ({'https' if tls else 'http'})"
            assert path.lower() == backend_view(path), f"{form}: backend got {path!r}, not a normalized path"
        # A 200 only ever comes from the backend, for what was checked above.
        assert {f for f, s in statuses.items() if s == 200} == {CONFUSIONS[int(r["headers"]["x-probe"])] for r in got}
        # Control: the same probe straight to an open route does reach the backend.
        if a in OPEN[tls]:
            gw.clear()
            assert send(gw, f"/{a}/demo".encode(), pki, tls=tls)[0] == 200
            assert [r["path"] for r in gw.received()] == [f"/{a}/demo"]


def test_a_catch_all_open_route_never_shadows_a_secured_one(gateway: GatewayFactory, pki: Path) -> None:
    """Listed first, a `none` route on `/` still loses to the longer `/rsa/` prefix, in any case."""
    routes = [{"name": "rest", "match": {"path_prefix": "/"}, "profile": "none", "upstream": {"address": "BACKEND"}},
              route_doc(pki, "rsa", name="rsa")]  # fmt: skip
    with gateway(routes) as g:
        for target in (b"/rsa/demo", b"/RSA/demo", b"/Rsa/x/../demo", b"/x/../rSa/demo", b"/x/%2e%2e/RSA/demo"):
            g.clear()
            assert send(g, target, pki, tls=False)[0] == 500  # the rsa route's fault: unsigned
            assert g.received() == []
        assert send(g, b"/other/demo", pki, tls=False)[0] == 200
        assert [r["path"] for r in g.received()] == ["/other/demo"]


@pytest.mark.parametrize(
    ("target", "forwarded"),
    [
        (b"/plain/./x/../demo", "/plain/demo"),
        (b"/plain//x///demo", "/plain/x/demo"),
        (b"/plain/%2e%2e/xml/demo", "/xml/demo"),
        (b"/plain/%7ex/%64emo", "/plain/~x/demo"),  # percent-encoded unreserved characters, decoded
        (b"/plain/a\\b", "/plain/a/b"),  # WHATWG: a backslash is a slash
        (b"/xml/..;/plain/demo", "/plain/demo"),
        (b"/plain/%20%C3%A9", "/plain/%20%C3%A9"),  # what is not ambiguous stays encoded
        (b"/plain/demo?q=../../rsa/%2e%2e", "/plain/demo?q=../../rsa/%2e%2e"),  # the query is not a path
    ],
)
def test_the_backend_gets_exactly_the_path_envoy_routed_on(
    gw: LiveGateway, pki: Path, target: bytes, forwarded: str
) -> None:
    for tls in (False, True):
        gw.clear()
        assert send(gw, target, pki, tls=tls)[0] == 200
        assert [r["path"] for r in gw.received()] == [forwarded]


@pytest.mark.parametrize(
    "target",
    [b"/plain/..%2fxml/demo", b"/plain/%2F", b"/plain/x%5cy", b"/plain/a;b/demo", b"/plain/x%3b/demo",
     b"/plain/%252e%252e/demo", b"/plain/%25", b"/plain/%zz", b"/plain/%", b"/plain/%c0%ae", b"/plain/%09x",
     b"/plain/%00", b"/plain/x%3f/demo", b"/plain/x%23/demo", b"/plain/demo#../../rsa"],
)  # fmt: skip
@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_ambiguous_paths_are_refused_with_a_400_fault(gw: LiveGateway, pki: Path, target: bytes, version: str) -> None:
    body = envelope(f'<d:echo xmlns:d="{DEMO}"><d:text>x</d:text></d:echo>', version)
    ctype = b"application/soap+xml" if version == "1.2" else b"text/xml"
    gw.clear()
    status, reply = send(gw, target, pki, tls=False, body=body, headers=b"content-type: " + ctype + b"\r\n")
    assert status == 400
    fault = etree.fromstring(reply)
    assert fault.findtext(".//faultcode" if version == "1.1" else ".//{*}Code/{*}Value") in (
        "soap:Client",
        "env:Sender",
    )
    assert gw.received() == []


# Every spelling of every header the gateway or Envoy vouches for: case, dash or underscore.
SPOOFED = b"".join(
    f"{name}: spoofed-{i}\r\n".encode()
    for i, name in enumerate([
        "x-wsgate-subject", "X-WSGATE-SUBJECT", "X-Wsgate-Subject", "x_wsgate_subject", "X_WSGATE_SUBJECT",
        "x-wsgate_subject", "x-wsgate-route", "x-wsgate-anything", "x-client-subject", "X-Client-Subject",
        "x_client_subject", "x-forwarded-client-cert", "x_forwarded_client_cert", "x-envoy-original-path",
        "x-envoy-internal", "x-envoy-external-address", "x-envoy-upstream-rq-timeout-ms", "x-forwarded-for",
        "x-forwarded-proto", "X-Forwarded-Proto", "x_forwarded_proto", "x-forwarded-host", "x-forwarded-port",
        "forwarded", "x-real-ip", "x.wsgate.subject", "X.Client.Subject", "x-wsgate~subject", "x-wsgate-subject.",
    ])
)  # fmt: skip


def _request_for(profile: str, pki: Path) -> bytes:
    if profile not in ("rsa", "hmac"):
        return BODY
    return Client(make_route(pki, profile, name=profile), ClientConfig(certs=pki)).secure(echo("probe"))[0]


@pytest.mark.parametrize(
    ("route", "tls", "identity"),
    [("plain", False, {}), ("plain", True, {}), ("xml", False, {}), ("xml", True, {}), ("tls", True, {}),
     ("mtls", True, {"x-client-subject": "Demo Client"}), ("rsa", False, {"x-wsgate-subject": SUBJECT}),
     ("rsa", True, {"x-wsgate-subject": SUBJECT}), ("hmac", False, {"x-wsgate-subject": "anonymous"})],
)  # fmt: skip
def test_identity_and_forwarding_headers_from_the_client_never_reach_the_backend(
    gw: LiveGateway, pki: Path, route: str, tls: bool, identity: dict[str, str]
) -> None:
    gw.clear()
    extra = SPOOFED + b"x-kept: an ordinary header passes\r\n"
    status, _ = send(gw, f"/{route}/demo".encode(), pki, tls=tls, headers=extra, body=_request_for(route, pki),
                     client_cert=route == "mtls")  # fmt: skip
    assert status == 200
    [got] = gw.received()
    headers = got["headers"]
    assert not [k for k, v in headers.items() if "spoofed" in v], headers
    assert not [k for k in headers if re.search("[^a-z0-9-]", k)], headers  # CGI, WSGI: x_wsgate_subject etc.
    assert headers["x-kept"] == "an ordinary header passes"
    assert headers["x-forwarded-proto"] == ("https" if tls else "http")
    assert headers.get("x-wsgate-subject") is None or "x-wsgate-subject" in identity
    for name, value in identity.items():
        assert value in headers[name]  # the gateway's own value, set after the client's was removed
    if not identity:
        assert "x-wsgate-subject" not in headers and "x-client-subject" not in headers


def test_a_spoofed_original_path_never_reaches_the_access_log(gw: LiveGateway, pki: Path) -> None:
    log = gw.opts.run_dir / "logs" / "envoy.log"
    assert send(gw, b"/plain/demo", pki, tls=False, headers=b"x-envoy-original-path: /rsa/forged-for-log\r\n")[0] == 200
    deadline = time.monotonic() + 5
    while '"POST /plain/demo HTTP/1.1" 200' not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert '"POST /plain/demo HTTP/1.1" 200' in log.read_text()
    assert "forged-for-log" not in log.read_text()


def _issue_proof(gw: LiveGateway, pki: Path, *, tls: bool, headers: bytes) -> str:
    """Send a signed, NOT encrypted Issue request with client entropy; the proof the gateway chose."""
    route = make_route(pki, "secureconversation", name="sc", encryption={"encrypt_response": True})
    client = Client(route, ClientConfig(certs=pki, sc_version="1.3"))
    version = next(v for v in sc.VERSIONS if v.name == "1.3")
    env = ws_trust.envelope(
        "1.1", ws_trust.build_issue_rst(version, entropy=os.urandom(32)), action=version.issue_action
    )
    secured, pending = client._secure(env, datetime.now(UTC))  # signed like `establish`, but the Body in clear
    status, reply = send(gw, b"/sc/demo", pki, tls=tls, headers=headers, body=secured)
    assert status == 200, reply[:500]
    proof = client.open(reply, pending).root.find(".//{*}RequestedProofToken")
    assert proof is not None
    return etree.QName(proof[0]).localname


def test_a_spoofed_forwarded_proto_does_not_make_plain_http_confidential(gw: LiveGateway, pki: Path) -> None:
    """Client entropy sent in clear over plain HTTP is not used for the key, whatever x-forwarded-proto says."""
    spoof = b"x-forwarded-proto: https\r\nx_forwarded_proto: https\r\nforwarded: proto=https\r\n"
    # A fresh key, as a BinarySecret in a Body encrypted to the requester: the clear entropy is not used.
    assert _issue_proof(gw, pki, tls=False, headers=spoof) == "BinarySecret"
    assert _issue_proof(gw, pki, tls=True, headers=b"x-forwarded-proto: http\r\n") == "ComputedKey"  # TLS is


# ---- slow and idle clients

EDGE = {"request_headers_timeout_s": 2, "request_timeout_s": 6, "stream_idle_timeout_s": 4,
        "connection_idle_timeout_s": 4}  # fmt: skip
LARGE = 10_000_000


@pytest.fixture(scope="module")
def slow_gw(module_gateway: GatewayFactory) -> LiveGateway:
    fast = {"upstream": {"address": "BACKEND", "timeout_s": 3}}
    routes = [{"name": "xml", "match": {"path_prefix": "/xml/"}, "profile": "xml", **fast},
              {"name": "plain", "match": {"path_prefix": "/plain/"}, "profile": "none", **fast}]  # fmt: skip
    # One worker whose budget holds one large body: the 24 idle clients of the report pinned it for minutes.
    return module_gateway(routes, edge=EDGE, metrics=True, body_budget_mb=12)


def in_flight(gw: LiveGateway) -> float:
    text = requests.get(gw.metrics_urls()[0], timeout=5).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("wsgate_body_bytes_in_flight")))


def released(gw: LiveGateway) -> bool:
    """The budget is back to zero (an exchange ends just after its reply left: poll briefly)."""
    deadline = time.monotonic() + 5
    while in_flight(gw) != 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _head(path: str, length: int) -> bytes:
    return f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: text/xml\r\ncontent-length: {length}\r\n\r\n".encode()


SLOW_OPENINGS = {
    "silent": b"",
    "partial headers": b"POST /xml/demo HTTP/1.1\r\nhost: x\r\ncontent-ty",
    "declared, xml": _head("/xml/demo", LARGE),
    "declared, plain": _head("/plain/demo", LARGE),
    "a few body bytes": _head("/xml/demo", LARGE) + b"<soap:Envelope",
}


def _closed_by_gateway(socks: dict[socket.socket, str], deadline: float) -> dict[str, bytes]:
    """Read every socket until the gateway closes it; what each got. Sockets still open at `deadline` fail."""
    got = {s: b"" for s in socks}
    open_ = set(socks)
    while open_ and time.monotonic() < deadline:
        readable, _, _ = select.select(list(open_), [], [], 0.2)
        for s in readable:
            try:
                chunk = s.recv(65536)
            except ConnectionError:
                chunk = b""
            got[s] += chunk
            if not chunk:
                open_.discard(s)
    assert not open_, f"still open: {sorted(socks[s] for s in open_)}"
    return {f"{socks[s]} #{i}": got[s] for i, s in enumerate(socks)}


def test_idle_and_slow_connections_do_not_starve_real_traffic(slow_gw: LiveGateway) -> None:
    port = slow_gw.opts.http_port
    socks: dict[socket.socket, str] = {}
    try:
        for i in range(50):
            kind = list(SLOW_OPENINGS)[i % len(SLOW_OPENINGS)]
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(SLOW_OPENINGS[kind])
            socks[s] = kind
        started = time.monotonic()
        time.sleep(0.3)  # their headers reached Envoy and the filter worker
        assert sum(len(v) for v in SLOW_OPENINGS.values()) * 10 < 6000  # about 5 KB in all, as in the report
        assert in_flight(slow_gw) == 0  # a declared length holds nothing
        big = envelope(f'<d:echo xmlns:d="{DEMO}"><d:text>{"x" * 1_000_000}</d:text></d:echo>')
        url = f"http://127.0.0.1:{port}"
        for path, body in [("/xml/demo", BODY), ("/plain/demo", BODY), ("/xml/demo", big)] * 3:
            r = requests.post(url + path, data=body, headers={"content-type": "text/xml"}, timeout=10)
            assert r.status_code == 200, r.text[:300]
        assert time.monotonic() - started < EDGE["stream_idle_timeout_s"]  # served while they hang
        # Envoy's timeouts close every one of them: request headers, request, stream and connection idle.
        got = _closed_by_gateway(socks, time.monotonic() + EDGE["request_timeout_s"] + 5)
        for name, data in got.items():
            if name.startswith("declared") or name.startswith("a few"):
                assert data.startswith(b"HTTP/1.1 408"), (name, data[:200])
                assert b"Request timeout" in data  # a SOAP fault
    finally:
        for s in socks:
            s.close()
    assert released(slow_gw)


def test_a_slow_body_is_cut_by_the_request_timeout_and_frees_the_budget(slow_gw: LiveGateway) -> None:
    """A body trickling in (4 bytes a second) never idles the stream; the request timeout ends it."""
    s = socket.create_connection(("127.0.0.1", slow_gw.opts.http_port), timeout=10)
    with s:
        s.sendall(_head("/xml/demo", len(BODY)))
        started = time.monotonic()
        reply = b""
        for byte in BODY:
            try:
                s.sendall(bytes([byte]))
            except ConnectionError:
                break
            if select.select([s], [], [], 0.25)[0]:
                reply = s.recv(65536)
                break
            assert in_flight(slow_gw) == 0  # bytes in Envoy's buffer, nothing reserved until the body is whole
            assert time.monotonic() - started < EDGE["request_timeout_s"] + 3, "the slow body was never cut"
        elapsed = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert EDGE["stream_idle_timeout_s"] < elapsed < EDGE["request_timeout_s"] + 2
    r = requests.post(f"http://127.0.0.1:{slow_gw.opts.http_port}/xml/demo", data=BODY,
                      headers={"content-type": "text/xml"}, timeout=10)  # fmt: skip
    assert r.status_code == 200
    assert released(slow_gw)


def test_envoy_timeouts_come_from_the_policy(slow_gw: LiveGateway) -> None:
    lds = (slow_gw.opts.run_dir / "envoy" / "lds.yaml").read_text()
    for field, value in [("request_headers_timeout", "2s"), ("request_timeout", "6s"),
                         ("stream_idle_timeout", "4s"), ("idle_timeout", "4s")]:  # fmt: skip
        assert re.search(rf"\b{field}: {value}\n", lds), field
