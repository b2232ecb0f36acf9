"""The SAML 2.0 assertions the gateway issues (filters/engine/wss/saml_issuer.py), verified by signxml: a library we
did not write, with the issuer's certificate only (never the one in the KeyInfo)."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from lxml import etree
from pydantic import ValidationError
from signxml import InvalidSignature, XMLVerifier

from certs import hsm as hsm_mod
from filters.engine import ns
from filters.engine.faults import Fault
from filters.engine.wss import inventory, keys
from filters.engine.wss.saml_issuer import AC_X509, NAMEID_X509, Identity, Issuer
from filters.engine.wss.timestamp import format_datetime
from gateway.policy import BackendAssertion, Route
from tests.support.wss_helpers import eddsa_certificate, route_doc

SAML = {"saml2": ns.SAML2, "ds": ns.DS}
NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
WHO = Identity("CN=Demo Client,O=WSGate Demo", NAMEID_X509, AC_X509, NOW)


def verify(assertion: bytes, pki: Path) -> etree._Element:
    """What a backend does: signxml with the gateway's configured certificate, one reference (the assertion)."""
    cert = (pki / "gateway-sign.pem").read_text()
    return XMLVerifier().verify(assertion, x509_cert=cert, expect_references=1).signed_xml


def policy(pki: Path, **extra: object) -> BackendAssertion:
    return BackendAssertion(key=str(pki / "gateway-sign.key"), certificate=str(pki / "gateway-sign.pem"),
                            audience="urn:backend", **extra)  # fmt: skip


def test_sender_vouches_assertion_verifies_with_signxml(pki: Path) -> None:
    assertion = Issuer(policy(pki, lifetime_s=120)).issue(WHO, audience="urn:backend", now=NOW)
    signed = verify(etree.tostring(assertion), pki)
    assert signed.findtext("saml2:Subject/saml2:NameID", namespaces=SAML) == WHO.subject
    assert signed.find("saml2:Subject/saml2:NameID", SAML).get("Format") == NAMEID_X509
    method = signed.find("saml2:Subject/saml2:SubjectConfirmation", SAML).get("Method")
    assert method == ns.SAML2_SENDER_VOUCHES
    assert (
        signed.findtext("saml2:Conditions/saml2:AudienceRestriction/saml2:Audience", namespaces=SAML) == "urn:backend"
    )
    conditions = signed.find("saml2:Conditions", SAML)
    assert conditions.get("NotOnOrAfter") == format_datetime(NOW + timedelta(seconds=120))
    assert (
        signed.findtext("saml2:AuthnStatement/saml2:AuthnContext/saml2:AuthnContextClassRef", namespaces=SAML)
        == AC_X509
    )


def test_assertion_altered_after_signing_fails_verification(pki: Path) -> None:
    assertion = Issuer(policy(pki)).issue(WHO, audience="urn:backend", now=NOW)
    forged = etree.tostring(assertion).replace(b"CN=Demo Client", b"CN=Administrator")
    with pytest.raises(InvalidSignature):
        verify(forged, pki)


def test_holder_of_key_assertion_names_the_holders_certificate(pki: Path) -> None:
    holder = keys.load_certificate(pki / "client.pem")
    assertion = Issuer(policy(pki)).issue(WHO, audience="urn:a", now=NOW, confirmation=ns.SAML2_HOLDER_OF_KEY,
                                          holder=holder)  # fmt: skip
    signed = verify(etree.tostring(assertion), pki)
    data = signed.find("saml2:Subject/saml2:SubjectConfirmation/saml2:SubjectConfirmationData", SAML)
    der = base64.b64encode(holder.public_bytes(serialization.Encoding.DER)).decode()
    assert data.findtext("ds:KeyInfo/ds:X509Data/ds:X509Certificate", namespaces=SAML) == der


def test_token_key_signs_assertions_signxml_accepts(pki: Path, hsm: Path) -> None:
    """A PKCS#11 key signs in its token: the assertion verifies all the same."""
    issuer = Issuer(policy(pki).model_copy(update={"key": hsm_mod.uri(hsm, "gateway-sign")}))
    verify(etree.tostring(issuer.issue(WHO, audience="urn:backend", now=NOW)), pki)


def test_issuer_with_a_certificate_not_its_keys_refused(pki: Path) -> None:
    with pytest.raises(Exception, match="not the key's"):
        Issuer(policy(pki).model_copy(update={"certificate": str(pki / "client.pem")}))


@pytest.mark.parametrize(
    ("profile", "extra", "error"),
    [
        ("xml", {}, "verifies no caller"),
        ("hmac", {"hmac": {"allow_anonymous": True}}, "anonymous"),
        ("rsa", {"backend_assertion": {"audience": "urn:b", "header": "X_Bad"}}, "header"),
    ],
)
def test_backend_assertion_without_a_verified_caller_refused_by_the_model(
    pki: Path, profile: str, extra: dict, error: str
) -> None:
    doc = route_doc(pki, profile, **{"backend_assertion": {"audience": "urn:b"}, **extra})
    doc["upstream"] = {"address": "127.0.0.1:1"}
    with pytest.raises(ValidationError, match=error):
        Route.model_validate(doc)


def test_expiring_saml_signing_certificate_is_in_the_inventory(pki: Path) -> None:
    """`wsgate keys list`, `wsgate check` and the expiry metric see the issuing key's certificate."""
    doc = route_doc(pki, "rsa", backend_assertion={"audience": "urn:b", "certificate": str(pki / "gateway-sign.pem"),
                                                   "key": str(pki / "gateway-sign.key")})  # fmt: skip
    doc["upstream"] = {"address": "127.0.0.1:1"}
    items = [i for i in inventory.route_items(Route.model_validate(doc)) if i.use == "saml_signing"]
    assert [(i.source, i.certificate is not None) for i in items] == [(str(pki / "gateway-sign.key"), True)]


def test_issuer_with_an_eddsa_certificate_refused_as_not_its_keys(pki: Path, tmp_path: Path) -> None:
    """A policy error named as one (the key has no numbers to compare), not an internal error."""
    with pytest.raises(Fault, match="not the key's"):
        Issuer(policy(pki).model_copy(update={"certificate": str(eddsa_certificate(tmp_path / "eddsa.pem"))}))
