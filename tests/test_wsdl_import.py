"""`wsgate import`: real WSDLs (tests/wsdl/) -> the routes they must give; hostile WSDLs refused without a fetch;
imported routes serving real traffic through the running gateway."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from gateway.policy import Route
from gateway.tools.client import Client, ClientConfig
from gateway.tools.wsdl_import import WsdlImportError, import_wsdl
from tests.harness import content_type, received, running_gateway
from tests.wss_helpers import DEMO, echo

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "wsdl"


def imported(name: str, **kw: object) -> dict[str, dict]:
    path = FIXTURES / name
    return {r.route["name"]: r for r in import_wsdl(path.read_bytes(), path, str(path), **kw).routes}  # type: ignore[misc]


# fixture, route name -> (profile, path, soap_action, upstream, parts, algorithms, encryption, unmapped fragments)
EXPECTED = {
    ("cxf-wsdl-first-https.wsdl", "soapport"): (
        "xml", "/SoapContext/SoapPort", None, {"address": "localhost:9001", "tls": True}, None, None, None, []),
    ("cxf-sign-enc-policy.wsdl", "soapport"): (
        "hmac", "/SoapContext/SoapPort", None, {"address": "localhost:9001"}, ["body", "timestamp", "username_token"],
        ["hmac-sha1"], (True, True, ["aes128-gcm"]), []),
    ("cxf-DoubleItPolicyOperation.wsdl", "doubleitport"): (
        "rsa", "/DoubleIt", None, {"address": "localhost:9010"}, ["body", "timestamp"], ["rsa-sha1"],
        (True, True, ["aes128-gcm"]), ["operation DoubleIt2"]),
    ("cxf-DoubleItX509.wsdl", "doubleitasymmetricsignencryptport"): (
        "rsa", "/DoubleItX509AsymmetricSignEncrypt", None, {"address": "localhost:9009"}, ["body", "timestamp"],
        ["rsa-sha1"], (True, True, ["aes128-gcm"]), []),
    ("cxf-DoubleItX509.wsdl", "doubleitasymmetricprotecttokensport"): (
        "rsa", "/DoubleItX509AsymmetricProtectTokens", None, {"address": "localhost:9009"}, ["body", "timestamp"],
        ["rsa-sha1"], (True, True, ["aes128-gcm"]), ["ProtectTokens"]),
    ("cxf-DoubleItX509.wsdl", "doubleitsymmetricsignencryptport"): (
        "hmac", "/DoubleItX509SymmetricSignEncrypt", None, {"address": "localhost:9009"}, ["body", "timestamp"],
        ["hmac-sha1"], (True, True, ["aes128-gcm"]), ["RequireSignatureConfirmation"]),
    ("cxf-DoubleItSecConv.wsdl", "doubleitsecureconversationport"): (
        "secureconversation", "/DoubleItSecureConversation", None, {"address": "localhost:9009"},
        ["body", "timestamp", "addressing"], ["rsa-sha1", "hmac-sha1"], (False, False, ["aes128-gcm"]), []),
    ("wcf-wssec10/WsSecurity10.wsdl", "usernameovertransport-ipingservice"): (
        "tls", "/Security_WsSecurity_Service_Indigo/WsSecurity10.svc/UserNameOverTransport",
        "http://WSSec/wssec10/echo", {"address": "localhost:9001", "tls": True}, None, None, None,
        ["IncludeTimestamp", "UsernameToken over TransportBinding"]),
    ("wcf-wssec10/WsSecurity10.wsdl", "username-ipingservice"): (
        "xml", "/Security_WsSecurity_Service_Indigo/WsSecurity10.svc/UserName", "http://WSSec/wssec10/echo",
        {"address": "localhost:9003"}, None, None, None, ["UsernameToken without a security binding"]),
    ("wcf-wssec10/WsSecurity10.wsdl", "mutualcertificate10signencrypt-ipingservice"): (
        "rsa", "/Security_WsSecurity_Service_Indigo/WsSecurity10.svc/MutualCertificate10SignEncrypt",
        "http://WSSec/wssec10/echo", {"address": "localhost:9002"}, ["body", "timestamp"],
        ["rsa-sha1"], (True, True, ["aes256-gcm"]), ["RequireSignatureConfirmation"]),
}  # fmt: skip


@pytest.mark.parametrize(("fixture", "name"), list(EXPECTED))
def test_real_wsdl_gives_the_route_its_policy_asks_for(fixture: str, name: str) -> None:
    profile, path, action, upstream, parts, algorithms, encryption, unmapped = EXPECTED[(fixture, name)]
    got = imported(fixture)[name]
    route = got.route
    assert route["profile"] == profile
    assert route["match"] == {"path_prefix": path, **({"soap_action": action} if action else {})}
    assert route["upstream"] == upstream
    assert got.soap_version == "1.1"
    assert route["wsdl"] == {"file": str(FIXTURES / fixture), "publish": True}
    if parts is not None:
        assert route["signature"]["parts"] == parts and route["signature"]["algorithms"] == algorithms
        assert route["timestamp"] == {"required": True}
    if encryption is not None:
        enc = route["encryption"]
        assert (enc["require_request"], enc["encrypt_response"], enc["data_algorithms"]) == encryption
    for fragment in unmapped:
        assert any(fragment in line for line in got.mapped.unmapped), (fragment, got.mapped.unmapped)
    assert len(got.mapped.unmapped) == len(unmapped), got.mapped.unmapped
    Route.model_validate(route)


def test_policies_the_gateway_cannot_enforce_give_no_route() -> None:
    """An X.509 endorsing token names the caller: a route without it would let anyone in. TripleDes: no cipher."""
    x509 = imported("cxf-DoubleItX509.wsdl")
    assert "doubleitsymmetricendorsingport" not in x509
    wcf = imported("wcf-wssec10/WsSecurity10.wsdl")
    assert not any("tripledes" in n for n in wcf)


def test_encrypt_signature_encrypts_the_response_signature_too() -> None:
    # A client whose policy says EncryptSignature expects the reply's Signature hidden as well: it covers the
    # plaintext Body's digest, which would let an eavesdropper test guesses of the encrypted Body.
    got = imported("wcf-wssec10/WsSecurity10.wsdl")["mutualcertificate10signencrypt-ipingservice"]
    assert got.route["encryption"]["encrypt_signature"] is True
    assert Route.model_validate({**got.route, "upstream": {"address": "h:1"}}).encryption.encrypt_signature


def test_cbc_and_rsa15_suites_are_named_and_mapped_to_the_safer_choice() -> None:
    got = imported("wcf-wssec10/WsSecurity10.wsdl")["mutualcertificate10signencrypt-ipingservice"]
    assert got.route["encryption"]["key_transport"] == ["rsa-oaep-mgf1p"]
    assert any("AES-CBC" in n and "aes256-gcm" in n for n in got.mapped.notes)


def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.control.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


@pytest.mark.parametrize(
    "fixture",
    sorted({f for f, _ in EXPECTED}),
)
def test_imported_policy_passes_wsgate_check(fixture: str, tmp_path: Path) -> None:
    out = tmp_path / "imported.yaml"
    done = _cli("import", str(FIXTURES / fixture), "-o", str(out))
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    # What is not mapped is named both in the file and on stderr, line by line.
    for line in (ln for ln in done.stderr.splitlines() if ln.startswith("UNMAPPED ")):
        assert f"# UNMAPPED: {line.split(': ', 1)[1]}" in text
    check = _cli("check", str(tmp_path))
    assert check.returncode == 0, check.stderr
    assert check.stdout.count("ok  ") == len(yaml.safe_load(text)["routes"])


def test_wsdl_without_policy_gives_an_xml_route_and_says_so(tmp_path: Path) -> None:
    done = _cli("import", str(FIXTURES / "cxf-wsdl-first-https.wsdl"))
    assert done.returncode == 0
    assert "profile: xml" in done.stdout and "no WS-Policy attached" in done.stdout


def test_a_wsdl_whose_imports_cannot_be_read_is_not_named_for_publishing(tmp_path: Path) -> None:
    # The gateway loads a route's wsdl.file with everything it imports when the policy loads: an import left
    # behind (a WSDL copied out of its project) must not give a policy `wsgate check` refuses.
    fixture = (FIXTURES / "cxf-DoubleItX509.wsdl").read_bytes()
    alone = tmp_path / "DoubleItX509.wsdl"
    alone.write_bytes(fixture)
    routes = {r.route["name"]: r for r in import_wsdl(fixture, alone, str(alone)).routes}
    got = routes["doubleitasymmetricsignencryptport"]
    assert "wsdl" not in got.route
    assert any(u.startswith("wsdl: not published") and "DoubleItLogical.wsdl" in u for u in got.mapped.unmapped)


SOAP12_WSDL = """<?xml version="1.0"?>
<wsdl:definitions xmlns:wsdl="http://schemas.xmlsoap.org/wsdl/" xmlns:soap12="http://schemas.xmlsoap.org/wsdl/soap12/"
    xmlns:wsp="http://www.w3.org/ns/ws-policy" xmlns:sp="http://docs.oasis-open.org/ws-sx/ws-securitypolicy/200702"
    xmlns:wsu="http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-wssecurity-utility-1.0.xsd"
    xmlns:tns="urn:t" targetNamespace="urn:t">
  <wsp:Policy wsu:Id="Endpoint"><wsp:ExactlyOne>
    <wsp:All><sp:SymmetricBinding><wsp:Policy><sp:ProtectionToken><wsp:Policy><sp:KerberosToken/></wsp:Policy>
      </sp:ProtectionToken></wsp:Policy></sp:SymmetricBinding></wsp:All>
    <wsp:All><sp:AsymmetricBinding><wsp:Policy>
      <sp:InitiatorToken><wsp:Policy><sp:X509Token/></wsp:Policy></sp:InitiatorToken>
      <sp:RecipientToken><wsp:Policy><sp:X509Token/></wsp:Policy></sp:RecipientToken>
      <sp:AlgorithmSuite><wsp:Policy><sp:Basic256Sha256/></wsp:Policy></sp:AlgorithmSuite>
      <sp:IncludeTimestamp/></wsp:Policy></sp:AsymmetricBinding>
      <sp:SignedParts><sp:Body/><sp:Header Name="Secret" Namespace="urn:app"/></sp:SignedParts>
      <sp:Wss11 wsp:Optional="true"><wsp:Policy/></sp:Wss11></wsp:All>
  </wsp:ExactlyOne></wsp:Policy>
  <wsp:Policy wsu:Id="Enc"><sp:EncryptedParts><sp:Body/></sp:EncryptedParts></wsp:Policy>
  <wsdl:binding name="B" type="tns:P"><wsp:PolicyReference URI="#Endpoint"/>
    <soap12:binding transport="http://schemas.xmlsoap.org/soap/http"/>
    <wsdl:operation name="Read"><soap12:operation soapAction="urn:t/Read"/><wsdl:input/><wsdl:output/></wsdl:operation>
    <wsdl:operation name="List"><soap12:operation soapAction="urn:t/List"/><wsdl:input/><wsdl:output/></wsdl:operation>
    <wsdl:operation name="Pay"><wsp:PolicyReference URI="#Enc"/><soap12:operation soapAction="urn:t/Pay"/>
      <wsdl:input/><wsdl:output/></wsdl:operation>
  </wsdl:binding>
  <wsdl:service name="S"><wsdl:port name="Port12" binding="tns:B">
    <soap12:address location="https://backend.example:8443/svc/v1"/></wsdl:port></wsdl:service>
</wsdl:definitions>"""


def test_operation_policy_differing_from_the_binding_gives_its_own_route() -> None:
    """WS-Policy 1.5, SOAP 1.2, an alternative the gateway cannot enforce (Kerberos) skipped for the next one."""
    routes = import_wsdl(SOAP12_WSDL.encode(), None, "inline").routes
    by_name = {r.route["name"]: r for r in routes}
    assert set(by_name) == {"port12", "port12-pay"}
    shared, pay = by_name["port12"], by_name["port12-pay"]
    assert shared.soap_version == "1.2" and shared.operations == ["Read", "List"]
    assert shared.route["match"] == {"path_prefix": "/svc/v1", "soap_action": ["urn:t/List", "urn:t/Read"]}
    assert pay.route["match"] == {"path_prefix": "/svc/v1", "soap_action": "urn:t/Pay"}
    assert shared.route["upstream"] == {"address": "backend.example:8443", "tls": True}
    assert shared.route["signature"]["algorithms"] == ["rsa-sha256"] and shared.route["signature"]["digests"] == [
        "sha256"
    ]
    assert "encryption" not in shared.route and pay.route["encryption"]["require_request"] is True
    assert any("alternative 2 of" in n for n in shared.mapped.notes)
    assert any("{urn:app}Secret" in u for u in shared.mapped.unmapped)
    for r in routes:
        Route.model_validate(r.route)


class _Listener:
    """A loopback TCP listener counting connections: proof that nothing was fetched."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.sock.settimeout(0.2)
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
                self.accepted += 1
                conn.close()
            except TimeoutError:
                continue

    def close(self) -> None:
        self._stop = True
        self.thread.join(2)
        self.sock.close()


def _hostile(listener_port: int) -> dict[str, bytes]:
    url = f"http://127.0.0.1:{listener_port}"
    head = '<wsdl:definitions xmlns:wsdl="http://schemas.xmlsoap.org/wsdl/" xmlns:wsp="http://www.w3.org/ns/ws-policy"'
    laughs = "".join(f'<!ENTITY l{i} "&l{i - 1};&l{i - 1};&l{i - 1};&l{i - 1};">' for i in range(1, 12))
    nested = "<wsp:Policy>" * 3000 + "</wsp:Policy>" * 3000
    many = "<wsp:ExactlyOne><wsp:All/><wsp:All/><wsp:All/></wsp:ExactlyOne>" * 20
    port = (
        '<wsdl:binding name="B" type="P" xmlns:soap="http://schemas.xmlsoap.org/wsdl/soap/">{}'
        '<soap:binding/><wsdl:operation name="o"/></wsdl:binding>'
        '<wsdl:service name="S"><wsdl:port name="p" binding="B" xmlns:soap="http://schemas.xmlsoap.org/wsdl/soap/">'
        '<soap:address location="http://h:1/x"/></wsdl:port></wsdl:service>'
    )
    remote_ref = f'<wsp:PolicyReference URI="{url}/p.xml"/>'
    self_ref = '<wsp:PolicyReference URI="#a"/>'
    return {
        "xxe": f'<!DOCTYPE d [<!ENTITY x SYSTEM "{url}/x">]>{head}>&x;</wsdl:definitions>'.encode(),
        "external-dtd": f'<!DOCTYPE d SYSTEM "{url}/d.dtd">{head}/>'.encode(),
        "billion-laughs": f'<!DOCTYPE d [<!ENTITY l0 "ha">{laughs}]>{head}>&l11;</wsdl:definitions>'.encode(),
        "utf16-doctype": f'<?xml version="1.0" encoding="UTF-16"?><!DOCTYPE d SYSTEM "{url}/d">{head}/>'.encode(
            "utf-16"
        ),
        "remote-import": f'{head}><wsdl:import location="{url}/b.wsdl" namespace="urn:x"/>{port.format("")}'
        "</wsdl:definitions>".replace('binding="B"', 'binding="x:Missing" xmlns:x="urn:x"').encode(),
        "remote-policy": f"{head}>{port.format(remote_ref)}</wsdl:definitions>".encode(),
        "deep-nesting": f"{head}>{port.format(nested)}</wsdl:definitions>".encode(),
        "alternatives-explosion": f"{head}>{port.format(f'<wsp:Policy>{many}</wsp:Policy>')}</wsdl:definitions>".encode(),
        "reference-cycle": f'{head} xmlns:wsu="http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-wssecurity-utility-1.0.xsd">'
        f'<wsp:Policy wsu:Id="a"><wsp:PolicyReference URI="#a"/></wsp:Policy>'
        f"{port.format(self_ref)}</wsdl:definitions>".encode(),
    }  # fmt: skip


HOSTILE = ["xxe", "external-dtd", "billion-laughs", "utf16-doctype", "remote-import", "remote-policy",
           "deep-nesting", "alternatives-explosion", "reference-cycle"]  # fmt: skip


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_wsdl_is_refused_without_a_fetch_or_a_hang(case: str, tmp_path: Path) -> None:
    listener = _Listener()
    try:
        path = tmp_path / "hostile.wsdl"
        path.write_bytes(_hostile(listener.port)[case])
        started = time.monotonic()
        done = _cli("import", str(path), "-o", str(tmp_path / "out.yaml"))
        assert time.monotonic() - started < 30
        assert done.returncode != 0, done.stdout
        assert done.stderr.strip() and "Traceback" not in done.stderr
        assert not (tmp_path / "out.yaml").exists()
        assert listener.accepted == 0
    finally:
        listener.close()


def test_local_import_outside_the_wsdl_directory_is_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret.wsdl"
    secret.write_text((FIXTURES / "wcf-wssec10" / "WsSecurity10_policy.wsdl").read_text())
    inner = tmp_path / "svc"
    inner.mkdir()
    text = (FIXTURES / "wcf-wssec10" / "WsSecurity10.wsdl").read_text()
    (inner / "service.wsdl").write_text(
        text.replace('location="WsSecurity10_policy.wsdl"', 'location="../secret.wsdl"')
    )
    with pytest.raises(WsdlImportError, match="not in the WSDL or a local import"):
        import_wsdl((inner / "service.wsdl").read_bytes(), inner / "service.wsdl", "service.wsdl")


# ---- end to end: imported routes in front of the demo backend


def _for_gateway(route: dict, pki: Path) -> dict:
    """The imported route pointed at the demo backend and the test's PKI (what an operator edits)."""
    text = yaml.safe_dump(route).replace("certs/out/", f"{pki}/")
    doc = yaml.safe_load(text)
    doc["upstream"] = {"address": "BACKEND"}
    return doc


@pytest.fixture(scope="module")
def imported_gw(tmp_path_factory: pytest.TempPathFactory, pki: Path):
    routes = [
        imported("cxf-wsdl-first-https.wsdl")["soapport"].route,
        imported("cxf-DoubleItPolicyOperation.wsdl")["doubleitport"].route,
        imported("cxf-sign-enc-policy.wsdl")["soapport"].route,
        imported("wcf-wssec10/WsSecurity10.wsdl")["username-ipingservice"].route,
    ]
    routes[2] = {**routes[2], "name": "greeter-hmac", "match": {"path_prefix": "/hmac/SoapContext/SoapPort"}}
    with running_gateway(tmp_path_factory.mktemp("wsdlimport"), [_for_gateway(r, pki) for r in routes], pki) as gw:
        yield gw


def _post(gw, path: str, body: bytes, action: str | None = None, version: str = "1.1") -> requests.Response:
    headers = {"content-type": content_type(version), **({"soapaction": f'"{action}"'} if action else {})}
    return requests.post(f"http://127.0.0.1:{gw.opts.http_port}{path}", data=body, headers=headers, timeout=10)


def _route(gw, name: str) -> Route:
    doc = yaml.safe_load((gw.opts.policies / "routes.yaml").read_text())["routes"]
    return Route.model_validate({**next(r for r in doc if r["name"] == name), "upstream": {"address": "h:1"}})


def test_imported_xml_route_forwards_well_formed_soap(imported_gw) -> None:
    resp = _post(imported_gw, "/SoapContext/SoapPort", echo("plain import"))
    assert resp.status_code == 200, resp.text
    assert "plain import" in received(imported_gw)[-1]["body"]


@pytest.mark.parametrize(
    ("name", "path", "cfg", "identity"),
    [
        ("doubleitport", "/DoubleIt", {}, "CN=Demo Client,O=WSGate Demo"),
        ("greeter-hmac", "/hmac/SoapContext/SoapPort", {"user": "bob", "password": "bob-demo-password"}, "bob"),
    ],
)
def test_imported_secured_route_round_trip_with_the_project_client(
    imported_gw, pki: Path, name: str, path: str, cfg: dict, identity: str
) -> None:
    client = Client(_route(imported_gw, name), ClientConfig(certs=pki, **cfg))
    secured, pending = client.secure(echo("secured import"))
    resp = _post(imported_gw, path, secured)
    assert resp.status_code == 200, resp.text
    assert client.open(resp.content, pending).body.findtext(f".//{{{DEMO}}}text") == "secured import"
    got = received(imported_gw)[-1]
    assert "secured import" in got["body"] and "Security" not in got["body"]
    assert got["headers"].get("x-wsgate-subject") == identity


def test_imported_secured_route_refuses_a_plain_request(imported_gw) -> None:
    resp = _post(imported_gw, "/DoubleIt", echo("no security"))
    assert resp.status_code == 500 and b"Fault" in resp.content


def test_imported_route_refuses_a_soap_action_the_wsdl_does_not_name(imported_gw) -> None:
    path = "/Security_WsSecurity_Service_Indigo/WsSecurity10.svc/UserName"
    assert _post(imported_gw, path, echo("named"), action="http://WSSec/wssec10/echo").status_code == 200
    assert _post(imported_gw, path, echo("other"), action="http://WSSec/wssec10/admin").status_code == 404
    assert _post(imported_gw, path, echo("none")).status_code == 404
