"""End to end through the real Envoy, the real filter workers and the real demo backend, over loopback HTTP(S)."""

from __future__ import annotations

import http.client
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests
from lxml import etree

from tests.support.harness import GatewayFactory, LiveGateway, content_type, envelope

DEMO = "urn:wsgate:demo"
ECHO = f'<d:echo xmlns:d="{DEMO}"><d:text>hello gateway</d:text></d:echo>'

ROUTES = [
    {
        "name": "plain",
        "match": {"path_prefix": "/plain/"},
        "upstream": {"address": "BACKEND"},
        "profile": "none",
    },
    {
        "name": "xml",
        "match": {"path_prefix": "/xml/"},
        "upstream": {"address": "BACKEND"},
        "profile": "xml",
        "limits": {
            "max_body_bytes": 200_000,
            "max_depth": 20,
            "max_elements": 500,
            "max_attributes": 5,
            "max_text_length": 10_000,
        },
    },
    {"name": "tls", "match": {"path_prefix": "/tls/"}, "upstream": {"address": "BACKEND"}, "profile": "tls"},
    {
        "name": "mtls",
        "match": {"path_prefix": "/mtls/"},
        "upstream": {"address": "BACKEND"},
        "profile": "tls",
        "tls": {"require_client_certificate": True, "subject_header": "x-client-subject"},
    },
]


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory) -> LiveGateway:
    return module_gateway(ROUTES, workers=2)


def fault_of(resp: requests.Response) -> tuple[str, str]:
    """(code, text) of a SOAP 1.1 or 1.2 fault response."""
    root = etree.fromstring(resp.content)
    code = root.findtext(".//faultcode") or root.findtext(".//{*}Code/{*}Value")
    text = root.findtext(".//faultstring") or root.findtext(".//{*}Reason/{*}Text")
    return code, text


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize("path", ["/plain/echo", "/xml/echo"])
def test_echo_through_gateway(gw, path: str, version: str) -> None:
    r = gw.post(path, envelope(ECHO, version), version)
    assert r.status_code == 200, r.text
    root = etree.fromstring(r.content)
    assert root.findtext(f".//{{{DEMO}}}text") == "hello gateway"
    assert r.headers["content-type"].startswith(content_type(version).split(";")[0])


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_tls_route_over_https(gw, pki: Path, version: str) -> None:
    r = gw.post("/tls/echo", envelope(ECHO, version), version, tls=True, verify=str(pki / "ca.pem"))
    assert r.status_code == 200
    assert b"hello gateway" in r.content


def test_tls_route_refuses_plain_http(gw) -> None:
    r = gw.post("/tls/echo", envelope(ECHO))
    assert r.status_code == 426
    assert fault_of(r) == ("soap:Client", "This service requires HTTPS")


def test_mtls_requires_client_certificate_and_passes_subject(gw, pki: Path) -> None:
    ca = str(pki / "ca.pem")
    r = gw.post("/mtls/echo", envelope(ECHO), tls=True, verify=ca)
    assert r.status_code == 403
    assert fault_of(r)[0] == "soap:Client"
    gw.clear()
    r = gw.post("/mtls/echo", envelope(ECHO), tls=True, verify=ca,
            cert=(str(pki / "client.pem"), str(pki / "client.key")))  # fmt: skip
    assert r.status_code == 200
    assert "CN=Demo Client" in gw.received()[-1]["headers"]["x-client-subject"]


def test_mtls_client_cannot_spoof_subject_header(gw, pki: Path) -> None:
    gw.clear()
    r = requests.post(gw.url("/mtls/echo", tls=True), data=envelope(ECHO), verify=str(pki / "ca.pem"),
                      cert=(str(pki / "client2.pem"), str(pki / "client2.key")),
                      headers={"content-type": "text/xml", "x-client-subject": "CN=admin"}, timeout=10)  # fmt: skip
    assert r.status_code == 200
    assert "CN=Demo Client Two" in gw.received()[-1]["headers"]["x-client-subject"]


def test_untrusted_client_certificate_refused(gw, pki: Path) -> None:
    with pytest.raises(requests.exceptions.SSLError):
        gw.post("/mtls/echo", envelope(ECHO), tls=True, verify=str(pki / "ca.pem"),
            cert=(str(pki / "rogue.pem"), str(pki / "rogue.key")))  # fmt: skip


def test_xml_route_passes_both_ways_through_filter(gw) -> None:
    gw.clear()
    r = gw.post("/xml/query", envelope(f'<d:query xmlns:d="{DEMO}"><d:count>100</d:count></d:query>'))
    assert r.status_code == 200
    assert len(r.content) > 20_000
    assert len(etree.fromstring(r.content).findall(f".//{{{DEMO}}}quake")) == 100
    # The response headers phase is skipped (one gRPC round trip less): Envoy frames the body chunked.
    assert r.headers.get("transfer-encoding") == "chunked" or int(r.headers["content-length"]) == len(r.content)
    assert b"<d:count>100</d:count>" in gw.received()[-1]["body"].encode()
    stats = requests.get(f"http://127.0.0.1:{gw.opts.admin_port}/stats?filter=^http\\.http\\.ext_proc\\.streams_started$",
                         timeout=5)  # fmt: skip
    assert int(stats.text.split(":")[-1]) > 0  # the body went through the filter, not around it


BAD = {
    "malformed": b"<soap:Envelope xmlns:soap='http://schemas.xmlsoap.org/soap/envelope/'><soap:Body>",
    "not soap": b"<hello/>",
    "two bodies": envelope("<a/>").replace(b"</soap:Envelope>", b"<soap:Body/></soap:Envelope>"),
    "depth": envelope("<a>" * 30 + "</a>" * 30),
    "elements": envelope("<a/>" * 600),
    "attributes": envelope('<a b="1" c="2" d="3" e="4" f="5" g="6"/>'),
    "text length": envelope("<a>" + "x" * 10_001 + "</a>"),
    "body size": envelope("<a>" + "<b>x</b>" * 30_000 + "</a>"),
    "processing instruction": envelope("<?evil thing?><a/>"),
    "billion laughs": b'<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;'
    b'&lol;&lol;&lol;&lol;&lol;&lol;&lol;"><!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">]>'
    + envelope("<a>&lol3;</a>"),
    "external entity": b'<!DOCTYPE foo [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>' + envelope("<a>&xxe;</a>"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_threat_protection_refuses(gw, case: str) -> None:
    gw.clear()
    start = time.monotonic()
    r = gw.post("/xml/echo", BAD[case])
    assert r.status_code in (413, 500), r.text
    assert fault_of(r)[0] == "soap:Client"
    assert "passwd" not in r.text and "root:" not in r.text
    assert gw.received() == []  # nothing of a refused request reaches the backend
    assert time.monotonic() - start < 5


def test_soap12_fault_for_soap12_request(gw) -> None:
    r = gw.post("/xml/echo", b"<broken", version="1.2")
    assert r.status_code == 500
    assert r.headers["content-type"].startswith("application/soap+xml")
    assert fault_of(r)[0] == "env:Sender"


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_other_methods_on_xml_route_refused_by_envoy(gw, method: str) -> None:
    # The filter sees bodies only, so Envoy itself refuses what is not a SOAP POST, even with a body.
    gw.clear()
    r = requests.request(method, gw.url("/xml/echo"), data=envelope(ECHO), timeout=5)
    assert r.status_code == 405
    assert fault_of(r) == ("soap:Client", "Only SOAP POST requests are accepted")
    assert gw.received() == []


@pytest.mark.parametrize("length", [None, "0", "00"])
def test_bodyless_post_on_xml_route_refused(gw, length: str | None) -> None:
    # A POST without a body would never reach the filter's body phase: it must not reach the backend either.
    gw.clear()
    conn = http.client.HTTPConnection("127.0.0.1", gw.opts.http_port, timeout=5)
    conn.putrequest("POST", "/xml/echo")
    conn.putheader("content-type", content_type("1.2"))
    if length is not None:
        conn.putheader("content-length", length)
    conn.endheaders()
    r = conn.getresponse()
    body = r.read()
    assert r.status == 411
    assert r.getheader("content-type").startswith("application/soap+xml")
    assert b"A SOAP request needs a body" in body
    assert gw.received() == []


@pytest.mark.parametrize(("chunks", "status"), [([], 500), ([b""], 500), ([envelope(ECHO)], 200)])
def test_chunked_post_goes_through_the_filter(gw, chunks: list[bytes], status: int) -> None:
    # No Content-Length: the filter sees the headers too (a body-less request is refused there); an empty
    # chunked body is not SOAP.
    gw.clear()
    conn = http.client.HTTPConnection("127.0.0.1", gw.opts.http_port, timeout=5)
    conn.request("POST", "/xml/echo", body=iter(chunks), headers={"content-type": content_type("1.1")},
                 encode_chunked=True)  # fmt: skip
    r = conn.getresponse()
    body = r.read()
    assert r.status == status, body
    if status == 200:
        assert b"hello gateway" in body
        assert len(gw.received()) == 1
    else:
        assert b"soap:Client" in body
        assert gw.received() == []


def test_unknown_path_is_soap_fault(gw) -> None:
    r = gw.post("/nowhere", envelope(ECHO))
    assert r.status_code == 404
    assert fault_of(r) == ("soap:Client", "No such service")


def test_backend_down_gives_503_fault(gateway: GatewayFactory) -> None:
    routes = [{"name": "xml", "match": {"path_prefix": "/"}, "upstream": {"address": "BACKEND"}, "profile": "xml"}]
    with gateway(routes, backend=False) as g:
        for version in ("1.1", "1.2"):
            r = g.post("/echo", envelope(ECHO, version), version)
            assert r.status_code == 503
            code, text = fault_of(r)
            assert code == ("env:Receiver" if version == "1.2" else "soap:Server")
            assert text == "Service unavailable"


def test_filter_killed_fails_closed(gateway: GatewayFactory) -> None:
    routes = [{"name": "xml", "match": {"path_prefix": "/"}, "upstream": {"address": "BACKEND"}, "profile": "xml"}]
    with gateway(routes) as g:
        assert g.post("/echo", envelope(ECHO)).status_code == 200
        g.clear()
        os.kill(g.workers[0].pid, signal.SIGKILL)
        g.workers[0].wait()
        r = g.post("/echo", envelope(ECHO))
        assert r.status_code == 503
        assert fault_of(r) == ("soap:Server", "Service unavailable")
        assert g.received() == []  # fail closed: nothing reached the backend unprocessed
        g.supervise_once()  # the supervisor restarts the worker
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if g.post("/echo", envelope(ECHO)).status_code == 200:
                break
            time.sleep(0.2)
        else:
            pytest.fail("gateway did not recover after the worker restart")


def test_policy_change_applies_without_restart(gateway: GatewayFactory) -> None:
    routes = [
        {"name": "stable", "match": {"path_prefix": "/s/"}, "upstream": {"address": "BACKEND"}, "profile": "xml"},
        {"name": "a", "match": {"path_prefix": "/a/"}, "upstream": {"address": "BACKEND"}, "profile": "xml"},
    ]
    with gateway(routes) as g:
        assert g.post("/a/x", envelope(ECHO)).status_code == 200
        assert g.post("/b/x", envelope(ECHO)).status_code == 404
        policy = g.opts.policies / "routes.yaml"
        text = policy.read_text()
        # A broken change is refused and the running policies stay.
        policy.write_text(text.replace("profile: xml", "profile: bogus"))
        assert g.reload_if_changed() is False
        assert g.post("/a/x", envelope(ECHO)).status_code == 200
        # Traffic on an unchanged route keeps flowing while the listener is replaced: nothing is dropped.
        statuses: list[int] = []
        stop = threading.Event()

        def load() -> None:
            with requests.Session() as s:
                while not stop.is_set():
                    statuses.append(s.post(g.url("/s/x"), data=envelope(ECHO), timeout=10).status_code)

        worker = threading.Thread(target=load)
        worker.start()
        time.sleep(0.3)
        policy.write_text(text.replace("/a/", "/b/"))
        assert g.reload_if_changed() is True
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and g.post("/b/x", envelope(ECHO)).status_code != 200:
            time.sleep(0.1)
        time.sleep(0.3)
        stop.set()
        worker.join()
        assert g.post("/b/x", envelope(ECHO)).status_code == 200
        assert g.post("/a/x", envelope(ECHO)).status_code == 404
        assert len(statuses) > 10 and set(statuses) == {200}


def test_reload_raising_a_body_limit_needs_no_restart(gateway: GatewayFactory) -> None:
    # The workers' gRPC limits are fixed at start: they are the schema's largest, not the first policies'.
    routes = [{"name": "xml", "match": {"path_prefix": "/"}, "upstream": {"address": "BACKEND"}, "profile": "xml",
               "limits": {"max_body_bytes": 1024 * 1024}, "response_limits": {"max_body_bytes": 1024 * 1024}}]  # fmt: skip
    big = envelope(f'<d:echo xmlns:d="{DEMO}">' + "<d:text>" + "x" * 3_000_000 + "</d:text>" * 1 + "<d:text>"
                   + "y" * 3_000_000 + "</d:text></d:echo>")  # fmt: skip
    with gateway(routes) as g:
        assert g.post("/echo", big).status_code == 413
        policy = g.opts.policies / "routes.yaml"
        policy.write_text(policy.read_text().replace("1048576", str(8 * 1024 * 1024)))
        assert g.reload_if_changed() is True
        # While Envoy and the workers switch policies, a request may meet one side's old limit: refused (413,
        # or 503 when Envoy's old buffer cuts it after the worker admitted it), never passed on unchecked.
        deadline = time.monotonic() + 10
        while (r := g.post("/echo", big)).status_code in (413, 503) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.status_code == 200, r.text[:300]
        assert len(r.content) > 6_000_000


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_recycling_drops_nothing(gateway: GatewayFactory, workers: int) -> None:
    """A worker grown past its memory limit is replaced under traffic: every request still succeeds."""
    routes = [{"name": "xml", "match": {"path_prefix": "/"}, "upstream": {"address": "BACKEND"}, "profile": "xml"}]
    with gateway(routes, workers=workers, worker_max_rss_mb=1) as g:
        before = [w.pid for w in g.workers]
        statuses: list[int] = []
        stop = threading.Event()

        def load() -> None:
            with requests.Session() as s:
                while not stop.is_set():
                    statuses.append(s.post(g.url("/echo"), data=envelope(ECHO), timeout=10).status_code)

        worker = threading.Thread(target=load)
        worker.start()
        for _ in range(3):
            time.sleep(0.3)
            g.supervise_once()  # every worker is over 1 MiB: each round replaces all of them
        time.sleep(0.3)
        stop.set()
        worker.join()
        assert not set(before) & {w.pid for w in g.workers}
        assert len(statuses) > 20 and set(statuses) == {200}
