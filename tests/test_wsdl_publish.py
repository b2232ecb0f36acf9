"""The published WSDL (policy `wsdl.publish`): served by Envoy at `<path>?wsdl` with its imports at stable URLs,
addresses pointing at the gateway, the gateway's WS-SecurityPolicy in place of the backend's; zeep builds working
clients from it. And what publishing must not open: a POST with ?wsdl is still a secured request, path tricks
reach nothing else, the Host header does not choose the published address."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import zeep
from lxml import etree
from zeep.plugins import HistoryPlugin
from zeep.wsse.compose import Compose

from filters.engine import ns
from gateway.control import envoy_config, wsdl_publish
from gateway.policy import Edge, PolicyError, Route, load_dir
from tests.harness import fault_code, received, write_policies
from tests.harness import running_gateway as running
from tests.test_interop import SIGNATURE, SignWithClientVerifyGateway, ZeepTimestamp, need_zeep, zeep_signer
from tests.wss_helpers import DEMO, echo, route_doc

__all__ = ["need_zeep"]  # a fixture, used by name

FIXTURES = Path(__file__).parent / "wsdl" / "publish"
ECHO_WSDL = FIXTURES / "echo.wsdl"
SOAP_ADDRESS = "{http://schemas.xmlsoap.org/wsdl/soap/}address"
SOAP12_ADDRESS = "{http://schemas.xmlsoap.org/wsdl/soap12/}address"
WSDL_NS = "http://schemas.xmlsoap.org/wsdl/"
XSD_NS = "http://www.w3.org/2001/XMLSchema"
SERVICE = "{urn:wsgate:demo:service}EchoService"
PUBLISHED = {"file": str(ECHO_WSDL), "publish": True}
VALIDATED = {"requests": True, "responses": True}


def _routes(pki: Path) -> list[dict[str, Any]]:
    return [
        {"name": "echo-xml", "match": {"path_prefix": "/echo/service"}, "upstream": {"address": "BACKEND"},
         "profile": "xml", "wsdl": PUBLISHED, "schema_validation": VALIDATED},
        route_doc(pki, "rsa", name="echo-rsa", match={"path_prefix": "/echo-rsa/service"}, wsdl=PUBLISHED,
                  schema_validation=VALIDATED),
        route_doc(pki, "rsa", name="rsa"),  # secured, nothing published
    ]  # fmt: skip


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[Any]:
    with running(tmp_path_factory.mktemp("wsdl-publish"), _routes(pki), pki) as g:
        yield g


def base(gw: Any) -> str:
    return f"http://127.0.0.1:{gw.opts.http_port}"


def get(gw: Any, target: str, **kw: Any) -> requests.Response:
    return requests.get(base(gw) + target, timeout=10, **kw)


def parsed(resp: requests.Response) -> etree._Element:
    assert resp.status_code == 200, (resp.status_code, resp.text[:300])
    assert resp.headers["content-type"] == "text/xml; charset=utf-8"
    return etree.fromstring(resp.content)


def test_wsdl_served_with_addresses_rewritten_to_the_gateway(gw: Any) -> None:
    root = parsed(get(gw, "/echo/service?wsdl"))
    locations = [a.get("location") for a in root.iter(SOAP_ADDRESS, SOAP12_ADDRESS)]
    assert locations == [f"{base(gw)}/echo/service"] * 2  # the SOAP 1.1 and the SOAP 1.2 port
    assert b"backend.internal" not in etree.tostring(root)


def test_imported_documents_served_at_stable_urls(gw: Any) -> None:
    root = parsed(get(gw, "/echo/service?wsdl"))
    imported = root.find(f"{{{WSDL_NS}}}import").get("location")
    assert imported == f"{base(gw)}/echo/service?wsdl=1"
    interface = parsed(requests.get(imported, timeout=10))
    schema_import = interface.find(f".//{{{XSD_NS}}}import").get("schemaLocation")
    assert schema_import == f"{base(gw)}/echo/service?xsd=2"
    xsd = parsed(requests.get(schema_import, timeout=10))
    assert xsd.get("targetNamespace") == "urn:wsgate:demo:types"
    # The same URLs give the same bytes every time (and HEAD the headers only).
    assert requests.get(imported, timeout=10).content == requests.get(imported, timeout=10).content
    head = requests.head(schema_import, timeout=10)
    assert head.status_code == 200 and head.content == b""


@pytest.mark.parametrize("query", ["?wsdl=7", "?xsd=1", "?xsd=../../etc/passwd", "?xsd", "?WSDL=1"])
def test_unknown_document_numbers_serve_nothing(gw: Any, query: str) -> None:
    resp = get(gw, "/echo/service" + query)
    assert resp.status_code == 405, resp.text[:200]  # the route's refusal of a GET: no document


def test_post_with_wsdl_query_is_still_a_secured_request(gw: Any) -> None:
    """?wsdl only chooses Envoy's answer for GET and HEAD: a POST goes through the secured route, unsigned
    requests are refused there and never reach the backend."""
    requests.delete(f"http://{gw.backend_addr}/_received", timeout=5)
    resp = requests.post(base(gw) + "/echo-rsa/service?wsdl", data=echo("unsigned"),
                         headers={"content-type": "text/xml; charset=utf-8"}, timeout=10)  # fmt: skip
    assert resp.status_code == 500 and "InvalidSecurity" in fault_code(resp), resp.text[:300]
    assert received(gw) == []


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH", "OPTIONS"])
def test_other_methods_with_wsdl_query_are_refused(gw: Any, method: str) -> None:
    resp = requests.request(method, base(gw) + "/echo-rsa/service?wsdl", timeout=10)
    assert resp.status_code == 405
    assert received(gw) == [] or all(r["method"] == "POST" for r in received(gw))


@pytest.mark.parametrize(
    "target",
    ["/rsa/../echo/x?wsdl", "/rsa/?wsdl", "/echo/service/../../rsa/?wsdl", "/echo/service/x?wsdl",
     "/echo/service;x?wsdl", "/echo/service%3Fwsdl", "/echo/service/?wsdl"],
)  # fmt: skip
def test_path_tricks_reach_no_other_document_or_route(gw: Any, target: str) -> None:
    resp = get(gw, target)
    assert resp.status_code in (400, 404, 405), (target, resp.status_code)
    assert b"definitions" not in resp.content
    assert all(r["method"] == "POST" for r in received(gw))  # nothing but POSTs ever reached the backend


def test_host_header_does_not_choose_the_published_address(gw: Any) -> None:
    root = parsed(get(gw, "/echo/service?wsdl", headers={"host": "attacker.example"}))
    assert {a.get("location") for a in root.iter(SOAP_ADDRESS)} == {f"{base(gw)}/echo/service"}


def test_secured_route_publishes_the_gateways_asymmetric_binding(gw: Any) -> None:
    root = parsed(get(gw, "/echo-rsa/service?wsdl"))
    policy = root.find(f"{{{ns.WSP}}}Policy")
    assert policy is not None
    sp = ns.SP12
    assert policy.find(f".//{{{sp}}}AsymmetricBinding//{{{sp}}}InitiatorToken//{{{sp}}}X509Token") is not None
    assert policy.find(f".//{{{sp}}}IncludeTimestamp") is not None
    assert policy.find(f".//{{{sp}}}SignedParts/{{{sp}}}Body") is not None
    policy_id = policy.get(f"{{{ns.WSU}}}Id")
    refs = [b.find(f"{{{ns.WSP}}}PolicyReference") for b in root.iterfind(f"{{{WSDL_NS}}}binding")]
    assert [r.get("URI") for r in refs] == [f"#{policy_id}"] * 2
    # The xml route passes messages as they are: its published WSDL states no policy of the gateway's.
    assert parsed(get(gw, "/echo/service?wsdl")).find(f"{{{ns.WSP}}}Policy") is None


def test_backend_policy_replaced_on_secured_routes(tmp_path: Path, pki: Path) -> None:
    """A WSDL whose binding asks for a UsernameToken over TLS (the backend's hop): the rsa route publishes its own
    policy instead, and no reference to the backend's is left dangling."""
    wsdl_dir = tmp_path / "svc"
    wsdl_dir.mkdir()
    text = ECHO_WSDL.read_text()
    backend_policy = (
        f'<wsp:Policy xmlns:wsp="{ns.WSP}" xmlns:wsu="{ns.WSU}" wsu:Id="BackendPolicy">'
        f'<sp:TransportBinding xmlns:sp="{ns.SP12}"/></wsp:Policy>'
    )
    text = text.replace('<wsdl:binding name="EchoBinding" type="d:EchoPortType">',
                        backend_policy + '<wsdl:binding name="EchoBinding" type="d:EchoPortType">'
                        f'<wsp:PolicyReference xmlns:wsp="{ns.WSP}" URI="#BackendPolicy"/>')  # fmt: skip
    (wsdl_dir / "echo.wsdl").write_text(text)
    for f in ("echo-interface.wsdl", "types/echo-types.xsd"):
        (wsdl_dir / f).parent.mkdir(exist_ok=True)
        (wsdl_dir / f).write_text((FIXTURES / f).read_text())
    route = Route.model_validate(
        {**route_doc(pki, "rsa", name="r"), "upstream": {"address": "127.0.0.1:1"},
         "wsdl": {"file": str(wsdl_dir / "echo.wsdl"), "publish": True}}
    )  # fmt: skip
    doc = etree.fromstring(wsdl_publish.documents(route, "https://gw.example")[0].body)
    out = etree.tostring(doc).decode()
    assert "BackendPolicy" not in out and "TransportBinding" not in out
    assert "AsymmetricBinding" in out


def test_public_url_from_policy_and_https_only_routes(tmp_path: Path, pki: Path) -> None:
    route = Route.model_validate({**route_doc(pki, "tls", name="t"), "upstream": {"address": "127.0.0.1:1"},
                                  "wsdl": PUBLISHED})  # fmt: skip
    assert wsdl_publish.base_url(route, Edge(), "127.0.0.1", 8080, 8443) == "https://127.0.0.1:8443"
    assert wsdl_publish.base_url(route, Edge(), "0.0.0.0", 8080, 8443) == "https://localhost:8443"
    edge = Edge(public_url="https://soap.example.com")
    assert wsdl_publish.base_url(route, edge, "0.0.0.0", 8080, 8443) == "https://soap.example.com"
    body = wsdl_publish.documents(route, "https://soap.example.com")[0].body
    assert b'location="https://soap.example.com/t/"' in body
    assert b"TransportBinding" in body and b"HttpsToken" in body
    # An http public URL for a route served over HTTPS only would publish an address that answers 426.
    write_policies(tmp_path / "p", [{**route_doc(pki, "tls", name="t"), "upstream": {"address": "127.0.0.1:1"},
                                    "wsdl": PUBLISHED}], edge={"public_url": "http://soap.example.com"})  # fmt: skip
    with pytest.raises(PolicyError, match=r"edge\.public_url is http"):
        load_dir(tmp_path / "p")


@pytest.mark.parametrize("url", ["soap.example.com", "http://x/path", "http://x?q", "javascript:x", "http://a b"])
def test_public_url_is_scheme_host_and_port_only(url: str) -> None:
    with pytest.raises(ValueError, match="public_url"):
        Edge(public_url=url)


def test_rendered_routes_serve_wsdl_before_the_secured_route(pki: Path) -> None:
    from gateway.policy import PolicySet

    ps = PolicySet(routes=[Route.model_validate(r | {"upstream": {"address": "127.0.0.1:1"}}) for r in _routes(pki)],
                   sources={"echo-xml": "x", "echo-rsa": "x", "rsa": "x"})  # fmt: skip
    files = envoy_config.render(ps, envoy_config.Topology())
    text = files["lds.yaml"]
    assert "max_direct_response_body_size_bytes" in text
    names = re.findall(r"^ {10,}- name: (echo-rsa\S*)$", text, re.M)
    assert names.index("echo-rsa-wsdl") < names.index("echo-rsa")


# ---------------------------------------------------------------------------------------------------------
# zeep, from the published WSDL


def test_zeep_client_from_published_wsdl_calls_validated_xml_route(need_zeep: None, gw: Any) -> None:
    requests.delete(f"http://{gw.backend_addr}/_received", timeout=5)
    client = zeep.Client(f"{base(gw)}/echo/service?wsdl")
    service = client.bind("EchoService", "EchoPort")
    assert service.echo(text=["from the published WSDL"]) == ["from the published WSDL"]
    got = received(gw)
    assert len(got) == 1 and got[0]["path"] == "/echo/service"
    # Schema validation is on: what zeep's schema allows but the published one does not, the gateway refuses.
    with pytest.raises(zeep.exceptions.Fault):
        service.echo(text=["x" * 65])  # ShortText: maxLength 64


def test_zeep_client_from_published_wsdl_soap12_port(need_zeep: None, gw: Any) -> None:
    service = zeep.Client(f"{base(gw)}/echo/service?wsdl").bind("EchoService", "EchoPort12")
    assert service.echo(text=["over SOAP 1.2"]) == ["over SOAP 1.2"]


def test_zeep_binary_signature_through_secured_route_from_published_wsdl(need_zeep: None, gw: Any, pki: Path) -> None:
    requests.delete(f"http://{gw.backend_addr}/_received", timeout=5)
    history = HistoryPlugin()
    sign = SignWithClientVerifyGateway(zeep_signer(pki, sha256=True), (pki / "gateway-sign.pem").read_bytes())
    client = zeep.Client(f"{base(gw)}/echo-rsa/service?wsdl", wsse=Compose([ZeepTimestamp(), sign]),
                         plugins=[history])  # fmt: skip
    service = client.bind("EchoService", "EchoPort")

    assert service.echo(text=["signed by zeep"]) == ["signed by zeep"]

    assert sign.verified == 1  # zeep checked the gateway's signature on the reply
    assert history.last_sent["envelope"].find(f".//{SIGNATURE}") is not None
    got = received(gw)
    assert len(got) == 1 and got[0]["headers"]["x-wsgate-subject"] == "CN=Demo Client,O=WSGate Demo"
    assert "Security" not in got[0]["body"] and f"{{{DEMO}}}" not in got[0]["body"]  # plain SOAP, prefixed
