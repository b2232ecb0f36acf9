"""Schema validation per route (policy `schema_validation`): invalid payloads refused before the backend, a
backend's invalid response a 502, validation after decryption, what WS-Security adds never a schema error; and
the schema documents themselves: nothing fetched from the network or outside the WSDL's directory, no entities."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from lxml import etree
from prometheus_client import REGISTRY

from filters.engine import faults, ns
from filters.engine.engine import Exchange, build_pipeline
from filters.engine.xml import schema_validation, wsdl
from filters.stores.factory import RouteStores
from gateway.control.documents import load_checked
from gateway.policy import PolicyError, Route
from tests.harness import LoopbackHttp, content_type, envelope, received, running_gateway, write_policies
from tests.wss_helpers import DEMO, client_for, echo, route_doc

FIXTURES = Path(__file__).parent / "wsdl" / "publish"
ECHO_WSDL = str(FIXTURES / "echo.wsdl")
BOTH = {"requests": True, "responses": True}


def _routes(pki: Path) -> list[dict[str, Any]]:
    return [
        {"name": "validated", "match": {"path_prefix": "/validated/"}, "upstream": {"address": "BACKEND"},
         "profile": "xml", "wsdl": {"file": ECHO_WSDL}, "schema_validation": BOTH},
        {"name": "responses", "match": {"path_prefix": "/responses/"}, "upstream": {"address": "BACKEND"},
         "profile": "xml", "wsdl": {"file": ECHO_WSDL}, "schema_validation": {"responses": True}},
        route_doc(pki, "rsa", name="sealed", wsdl={"file": ECHO_WSDL}, schema_validation=BOTH,
                  encryption={"require_request": True, "encrypt_response": True}),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[Any]:
    with running_gateway(tmp_path_factory.mktemp("schema-gw"), _routes(pki), pki) as g:
        yield g


def post(gw: Any, path: str, body: bytes, version: str = "1.1") -> requests.Response:
    return requests.post(f"http://127.0.0.1:{gw.opts.http_port}{path}", data=body,
                         headers={"content-type": content_type(version)}, timeout=10)  # fmt: skip


def clear(gw: Any) -> None:
    requests.delete(f"http://{gw.backend_addr}/_received", timeout=5)


def top_code(resp: requests.Response) -> str:
    root = etree.fromstring(resp.content)
    return (root.findtext(".//faultcode") or root.findtext(".//{*}Code/{*}Value") or "").split(":")[-1]


def op(inner: str, name: str = "echo") -> str:
    return f'<d:{name} xmlns:d="{DEMO}">{inner}</d:{name}>'


INVALID = {
    "unknown-child": op("<d:txt>x</d:txt>"),
    "too-long": op(f"<d:text>{'x' * 65}</d:text>"),
    "too-many": op("<d:text>x</d:text>" * 11),
    "no-child": op(""),
    "undeclared-operation": op("", name="other"),
    "other-namespace": '<e:echo xmlns:e="urn:other"><e:text>x</e:text></e:echo>',
    "unprefixed-child-in-no-namespace": op("<text>x</text>"),
    "stray-attribute": op("<d:text>x</d:text>").replace("<d:echo ", '<d:echo evil="1" '),
    "second-payload-invalid": op("<d:text>x</d:text>") + op("<d:bad/>"),
}


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize("payload", list(INVALID), ids=list(INVALID))
def test_schema_invalid_request_refused_before_the_backend(gw: Any, payload: str, version: str) -> None:
    clear(gw)
    resp = post(gw, "/validated/", envelope(INVALID[payload], version), version)
    assert resp.status_code == 500
    assert top_code(resp) == ("Client" if version == "1.1" else "Sender"), resp.text
    assert received(gw) == []


def test_valid_request_and_response_pass(gw: Any) -> None:
    clear(gw)
    resp = post(gw, "/validated/", envelope(op("<d:text>fine</d:text><d:text>twice</d:text>")))
    assert resp.status_code == 200, resp.text
    assert etree.fromstring(resp.content).findtext(f".//{{{DEMO}}}echoResponse/{{{DEMO}}}text") == "fine"
    assert len(received(gw)) == 1


def test_comments_and_cdata_do_not_hide_invalid_text(gw: Any) -> None:
    clear(gw)
    split = op(f"<d:text>{'x' * 40}<!-- -->{'y' * 40}</d:text>")
    assert post(gw, "/validated/", envelope(split)).status_code == 500
    cdata = op(f"<d:text><![CDATA[{'x' * 65}]]></d:text>")
    assert post(gw, "/validated/", envelope(cdata)).status_code == 500
    assert received(gw) == []


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_invalid_backend_response_is_a_502_server_fault(gw: Any, version: str) -> None:
    """The request is not validated on this route; the backend echoes what the response schema does not allow."""
    clear(gw)
    resp = post(gw, "/responses/", envelope(op("<d:unexpected/>"), version), version)
    assert resp.status_code == 502
    assert top_code(resp) == ("Server" if version == "1.1" else "Receiver"), resp.text
    assert len(received(gw)) == 1  # the backend answered; its answer did not leave the gateway
    assert b"unexpected" not in resp.content


def test_backend_faults_are_passed_not_validated(gw: Any) -> None:
    resp = post(gw, "/responses/", envelope(op("", name="fault")))
    assert resp.status_code == 500 and top_code(resp) == "Server"
    assert b"The gateway could not process" not in resp.content  # the backend's own fault


def test_precise_reason_logged_without_the_payload_values(gw: Any) -> None:
    post(gw, "/validated/", envelope(op("<d:text>hunter2-" + "s" * 60 + "</d:text>")))
    log = (gw.logs / "filter-0.log").read_text()
    line = next(x for x in reversed(log.splitlines()) if "schema invalid: request payload" in x)
    assert "maxLength" in line and "{urn:wsgate:demo}text" in line
    assert "hunter2" not in log


def test_signed_encrypted_request_validated_after_decryption(gw: Any, pki: Path) -> None:
    route = Route.model_validate({**_routes(pki)[2], "upstream": {"address": "127.0.0.1:1"}})
    client = client_for(route, pki, encrypt=True)
    clear(gw)
    secured, pending = client.secure(echo("sealed and valid"))
    assert DEMO.encode() not in secured  # the payload travels encrypted: only the gateway can validate it
    resp = post(gw, "/sealed/", secured)
    assert resp.status_code == 200, resp.text
    assert client.open(resp.content, pending).body.findtext(f".//{{{DEMO}}}text") == "sealed and valid"
    assert len(received(gw)) == 1

    clear(gw)
    secured, _ = client.secure(echo("x" * 65))  # well formed, signed, encrypted: and invalid inside
    resp = post(gw, "/sealed/", secured)
    assert resp.status_code == 500 and top_code(resp) == "Client", resp.text
    assert received(gw) == []


# ---------------------------------------------------------------------------------------------------------
# the engine, in process


def make(pki: Path, **extra: Any) -> Route:
    doc = route_doc(pki, "rsa", name="v", wsdl={"file": ECHO_WSDL}, schema_validation=BOTH, **extra)
    return Route.model_validate({**doc, "upstream": {"address": "127.0.0.1:1"}})


def test_wsu_id_and_wsse_attributes_the_signature_added_are_not_schema_errors(pki: Path) -> None:
    schema = schema_validation.for_route(make(pki))
    assert schema is not None
    body = etree.fromstring(
        f'<b xmlns:wsu="{ns.WSU}" xmlns:wsse="{ns.WSSE}" xmlns:wsse11="{ns.WSSE11}">'
        f'<d:echo xmlns:d="{DEMO}" wsu:Id="id-1" wsse11:Usage="x"><d:text wsse:Usage="y" wsu:Id="id-2">t</d:text>'
        "</d:echo></b>"
    )
    schema.check(body, request=True)
    assert body[0].get(f"{{{ns.WSU}}}Id") == "id-1"  # the message itself is left as verified
    # Any other foreign attribute is still an error.
    body[0].set("{urn:other}Id", "x")
    with pytest.raises(faults.Fault, match="schema invalid"):
        schema.check(body, request=True)


def test_signed_request_with_body_wsu_id_passes_the_pipeline(pki: Path) -> None:
    route = make(pki)
    secured, _ = client_for(route, pki).secure(echo("signed"))
    assert ns.WSU.encode() in secured
    out = build_pipeline(route, RouteStores()).request(secured, {}, Exchange(route=route))
    assert out.body is not None and b"signed" in out.body


def test_schema_refusal_counted_as_schema_and_timed_as_a_stage(pki: Path) -> None:
    route = Route.model_validate(
        {"name": "staged", "match": {"path_prefix": "/s/"}, "upstream": {"address": "127.0.0.1:1"},
         "profile": "xml", "wsdl": {"file": ECHO_WSDL}, "schema_validation": BOTH}
    )  # fmt: skip
    pipeline = build_pipeline(route, RouteStores())
    labels = {"route": "staged", "profile": "xml", "stage": "schema"}
    before = REGISTRY.get_sample_value("wsgate_stage_seconds_count", labels) or 0
    pipeline.request(envelope(op("<d:text>ok</d:text>")), {}, Exchange(route=route))
    with pytest.raises(faults.Fault) as refused:
        pipeline.request(envelope(op("<d:nope/>")), {}, Exchange(route=route))
    assert REGISTRY.get_sample_value("wsgate_stage_seconds_count", labels) == before + 2
    assert faults.metric_reason(refused.value) == "schema" and "schema" in faults.LABELS
    with pytest.raises(faults.Fault) as bad_response:
        pipeline.response(envelope(op("<d:nope/>", name="echoResponse")), Exchange(route=route))
    assert bad_response.value.http_status == 502 and not bad_response.value.sender
    assert faults.metric_reason(bad_response.value) == "schema"


# ---------------------------------------------------------------------------------------------------------
# the schema documents: local files only


def _evil_schema(_: bytes) -> tuple[str, bytes]:
    return "application/xml", f'<xs:schema xmlns:xs="{ns.XSD}" targetNamespace="urn:evil"/>'.encode()


@pytest.fixture
def listener() -> Iterator[LoopbackHttp]:
    """A real HTTP server on loopback that records every request: proof that nothing was fetched."""
    got = LoopbackHttp(_evil_schema)
    yield got
    got.close()


def xsd(body: str = "", doctype: str = "") -> str:
    return f'{doctype}<xs:schema xmlns:xs="{ns.XSD}" targetNamespace="urn:t">{body}</xs:schema>'


def policy_with_xsd(tmp: Path, text: str) -> Path:
    schemas = tmp / "schemas"
    schemas.mkdir(parents=True, exist_ok=True)
    (schemas / "main.xsd").write_text(text)
    route = {"name": "x", "match": {"path_prefix": "/x/"}, "upstream": {"address": "127.0.0.1:1"},
             "profile": "xml", "schema_validation": {"requests": True, "xsd_files": [str(schemas / "main.xsd")]}}  # fmt: skip
    return write_policies(tmp / "policies", [route])


REFERENCES = {
    "http-import": '<xs:import namespace="urn:e" schemaLocation="{url}/evil.xsd"/>',
    "http-include": '<xs:include schemaLocation="{url}/evil.xsd"/>',
    "http-redefine": '<xs:redefine schemaLocation="{url}/evil.xsd"/>',
    "network-path": '<xs:import namespace="urn:e" schemaLocation="//{host}/evil.xsd"/>',
    "file-url": '<xs:import namespace="urn:e" schemaLocation="file:///etc/passwd"/>',
    "absolute-path": '<xs:import namespace="urn:e" schemaLocation="/etc/passwd"/>',
    "dot-dot": '<xs:import namespace="urn:e" schemaLocation="../outside.xsd"/>',
    "encoded-dot-dot": '<xs:import namespace="urn:e" schemaLocation="%2e%2e/outside.xsd"/>',
    "backslash": '<xs:import namespace="urn:e" schemaLocation="..\\outside.xsd"/>',
    "symlink-out": '<xs:import namespace="urn:e" schemaLocation="link.xsd"/>',
    "uppercase-scheme": '<xs:import namespace="urn:e" schemaLocation="HTTP://{host}/evil.xsd"/>',
}


@pytest.mark.parametrize("kind", list(REFERENCES), ids=list(REFERENCES))
def test_schema_references_to_the_network_or_outside_files_refused_at_policy_load(
    tmp_path: Path, listener: LoopbackHttp, kind: str
) -> None:
    (tmp_path / "outside.xsd").write_text(xsd())
    ref = REFERENCES[kind].format(url=listener.url, host=listener.url.removeprefix("http://"))
    policies = policy_with_xsd(tmp_path, xsd(ref))
    (tmp_path / "schemas" / "link.xsd").symlink_to(tmp_path / "outside.xsd")
    with pytest.raises(PolicyError, match="field schema_validation"):
        load_checked(policies)
    assert listener.paths == []


def test_wsdl_import_from_the_network_refused(tmp_path: Path, listener: LoopbackHttp) -> None:
    (tmp_path / "s.wsdl").write_text(
        f'<wsdl:definitions xmlns:wsdl="{ns.WSDL}"><wsdl:import namespace="urn:e" location="{listener.url}/x.wsdl"/>'
        "</wsdl:definitions>"
    )
    with pytest.raises(wsdl.DocumentError, match="not a relative file path"):
        wsdl.load(tmp_path / "s.wsdl")
    assert listener.paths == []


ENTITIES = {
    "external-entity-http": '<!DOCTYPE xs:schema [<!ENTITY e SYSTEM "{url}/xxe">]>',
    "external-entity-file": '<!DOCTYPE xs:schema [<!ENTITY e SYSTEM "file:///etc/passwd">]>',
    "external-subset": '<!DOCTYPE xs:schema SYSTEM "{url}/evil.dtd">',
    "parameter-entity": '<!DOCTYPE xs:schema [<!ENTITY % p SYSTEM "{url}/p.dtd"> %p;]>',
    "billion-laughs": '<!DOCTYPE xs:schema [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;">]>',
}


@pytest.mark.parametrize("kind", list(ENTITIES), ids=list(ENTITIES))
def test_dtds_and_entities_in_a_schema_refused(tmp_path: Path, listener: LoopbackHttp, kind: str) -> None:
    doctype = ENTITIES[kind].format(url=listener.url)
    body = '<xs:element name="e" type="xs:string" fixed="&e;"/>' if "entity-" in kind else ""
    policies = policy_with_xsd(tmp_path, xsd(body, doctype))
    with pytest.raises(PolicyError, match=r"DOCTYPE|external resource|not well-formed"):
        load_checked(policies)
    assert listener.paths == []


def test_imports_inside_the_wsdl_directory_are_followed(tmp_path: Path) -> None:
    loaded = wsdl.load(ECHO_WSDL)
    assert [(d.path.name, d.kind) for d in loaded.documents] == [
        ("echo.wsdl", "wsdl"), ("echo-interface.wsdl", "wsdl"), ("echo-types.xsd", "xsd")]  # fmt: skip


@pytest.mark.parametrize(
    ("route", "message"),
    [
        ({"profile": "xml", "schema_validation": {"requests": True}}, "needs a schema"),
        ({"profile": "none", "schema_validation": {"requests": True}, "wsdl": {"file": ECHO_WSDL}}, "does not read"),
        ({"profile": "tls", "schema_validation": {"responses": True}, "wsdl": {"file": ECHO_WSDL}}, "does not read"),
    ],
    ids=["no-schema", "none-profile", "tls-profile"],
)
def test_validation_policy_errors(route: dict[str, Any], message: str) -> None:
    doc = {"name": "x", "match": {"path_prefix": "/x/"}, "upstream": {"address": "127.0.0.1:1"}, **route}
    with pytest.raises(ValueError, match=message):
        Route.model_validate(doc)


def test_rpc_style_wsdl_refused_for_validation(tmp_path: Path) -> None:
    text = Path(ECHO_WSDL).read_text().replace('style="document"', 'style="rpc"')
    for name in ("echo-interface.wsdl", "types/echo-types.xsd"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text((FIXTURES / name).read_text())
    (tmp_path / "echo.wsdl").write_text(text)
    with pytest.raises(wsdl.DocumentError, match="rpc style"):
        schema_validation.PayloadSchema(wsdl.load(tmp_path / "echo.wsdl"), [])


def test_xsi_schema_location_in_a_payload_is_never_fetched(pki: Path, listener: LoopbackHttp) -> None:
    """The instance cannot bring its own schema: xsi:schemaLocation is not followed, the route's schema decides."""
    schema = schema_validation.for_route(make(pki))
    assert schema is not None
    xsi = "http://www.w3.org/2001/XMLSchema-instance"
    body = etree.fromstring(
        f'<b><d:echo xmlns:d="{DEMO}" xmlns:xsi="{xsi}" xsi:schemaLocation="{DEMO} {listener.url}/evil.xsd"'
        f' xsi:noNamespaceSchemaLocation="{listener.url}/nons.xsd"><d:text>t</d:text></d:echo></b>'
    )
    schema.check(body, request=True)
    body[0].append(etree.Element(f"{{{DEMO}}}extra"))
    with pytest.raises(faults.Fault):
        schema.check(body, request=True)
    assert listener.paths == []
