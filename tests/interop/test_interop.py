"""Interoperability with WS-Security implementations we did not write.

- zeep, a real SOAP client: its BinarySignature (X.509 token, Body and Timestamp signed) and its UsernameToken
  (PasswordText, PasswordDigest) through the running gateway; zeep's own code verifies the signed reply.
- the xmlsec1 command-line tool: verifies responses our engine signs, and signs requests (from a template with a
  BinarySecurityToken and a SecurityTokenReference) that the engine and the running gateway accept.
- signxml: verifies responses our engine signs and returns the Body and the Timestamp as the signed data.
- WSS4J/CXF's message layout, built by hand with lxml and python-xmlsec (not with our `secure()`).

Each accepted request is checked on the far side too: the demo backend (or the engine's output) holds plain SOAP.
A missing tool fails its tests with a message that says how to install it; nothing here is skipped."""

from __future__ import annotations

import base64
import re
import shutil
import string
import subprocess
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
import xmlsec
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from lxml import etree

from certs.pki import DEMO_USERS
from filters.engine import ns
from filters.engine.engine import Exchange
from filters.engine.profiles import SecuredPipeline
from filters.stores.factory import RouteStores
from gateway.policy import Route
from tests.support.harness import GatewayFactory, LiveGateway
from tests.support.wss_helpers import DEMO, Keys, client_for, echo, echo_response, make_route, route_doc

try:
    import zeep
    from zeep.exceptions import Fault as ZeepFault
    from zeep.exceptions import SignatureVerificationFailed
    from zeep.plugins import HistoryPlugin
    from zeep.transports import Transport
    from zeep.wsse.compose import Compose
    from zeep.wsse.signature import BinarySignature, MemorySignature, verify_envelope
    from zeep.wsse.username import UsernameToken
    from zeep.wsse.utils import WSU, get_security_header
except ImportError as exc:  # pragma: no cover - the message below is the point
    ZEEP_MISSING: str | None = (
        f"zeep is not installed ({exc}): .venv/bin/pip install zeep==4.3.3 (pyproject dev extras)"
    )
else:
    ZEEP_MISSING = None

try:
    from signxml import SignatureConfiguration, XMLVerifier
    from signxml.exceptions import InvalidSignature
except ImportError as exc:  # pragma: no cover
    SIGNXML_MISSING: str | None = f"signxml is not installed ({exc}): .venv/bin/pip install signxml==5.2.0"
else:
    SIGNXML_MISSING = None

INTEROP = Path(__file__).parent
WSDL = INTEROP / "demo.wsdl"
XMLSEC1_TEMPLATE = INTEROP / "xmlsec1-request.xml"
DEMO_BINDING = f"{{{DEMO}}}DemoBinding"

RSA_SHA1 = "http://www.w3.org/2000/09/xmldsig#rsa-sha1"
RSA_SHA256 = "http://www.w3.org/2001/04/xmldsig-more#rsa-sha256"
SHA1 = "http://www.w3.org/2000/09/xmldsig#sha1"
SHA256 = "http://www.w3.org/2001/04/xmlenc#sha256"
EXC_C14N = "http://www.w3.org/2001/10/xml-exc-c14n#"
WSSE_NS_TEXT = "oasis-200401-wss-wssecurity-secext-1.0.xsd"

SIGNATURE = ns.q(ns.DS, "Signature")
BST = ns.q(ns.WSSE, "BinarySecurityToken")
SECURITY = ns.q(ns.WSSE, "Security")
TIMESTAMP = ns.q(ns.WSU, "Timestamp")
USERNAME_TOKEN = ns.q(ns.WSSE, "UsernameToken")
WSU_ID = ns.q(ns.WSU, "Id")

# zeep's BinarySignature signs with rsa-sha1/sha1 unless told otherwise: one route allows that, one does not.
SHA1_TOO = {"algorithms": ["rsa-sha256", "rsa-sha1"], "digests": ["sha256", "sha1"]}


def _routes(pki: Path) -> list[dict[str, Any]]:
    return [
        route_doc(pki, "rsa", name="rsa"),
        route_doc(pki, "rsa", name="rsa-sha1", signature=SHA1_TOO),
        # PasswordText travels readable: the route is HTTPS-only (plain HTTP gets 426).
        route_doc(
            pki,
            "rsa",
            name="ut",
            username_token={"required": True, "users_file": str(pki / "users.yaml"), "protection": "tls"},
        ),
    ]


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path, gateway_keys: Keys) -> LiveGateway:
    """The gateway, its keys in files, then in the token (each module-scoped gateway_keys param)."""
    return module_gateway([gateway_keys(r) for r in _routes(pki)])


def assert_plain_soap(body: bytes | str, text: str) -> etree._Element:
    """`body` is a SOAP envelope with no trace of WS-Security whose d:echo carries `text`."""
    raw = body.encode() if isinstance(body, str) else body
    assert WSSE_NS_TEXT.encode() not in raw, raw.decode(errors="replace")
    root = etree.fromstring(raw)
    assert etree.QName(root).localname == "Envelope" and root.nsmap.get(root.prefix) in (ns.SOAP11, ns.SOAP12)
    assert not root.findall(f".//{SECURITY}")
    assert root.findtext(f".//{{{DEMO}}}echo/{{{DEMO}}}text") == text
    return root


def backend_got(gw: Any, text: str) -> dict[str, Any]:
    """The one request the backend received since the last clear(): plain SOAP carrying `text`."""
    got = gw.received()
    assert len(got) == 1, got
    assert_plain_soap(got[0]["body"], text)
    return got[0]


def pem_base64(path: Path) -> str:
    """The base64 DER of a PEM certificate, as a BinarySecurityToken carries it."""
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()


def wss_time(when: datetime) -> str:
    return f"{when:%Y-%m-%dT%H:%M:%S}.{when.microsecond // 1000:03d}Z"


def engine_response(pki: Path, route: Route, text: str, version: str = "1.1") -> bytes:
    """A response our gateway engine signed: a client request through SecuredPipeline, the backend's echo back."""
    pipeline = SecuredPipeline(route, RouteStores())
    secured, _ = client_for(route, pki).secure(echo(text, version))
    ex = Exchange(route=route)
    plain = pipeline.request(secured, {}, ex).body
    assert plain is not None
    reply = pipeline.response(echo_response(plain), ex).body
    assert reply is not None
    return reply


# ---------------------------------------------------------------------------------------------------------
# zeep


@pytest.fixture
def need_zeep() -> None:
    if ZEEP_MISSING:
        pytest.fail(ZEEP_MISSING)


def zeep_timestamp(ttl_s: int = 300) -> etree._Element:
    """A wsu:Timestamp built with zeep's own element maker, the way zeep's documentation builds one."""
    now = datetime.now(UTC)
    return WSU.Timestamp(WSU.Created(wss_time(now)), WSU.Expires(wss_time(now + timedelta(seconds=ttl_s))))


class ZeepTimestamp:
    """zeep has no Timestamp token of its own (its docs hand one to UsernameToken(timestamp_token=...)); this puts
    that element into zeep's Security header for a client that only signs. zeep then signs it."""

    def apply(self, envelope: etree._Element, headers: dict[str, str]) -> tuple[etree._Element, dict[str, str]]:
        get_security_header(envelope).append(zeep_timestamp())
        return envelope, headers

    def verify(self, envelope: etree._Element) -> etree._Element:
        return envelope


class SignOnly:
    """zeep's BinarySignature without its reply check, for requests the gateway must refuse: zeep verifies the
    reply's signature before it looks for a Fault, so an (unsigned) SOAP fault would otherwise surface as
    SignatureVerificationFailed instead of zeep.exceptions.Fault."""

    def __init__(self, signer: Any) -> None:
        self.signer = signer

    def apply(self, envelope: etree._Element, headers: dict[str, str]) -> tuple[etree._Element, dict[str, str]]:
        return self.signer.apply(envelope, headers)

    def verify(self, envelope: etree._Element) -> etree._Element:
        return envelope


class SignWithClientVerifyGateway(SignOnly):
    """zeep's Signature classes take one certificate file and use it both to sign and to verify the reply, which
    only works when both ends share one key pair. The gateway signs with its own key: so sign with zeep's
    BinarySignature (client key and certificate) and verify the reply with zeep's MemorySignature holding the
    gateway's signing certificate. Both halves are zeep's code, unchanged."""

    def __init__(self, signer: Any, gateway_cert_pem: bytes) -> None:
        super().__init__(signer)
        self.verifier = MemorySignature(b"", gateway_cert_pem)
        self.verified = 0

    def verify(self, envelope: etree._Element) -> etree._Element:
        fault = envelope.find("{*}Body/{*}Fault")
        if fault is not None and envelope.find(f".//{SECURITY}") is None:
            # Say what the gateway said, rather than zeep's bare SignatureVerificationFailed.
            code = fault.findtext("faultcode") or fault.findtext("{*}Code/{*}Subcode/{*}Value")
            text = fault.findtext("faultstring") or fault.findtext("{*}Reason/{*}Text")
            pytest.fail(f"the gateway refused zeep's request: {code}: {text}")
        got = self.verifier.verify(envelope)  # zeep's check; raises SignatureVerificationFailed
        self.verified += 1
        return got


def zeep_signer(pki: Path, sha256: bool) -> Any:
    if sha256:
        return BinarySignature(str(pki / "client.key"), str(pki / "client.pem"),
                               signature_method=xmlsec.Transform.RSA_SHA256,
                               digest_method=xmlsec.Transform.SHA256)  # fmt: skip
    return BinarySignature(str(pki / "client.key"), str(pki / "client.pem"))  # zeep's defaults: rsa-sha1, sha1


def zeep_service(gw: Any, route_name: str, wsse: Any, history: Any, ca: Path | None = None) -> Any:
    """zeep's service on a route, over HTTPS trusting `ca` when given."""
    transport = None
    url = gw.url(f"/{route_name}/echo")
    if ca is not None:
        session = requests.Session()
        session.verify = str(ca)
        session.trust_env = False  # else REQUESTS_CA_BUNDLE from the environment overrides `verify`
        transport = Transport(session=session)
        url = f"https://localhost:{gw.opts.https_port}/{route_name}/echo"
    client = zeep.Client(str(WSDL), wsse=wsse, plugins=[history] if history else [], transport=transport)
    return client.create_service(DEMO_BINDING, url)


def zeep_sent(history: Any) -> etree._Element:
    envelope = history.last_sent["envelope"]
    assert envelope is not None
    return envelope


def assert_zeep_signature(sent: etree._Element, method: str, digest: str) -> None:
    """What zeep put on the wire: its layout (Signature, then the token it refers to), its algorithms, and
    references to the Body and the Timestamp."""
    security = sent.find(f".//{SECURITY}")
    assert security is not None
    kids = [c.tag for c in security]
    assert kids.index(SIGNATURE) < kids.index(BST), kids  # zeep puts the BinarySecurityToken after the Signature
    sig = security.find(SIGNATURE)
    assert sig.find(f".//{{{ns.DS}}}SignatureMethod").get("Algorithm") == method
    assert {d.get("Algorithm") for d in sig.iterfind(f".//{{{ns.DS}}}DigestMethod")} == {digest}
    uris = {r.get("URI") for r in sig.iterfind(f".//{{{ns.DS}}}Reference")}
    body = sent.find(ns.q(ns.SOAP11, "Body"))
    assert uris == {"#" + body.get(WSU_ID), "#" + security.find(TIMESTAMP).get(WSU_ID)}


def test_zeep_signed_envelope_accepted_by_engine(need_zeep: None, pki: Path) -> None:
    """The engine alone, on the envelope zeep builds and signs (Client.create_message leaves WS-Security out, so
    zeep's wsse objects are applied as zeep's send path does): no Envoy, no HTTP, the plain SOAP it passes on."""
    route = make_route(pki, "rsa")
    client = zeep.Client(str(WSDL))
    envelope = client.create_message(client.create_service(DEMO_BINDING, "http://127.0.0.1:9/"), "echo", text="zeep")
    for wsse in (ZeepTimestamp(), zeep_signer(pki, sha256=True)):
        envelope, _ = wsse.apply(envelope, {})
    assert_zeep_signature(envelope, RSA_SHA256, SHA256)

    out = SecuredPipeline(route, RouteStores()).request(etree.tostring(envelope), {}, Exchange(route=route))

    assert out.body is not None
    assert_plain_soap(out.body, "zeep")
    assert out.set_headers["x-wsgate-subject"] == "CN=Demo Client,O=WSGate Demo"


@pytest.mark.parametrize(
    ("route_name", "sha256", "method", "digest"),
    [("rsa", True, RSA_SHA256, SHA256), ("rsa-sha1", False, RSA_SHA1, SHA1)],
    ids=["rsa-sha256", "zeep-default-rsa-sha1"],
)
def test_zeep_binary_signature_accepted_and_reply_verified_by_zeep(
    need_zeep: None, gw: Any, pki: Path, route_name: str, sha256: bool, method: str, digest: str
) -> None:
    gw.clear()
    history = HistoryPlugin()
    sign = SignWithClientVerifyGateway(zeep_signer(pki, sha256), (pki / "gateway-sign.pem").read_bytes())
    service = zeep_service(gw, route_name, Compose([ZeepTimestamp(), sign]), history)

    result = service.echo(text="hello from zeep")

    assert result == "hello from zeep"
    assert sign.verified == 1  # zeep's own code checked the gateway's signature on the reply
    assert_zeep_signature(zeep_sent(history), method, digest)
    got = backend_got(gw, "hello from zeep")
    assert got["headers"]["x-wsgate-subject"] == "CN=Demo Client,O=WSGate Demo"
    # The reply zeep accepted really was signed by the gateway: zeep's checker refuses it once tampered with.
    reply = history.last_received["envelope"]
    assert reply.find(f".//{SECURITY}/{SIGNATURE}") is not None
    reply.find(f".//{{{DEMO}}}text").text = "tampered"
    with pytest.raises(SignatureVerificationFailed):
        verify_envelope(reply, str(pki / "gateway-sign.pem"))


def test_zeep_default_rsa_sha1_refused_where_policy_wants_sha256(need_zeep: None, gw: Any, pki: Path) -> None:
    gw.clear()
    service = zeep_service(gw, "rsa", Compose([ZeepTimestamp(), SignOnly(zeep_signer(pki, sha256=False))]), None)
    with pytest.raises(ZeepFault) as refused:
        service.echo(text="sha1 is not allowed here")
    assert "UnsupportedAlgorithm" in str(refused.value.code), (refused.value.code, refused.value.message)
    assert gw.received() == []


@pytest.mark.parametrize(
    ("user", "digest"), [("alice", False), ("bob", True)], ids=["alice-PasswordText", "bob-PasswordDigest"]
)
def test_zeep_username_token_with_binary_signature(
    need_zeep: None, gw: Any, pki: Path, user: str, digest: bool
) -> None:
    """The UsernameToken route also requires an X.509 signature (every secured profile does), so zeep sends its
    UsernameToken (with the Timestamp zeep's docs add through timestamp_token) and signs with BinarySignature."""
    gw.clear()
    history = HistoryPlugin()
    token = UsernameToken(user, DEMO_USERS[user], use_digest=digest, timestamp_token=zeep_timestamp())
    sign = SignWithClientVerifyGateway(zeep_signer(pki, sha256=True), (pki / "gateway-sign.pem").read_bytes())
    service = zeep_service(gw, "ut", Compose([token, sign]), history, ca=pki / "ca.pem")

    assert service.echo(text=f"hello {user}") == f"hello {user}"

    assert sign.verified == 1
    ut = zeep_sent(history).find(f".//{SECURITY}/{USERNAME_TOKEN}")
    assert ut is not None
    password = ut.find(ns.q(ns.WSSE, "Password"))
    assert password.get("Type") == (ns.PASSWORD_DIGEST if digest else ns.PASSWORD_TEXT)
    assert (password.text == DEMO_USERS[user]) is not digest
    backend_got(gw, f"hello {user}")


def test_zeep_username_token_wrong_password_refused(need_zeep: None, gw: Any, pki: Path) -> None:
    gw.clear()
    token = UsernameToken("bob", "not-bobs-password", use_digest=True, timestamp_token=zeep_timestamp())
    service = zeep_service(gw, "ut", Compose([token, SignOnly(zeep_signer(pki, sha256=True))]), None, ca=pki / "ca.pem")
    with pytest.raises(ZeepFault) as refused:
        service.echo(text="let me in")
    assert "FailedAuthentication" in str(refused.value.code), (refused.value.code, refused.value.message)
    assert gw.received() == []


# ---------------------------------------------------------------------------------------------------------
# xmlsec1, the command-line tool of the XML Security Library


def xmlsec1() -> str:
    found = shutil.which("xmlsec1")
    if found is None:
        pytest.fail("the xmlsec1 command-line tool is not installed: apt-get install -y xmlsec1")
    return found


def id_attrs(version: str = "1.1") -> list[str]:
    """xmlsec1 knows no wsu:Id: declare the Id attribute of wsu:Timestamp and soap:Body as ids. (--id-attr
    matches the attribute by local name, so it takes wsu:Id.)"""
    soap = ns.SOAP12 if version == "1.2" else ns.SOAP11
    return ["--id-attr:Id", f"{ns.WSU}:Timestamp", "--id-attr:Id", f"{soap}:Body"]


def xmlsec1_verify(document: bytes, cert: Path, tmp_path: Path, version: str = "1.1") -> subprocess.CompletedProcess:
    """`xmlsec1 --verify` with the signer's certificate given out of band: the KeyInfo is a WS-Security
    SecurityTokenReference, which xmlsec1 cannot follow. --store-references prints what each reference digested."""
    path = tmp_path / f"verify-{uuid.uuid4().hex}.xml"
    path.write_bytes(document)
    cmd = [xmlsec1(), "--verify", "--store-references", "--pubkey-cert-pem", str(cert), *id_attrs(version), str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def predigest(stdout: str) -> list[etree._Element]:
    """The canonical XML each verified reference digested, from xmlsec1's --store-references report."""
    chunks = re.findall(r"== PreDigest data - start buffer:\n(.*?)\n== PreDigest data - end buffer", stdout, re.S)
    return [etree.fromstring(c.encode()) for c in chunks]


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_xmlsec1_verifies_engine_signed_response(pki: Path, gateway_keys: Keys, tmp_path: Path, version: str) -> None:
    reply = engine_response(pki, make_route(pki, "rsa", gateway_keys), "signed by the gateway", version)

    done = xmlsec1_verify(reply, pki / "gateway-sign.pem", tmp_path, version)

    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("OK"), done.stderr
    assert "SignedInfo References (ok/all): 2/2" in done.stderr
    soap = ns.SOAP12 if version == "1.2" else ns.SOAP11
    signed = predigest(done.stdout)
    assert sorted(el.tag for el in signed) == sorted([ns.q(soap, "Body"), TIMESTAMP])
    body = next(el for el in signed if el.tag == ns.q(soap, "Body"))
    assert body.findtext(f".//{{{DEMO}}}text") == "signed by the gateway"
    # And xmlsec1 does check: a changed Body, or the wrong certificate, fails.
    tampered = xmlsec1_verify(reply.replace(b"signed by the gateway", b"changed en route"), pki / "gateway-sign.pem",
                              tmp_path, version)  # fmt: skip
    assert tampered.returncode != 0 and "FAIL" in tampered.stderr, tampered.stderr
    wrong_key = xmlsec1_verify(reply, pki / "client.pem", tmp_path, version)
    assert wrong_key.returncode != 0, wrong_key.stderr


def xmlsec1_signed_request(pki: Path, tmp_path: Path, text: str) -> bytes:
    """tests/interop/xmlsec1-request.xml filled in (client certificate, a fresh Timestamp) and signed by
    `xmlsec1 --sign` with client.key: rsa-sha256, exclusive C14N, Body and Timestamp by wsu:Id."""
    now = datetime.now(UTC)
    filled = string.Template(XMLSEC1_TEMPLATE.read_text()).substitute(
        certificate=pem_base64(pki / "client.pem"),
        created=wss_time(now),
        expires=wss_time(now + timedelta(minutes=5)),
        text=text,
    )
    template = tmp_path / f"template-{uuid.uuid4().hex}.xml"
    template.write_text(filled)
    out = tmp_path / f"signed-{uuid.uuid4().hex}.xml"
    cmd = [xmlsec1(), "--sign", "--privkey-pem", str(pki / "client.key"), *id_attrs(), "--output", str(out),
           str(template)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    signed = out.read_bytes()
    root = etree.fromstring(signed)
    assert all((d.text or "").strip() for d in root.iter(ns.q(ns.DS, "DigestValue"), ns.q(ns.DS, "SignatureValue")))
    return signed


def test_xmlsec1_signed_request_accepted_by_engine(pki: Path, tmp_path: Path) -> None:
    route = make_route(pki, "rsa")
    signed = xmlsec1_signed_request(pki, tmp_path, "signed by xmlsec1")

    out = SecuredPipeline(route, RouteStores()).request(signed, {}, Exchange(route=route))

    assert out.body is not None
    assert_plain_soap(out.body, "signed by xmlsec1")
    assert out.set_headers["x-wsgate-subject"] == "CN=Demo Client,O=WSGate Demo"


def test_xmlsec1_signed_request_through_gateway_and_reply_verified_by_xmlsec1(
    gw: Any, pki: Path, tmp_path: Path
) -> None:
    gw.clear()
    signed = xmlsec1_signed_request(pki, tmp_path, "xmlsec1 end to end")

    r = requests.post(gw.url("/rsa/echo"), data=signed, headers={"content-type": "text/xml"}, timeout=10)

    assert r.status_code == 200, r.text
    got = backend_got(gw, "xmlsec1 end to end")
    assert got["headers"]["x-wsgate-subject"] == "CN=Demo Client,O=WSGate Demo"
    done = xmlsec1_verify(r.content, pki / "gateway-sign.pem", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "SignedInfo References (ok/all): 2/2" in done.stderr
    # The same message again is a replay.
    again = requests.post(gw.url("/rsa/echo"), data=signed, headers={"content-type": "text/xml"}, timeout=10)
    assert again.status_code == 500
    assert len(gw.received()) == 1


# ---------------------------------------------------------------------------------------------------------
# signxml


@pytest.fixture
def need_signxml() -> None:
    if SIGNXML_MISSING:
        pytest.fail(SIGNXML_MISSING)


def signxml_verify(document: bytes, cert: Path) -> list[Any]:
    """signxml's XMLVerifier with the signer's certificate given out of band (x509_cert: the KeyInfo is a
    SecurityTokenReference signxml cannot follow) and two references expected. signxml finds wsu:Id by local
    name ("Id"), so no id_attribute is needed.

    validate_schema=False: signxml checks ds:Signature against the XML-DSig schema alone, where the
    CanonicalizationMethod's content is a strict wildcard; without the exclusive C14N schema the WSS4J-style
    <ec:InclusiveNamespaces> there ("No matching global element declaration available, but demanded by the
    strict wildcard") is refused before any cryptography. That element is standard (exc-c14n section 3)."""
    results = XMLVerifier().verify(
        document,
        x509_cert=x509.load_pem_x509_certificate(cert.read_bytes()),
        expect_config=SignatureConfiguration(expect_references=2),
        validate_schema=False,
    )
    assert isinstance(results, list)
    return results


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_signxml_verifies_engine_signed_response(
    need_signxml: None, pki: Path, gateway_keys: Keys, version: str
) -> None:
    reply = engine_response(pki, make_route(pki, "rsa", gateway_keys), "verified by signxml", version)

    results = signxml_verify(reply, pki / "gateway-sign.pem")

    soap = ns.SOAP12 if version == "1.2" else ns.SOAP11
    assert [r.signed_xml.tag for r in results] == [ns.q(soap, "Body"), TIMESTAMP]
    body, ts = (r.signed_xml for r in results)
    assert body.findtext(f".//{{{DEMO}}}echoResponse/{{{DEMO}}}text") == "verified by signxml"
    assert ts.find(ns.q(ns.WSU, "Created")) is not None and ts.find(ns.q(ns.WSU, "Expires")) is not None
    assert all(r.signed_data.startswith(b"<") for r in results)
    with pytest.raises(InvalidSignature):
        signxml_verify(reply, pki / "client.pem")
    with pytest.raises(InvalidSignature):
        signxml_verify(reply.replace(b"verified by signxml", b"changed en route"), pki / "gateway-sign.pem")


# ---------------------------------------------------------------------------------------------------------
# The layout WSS4J (Apache CXF, Axis2...) writes, built by hand


def _el(parent: etree._Element, tag: str, attrib: dict[str, str] | None = None, **kw: Any) -> etree._Element:
    return etree.SubElement(parent, tag, attrib or {}, **kw)


def wss4j_request(pki: Path, text: str, version: str = "1.1") -> bytes:
    """A request laid out as WSS4J's "Timestamp Signature" action writes it: wsse:Security (mustUnderstand) with
    the BinarySecurityToken first, then ds:Signature (Id, exclusive C14N with ec:InclusiveNamespaces PrefixList on
    CanonicalizationMethod and on each reference's transform, rsa-sha256, sha256, Timestamp then Body, a
    KeyInfo/SecurityTokenReference with wsu:Id and a direct wsse:Reference), wsu:Timestamp last, and wsu:Id on
    soap:Body (declaring wsu there). Signed with python-xmlsec directly, not with filters/."""
    soap = ns.SOAP12 if version == "1.2" else ns.SOAP11

    def uid(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex.upper()}"

    bst_id, ts_id, body_id = uid("X509"), uid("TS"), uid("id")
    env = etree.Element(ns.q(soap, "Envelope"), nsmap={"soap": soap})
    header = _el(env, ns.q(soap, "Header"))
    security = _el(header, SECURITY, nsmap={"wsse": ns.WSSE, "wsu": ns.WSU})
    security.set(ns.q(soap, "mustUnderstand"), "true" if version == "1.2" else "1")
    bst = _el(security, BST, {"EncodingType": ns.BASE64, "ValueType": ns.X509V3, WSU_ID: bst_id})
    bst.text = pem_base64(pki / "client.pem")

    sig = _el(security, SIGNATURE, {"Id": uid("SIG")}, nsmap={"ds": ns.DS})
    info = _el(sig, ns.q(ns.DS, "SignedInfo"))
    c14n = _el(info, ns.q(ns.DS, "CanonicalizationMethod"), {"Algorithm": EXC_C14N})
    _el(c14n, ns.q(ns.EXC_C14N, "InclusiveNamespaces"), {"PrefixList": "soap"}, nsmap={"ec": ns.EXC_C14N})
    _el(info, ns.q(ns.DS, "SignatureMethod"), {"Algorithm": RSA_SHA256})
    # WSS4J's PrefixLists: the prefixes in scope that the element does not use visibly itself.
    for ref_id, prefixes in ((ts_id, "wsse soap"), (body_id, "")):
        ref = _el(info, ns.q(ns.DS, "Reference"), {"URI": f"#{ref_id}"})
        transform = _el(_el(ref, ns.q(ns.DS, "Transforms")), ns.q(ns.DS, "Transform"), {"Algorithm": EXC_C14N})
        _el(transform, ns.q(ns.EXC_C14N, "InclusiveNamespaces"), {"PrefixList": prefixes}, nsmap={"ec": ns.EXC_C14N})
        _el(ref, ns.q(ns.DS, "DigestMethod"), {"Algorithm": SHA256})
        _el(ref, ns.q(ns.DS, "DigestValue"))
    _el(sig, ns.q(ns.DS, "SignatureValue"))
    key_info = _el(sig, ns.q(ns.DS, "KeyInfo"), {"Id": uid("KI")})
    token_ref = _el(key_info, ns.q(ns.WSSE, "SecurityTokenReference"), {WSU_ID: uid("STR")})
    _el(token_ref, ns.q(ns.WSSE, "Reference"), {"URI": f"#{bst_id}", "ValueType": ns.X509V3})

    now = datetime.now(UTC)
    ts = _el(security, TIMESTAMP, {WSU_ID: ts_id})
    _el(ts, ns.q(ns.WSU, "Created")).text = wss_time(now)
    _el(ts, ns.q(ns.WSU, "Expires")).text = wss_time(now + timedelta(minutes=5))

    body = _el(env, ns.q(soap, "Body"), nsmap={"wsu": ns.WSU})
    body.set(WSU_ID, body_id)
    op = _el(body, ns.q(DEMO, "echo"), nsmap={"d": DEMO})
    _el(op, ns.q(DEMO, "text")).text = text

    ctx = xmlsec.SignatureContext()
    ctx.key = xmlsec.Key.from_file(str(pki / "client.key"), xmlsec.constants.KeyDataFormatPem)
    ctx.register_id(ts, "Id", ns.WSU)
    ctx.register_id(body, "Id", ns.WSU)
    ctx.sign(sig)
    return etree.tostring(env)


def test_wss4j_request_layout_is_what_wss4j_writes(pki: Path) -> None:
    """The builder above, checked against the WSS4J features it claims (so the engine tests below mean it)."""
    root = etree.fromstring(wss4j_request(pki, "layout"))
    security = root.find(f".//{SECURITY}")
    assert security.get(ns.q(ns.SOAP11, "mustUnderstand")) == "1"
    assert [c.tag for c in security] == [BST, SIGNATURE, TIMESTAMP]
    sig = security.find(SIGNATURE)
    prefix_lists = [e.get("PrefixList") for e in sig.iter(ns.q(ns.EXC_C14N, "InclusiveNamespaces"))]
    assert prefix_lists == ["soap", "wsse soap", ""]
    ref = sig.find(f"{{{ns.DS}}}KeyInfo/{{{ns.WSSE}}}SecurityTokenReference/{{{ns.WSSE}}}Reference")
    assert ref.get("URI") == "#" + security.find(BST).get(WSU_ID)
    body = root.find(ns.q(ns.SOAP11, "Body"))
    assert body.get(WSU_ID) and body.nsmap["wsu"] == ns.WSU


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_wss4j_layout_accepted_by_engine(pki: Path, version: str) -> None:
    route = make_route(pki, "rsa")
    request = wss4j_request(pki, "hello from a WSS4J-shaped client", version)

    out = SecuredPipeline(route, RouteStores()).request(request, {}, Exchange(route=route))

    assert out.body is not None
    root = assert_plain_soap(out.body, "hello from a WSS4J-shaped client")
    assert etree.QName(root).namespace == (ns.SOAP12 if version == "1.2" else ns.SOAP11)
    assert out.set_headers["x-wsgate-subject"] == "CN=Demo Client,O=WSGate Demo"


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_wss4j_layout_through_gateway(gw: Any, pki: Path, version: str) -> None:
    gw.clear()
    content_type = "application/soap+xml; charset=utf-8" if version == "1.2" else "text/xml; charset=utf-8"
    r = requests.post(gw.url("/rsa/echo"), data=wss4j_request(pki, "WSS4J end to end", version),
                      headers={"content-type": content_type}, timeout=10)  # fmt: skip
    assert r.status_code == 200, r.text
    assert etree.fromstring(r.content).find(f".//{SECURITY}/{SIGNATURE}") is not None
    backend_got(gw, "WSS4J end to end")
