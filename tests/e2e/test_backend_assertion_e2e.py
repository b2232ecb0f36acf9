"""The signed identity the gateway gives the backend (route option backend_assertion, docs/saml.md), through the
running gateway, to a backend that verifies it with signxml (a library we did not write) and the gateway's
certificate: every WS-Security profile's caller, in a wsse:Security header block or an HTTP header; and what a
client sends to pass for it never reaches the backend."""

from __future__ import annotations

import base64
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest
import requests
from lxml import etree
from signxml import XMLVerifier

from filters.engine import ns
from filters.engine.wss.timestamp import parse_datetime
from gateway.tools.client import Client, http_post
from tests.support import saml as saml_support
from tests.support.harness import GatewayFactory, LiveGateway, LoopbackHttp, envelope, fault_code
from tests.support.wss_helpers import DEMO, echo, route_doc

AUDIENCE = "urn:wsgate:test-backend"
SAML = {"saml2": ns.SAML2, "wsse": ns.WSSE}
CLIENT = "CN=Demo Client,O=WSGate Demo"


class VerifyingBackend(LoopbackHttp):
    """A backend that believes only the gateway's assertion: exactly one, signature checked by signxml with the
    configured certificate, its audience, validity and confirmation; it answers with the subject it verified
    (and 403 otherwise). `seen`: what it verified or why it refused, per request."""

    def __init__(self, certificate: str) -> None:
        self.certificate = certificate
        self.seen: list[str] = []
        self.verified: list[etree._Element] = []  # the assertions that verified, as signxml returned them
        self.lock = threading.Lock()
        super().__init__()

    def respond(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        try:
            subject = self.verified_subject(headers, body)
        except Exception as exc:  # whatever failed, the backend refuses and says why
            with self.lock:
                self.seen.append(f"refused: {exc}")
            return 403, "text/plain", b"refused"
        with self.lock:
            self.seen.append(subject)
        soap = etree.fromstring(body).tag.split("}")[0][1:]
        reply = f'<s:Envelope xmlns:s="{soap}"><s:Body><d:echoResponse xmlns:d="{DEMO}"><d:text>{subject}</d:text>'
        return (
            200,
            headers.get("content-type", "text/xml"),
            (reply + "</d:echoResponse></s:Body></s:Envelope>").encode(),
        )

    def verified_subject(self, headers: dict[str, str], body: bytes) -> str:
        lower = {k.lower(): v for k, v in headers.items()}
        root = etree.fromstring(body)
        in_soap = root.findall(".//wsse:Security/saml2:Assertion", SAML)
        if path_header := lower.get("x-wsgate-assertion"):
            assert not in_soap, "an assertion in the message as well"
            raw = base64.b64decode(path_header)
        else:
            assert len(in_soap) == 1 and len(root.findall(".//{*}Assertion")) == 1, "not exactly one assertion"
            raw = etree.tostring(in_soap[0])
        signed = XMLVerifier().verify(raw, x509_cert=self.certificate, expect_references=1).signed_xml
        assert signed.findtext("saml2:Conditions/saml2:AudienceRestriction/saml2:Audience", namespaces=SAML) == AUDIENCE
        conditions = signed.find("saml2:Conditions", SAML)
        now = datetime.now(UTC)
        assert parse_datetime(conditions.get("NotBefore")) <= now < parse_datetime(conditions.get("NotOnOrAfter"))
        confirmation = signed.find("saml2:Subject/saml2:SubjectConfirmation", SAML)
        assert confirmation.get("Method") == ns.SAML2_SENDER_VOUCHES
        with self.lock:
            self.verified.append(signed)
        return signed.findtext("saml2:Subject/saml2:NameID", namespaces=SAML)


@pytest.fixture(scope="module")
def backend(pki: Path) -> VerifyingBackend:
    server = VerifyingBackend((pki / "gateway-sign.pem").read_text())
    yield server
    server.close()


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path, backend: VerifyingBackend) -> LiveGateway:
    address = backend.url.removeprefix("http://")
    vouch = {"audience": AUDIENCE, "key": str(pki / "gateway-sign.key"), "certificate": str(pki / "gateway-sign.pem")}
    users = {"required": True, "users_file": str(pki / "users.yaml"), "protection": "encrypted"}
    sc = {"master_keys_file": str(pki / "sct-master-keys.yaml")}

    def route(profile: str, name: str, placement: str = "security_header", **extra: object) -> dict:
        doc = route_doc(pki, profile, name=name, backend_assertion={**vouch, "placement": placement}, **extra)
        doc["upstream"] = {"address": address}
        doc["hmac"]["allow_anonymous"] = False
        return doc

    return module_gateway([
        route("rsa", "rsa"),
        route("rsa", "rsa-http", placement="http_header"),
        route("rsa", "rsa-forward", unsigned_headers={"default": "forward"}),
        route("hmac", "psk"),
        route("hmac", "username", username_token=users),
        route("secureconversation", "sc", secureconversation=sc),
        {**saml_support.saml_doc(pki, name="saml", backend_assertion=vouch), "upstream": {"address": address}},
    ])  # fmt: skip


def call(gw: LiveGateway, name: str, version: str = "1.1", **cfg: object) -> str:
    client: Client = gw.client(name, **cfg)
    post = http_post(gw.url(name))
    if gw.route(name).profile == "secureconversation":
        client.establish(post, version)
    secured, pending = client.secure(echo("who am I", version))
    return client.open(post(secured, pending.content_type), pending).body.findtext(f".//{{{DEMO}}}text")


def test_backend_verifies_the_identity_in_a_soap12_message(gw: LiveGateway) -> None:
    assert call(gw, "rsa", "1.2") == CLIENT
    assert call(gw, "sc", "1.2") == CLIENT


@pytest.mark.parametrize(
    ("name", "cfg", "subject"),
    [
        ("rsa", {}, CLIENT),
        ("rsa-http", {}, CLIENT),
        ("psk", {"key_name": "demo-client"}, "key:demo-client"),
        ("username", {"user": "bob", "password": "bob-demo-password"}, "bob"),
        ("sc", {}, CLIENT),
    ],
)
def test_backend_verifies_the_callers_identity_with_signxml(
    gw: LiveGateway, name: str, cfg: dict, subject: str
) -> None:
    assert call(gw, name, **cfg) == subject


@pytest.mark.parametrize(("method", "signer"), [("sender-vouches", "client2"), ("holder-of-key", "client")])
def test_saml_callers_identity_and_attributes_reach_the_backend_signed(
    gw: LiveGateway, pki: Path, backend: VerifyingBackend, tmp_path: Path, method: str, signer: str
) -> None:
    """A SAML caller: the backend gets the verified assertion's subject, its issuer's authentication and the
    route's attributes, vouched for by the gateway (not the IdP's assertion itself)."""
    idp_assertion = saml_support.sign(saml_support.assertion_xml(pki, method=method, roles=("clerk", "auditor")), pki)
    client = saml_support.client(gw.route("saml"), pki, saml_support.write(tmp_path, idp_assertion), signer)
    post = http_post(gw.url("saml"))
    secured, pending = client.secure(echo("who am I"))
    assert client.open(post(secured, pending.content_type), pending).body.findtext(f".//{{{DEMO}}}text") == (
        saml_support.SUBJECT
    )
    ours = backend.verified[-1]
    name_id = ours.find("saml2:Subject/saml2:NameID", SAML)
    assert name_id.get("Format") == "urn:oasis:names:tc:SAML:1.1:nameid-format:emailAddress"
    assert ours.findtext("saml2:Issuer", namespaces=SAML) == "urn:wsgate:gateway"
    method_used = ours.findtext("saml2:AuthnStatement/saml2:AuthnContext/saml2:AuthnContextClassRef", namespaces=SAML)
    assert method_used == "urn:oasis:names:tc:SAML:2.0:ac:classes:Password"
    values = ours.findall(
        f"saml2:AttributeStatement/saml2:Attribute[@Name='{saml_support.ROLE}']/saml2:AttributeValue", SAML
    )
    assert [v.text for v in values] == ["clerk", "auditor"]


def _forged_assertion(pki: Path) -> str:
    """An assertion a client made itself: well formed, signed with the client's own key."""
    from filters.engine.wss.saml_issuer import AC_X509, NAMEID_X509, Identity, Issuer
    from gateway.policy import BackendAssertion

    own = BackendAssertion(key=str(pki / "client.key"), certificate=str(pki / "client.pem"), audience=AUDIENCE)
    now = datetime.now(UTC)
    assertion = Issuer(own).issue(Identity("CN=Administrator", NAMEID_X509, AC_X509, now), audience=AUDIENCE, now=now)
    return etree.tostring(assertion).decode()


def test_backend_refuses_an_assertion_the_gateway_did_not_sign(pki: Path, backend: VerifyingBackend) -> None:
    """The verifier is real: a client's own assertion, sent to the backend directly, is refused."""
    forged = base64.b64encode(_forged_assertion(pki).encode()).decode()
    plain = envelope(f'<d:echo xmlns:d="{DEMO}"><d:text>x</d:text></d:echo>')
    reply = requests.post(backend.url, data=plain, headers={"x-wsgate-assertion": forged}, timeout=10)
    assert reply.status_code == 403 and "Signature" in backend.seen[-1]


def test_client_assertion_in_an_http_header_never_reaches_the_backend(
    gw: LiveGateway, pki: Path, backend: VerifyingBackend
) -> None:
    forged = base64.b64encode(_forged_assertion(pki).encode()).decode()
    client = gw.client("rsa-http")
    for name in ("x-wsgate-assertion", "X-WSGate-Assertion", "X-WSGATE-ASSERTION"):
        secured, pending = client.secure(echo("who am I"))
        reply = requests.post(
            gw.url("rsa-http"), data=secured, headers={"content-type": pending.content_type, name: forged}, timeout=10
        )
        assert reply.status_code == 200
        assert client.open(reply.content, pending).body.findtext(f".//{{{DEMO}}}text") == CLIENT


@pytest.mark.parametrize(
    "block",
    [
        # A second Security header for another actor, and lookalikes in other namespaces or inside another block.
        '<wsse:Security xmlns:wsse="{wsse}" soap:actor="urn:backend">{assertion}</wsse:Security>',
        '<x:Security xmlns:x="urn:other">{assertion}</x:Security>',
        '<x:Info xmlns:x="urn:other">{assertion}</x:Info>',
    ],
)
def test_client_security_header_or_assertion_for_the_backend_refused(
    gw: LiveGateway, pki: Path, backend: VerifyingBackend, block: str
) -> None:
    """Forwarded unsigned (the route forwards unsigned blocks) or not, a client's own Security header or
    assertion never reaches a backend that gets the gateway's."""
    client = gw.client("rsa-forward")
    header = block.format(wsse=ns.WSSE, assertion=_forged_assertion(pki))
    plain = envelope(f'<d:echo xmlns:d="{DEMO}"><d:text>x</d:text></d:echo>', header_xml=header)
    secured, pending = client.secure(plain)
    before = len(backend.seen)
    reply = requests.post(
        gw.url("rsa-forward"), data=secured, headers={"content-type": pending.content_type}, timeout=10
    )
    assert reply.status_code == 500 and fault_code(reply).endswith("InvalidSecurity")
    assert len(backend.seen) == before
