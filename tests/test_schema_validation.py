"""Schema validation per route (policy `schema_validation`): invalid payloads refused before the backend, a
backend's invalid response a 502, validation after decryption, what WS-Security adds never a schema error; and
the schema documents themselves: nothing fetched from the network or outside the WSDL's directory, no entities."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from lxml import etree
from prometheus_client import REGISTRY

from filters.engine import cpu_budget, faults, ns
from filters.engine.engine import Exchange, build_pipeline
from filters.engine.xml import schema_validation, wsdl, xsd_patterns
from filters.engine.xml.schema_validation import PayloadSchema
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
        route_doc(pki, "hmac", name="hmacv", wsdl={"file": ECHO_WSDL}, schema_validation=BOTH),
    ]  # fmt: skip


# A schema whose matching backtracks in libxml2: ambiguous pattern facets and a repeated sequence of a repeated
# element (each such value or element costs libxml2 up to its own limit, 0.1 to 0.5 s, then an internal error).
BACKTRACKING_XSD = f"""<xs:schema xmlns:xs="{ns.XSD}" xmlns:d="{DEMO}" targetNamespace="{DEMO}"
    elementFormDefault="qualified">
  <xs:simpleType name="Identifier"><xs:restriction base="xs:string"><xs:pattern value="(a|aa)*"/></xs:restriction>
  </xs:simpleType>
  <xs:simpleType name="Words"><xs:restriction base="xs:string"><xs:pattern value="(\\w{{1,10}}\\s?)*"/>
  </xs:restriction></xs:simpleType>
  <xs:simpleType name="Code"><xs:restriction base="xs:string"><xs:pattern value="[A-Z]{{3}}[0-9]{{4}}"/>
  </xs:restriction></xs:simpleType>
  <xs:complexType name="Runs"><xs:sequence maxOccurs="unbounded"><xs:element name="n" maxOccurs="5"/>
  </xs:sequence></xs:complexType>
  <xs:complexType name="Items"><xs:choice maxOccurs="unbounded">
    <xs:element name="text" type="d:Identifier"/><xs:element name="words" type="d:Words"/>
    <xs:element name="code" type="d:Code"/><xs:element name="runs" type="d:Runs"/>
  </xs:choice></xs:complexType>
  <xs:element name="echo" type="d:Items"/>
  <xs:element name="echoResponse" type="d:Items"/>
</xs:schema>"""


def _backtracking_routes(xsd_file: Path) -> list[dict[str, Any]]:
    sv = {"xsd_files": [str(xsd_file)]}
    return [
        {"name": "patterns", "match": {"path_prefix": "/patterns/"}, "upstream": {"address": "BACKEND"},
         "profile": "xml", "schema_validation": {**BOTH, **sv}},
        {"name": "patterns-out", "match": {"path_prefix": "/patterns-out/"}, "upstream": {"address": "BACKEND"},
         "profile": "xml", "schema_validation": {"responses": True, **sv}},
    ]  # fmt: skip


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[Any]:
    tmp = tmp_path_factory.mktemp("schema-gw")
    (tmp / "backtracking.xsd").write_text(BACKTRACKING_XSD)
    with running_gateway(tmp, _routes(pki) + _backtracking_routes(tmp / "backtracking.xsd"), pki) as g:
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
# what is validated is what the backend gets: no attribute left out of validation


WSU_LOOKALIKE_CASE = ns.WSU.replace("wssecurity-utility", "WSSecurity-utility")
# name -> (where: operation, leaf, Body or Envelope; the attribute; its namespace declaration)
ATTRIBUTES = {
    "wsse-role-on-operation": ("operation", 'wsse:Role="admin"', f'xmlns:wsse="{ns.WSSE}"'),
    "wsse-role-on-leaf": ("leaf", 'wsse:Role="admin"', f'xmlns:wsse="{ns.WSSE}"'),
    "wsu-created-on-leaf": ("leaf", 'wsu:Created="2026-01-01T00:00:00Z"', f'xmlns:wsu="{ns.WSU}"'),
    "wsse11-salt-on-leaf": ("leaf", 'wsse11:Salt="x"', f'xmlns:wsse11="{ns.WSSE11}"'),
    "wsu-id-no-reference-points-to": ("operation", 'wsu:Id="op-1"', f'xmlns:wsu="{ns.WSU}"'),
    "wsu-lookalike-trailing-slash": ("operation", 'u:Id="x"', f'xmlns:u="{ns.WSU}/"'),
    "wsu-lookalike-other-case": ("operation", 'u:Id="x"', f'xmlns:u="{WSU_LOOKALIKE_CASE}"'),
    "xml-lang": ("leaf", 'xml:lang="en"', ""),
    "xml-base": ("operation", 'xml:base="http://evil.example/"', ""),
    "xml-id": ("operation", 'xml:id="op"', ""),
    "wsse-role-on-body": ("Body", 'wsse:Role="admin"', f'xmlns:wsse="{ns.WSSE}"'),
    "wsu-id-on-body": ("Body", 'wsu:Id="body"', f'xmlns:wsu="{ns.WSU}"'),
    "plain-attribute-on-body": ("Body", 'role="admin"', ""),
    "wsse-role-on-envelope": ("Envelope", 'wsse:Role="admin"', f'xmlns:wsse="{ns.WSSE}"'),
}


def with_attribute(kind: str, version: str = "1.1", text: str = "x") -> bytes:
    where, attribute, declaration = ATTRIBUTES[kind]
    tag = {"operation": "<d:echo ", "leaf": "<d:text", "Body": "<soap:Body", "Envelope": "<soap:Envelope"}[where]
    plain = envelope(op(f"<d:text>{text}</d:text>"), version).decode()
    return plain.replace(tag, f"{tag} {attribute} {declaration} ".replace("  ", " "), 1).encode()


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize("kind", list(ATTRIBUTES), ids=list(ATTRIBUTES))
def test_ignored_security_attribute_never_reaches_backend_request(gw: Any, kind: str, version: str) -> None:
    clear(gw)
    resp = post(gw, "/validated/", with_attribute(kind, version), version)
    assert resp.status_code == 500, resp.text
    assert top_code(resp) == ("Client" if version == "1.1" else "Sender"), resp.text
    assert received(gw) == []


LEAF = [k for k, (where, _, _) in ATTRIBUTES.items() if where == "leaf"] + ["wsu-lookalike-trailing-slash"]


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize("kind", LEAF)
def test_ignored_security_attribute_never_reaches_client_response(gw: Any, kind: str, version: str) -> None:
    """The demo backend echoes the operation's children with their attributes: its answer carries them."""
    body = with_attribute(kind, version)
    if kind == "wsu-lookalike-trailing-slash":
        body = body.replace(b'<d:echo u:Id="x"', b"<d:echo").replace(b"<d:text>", b'<d:text u:Id="x">')
    resp = post(gw, "/responses/", body, version)
    assert resp.status_code == 502, resp.text
    assert top_code(resp) == ("Server" if version == "1.1" else "Receiver"), resp.text
    assert b"admin" not in resp.content and b"Created" not in resp.content


@pytest.mark.parametrize("kind", ["wsse-role-on-operation", "wsu-id-no-reference-points-to", "xml-lang"])
@pytest.mark.parametrize("route", ["sealed", "hmacv"])
def test_ignored_security_attribute_never_reaches_backend_inside_signed_and_encrypted_content(
    gw: Any, pki: Path, kind: str, route: str
) -> None:
    """Added by the sender before it signed (and, on `sealed`, encrypted): the decrypted, verified payload is
    validated with the attribute, and refused."""
    doc = next(r for r in _routes(pki) if r["name"] == route)
    client = client_for(Route.model_validate({**doc, "upstream": {"address": "127.0.0.1:1"}}), pki)
    clear(gw)
    secured, _ = client.secure(with_attribute(kind))
    resp = post(gw, f"/{route}/", secured)
    assert resp.status_code == 500 and top_code(resp) == "Client", resp.text
    assert received(gw) == []


@pytest.mark.parametrize("route", ["sealed", "hmacv"])
def test_signed_body_wsu_id_still_accepted_and_never_forwarded(gw: Any, pki: Path, route: str) -> None:
    """The one attribute WS-Security needs, the wsu:Id the signature's reference points at on the signed Body, is
    removed with the Security header: validated payload and forwarded payload are the same."""
    doc = next(r for r in _routes(pki) if r["name"] == route)
    client = client_for(Route.model_validate({**doc, "upstream": {"address": "127.0.0.1:1"}}), pki)
    clear(gw)
    secured, pending = client.secure(echo("signed"))
    assert f"{{{ns.WSU}}}Id" in {a for el in etree.fromstring(secured).iter() for a in el.attrib}
    resp = post(gw, f"/{route}/", secured)
    assert resp.status_code == 200, resp.text
    assert client.open(resp.content, pending).body.findtext(f".//{{{DEMO}}}text") == "signed"
    [got] = received(gw)
    assert ns.WSU not in got["body"] and ns.WSSE not in got["body"]


# ---------------------------------------------------------------------------------------------------------
# bounded validation time: backtracking patterns and content models


def hostile(kind: str, count: int = 40) -> str:
    item = {"pattern-alternation": "<d:text>" + "a" * 60 + "b</d:text>",
            "pattern-nested-counter": "<d:words>" + "a" * 60 + "!</d:words>",
            "content-model-nested-repetition": "<d:runs>" + "<d:n/>" * 40 + "<d:z/></d:runs>"}[kind]  # fmt: skip
    return op(item * count)


HOSTILE = ["pattern-alternation", "pattern-nested-counter", "content-model-nested-repetition"]


def filter_log(gw: Any) -> str:
    return (gw.logs / "filter-0.log").read_text()


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize("kind", HOSTILE)
def test_backtracking_pattern_costs_a_bounded_cpu_and_gets_the_schema_fault(gw: Any, kind: str, version: str) -> None:
    """40 values that each cost libxml2 up to its own limit (0.1-0.5 s, then "Internal error" and a 500 Server
    fault with a traceback): refused as schema-invalid within the route's CPU budget."""
    clear(gw)
    started = time.monotonic()
    resp = post(gw, "/patterns/", envelope(hostile(kind), version), version)
    assert time.monotonic() - started < 3.0  # unbounded: 40 x 0.1-0.5 s of CPU
    assert resp.status_code == 500, resp.text
    assert top_code(resp) == ("Client" if version == "1.1" else "Sender"), resp.text
    assert received(gw) == []
    log = filter_log(gw)
    assert "schema invalid: request payload" in log.splitlines()[-1]
    assert "Internal error" not in log and "Traceback" not in log
    # The next message finds a validator again (the killed one is replaced).
    resp = post(gw, "/patterns/", envelope(op("<d:text>aaa</d:text><d:code>ABC1234</d:code>"), version), version)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("kind", HOSTILE)
def test_backtracking_pattern_in_a_backend_response_is_a_bounded_502(gw: Any, kind: str) -> None:
    started = time.monotonic()
    resp = post(gw, "/patterns-out/", envelope(hostile(kind)))
    assert time.monotonic() - started < 3.0
    assert resp.status_code == 502 and top_code(resp) == "Server", resp.text
    assert "Internal error" not in filter_log(gw)


def test_backtracking_budget_kills_the_validator_within_its_cpu_budget() -> None:
    """The bound itself: whatever the work, the child's CPU per call is its budget plus a scheduler tick."""
    bounded = cpu_budget.Bounded(lambda data: data if data == b"quick" else _spin())
    assert bounded(b"quick", 0.05) == b"quick"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with pytest.raises(cpu_budget.OverBudget):
        bounded(b"spin", 0.05)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    # The kernel fires at the tick after the budget (HZ=250: 4 ms); rusage samples at ticks too: room both ways.
    assert 0.04 <= used < 0.05 + 0.03, used
    assert bounded(b"quick", 0.05) == b"quick"  # a new child
    bounded.close()


def _spin() -> bytes:
    while True:
        pass


# Warned: nested quantifiers and repeated alternations whose branches begin alike. Not warned: the rest.
WARNED = ["(a+|b+)*", "(a|a)*", "(\\w+\\s?)*", "(a|aa)*", "(a|b|ab)*c", "(a{1,5})*", "(\\d|[0-9a-f])+",
          "[a-z]{1,20}([a-z]{1,20})*", "x(y(a|ab)+)?"]  # fmt: skip
NOT_WARNED = ["[A-Z]{3}[0-9]{4}", "([A-Z][0-9])*", "(ab|cd)+", "\\d{3}-\\d{4}", "([0-9]{3})?", "[^a]*",
              "\\p{Lu}+", "[a-z-[aeiou]]+", "(x|y)?z*"]  # fmt: skip


@pytest.mark.parametrize("pattern", WARNED)
def test_backtracking_pattern_is_warned(pattern: str) -> None:
    assert xsd_patterns.backtracking(pattern)


@pytest.mark.parametrize("pattern", NOT_WARNED)
def test_unambiguous_pattern_is_not_warned(pattern: str) -> None:
    assert xsd_patterns.backtracking(pattern) == []


# In the class libxml2 matches in linear time (validated in the worker): with the value that would make a
# backtracking matcher try every split.
LINEAR = {"[A-Z]{3}[0-9]{4}": "A" * 200_000, "[0-9]{8}x+": "12345678" + "x" * 200_000 + "!",
          "a{1,1000}b": "a" * 200_000, "\\d{1,5}-\\d{1,5}": "1" * 200_000, "[a-z]*[0-9]*": "a" * 100_000 + "1" * 100_000 + "a",
          "[a-z]{2,}@[0-9]+": "a" * 100_000 + "@" + "1" * 100_000 + "a", ".{1,300000}": "x" * 200_000,
          "abc|abd|a*": "a" * 200_000 + "b"}  # fmt: skip
NONLINEAR = [*WARNED, "[a-z]+[a-z0-9]*", "[a-z]*[a-z]*x", "(ab)+", "a{0,5}a{0,5}"]


@pytest.mark.parametrize("pattern", list(LINEAR))
def test_linear_pattern_validated_in_the_worker_takes_linear_time(pattern: str) -> None:
    assert xsd_patterns.linear(pattern)
    schema = etree.XMLSchema(etree.fromstring(
        f'<xs:schema xmlns:xs="{ns.XSD}"><xs:element name="v"><xs:simpleType><xs:restriction base="xs:string">'
        f'<xs:pattern value="{pattern}"/></xs:restriction></xs:simpleType></xs:element></xs:schema>'))  # fmt: skip
    value = etree.fromstring(f"<v>{LINEAR[pattern]}</v>")
    started = time.process_time()
    schema(value)
    assert time.process_time() - started < 0.1  # 200,000 characters: about 5 ms; backtracking: its 0.2-0.5 s limit


@pytest.mark.parametrize("pattern", NONLINEAR)
def test_backtracking_pattern_sends_validation_to_the_budgeted_child(tmp_path: Path, pattern: str) -> None:
    assert not xsd_patterns.linear(pattern)
    schema = PayloadSchema(None, [wsdl.load(_xsd_file(tmp_path, f'<xs:simpleType name="T"><xs:restriction '
                                                           f'base="xs:string"><xs:pattern value="{pattern}"/>'
                                                           "</xs:restriction></xs:simpleType>"))])  # fmt: skip
    assert schema.bounded is not None and "pattern" in (schema.nonlinear or "")


MODELS = {
    "repeated-sequence": '<xs:complexType name="C"><xs:sequence maxOccurs="9"><xs:element name="a"/></xs:sequence>'
    "</xs:complexType>",
    "repeated-choice": '<xs:complexType name="C"><xs:choice minOccurs="2" maxOccurs="2"><xs:element name="a"/>'
    "</xs:choice></xs:complexType>",
    "repeated-group-ref": '<xs:group name="G"><xs:sequence><xs:element name="a" maxOccurs="3"/></xs:sequence>'
    '</xs:group><xs:complexType name="C"><xs:sequence><xs:group ref="t:G" maxOccurs="unbounded"/></xs:sequence>'
    "</xs:complexType>",
    "identity-constraint": '<xs:element name="e"><xs:complexType><xs:sequence><xs:element name="a" '
    'maxOccurs="unbounded"/></xs:sequence></xs:complexType><xs:unique name="u"><xs:selector xpath="a"/>'
    '<xs:field xpath="."/></xs:unique></xs:element>',
}


@pytest.mark.parametrize("kind", list(MODELS))
def test_backtracking_content_model_sends_validation_to_the_budgeted_child(tmp_path: Path, kind: str) -> None:
    schema = PayloadSchema(None, [wsdl.load(_xsd_file(tmp_path, MODELS[kind]))])
    assert schema.bounded is not None, kind


def test_linear_schemas_validate_in_the_worker() -> None:
    """The common case keeps its cost: no child, no copy of the payload."""
    for source in (ECHO_WSDL, Path(__file__).parent / "wsdl" / "demo-asymmetric.wsdl"):
        schema = PayloadSchema(wsdl.load(source), [])
        assert schema.nonlinear is None and schema.bounded is None


def _xsd_file(tmp: Path, body: str) -> Path:
    (tmp / "s.xsd").write_text(
        f'<xs:schema xmlns:xs="{ns.XSD}" xmlns:t="urn:t" targetNamespace="urn:t">{body}</xs:schema>'
    )
    return tmp / "s.xsd"


def test_backtracking_pattern_named_by_wsgate_check_and_import(tmp_path: Path) -> None:
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "main.xsd").write_text(BACKTRACKING_XSD)
    route = {"name": "x", "match": {"path_prefix": "/x/"}, "upstream": {"address": "127.0.0.1:1"}, "profile": "xml",
             "schema_validation": {"requests": True, "xsd_files": [str(tmp_path / "schemas" / "main.xsd")]}}  # fmt: skip
    check = _cli("check", str(write_policies(tmp_path / "policies", [route])))
    assert check.returncode == 0, check.stderr
    warned = [x for x in check.stderr.splitlines() if x.startswith("warning: route x: main.xsd: ")]
    assert len(warned) == 2, check.stderr
    assert "simpleType Identifier: pattern '(a|aa)*'" in warned[0]
    assert "simpleType Words: pattern '(\\\\w{1,10}\\\\s?)*'" in warned[1]
    assert "Code" not in check.stderr
    # The same schema as a WSDL's types, imported with --validate.
    for name in ("echo.wsdl", "echo-interface.wsdl", "types/echo-types.xsd"):
        (tmp_path / "w" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "w" / name).write_text((FIXTURES / name).read_text())
    types = tmp_path / "w" / "types" / "echo-types.xsd"
    types.write_text(types.read_text().replace('<xs:maxLength value="64"/>', '<xs:pattern value="(a|aa)*"/>'))
    done = _cli("import", str(tmp_path / "w" / "echo.wsdl"), "--port", "EchoPort", "--upstream", "127.0.0.1:9",
                "--validate")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "# warning: echo-types.xsd: simpleType ShortText: pattern '(a|aa)*' can backtrack" in done.stderr


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.control.cli", *args], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# the engine, in process


def make(pki: Path, **extra: Any) -> Route:
    doc = route_doc(pki, "rsa", name="v", wsdl={"file": ECHO_WSDL}, schema_validation=BOTH, **extra)
    return Route.model_validate({**doc, "upstream": {"address": "127.0.0.1:1"}})


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
