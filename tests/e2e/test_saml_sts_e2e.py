"""The gateway's WS-Trust endpoint issuing SAML 2.0 assertions (route option saml_token_service, docs/saml.md),
through the running gateway: a client asks for one, holder-of-key or bearer, and verifies it with signxml (a
library we did not write) and the gateway's certificate; what the STS must not issue, it refuses."""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from pathlib import Path

import pytest
import requests
from cryptography.hazmat.primitives import serialization
from lxml import etree
from signxml import XMLVerifier

from filters.engine import ns
from filters.engine.conversation import ws_trust
from filters.engine.faults import content_type
from filters.engine.wss import keys
from filters.engine.wss.timestamp import parse_datetime
from gateway.tools.client import Client, ClientConfig, ClientError, http_post
from tests.support import saml as saml_support
from tests.support.harness import GatewayFactory, LiveGateway, fault_code
from tests.support.wss_helpers import DEMO, echo, route_doc

SAML = {"saml2": ns.SAML2, "ds": ns.DS}
CLIENT = "CN=Demo Client,O=WSGate Demo"


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path) -> LiveGateway:
    sc = {"master_keys_file": str(pki / "sct-master-keys.yaml")}
    sts = {"audience": "urn:service-a", "other_audiences": ["urn:service-b"], "key": str(pki / "gateway-sign.key"),
           "certificate": str(pki / "gateway-sign.pem"), "lifetime_s": 600}  # fmt: skip
    return module_gateway([
        route_doc(pki, "secureconversation", name="sts", secureconversation=sc,
                  saml_token_service={**sts, "confirmations": ["holder-of-key", "bearer"]}),
        route_doc(pki, "secureconversation", name="sts-hok", secureconversation=sc, saml_token_service=sts),
        route_doc(pki, "secureconversation", name="sct-only", secureconversation=sc),
        # A service that takes the STS's assertions: the gateway's signing certificate is its issuer's.
        route_doc(pki, "saml", name="service-a", saml={
            "issuers": [{"name": "urn:wsgate:gateway", "certificates": [str(pki / "gateway-sign.pem")]}],
            "confirmation": ["holder-of-key", "bearer"], "audiences": ["urn:service-a"]}),
    ])  # fmt: skip


def verified(assertion: etree._Element, pki: Path) -> etree._Element:
    cert = (pki / "gateway-sign.pem").read_text()
    return XMLVerifier().verify(etree.tostring(assertion), x509_cert=cert, expect_references=1).signed_xml


def test_sts_issues_holder_of_key_assertion_for_the_callers_certificate(gw: LiveGateway, pki: Path) -> None:
    assertion = gw.client("sts").request_saml(http_post(gw.url("sts")))
    signed = verified(assertion, pki)
    assert signed.findtext("saml2:Subject/saml2:NameID", namespaces=SAML) == CLIENT
    confirmation = signed.find("saml2:Subject/saml2:SubjectConfirmation", SAML)
    assert confirmation.get("Method") == ns.SAML2_HOLDER_OF_KEY
    held = confirmation.findtext(
        "saml2:SubjectConfirmationData/ds:KeyInfo/ds:X509Data/ds:X509Certificate", namespaces=SAML
    )
    ours = keys.load_certificate(pki / "client.pem").public_bytes(serialization.Encoding.DER)
    assert base64.b64decode(held) == ours  # the key the caller signed its request with
    assert (
        signed.findtext("saml2:Conditions/saml2:AudienceRestriction/saml2:Audience", namespaces=SAML) == "urn:service-a"
    )
    expires = parse_datetime(signed.find("saml2:Conditions", SAML).get("NotOnOrAfter"))
    assert 500 < (expires - datetime.now(UTC)).total_seconds() <= 600


def test_bearer_assertion_travels_encrypted_for_the_audience_asked(gw: LiveGateway, pki: Path) -> None:
    client = gw.client("sts")
    seen: list[bytes] = []
    post = http_post(gw.url("sts"))

    def recording(body: bytes, ctype: str) -> bytes:
        seen.append(post(body, ctype))
        return seen[-1]

    assertion = client.request_saml(recording, bearer=True, applies_to="urn:service-b")
    signed = verified(assertion, pki)
    assert signed.find("saml2:Subject/saml2:SubjectConfirmation", SAML).get("Method") == ns.SAML2_BEARER
    assert (
        signed.findtext("saml2:Conditions/saml2:AudienceRestriction/saml2:Audience", namespaces=SAML) == "urn:service-b"
    )
    # Whoever reads a bearer assertion can use it: over plain HTTP, the reply's Body is encrypted to the caller.
    assert b"Assertion" not in seen[0] and b"EncryptedData" in seen[0]


@pytest.mark.parametrize(
    ("route", "kwargs", "reason"),
    [
        ("sts", {"applies_to": "urn:someone-else"}, "RequestFailed"),
        ("sts-hok", {"bearer": True}, "RequestFailed"),
        ("sct-only", {}, "InvalidRequest"),
    ],
)
def test_sts_refuses_assertions_it_may_not_issue(gw: LiveGateway, route: str, kwargs: dict, reason: str) -> None:
    with pytest.raises(ClientError, match=reason):
        gw.client(route).request_saml(http_post(gw.url(route)), **kwargs)


def test_untrusted_caller_gets_no_assertion(gw: LiveGateway, pki: Path) -> None:
    rogue = Client(gw.route("sts"), ClientConfig(certs=pki, key="rogue.key", certificate="rogue.pem"))
    with pytest.raises(ClientError, match="FailedAuthentication"):
        rogue.request_saml(http_post(gw.url("sts")))


def test_holder_of_key_for_another_key_refused(gw: LiveGateway) -> None:
    """UseKey would have the assertion confirm a key the caller never proved it holds."""
    rst = ws_trust.build_saml_issue_rst(bearer=False)
    use_key = etree.SubElement(rst, ns.q(ws_trust.WST_1_3, "UseKey"))
    etree.SubElement(use_key, ns.q(ns.DS, "KeyInfo"))
    env = ws_trust.envelope("1.1", rst, action=ws_trust.SAML_ISSUE_ACTION)
    # The Issue request signed as on an `rsa` route (the same client, not yet in a context).
    signer = Client(gw.route("sts").model_copy(update={"profile": "rsa"}), gw.client("sts").cfg)
    secured, _ = signer.secure(env.serialize())
    reply = requests.post(gw.url("sts"), data=secured, headers={"content-type": content_type("1.1")}, timeout=10)
    assert reply.status_code == 500 and fault_code(reply) == "InvalidRequest"


@pytest.mark.parametrize("bearer", [False, True])
def test_sts_assertion_used_on_a_saml_route(gw: LiveGateway, pki: Path, tmp_path: Path, bearer: bool) -> None:
    """A client gets its token from the gateway's STS and calls a service that takes the STS as its issuer."""
    assertion = gw.client("sts").request_saml(http_post(gw.url("sts")), bearer=bearer)
    service = saml_support.client(gw.route("service-a"), pki, saml_support.write(tmp_path, assertion))
    gw.clear()
    secured, pending = service.secure(echo("with the STS's token"))
    reply = service.open(http_post(gw.url("service-a"))(secured, pending.content_type), pending)
    assert reply.body.findtext(f".//{{{DEMO}}}text") == "with the STS's token"
    assert gw.received()[0]["headers"]["x-wsgate-subject"] == CLIENT
