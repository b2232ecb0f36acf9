"""Issue #22: SAML assertions that must not get a caller in, in-process and through the running gateway.

Each assertion is signed by a library we did not write (signxml, tests/support/saml.py) and sent by the gateway's
client as `wsgate client --assertion` sends it. Every refusal has a control beside it: the same message, honest,
gets through, so the refusal is the threat's doing."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import pytest
from lxml import etree

from filters.engine import faults, ns
from filters.engine.engine import Exchange
from filters.engine.profiles import SamlPipeline
from filters.engine.wss import keys, signing
from filters.engine.wss import wssecurity_sending as sending
from filters.engine.xml.threat_protection import parse_envelope
from filters.stores.factory import RouteStores
from gateway.policy import Route
from gateway.tools.client import saml_reference
from tests.support import saml as S
from tests.support.harness import GatewayFactory, LiveGateway, fault_code
from tests.support.wss_helpers import echo

HOUR = dt.timedelta(hours=1)


def beside(route: Route, pki: Path, assertion: etree._Element, signer: str, sign_reference: bool) -> bytes:
    """A message signed by `signer` with its certificate in a BinarySecurityToken, the assertion in the header;
    the STR naming the assertion signed too, or only present."""
    env = parse_envelope(echo(), route.limits)
    reference = (saml_reference(assertion, sending.new_id("STR")),)
    key = signing.Signer(keys.load_private_key(str(pki / f"{signer}.key")), "rsa-sha256", "sha256")
    bst = sending.new_id("X509")
    sign = sending.SignWith(key, lambda: keys.str_reference(bst, ns.X509V3),
                            keys.load_certificate(str(pki / f"{signer}.pem")))  # fmt: skip
    sending.secure(env, S.now(), timestamp_ttl_s=300, sign=sign, unique_ids=True,
                   tokens=(assertion, *(() if sign_reference else reference)),
                   signed_tokens=reference if sign_reference else ())  # fmt: skip
    return env.serialize()


def secured(route: Route, pki: Path, tmp: Path, assertion: etree._Element, signer: str = "client2") -> bytes:
    data, _ = S.client(route, pki, S.write(tmp, assertion), signer=signer).secure(echo())
    return data


def accepted(pipeline: SamlPipeline, data: bytes, headers: dict[str, str] | None = None) -> dict[str, str]:
    out = pipeline.request(data, headers or {}, Exchange(route=pipeline.route))
    return dict(out.set_headers)


def refused(pipeline: SamlPipeline, data: bytes, code: str | None = None) -> faults.Fault:
    with pytest.raises(faults.Fault) as info:
        pipeline.request(data, {}, Exchange(route=pipeline.route))
    if code is not None:
        assert info.value.code == code, info.value.reason
    return info.value


# Each threat: (how the assertion is made, who signs the message, the fault code expected). The control is the
# same call with the threat's one difference undone.
def _untrusted_issuer(pki: Path) -> etree._Element:
    return S.sign(S.assertion_xml(pki, issuer="https://evil.example"), pki)


def _issuer_certificate_in_key_info_only(pki: Path) -> etree._Element:
    """The configured issuer's name, signed by another key whose certificate rides in KeyInfo."""
    return S.sign(S.assertion_xml(pki), pki, stem="saml-rogue-idp")


def _audience_mismatch(pki: Path) -> etree._Element:
    return S.sign(S.assertion_xml(pki, audience="urn:other:service"), pki)


def _expired(pki: Path) -> etree._Element:
    return S.sign(S.assertion_xml(pki, issued=S.now() - HOUR, valid_s=600), pki)


def _not_yet_valid(pki: Path) -> etree._Element:
    return S.sign(S.assertion_xml(pki, issued=S.now(), not_before=S.now() + HOUR, valid_s=7200), pki)


def _too_old(pki: Path) -> etree._Element:
    """Still within NotOnOrAfter, but issued longer ago than the route's max_age_s (3600)."""
    return S.sign(S.assertion_xml(pki, issued=S.now() - 2 * HOUR, valid_s=4 * 3600), pki)


def _algorithm_downgrade(pki: Path) -> etree._Element:
    return S.sign_sha1(S.assertion_xml(pki), pki)


THREATS: dict[str, tuple[Callable[[Path], etree._Element], str, str]] = {
    "untrusted_issuer": (_untrusted_issuer, "client2", "FailedAuthentication"),
    "issuer_certificate_in_key_info_not_configured": (_issuer_certificate_in_key_info_only, "client2", "FailedCheck"),
    "audience_mismatch": (_audience_mismatch, "client2", "FailedAuthentication"),
    "expired_assertion": (_expired, "client2", "MessageExpired"),
    "not_yet_valid_assertion": (_not_yet_valid, "client2", "MessageExpired"),
    "assertion_older_than_max_age": (_too_old, "client2", "MessageExpired"),
    "algorithm_downgrade_to_sha1": (_algorithm_downgrade, "client2", "UnsupportedAlgorithm"),
    # sender-vouches from `client`, whose certificate the CA vouches for but the route does not list as attesting
    "sender_vouches_by_a_party_not_allowed_to_vouch": (lambda pki: S.sign(S.assertion_xml(pki), pki), "client",
                                                       "FailedAuthentication"),
    # holder-of-key for `client`, the message signed by `client2` naming the assertion's key: does not verify
    "holder_of_key_signed_with_another_key": (
        lambda pki: S.sign(S.assertion_xml(pki, method="holder-of-key", holder="client"), pki), "client2",
        "FailedCheck"),
}  # fmt: skip


def test_honest_assertions_get_through_every_confirmation(route: Route, pipeline: SamlPipeline, pki: Path,
                                                          tmp_path: Path) -> None:  # fmt: skip
    """The control: each method in both SAML versions, the subject and the mapped attribute for the backend."""
    for version in ("2.0", "1.1"):
        for method, signer in (("sender-vouches", "client2"), ("holder-of-key", "client"), ("bearer", "client")):
            a = S.sign(S.assertion_xml(pki, version=version, method=method, holder="client"), pki)
            headers = accepted(pipeline, secured(route, pki, tmp_path, a, signer))
            assert headers["x-wsgate-subject"] == S.SUBJECT
            assert headers["x-wsgate-role"] == "clerk"


@pytest.mark.parametrize("threat", THREATS)
def test_saml_threat_refused_in_process(threat: str, route: Route, pipeline: SamlPipeline, pki: Path,
                                        tmp_path: Path) -> None:  # fmt: skip
    make, signer, code = THREATS[threat]
    refused(pipeline, secured(route, pki, tmp_path, make(S.idp(pki)), signer), code)


def test_bearer_replay_is_refused(route: Route, pipeline: SamlPipeline, pki: Path, tmp_path: Path) -> None:
    """A bearer assertion is used once, whatever message carries it: a fresh message (new Timestamp, new
    signature) with the same assertion is a replay."""
    a = S.sign(S.assertion_xml(pki, method="bearer"), pki)
    accepted(pipeline, secured(route, pki, tmp_path, a, "client"))
    assert "replay" in refused(pipeline, secured(route, pki, tmp_path, a, "client"), "FailedAuthentication").reason


def test_one_time_use_assertion_replay_is_refused(route: Route, pipeline: SamlPipeline, pki: Path,
                                                  tmp_path: Path) -> None:  # fmt: skip
    for version in ("2.0", "1.1"):
        a = S.sign(S.assertion_xml(pki, version=version, one_time_use=True), pki)
        accepted(pipeline, secured(route, pki, tmp_path, a))
        refused(pipeline, secured(route, pki, tmp_path, a), "FailedAuthentication")
        # without OneTimeUse, a sender-vouches assertion serves the session it was issued for
        again = S.sign(S.assertion_xml(pki, version=version), pki)
        accepted(pipeline, secured(route, pki, tmp_path, again))
        accepted(pipeline, secured(route, pki, tmp_path, again))


def test_bearer_without_tls_or_trusted_signer_is_refused(pki: Path, tmp_path: Path) -> None:
    """A bearer assertion proves nothing about who sends it: without TLS, the message must be signed by a party
    the route's anchors vouch for. `rogue` chains to another CA."""
    route = S.saml_route(pki, saml={"confirmation": ["bearer"], "attesting_certificates": []})
    pipeline = SamlPipeline(route, RouteStores())
    refused(pipeline, secured(route, pki, tmp_path, S.sign(S.assertion_xml(pki, method="bearer"), pki), "rogue"))
    accepted(pipeline, secured(route, pki, tmp_path, S.sign(S.assertion_xml(pki, method="bearer"), pki), "client"))
    # the same unsigned-by-a-trusted-party message over TLS (Envoy's x-forwarded-proto) gets through
    data = secured(route, pki, tmp_path, S.sign(S.assertion_xml(pki, method="bearer"), pki), "rogue")
    assert accepted(pipeline, data, {"x-forwarded-proto": "https"})["x-wsgate-subject"] == S.SUBJECT


def _assertion_in(data: bytes) -> tuple[etree._Element, etree._Element]:
    root = etree.fromstring(data)
    return root, next(root.iter(ns.q(ns.SAML2, "Assertion")))


def test_comment_inside_name_id_does_not_truncate_the_subject(route: Route, pipeline: SamlPipeline, pki: Path,
                                                              tmp_path: Path) -> None:  # fmt: skip
    """The 2018 class: the IdP signs `admin@example.org.evil.example` with a comment after `admin@example.org`
    (C14N without comments ignores it, so the signature holds). The backend must be told the whole name."""
    name = "admin@example.org<!---->.evil.example"
    a = S.sign(S.assertion_xml(pki, subject=name), pki)
    assert a.find(f".//{{{ns.SAML2}}}NameID").text == "admin@example.org"  # a naive reader's subject
    headers = accepted(pipeline, secured(route, pki, tmp_path, a))
    assert headers["x-wsgate-subject"] == "admin@example.org.evil.example"
    # the comment added in transit to the honest name: the same signature, the same whole name
    root, assertion = _assertion_in(secured(route, pki, tmp_path, S.sign(S.assertion_xml(pki), pki)))
    name_id = assertion.find(f".//{{{ns.SAML2}}}NameID")
    name_id.text = "alice"
    name_id.append(etree.Comment("x"))
    name_id[-1].tail = "@example.org"
    assert accepted(pipeline, etree.tostring(root))["x-wsgate-subject"] == S.SUBJECT


def test_cdata_inside_name_id_is_read_whole(route: Route, pipeline: SamlPipeline, pki: Path, tmp_path: Path) -> None:
    a = S.sign(S.assertion_xml(pki, subject="admin@example.org<![CDATA[.evil.example]]>"), pki)
    assert accepted(pipeline, secured(route, pki, tmp_path, a))["x-wsgate-subject"] == "admin@example.org.evil.example"


@pytest.mark.parametrize("declaration", [
    '<!DOCTYPE x [<!ENTITY who "admin@example.org">]>',
    '<!DOCTYPE x [<!ENTITY % p SYSTEM "file:///etc/passwd"> %p;]>',
    "<!DOCTYPE x>",
])  # fmt: skip
def test_dtd_and_entities_in_a_saml_message_are_refused(declaration: str, route: Route, pipeline: SamlPipeline,
                                                        pki: Path, tmp_path: Path) -> None:  # fmt: skip
    data = secured(route, pki, tmp_path, S.sign(S.assertion_xml(pki), pki))
    refused(pipeline, declaration.encode() + data)
    data = secured(route, pki, tmp_path, S.sign(S.assertion_xml(pki), pki))
    refused(pipeline, data.replace(S.SUBJECT.encode(), b"&who;", 1))


def test_assertion_moved_to_another_message_is_refused(route: Route, pipeline: SamlPipeline, pki: Path,
                                                       tmp_path: Path) -> None:  # fmt: skip
    """Lifted from a message and put into one the thief signs: sender-vouches by a party not allowed to vouch,
    holder-of-key without the key, bearer already used."""
    sv = S.sign(S.assertion_xml(pki), pki)
    accepted(pipeline, secured(route, pki, tmp_path, sv, "client2"))
    refused(pipeline, secured(route, pki, tmp_path, sv, "rogue"), "FailedAuthentication")
    hok = S.sign(S.assertion_xml(pki, method="holder-of-key", holder="client"), pki)
    accepted(pipeline, secured(route, pki, tmp_path, hok, "client"))
    refused(pipeline, secured(route, pki, tmp_path, hok, "client2"), "FailedCheck")
    bearer = S.sign(S.assertion_xml(pki, method="bearer"), pki)
    accepted(pipeline, secured(route, pki, tmp_path, bearer, "client"))
    refused(pipeline, secured(route, pki, tmp_path, bearer, "client2"), "FailedAuthentication")


def test_sender_vouches_must_sign_the_assertion_reference(route: Route, pipeline: SamlPipeline, pki: Path) -> None:
    """The attesting party's signature must cover the STR naming the assertion: else any assertion could sit
    beside a message that party signed for someone else."""

    accepted(pipeline, beside(route, pki, S.sign(S.assertion_xml(pki), pki), "client2", sign_reference=True))
    refused(pipeline, beside(route, pki, S.sign(S.assertion_xml(pki), pki), "client2", sign_reference=False),
            "FailedAuthentication")  # fmt: skip


def test_sender_vouches_signing_the_assertion_itself_gets_through(route: Route, pipeline: SamlPipeline,
                                                                  pki: Path) -> None:  # fmt: skip
    """The control for the moved-assertion threats: the attesting party's signature may cover the assertion by its
    own ID (a direct reference) instead of the STR; then swapping in another assertion breaks that digest."""
    env = parse_envelope(echo(), route.limits)
    assertion = S.sign(S.assertion_xml(pki), pki)
    key = signing.Signer(keys.load_private_key(str(pki / "client2.key")), "rsa-sha256", "sha256")
    bst = sending.new_id("X509")
    sign = sending.SignWith(key, lambda: keys.str_reference(bst, ns.X509V3),
                            keys.load_certificate(str(pki / "client2.pem")))  # fmt: skip
    sending.secure(env, S.now(), timestamp_ttl_s=300, sign=sign, unique_ids=True, signed_tokens=(assertion,))
    data = env.serialize()
    assert f'URI="#{assertion.get("ID")}"'.encode() in data
    assert accepted(pipeline, data)["x-wsgate-subject"] == S.SUBJECT
    other = S.sign(S.assertion_xml(pki, subject="admin@example.org", assertion_id=assertion.get("ID")), pki)
    root = etree.fromstring(data)
    held = next(root.iter(ns.q(ns.SAML2, "Assertion")))
    held.getparent().replace(held, other)
    refused(pipeline, etree.tostring(root), "FailedCheck")


def test_holder_of_key_assertion_beside_another_certificate_is_refused(route: Route, pipeline: SamlPipeline,
                                                                       pki: Path) -> None:  # fmt: skip
    """The message signed with the sender's own certificate (a BinarySecurityToken) next to a holder-of-key
    assertion for another key: even a party allowed to vouch (client2) is not the holder."""
    hok = S.sign(S.assertion_xml(pki, method="holder-of-key", holder="client"), pki)
    accepted(pipeline, beside(route, pki, hok, "client", sign_reference=True))
    hok = S.sign(S.assertion_xml(pki, method="holder-of-key", holder="client"), pki)
    refused(pipeline, beside(route, pki, hok, "client2", sign_reference=True), "FailedAuthentication")


def test_a_second_assertion_is_refused(route: Route, pipeline: SamlPipeline, pki: Path, tmp_path: Path) -> None:
    root, assertion = _assertion_in(secured(route, pki, tmp_path, S.sign(S.assertion_xml(pki), pki)))
    assertion.addnext(S.sign(S.assertion_xml(pki, subject="admin@example.org"), pki))
    refused(pipeline, etree.tostring(root), "InvalidSecurity")


def test_attribute_values_are_bounded_and_encoded(pki: Path, tmp_path: Path) -> None:
    """Values become headers: percent-encoded outside printable ASCII (no header splitting), joined by commas
    (a comma inside a value encoded), and an assertion whose value passes the bound is refused."""
    route = S.saml_route(pki, saml={"max_attribute_bytes": 64})
    pipeline = SamlPipeline(route, RouteStores())
    a = S.sign(S.assertion_xml(pki, roles=("clerk", "a,b", "x&#13;&#10;x-wsgate-subject: root")), pki)
    headers = accepted(pipeline, secured(route, pki, tmp_path, a))
    assert headers["x-wsgate-role"] == "clerk,a%2Cb,x%0D%0Ax-wsgate-subject: root"
    refused(pipeline, secured(route, pki, tmp_path, S.sign(S.assertion_xml(pki, roles=("r" * 65,)), pki)))


# --------------------------------------------------------------------------------------------------------
# Through the running gateway: a representative set


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path) -> LiveGateway:
    return module_gateway([S.saml_doc(pki, replay={"store": "auto"})])


@pytest.mark.parametrize("threat", ["untrusted_issuer", "issuer_certificate_in_key_info_not_configured",
                                    "audience_mismatch", "expired_assertion", "algorithm_downgrade_to_sha1",
                                    "sender_vouches_by_a_party_not_allowed_to_vouch",
                                    "holder_of_key_signed_with_another_key"])  # fmt: skip
def test_saml_threat_refused_by_the_gateway(threat: str, gw: LiveGateway, pki: Path, tmp_path: Path) -> None:
    make, signer, code = THREATS[threat]
    gw.clear()
    resp = gw.post("saml", secured(gw.route("saml"), pki, tmp_path, make(pki), signer))
    assert resp.status_code == 500 and fault_code(resp) == code
    assert b"SAML" not in resp.content  # the client is told the generic message, the log the reason
    assert gw.received() == []


def test_bearer_replay_and_comment_truncation_through_the_gateway(gw: LiveGateway, pki: Path, tmp_path: Path) -> None:
    route = gw.route("saml")
    gw.clear()
    a = S.sign(S.assertion_xml(pki, method="bearer", subject="admin@example.org<!---->.evil.example"), pki)
    assert gw.post("saml", secured(route, pki, tmp_path, a, "client")).status_code == 200
    resp = gw.post("saml", secured(route, pki, tmp_path, a, "client"))
    assert resp.status_code == 500 and fault_code(resp) == "FailedAuthentication"
    got = gw.received()
    assert len(got) == 1 and got[0]["headers"]["x-wsgate-subject"] == "admin@example.org.evil.example"
    assert got[0]["headers"]["x-wsgate-role"] == "clerk"
