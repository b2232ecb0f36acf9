"""Issue #22: holder-of-key with a symmetric key (SAML Token Profile 1.1, 3.5). The assertion's confirmation holds an
xenc:EncryptedKey to the gateway's encryption certificate; the message is HMAC-signed with that key, its KeyInfo an
STR naming the assertion. The gateway opens the EncryptedKey with its own key, under the rules of any EncryptedKey
(one FailedCheck whatever fails), and verifies the signature with that key and no other.

The assertions are signed by signxml and their EncryptedKeys made by `cryptography` (tests/support/saml.py), the
messages sent by the gateway's client (`wsgate client --assertion --proof-key`) or, where a threat needs a message
the client would never make, put together from the engine's sending side. Every refusal has its control."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from pathlib import Path
from typing import Any

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
from tests.support.wss_helpers import echo, make_route, with_token_keys

ENCRYPTED_KEY = ns.q(ns.XENC, "EncryptedKey")
MESSAGE_SIGNATURE = f".//{{{ns.WSSE}}}Security/{{{ns.DS}}}Signature"
HOK_ONLY = {"confirmation": ["holder-of-key"], "attesting_certificates": []}


def hok(pki: Path, secret: bytes, version: str = "2.0", **kw: Any) -> etree._Element:
    """An IdP's holder-of-key assertion confirming `secret`, encrypted to the gateway."""
    to, transport = kw.pop("to", "gateway-enc"), kw.pop("transport", "rsa-oaep-mgf1p")
    proof = S.encrypted_key(S.idp(pki), secret, to=to, transport=transport)
    return S.sign(S.assertion_xml(pki, version=version, method="holder-of-key", proof=proof, **kw), pki)


def sent(route: Route, pki: Path, tmp: Path, assertion: etree._Element, secret: bytes) -> bytes:
    """The message `wsgate client --assertion --proof-key` sends."""
    return S.client(route, pki, S.write(tmp, assertion), proof_key=secret).secure(echo())[0]


def made(route: Route, assertion: etree._Element, key: signing.PrivateKey, algorithm: str = "hmac-sha256",
         key_info: Any = None) -> bytes:  # fmt: skip
    """A message the client would not make: signed with `key` and `algorithm`, its KeyInfo `key_info` (default: an
    STR naming the assertion), the assertion in the header before the signature."""
    env = parse_envelope(echo(), route.limits)
    sign = sending.SignWith(signing.Signer(key, algorithm, "sha256"),
                            key_info or (lambda: saml_reference(assertion, None)))  # fmt: skip
    sending.secure(env, S.now(), timestamp_ttl_s=300, sign=sign, unique_ids=True, tokens=(assertion,))
    return env.serialize()


def accepted(pipeline: SamlPipeline, data: bytes) -> dict[str, str]:
    return dict(pipeline.request(data, {}, Exchange(route=pipeline.route)).set_headers)


def refused(pipeline: SamlPipeline, data: bytes, code: str) -> faults.Fault:
    with pytest.raises(faults.Fault) as info:
        pipeline.request(data, {}, Exchange(route=pipeline.route))
    assert info.value.code == code, info.value.reason
    return info.value


def test_symmetric_holder_of_key_gets_through(route: Route, pipeline: SamlPipeline, pki: Path, tmp_path: Path) -> None:
    """The control: SAML 2.0 and 1.1, the EncryptedKey made by `cryptography` and by libxmlsec1, the key named by
    KeyIdentifier (SAMLID / SAMLAssertionID) as the client does, and by a direct Reference to the assertion's ID;
    the backend told the assertion's subject."""
    for version in ("2.0", "1.1"):
        secret = os.urandom(32)
        data = sent(route, pki, tmp_path, hok(pki, secret, version), secret)
        assert b"hmac-sha256" in data and b"BinarySecurityToken" not in data
        headers = accepted(pipeline, data)
        assert headers["x-wsgate-subject"] == S.SUBJECT and headers["x-wsgate-role"] == "clerk"
    for version in ("2.0", "1.1"):  # the EncryptedKey made by libxmlsec1 instead
        secret = os.urandom(32)
        proof = S.xmlsec_encrypted_key(pki, secret)
        a = S.sign(S.assertion_xml(pki, version=version, method="holder-of-key", proof=proof), pki)
        assert accepted(pipeline, sent(route, pki, tmp_path, a, secret))["x-wsgate-subject"] == S.SUBJECT
    secret = os.urandom(32)
    a = hok(pki, secret)
    assert accepted(
        pipeline, made(route, a, secret, key_info=lambda: keys.str_reference(a.get("ID"), ns.SAML_V2_TOKEN))
    )


def test_symmetric_key_encrypted_to_another_certificate_is_refused(route: Route, pipeline: SamlPipeline, pki: Path,
                                                                   tmp_path: Path) -> None:  # fmt: skip
    """Encrypted to client2's certificate (whose owner knows the key): the gateway's key does not open it."""
    secret = os.urandom(32)
    refused(pipeline, sent(route, pki, tmp_path, hok(pki, secret, to="client2"), secret), "FailedCheck")


def _flipped(ek_xml: str) -> str:
    root = etree.fromstring(ek_xml)
    value = root.find(f".//{{{ns.XENC}}}CipherValue")
    raw = bytearray(base64.b64decode(value.text))
    raw[len(raw) // 2] ^= 1
    value.text = base64.b64encode(bytes(raw)).decode()
    return etree.tostring(root).decode()


def _unopenable(pki: Path, secret: bytes) -> dict[str, str]:
    """EncryptedKeys that do not open with the gateway's key, each signed by the IdP (only the key is wrong)."""
    good = S.encrypted_key(pki, secret)
    short = base64.b64encode(os.urandom(20)).decode()
    return {
        "ciphertext changed": _flipped(good),
        "another certificate's": S.encrypted_key(pki, secret, to="client2"),
        "not RSA-sized": good.replace(good[good.index("<xenc:CipherValue>") + 18:good.index("</xenc:CipherValue>")],
                                      short),
        "a key too short to sign with": S.encrypted_key(pki, secret[:8]),
    }  # fmt: skip


def test_encrypted_key_that_does_not_open_looks_like_any_failed_signature(route: Route, pipeline: SamlPipeline,
                                                                          pki: Path, tmp_path: Path) -> None:  # fmt: skip
    """No oracle (Bleichenbacher, Jager-Somorovsky): whatever is wrong with the EncryptedKey, the client is told
    what it is told when the signature is made with another key: the same code, message and metric class."""
    secret = os.urandom(32)
    wrong_hmac = refused(pipeline, made(route, hok(pki, secret), os.urandom(32)), "FailedCheck")
    seen = {(wrong_hmac.code, wrong_hmac.message, faults.metric_reason(wrong_hmac))}
    for why, proof in _unopenable(pki, secret).items():
        a = S.sign(S.assertion_xml(pki, method="holder-of-key", proof=proof), pki)
        f = refused(pipeline, made(route, a, secret), "FailedCheck")
        assert "EncryptedKey" in f.reason, (why, f.reason)  # the log says which; the client is not told
        seen.add((f.code, f.message, faults.metric_reason(f)))
    assert len(seen) == 1, seen


def test_message_signed_with_another_hmac_key_is_refused(route: Route, pipeline: SamlPipeline, pki: Path) -> None:
    """The thief holds the assertion, not its key: (1) the signature names the assertion, made with the thief's key;
    (2) the thief's own key in an EncryptedKey of the header (the symmetric binding) signs, the assertion beside."""
    secret, mine = os.urandom(32), os.urandom(32)
    a = hok(pki, secret)
    accepted(pipeline, made(route, a, secret))
    refused(pipeline, made(route, hok(pki, secret), mine), "FailedCheck")
    gateway = keys.load_certificate(str(pki / "gateway-enc.pem"))
    refused(pipeline, made_with_binding(route, hok(pki, secret), mine, gateway), "FailedAuthentication")


def made_with_binding(route: Route, assertion: etree._Element, key: bytes, gateway: Any) -> bytes:
    """Signed with `key` carried in the header's own EncryptedKey (its KeyInfo names that EncryptedKey)."""
    env = parse_envelope(echo(), route.limits)
    sign = sending.SignWith(signing.Signer(key, "hmac-sha256", "sha256"), None)
    sending.secure(env, S.now(), timestamp_ttl_s=300, sign=sign, unique_ids=True, tokens=(assertion,),
                   symmetric_binding=(key, gateway, "rsa-oaep-mgf1p"))  # fmt: skip
    return env.serialize()


def test_rsa_signature_where_the_assertion_confirms_a_symmetric_key_and_vice_versa(
    route: Route, pipeline: SamlPipeline, pki: Path
) -> None:
    """The key the assertion confirms decides the algorithm family, never the message: an RSA signature naming a
    symmetric-key assertion, an HMAC one naming an X.509 assertion (keyed with what? never the certificate); and
    an X.509 signer beside a symmetric-key assertion is not its holder."""
    client = keys.load_private_key(str(pki / "client.key"))
    refused(pipeline, made(route, hok(pki, os.urandom(32)), client, "rsa-sha256"), "UnsupportedAlgorithm")
    x509_hok = S.sign(S.assertion_xml(pki, method="holder-of-key", holder="client"), pki)
    accepted(pipeline, made(route, x509_hok, client, "rsa-sha256"))
    x509_hok = S.sign(S.assertion_xml(pki, method="holder-of-key", holder="client"), pki)
    refused(pipeline, made(route, x509_hok, os.urandom(32)), "UnsupportedAlgorithm")
    bst = sending.new_id("X509")
    cert = keys.load_certificate(str(pki / "client.pem"))
    env = parse_envelope(echo(), route.limits)
    sign = sending.SignWith(signing.Signer(client, "rsa-sha256", "sha256"),
                            lambda: keys.str_reference(bst, ns.X509V3), cert)  # fmt: skip
    sending.secure(env, S.now(), timestamp_ttl_s=300, sign=sign, unique_ids=True, tokens=(hok(pki, os.urandom(32)),))
    refused(pipeline, env.serialize(), "FailedAuthentication")


def test_encrypted_key_outside_the_issuer_signature_is_refused(route: Route, pipeline: SamlPipeline,
                                                               pki: Path) -> None:  # fmt: skip
    """XSW on the key: the issuer's signature covers the EncryptedKey, which is read from the verified assertion by
    identity. Replaced by the thief's own (a key the thief knows), moved out of its KeyInfo, or a second
    confirmation with the thief's key added: the issuer's signature no longer verifies."""
    secret, mine = os.urandom(32), os.urandom(32)
    theirs = etree.fromstring(S.encrypted_key(pki, mine))

    def replaced(a: etree._Element) -> None:
        ek = next(a.iter(ENCRYPTED_KEY))
        ek.getparent().replace(ek, theirs)

    def moved(a: etree._Element) -> None:
        ek = next(a.iter(ENCRYPTED_KEY))
        data = ek.getparent().getparent()
        ek.getparent().remove(ek)
        etree.SubElement(data, ns.q(ns.DS, "KeyInfo")).append(theirs)

    def second_confirmation(a: etree._Element) -> None:
        confirmation = next(a.iter(ns.q(ns.SAML2, "SubjectConfirmation")))
        copy = etree.fromstring(etree.tostring(confirmation))
        ek = next(copy.iter(ENCRYPTED_KEY))
        ek.getparent().replace(ek, theirs)
        confirmation.addprevious(copy)

    for tamper in (replaced, moved, second_confirmation):
        a = hok(pki, secret)
        tamper(a)
        refused(pipeline, made(route, a, mine), "FailedCheck")
    accepted(pipeline, made(route, hok(pki, secret), secret))


def test_two_encrypted_keys_in_the_confirmation_are_refused(route: Route, pipeline: SamlPipeline, pki: Path) -> None:
    """Even signed by the IdP: two EncryptedKeys (one KeyInfo or two), an EncryptedKey beside a certificate, or two
    holder-of-key confirmations with a key each leave the message to choose its key."""
    secret = os.urandom(32)
    ek = S.encrypted_key(pki, secret)
    cert = f"<ds:X509Data><ds:X509Certificate>{S.cert_b64(pki, 'client')}</ds:X509Certificate></ds:X509Data>"
    for proof in (ek + ek, ek + cert, f'{ek}</ds:KeyInfo><ds:KeyInfo xmlns:ds="{ns.DS}">{ek}'):
        a = S.sign(S.assertion_xml(pki, method="holder-of-key", proof=proof), pki)
        assert (
            "holder-of-key confirmation must name one key"
            in refused(pipeline, made(route, a, secret), "InvalidSecurity").reason
        )
    xml = S.assertion_xml(pki, method="holder-of-key", proof=ek)
    start = xml.index("<saml:SubjectConfirmation ")
    confirmation = xml[start : xml.index("</saml:SubjectConfirmation>") + len("</saml:SubjectConfirmation>")]
    twice = S.sign(xml.replace(confirmation, confirmation + confirmation.replace(ek, S.encrypted_key(pki, secret))),
                   pki)  # fmt: skip
    refused(pipeline, made(route, twice, secret), "FailedAuthentication")


def test_forbidden_key_transport_or_hmac_algorithm_is_refused(pki: Path, tmp_path: Path) -> None:
    """RSA PKCS#1 v1.5 key transport and HMAC-SHA1 only where the route lists them (encryption.key_transport,
    signature.algorithms): the controls list them."""
    strict = S.saml_route(pki, signature={"algorithms": ["rsa-sha256", "hmac-sha256"]})
    lax = S.saml_route(pki, signature={"algorithms": ["rsa-sha256", "hmac-sha256", "hmac-sha1"]},
                       encryption={"key_transport": ["rsa-oaep-mgf1p", "rsa-1_5"]})  # fmt: skip
    for r, verdict in ((strict, "UnsupportedAlgorithm"), (lax, None)):
        p = SamlPipeline(r, RouteStores())
        secret = os.urandom(32)
        for data in (made(r, hok(pki, secret, transport="rsa-1_5"), secret),
                     made(r, hok(pki, secret), secret, "hmac-sha1")):  # fmt: skip
            if verdict is None:
                assert accepted(p, data)["x-wsgate-subject"] == S.SUBJECT
            else:
                refused(p, data, verdict)


def _truncated(data: bytes, secret: bytes, bits: int) -> bytes:
    """The signature re-made as a lax verifier would take it: HMACOutputLength `bits` in its SignatureMethod and the
    HMAC over that SignedInfo cut to `bits` (CVE-2009-0217: an 8-bit MAC is found in 256 tries)."""
    root = etree.fromstring(data)
    sig = root.find(MESSAGE_SIGNATURE)  # not the issuer's, inside the assertion
    info = sig.find(f"{{{ns.DS}}}SignedInfo")
    method = info.find(f"{{{ns.DS}}}SignatureMethod")
    if bits:
        etree.SubElement(method, ns.q(ns.DS, "HMACOutputLength")).text = str(bits)
    prefixes = info.find(f"{{{ns.DS}}}CanonicalizationMethod/{{{ns.EXC_C14N}}}InclusiveNamespaces").get("PrefixList")
    canonical = etree.tostring(info, method="c14n", exclusive=True, inclusive_ns_prefixes=prefixes.split())
    mac = hmac.new(secret, canonical, hashlib.sha256).digest()
    sig.find(f"{{{ns.DS}}}SignatureValue").text = base64.b64encode(mac[: bits // 8 or None]).decode()
    return etree.tostring(root)


def test_hmac_output_length_truncation_is_refused(route: Route, pipeline: SamlPipeline, pki: Path,
                                                  tmp_path: Path) -> None:  # fmt: skip
    secret = os.urandom(32)
    # the control: the same re-making without truncation verifies (so the refusals are the truncation's doing)
    assert accepted(pipeline, _truncated(sent(route, pki, tmp_path, hok(pki, secret), secret), secret, 0))
    for bits in (8, 128):
        data = _truncated(sent(route, pki, tmp_path, hok(pki, secret), secret), secret, bits)
        assert "HMACOutputLength" in refused(pipeline, data, "InvalidSecurity").reason
    # a cut value without the parameter: one length is taken per algorithm
    data = sent(route, pki, tmp_path, hok(pki, secret), secret)
    root = etree.fromstring(data)
    value = root.find(f"{MESSAGE_SIGNATURE}/{{{ns.DS}}}SignatureValue")
    value.text = base64.b64encode(base64.b64decode(value.text)[:16]).decode()
    assert "SignatureValue of 16 bytes" in refused(pipeline, etree.tostring(root), "InvalidSecurity").reason


def test_one_time_use_symmetric_assertion_in_another_message_is_refused(route: Route, pipeline: SamlPipeline,
                                                                        pki: Path, tmp_path: Path) -> None:  # fmt: skip
    """OneTimeUse (1.1: DoNotCacheCondition): the holder itself, with a fresh message and the right key, may not use
    it twice; without the condition it serves every message of its validity."""
    for version in ("2.0", "1.1"):
        secret = os.urandom(32)
        once = hok(pki, secret, version, one_time_use=True)
        accepted(pipeline, sent(route, pki, tmp_path, once, secret))
        assert "replay" in refused(pipeline, sent(route, pki, tmp_path, once, secret), "FailedAuthentication").reason
        again = hok(pki, secret, version)
        accepted(pipeline, sent(route, pki, tmp_path, again, secret))
        accepted(pipeline, sent(route, pki, tmp_path, again, secret))


def test_symmetric_holder_of_key_opened_with_a_token_key(pki: Path, hsm: Path, tmp_path: Path) -> None:
    """The gateway's decryption key in a PKCS#11 token (SoftHSM2): the keys module's key opens the EncryptedKey."""
    options = S.saml_doc(pki, saml=HOK_ONLY)["saml"]
    route = make_route(pki, "saml", keys=lambda doc: with_token_keys(doc, hsm), saml=options)
    pipeline = SamlPipeline(route, RouteStores())
    secret = os.urandom(32)
    assert accepted(pipeline, sent(route, pki, tmp_path, hok(pki, secret), secret))["x-wsgate-subject"] == S.SUBJECT
    refused(pipeline, sent(route, pki, tmp_path, hok(pki, secret, to="client2"), secret), "FailedCheck")


def test_route_that_encrypts_replies_refuses_symmetric_holder_of_key_before_the_backend(pki: Path,
                                                                                        tmp_path: Path) -> None:  # fmt: skip
    """Its replies are encrypted to the requester's certificate, which a symmetric holder has not shown: refused
    before the backend acts on the request, never after (a server fault on the reply)."""
    route = S.saml_route(pki, encryption={"encrypt_response": True})
    pipeline = SamlPipeline(route, RouteStores())
    secret = os.urandom(32)
    assert "no X.509 signer" in refused(pipeline, sent(route, pki, tmp_path, hok(pki, secret), secret),
                                        "InvalidSecurity").reason  # fmt: skip
    x509_hok = S.sign(S.assertion_xml(pki, method="holder-of-key", holder="client"), pki)
    assert accepted(pipeline, S.client(route, pki, S.write(tmp_path, x509_hok)).secure(echo())[0])


# --------------------------------------------------------------------------------------------------------
# Through the running gateway


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path) -> LiveGateway:
    return module_gateway([S.saml_doc(pki, replay={"store": "auto"})])


def test_symmetric_holder_of_key_threats_refused_by_the_gateway(gw: LiveGateway, pki: Path, tmp_path: Path) -> None:
    """Through Envoy and a worker: an unopenable EncryptedKey and another HMAC key give the very same answer, a
    replayed OneTimeUse assertion is refused, and nothing reaches the backend but the honest message."""
    route = gw.route("saml")
    gw.clear()
    secret = os.urandom(32)
    once = hok(pki, secret, one_time_use=True)
    assert gw.post("saml", sent(route, pki, tmp_path, once, secret)).status_code == 200
    assert gw.received()[0]["headers"]["x-wsgate-subject"] == S.SUBJECT
    gw.clear()
    replayed = gw.post("saml", sent(route, pki, tmp_path, once, secret))
    assert replayed.status_code == 500 and fault_code(replayed) == "FailedAuthentication"
    answers = set()
    for proof in _unopenable(pki, secret).values():
        a = S.sign(S.assertion_xml(pki, method="holder-of-key", proof=proof), pki)
        answers.add(gw.post("saml", made(route, a, secret)).content)
    answers.add(gw.post("saml", made(route, hok(pki, secret), os.urandom(32))).content)
    assert len(answers) == 1 and b"FailedCheck" in answers.pop()
    assert gw.received() == []
