"""Encrypted signatures (WSS4J's encryptSignature, WS-SecurityPolicy's EncryptSignature) through the running gateway.

Requests are built by hand in WSS4J's layout with lxml, python-xmlsec and `cryptography` (not with our sending
side): Security = [Timestamp] [BinarySecurityToken] [EncryptedKey, its ReferenceList naming the Signature's and
the Body content's EncryptedData] [EncryptedData (Type Element): the ds:Signature]; the Body holds an
EncryptedData (Type Content). The gateway decrypts the Signature where it is and verifies it like a clear one;
the rule that decrypted content must be signed (CVE-2015-0227) still holds for everything but that Signature,
and every wrapping and oracle defence still applies."""

from __future__ import annotations

import base64
import copy
import os
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
import xmlsec
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from lxml import etree

from filters.engine import ns
from gateway.policy import Route
from gateway.tools.client import Client, ClientConfig, Pending, content_type
from tests.harness import clear, fault_code, received, running_gateway
from tests.test_interop import EXC_C14N, RSA_SHA256, SHA256, pem_base64, wss_time
from tests.wss_helpers import DEMO, route_doc

SECURITY = ns.q(ns.WSSE, "Security")
SIGNATURE = ns.q(ns.DS, "Signature")
TIMESTAMP = ns.q(ns.WSU, "Timestamp")
ED = ns.q(ns.XENC, "EncryptedData")
WSU_ID = ns.q(ns.WSU, "Id")
AES128_GCM = ns.XENC11 + "aes128-gcm"
RSA_OAEP = ns.XENC + "rsa-oaep-mgf1p"
BOTH_WAYS = {"require_request": True, "encrypt_response": True}


def _routes(pki: Path) -> list[dict[str, Any]]:
    return [
        route_doc(pki, "rsa", name="rsa-enc", encryption=BOTH_WAYS),
        route_doc(pki, "rsa", name="rsa-encsig", encryption={**BOTH_WAYS, "encrypt_signature": True}),
    ]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[Any]:
    with running_gateway(tmp_path_factory.mktemp("encsig-gw"), _routes(pki), pki) as g:
        yield g


def _el(parent: etree._Element, tag: str, attrib: dict[str, str] | None = None, **kw: Any) -> etree._Element:
    return etree.SubElement(parent, tag, attrib or {}, **kw)


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex.upper()}"


def _gcm(key: bytes, plaintext: bytes) -> str:
    iv = os.urandom(12)
    return base64.b64encode(iv + AESGCM(key).encrypt(iv, plaintext, None)).decode()


def _encrypted_data(ed_id: str, kind: str, ek_id: str, cipher_value: str) -> etree._Element:
    """WSS4J's EncryptedData: its KeyInfo names the EncryptedKey (wsse11:TokenType EncryptedKey)."""
    ed = etree.Element(ED, {"Id": ed_id, "Type": ns.XENC + kind}, nsmap={"xenc": ns.XENC})
    _el(ed, ns.q(ns.XENC, "EncryptionMethod"), {"Algorithm": AES128_GCM})
    key_info = _el(ed, ns.q(ns.DS, "KeyInfo"), nsmap={"ds": ns.DS})
    str_el = _el(key_info, ns.q(ns.WSSE, "SecurityTokenReference"), {ns.q(ns.WSSE11, "TokenType"): ns.ENCKEY_TOKEN},
                 nsmap={"wsse": ns.WSSE, "wsse11": ns.WSSE11})  # fmt: skip
    _el(str_el, ns.q(ns.WSSE, "Reference"), {"URI": f"#{ek_id}"})
    _el(_el(ed, ns.q(ns.XENC, "CipherData")), ns.q(ns.XENC, "CipherValue")).text = cipher_value
    return ed


Hook = Callable[[etree._Element, etree._Element], None]  # (envelope, signature) before encryption


def wss4j_encrypted_signature(
    pki: Path,
    text: str,
    version: str = "1.1",
    *,
    sign_body: bool = True,
    before_encrypt: Hook | None = None,
    signature_plaintext: Callable[[etree._Element], bytes] | None = None,
    signature_cipher: Callable[[bytes, bytes], str] | None = None,
) -> bytes:
    """A request as WSS4J's "Timestamp Signature Encrypt" with encryptSignature writes it (see the module
    docstring). Hooks for hostile variants: `sign_body` False signs the Timestamp only; `before_encrypt` edits
    the signed envelope; `signature_plaintext` is what the Signature's EncryptedData holds instead of the
    Signature; `signature_cipher(key, plaintext)` makes its CipherValue instead of AES-GCM under the key."""
    soap = ns.SOAP12 if version == "1.2" else ns.SOAP11
    bst_id, ts_id, body_id, ek_id = _uid("X509"), _uid("TS"), _uid("id"), _uid("EK")
    env = etree.Element(ns.q(soap, "Envelope"), nsmap={"soap": soap})
    header = _el(env, ns.q(soap, "Header"))
    security = _el(header, SECURITY, nsmap={"wsse": ns.WSSE, "wsu": ns.WSU})
    security.set(ns.q(soap, "mustUnderstand"), "true" if version == "1.2" else "1")
    now = datetime.now(UTC)
    ts = _el(security, TIMESTAMP, {WSU_ID: ts_id})
    _el(ts, ns.q(ns.WSU, "Created")).text = wss_time(now)
    _el(ts, ns.q(ns.WSU, "Expires")).text = wss_time(now + timedelta(minutes=5))
    bst = _el(security, ns.q(ns.WSSE, "BinarySecurityToken"),
              {"EncodingType": ns.BASE64, "ValueType": ns.X509V3, WSU_ID: bst_id})  # fmt: skip
    bst.text = pem_base64(pki / "client.pem")
    body = _el(env, ns.q(soap, "Body"), nsmap={"wsu": ns.WSU})
    body.set(WSU_ID, body_id)
    _el(_el(body, ns.q(DEMO, "echo"), nsmap={"d": DEMO}), ns.q(DEMO, "text")).text = text

    sig = _el(security, SIGNATURE, {"Id": _uid("SIG")}, nsmap={"ds": ns.DS})
    info = _el(sig, ns.q(ns.DS, "SignedInfo"))
    _el(info, ns.q(ns.DS, "CanonicalizationMethod"), {"Algorithm": EXC_C14N})
    _el(info, ns.q(ns.DS, "SignatureMethod"), {"Algorithm": RSA_SHA256})
    for ref_id in [ts_id, body_id] if sign_body else [ts_id]:
        ref = _el(info, ns.q(ns.DS, "Reference"), {"URI": f"#{ref_id}"})
        _el(_el(ref, ns.q(ns.DS, "Transforms")), ns.q(ns.DS, "Transform"), {"Algorithm": EXC_C14N})
        _el(ref, ns.q(ns.DS, "DigestMethod"), {"Algorithm": SHA256})
        _el(ref, ns.q(ns.DS, "DigestValue"))
    _el(sig, ns.q(ns.DS, "SignatureValue"))
    token_ref = _el(_el(sig, ns.q(ns.DS, "KeyInfo")), ns.q(ns.WSSE, "SecurityTokenReference"))
    _el(token_ref, ns.q(ns.WSSE, "Reference"), {"URI": f"#{bst_id}", "ValueType": ns.X509V3})
    ctx = xmlsec.SignatureContext()
    ctx.key = xmlsec.Key.from_file(str(pki / "client.key"), xmlsec.constants.KeyDataFormatPem)
    ctx.register_id(ts, "Id", ns.WSU)
    ctx.register_id(body, "Id", ns.WSU)
    ctx.sign(sig)
    if before_encrypt is not None:
        before_encrypt(env, sig)

    key = os.urandom(16)
    body = env.find(ns.q(soap, "Body"))
    content = b"".join(etree.tostring(c) for c in body)
    body_ed_id, sig_ed_id = _uid("ED"), _uid("ED")
    body[:] = [_encrypted_data(body_ed_id, "Content", ek_id, _gcm(key, content))]
    plain = signature_plaintext(sig) if signature_plaintext else etree.tostring(sig)
    cipher = signature_cipher(key, plain) if signature_cipher else _gcm(key, plain)
    sig_ed = _encrypted_data(sig_ed_id, "Element", ek_id, cipher)
    security.replace(sig, sig_ed)

    gateway_enc = x509.load_pem_x509_certificate((pki / "gateway-enc.pem").read_bytes())
    ek = etree.Element(ns.q(ns.XENC, "EncryptedKey"), {"Id": ek_id}, nsmap={"xenc": ns.XENC, "ds": ns.DS})
    _el(ek, ns.q(ns.XENC, "EncryptionMethod"), {"Algorithm": RSA_OAEP})
    issuer_serial = _el(_el(_el(_el(ek, ns.q(ns.DS, "KeyInfo")), ns.q(ns.WSSE, "SecurityTokenReference")),
                            ns.q(ns.DS, "X509Data")), ns.q(ns.DS, "X509IssuerSerial"))  # fmt: skip
    _el(issuer_serial, ns.q(ns.DS, "X509IssuerName")).text = gateway_enc.issuer.rfc4514_string()
    _el(issuer_serial, ns.q(ns.DS, "X509SerialNumber")).text = str(gateway_enc.serial_number)
    oaep = padding.OAEP(mgf=padding.MGF1(hashes.SHA1()), algorithm=hashes.SHA1(), label=None)
    wrapped = gateway_enc.public_key().encrypt(key, oaep)  # type: ignore[union-attr]
    _el(_el(ek, ns.q(ns.XENC, "CipherData")), ns.q(ns.XENC, "CipherValue")).text = base64.b64encode(wrapped).decode()
    reflist = _el(ek, ns.q(ns.XENC, "ReferenceList"))
    for ed_id in (sig_ed_id, body_ed_id):
        _el(reflist, ns.q(ns.XENC, "DataReference"), {"URI": f"#{ed_id}"})
    security.insert(security.index(sig_ed), ek)
    return etree.tostring(env)


def post(gw: Any, route: str, body: bytes, version: str = "1.1") -> requests.Response:
    return requests.post(f"http://127.0.0.1:{gw.opts.http_port}/{route}/demo", data=body,
                         headers={"content-type": content_type(version)}, timeout=10)  # fmt: skip


def client_of(gw: Any, pki: Path, name: str) -> Client:
    doc = next(r for r in _routes(pki) if r["name"] == name)
    return Client(Route.model_validate({**doc, "upstream": {"address": gw.backend_addr}}), ClientConfig(certs=pki))


def refused(
    gw: Any, body: bytes, code: str | None = None, reason: str | None = None, route: str = "rsa-enc"
) -> requests.Response:
    """Posts `body`, which must be refused with `code` before the backend, the log saying `reason`."""
    clear(gw)
    seen = len(_refusals(gw))
    r = post(gw, route, body)
    assert r.status_code == 500, r.text
    if code is not None:
        assert fault_code(r) == code, r.text
    assert received(gw) == []  # nothing reached the backend
    if reason is not None:
        for _ in range(50):  # the worker logs as it answers
            if len(logged := _refusals(gw)) > seen:
                break
            time.sleep(0.02)
        assert reason in logged[-1], logged[seen:]
    return r


def _refusals(gw: Any) -> list[str]:
    return [line for f in sorted(gw.logs.glob("filter-*.log")) for line in f.read_text().splitlines()
            if " refused " in line]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Accepted


def test_the_builder_writes_wss4js_encrypted_signature_layout(pki: Path) -> None:
    root = etree.fromstring(wss4j_encrypted_signature(pki, "layout"))
    security = root.find(f".//{SECURITY}")
    assert [etree.QName(c).localname for c in security] == [
        "Timestamp", "BinarySecurityToken", "EncryptedKey", "EncryptedData"]  # fmt: skip
    assert security[3].get("Type") == ns.XENC + "Element"
    listed = [d.get("URI") for d in security[2].iter(ns.q(ns.XENC, "DataReference"))]
    body_ed = root.find(f"{{{ns.SOAP11}}}Body/{ED}")
    assert listed == [f"#{security[3].get('Id')}", f"#{body_ed.get('Id')}"]
    assert root.find(f".//{SIGNATURE}") is None and b"layout" not in etree.tostring(root)


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize("route", ["rsa-enc", "rsa-encsig"])
def test_a_request_whose_signature_is_encrypted_is_decrypted_verified_and_forwarded(
    gw: Any, pki: Path, version: str, route: str
) -> None:
    """Refused before ("decrypted content not covered by the signature"). On rsa-encsig the reply's own Signature
    comes encrypted too, and the client (the engine's receiving side) verifies it."""
    clear(gw)
    r = post(gw, route, wss4j_encrypted_signature(pki, "sealed and signed", version), version)
    assert r.status_code == 200, r.text
    got = received(gw)
    assert len(got) == 1 and "sealed and signed" in got[0]["body"] and "Security" not in got[0]["body"]
    security = etree.fromstring(r.content).find(f".//{SECURITY}")
    reply_signature_encrypted = security.find(SIGNATURE) is None and security[-1].tag == ED
    assert reply_signature_encrypted == (route == "rsa-encsig")
    opened = client_of(gw, pki, route).open(r.content, Pending(soap_version=version))
    assert opened.body.findtext(f".//{{{DEMO}}}text") == "sealed and signed"


# ---------------------------------------------------------------------------------------------------------
# Hostile variants


def _second_timestamp(sig: etree._Element) -> bytes:
    ts = sig.getparent().find(TIMESTAMP)
    clone = copy.deepcopy(ts)
    clone.set(WSU_ID, _uid("TS"))
    return etree.tostring(clone)


ELSE_THAN_ONE_SIGNATURE = {
    "a-second-timestamp": _second_timestamp,
    "two-signatures": lambda sig: etree.tostring(sig) + etree.tostring(sig),
    "a-foreign-element": lambda sig: b'<x:Evil xmlns:x="urn:evil">1</x:Evil>',
    "text-only": lambda sig: b"just text",
}
ELSE_REASONS = {
    "a-second-timestamp": "more than one wsu:Timestamp",
    "two-signatures": "not one element",
    "a-foreign-element": "unsupported security header element",
    "text-only": "not one element",
}


@pytest.mark.parametrize("variant", list(ELSE_THAN_ONE_SIGNATURE))
def test_an_encrypted_signature_that_decrypts_to_anything_but_one_signature_is_refused(
    gw: Any, pki: Path, variant: str
) -> None:
    refused(
        gw,
        wss4j_encrypted_signature(pki, "x", signature_plaintext=ELSE_THAN_ONE_SIGNATURE[variant]),
        reason=ELSE_REASONS[variant],
    )


def test_a_clear_signature_next_to_an_encrypted_one_is_refused(gw: Any, pki: Path) -> None:
    """Two signatures, one encrypted and one readable after it (a copy without ids): the encrypted one verifies,
    and still the message has two. One Signature per message."""

    def clear_copy(env: etree._Element, sig: etree._Element) -> None:
        twin = copy.deepcopy(sig)
        for el in twin.iter():
            for attr in ("Id", WSU_ID):
                el.attrib.pop(attr, None)
        sig.addnext(twin)

    refused(
        gw,
        wss4j_encrypted_signature(pki, "x", before_encrypt=clear_copy),
        "InvalidSecurity",
        "more than one ds:Signature",
    )


def test_an_encrypted_signature_that_does_not_cover_the_body_is_refused(gw: Any, pki: Path) -> None:
    """Decrypted, verified, and signing only the Timestamp: the Body (decrypted too) is nobody's."""
    refused(gw, wss4j_encrypted_signature(pki, "x", sign_body=False), "InvalidSecurity", "soap:Body is not signed")


def test_an_encrypted_signature_over_a_wrapped_body_is_refused(gw: Any, pki: Path) -> None:
    """The signed Body moved into a header block, a new Body with other content: refused (a second soap:Body
    anywhere fails the envelope's structure check before any signature is looked at)."""

    def wrap(env: etree._Element, sig: etree._Element) -> None:
        body = env[1]
        _el(env[0], "{urn:evil}Wrapper").append(body)
        new_body = _el(env, body.tag)
        _el(_el(new_body, ns.q(DEMO, "echo"), nsmap={"d": DEMO}), ns.q(DEMO, "text")).text = "transfer everything"

    refused(
        gw, wss4j_encrypted_signature(pki, "x", before_encrypt=wrap), reason="a Body element appears below the envelope"
    )


def test_an_encrypted_signature_over_a_wrapped_timestamp_is_refused(gw: Any, pki: Path) -> None:
    """The signed Timestamp moved into a header block and a fresh one put in its place: a decrypted Signature's
    references go through the same placement checks as a clear one's."""

    def wrap(env: etree._Element, sig: etree._Element) -> None:
        security = sig.getparent()
        signed = security.find(TIMESTAMP)
        fresh = copy.deepcopy(signed)
        fresh.set(WSU_ID, _uid("TS"))
        security.replace(signed, fresh)
        _el(env[0], "{urn:evil}Wrapper").append(signed)

    r = refused(
        gw,
        wss4j_encrypted_signature(pki, "x", before_encrypt=wrap),
        "InvalidSecurity",
        "is not where a signed part may be",
    )
    assert b"not where a signed part may be" not in r.content  # the reason goes to the log, not the client


def test_a_tampered_encrypted_signature_fails_the_check(gw: Any, pki: Path) -> None:
    def tamper(env: etree._Element, sig: etree._Element) -> None:
        value = sig.find(ns.q(ns.DS, "SignatureValue"))
        raw = bytearray(base64.b64decode(value.text))
        raw[0] ^= 1
        value.text = base64.b64encode(bytes(raw)).decode()

    refused(gw, wss4j_encrypted_signature(pki, "x", before_encrypt=tamper), "FailedCheck", "does not verify")


def _flip_tag(key: bytes, plaintext: bytes) -> str:
    raw = bytearray(base64.b64decode(_gcm(key, plaintext)))
    raw[-1] ^= 1
    return base64.b64encode(bytes(raw)).decode()


ORACLE = {
    "bad-tag": _flip_tag,
    "other-key": lambda key, plaintext: _gcm(os.urandom(16), plaintext),
    "not-xml": lambda key, plaintext: _gcm(key, b"<ds:Signature xmlns:ds='" + ns.DS.encode() + b"'><unclosed>"),
    "truncated": lambda key, plaintext: base64.b64encode(os.urandom(20)).decode(),
}


def test_every_way_the_signature_fails_to_decrypt_looks_the_same(gw: Any, pki: Path) -> None:
    """Padding/tag/parse oracles (Jager and Somorovsky): one fault, word for word, whatever went wrong."""
    answers = set()
    for cipher in ORACLE.values():
        r = refused(gw, wss4j_encrypted_signature(pki, "x", signature_cipher=cipher), "FailedCheck")
        answers.add(r.content)
    assert len(answers) == 1, answers


def test_encrypt_signature_needs_the_reply_body_encrypted(pki: Path) -> None:
    """The Signature is encrypted with the Body, under the same key: alone it would name nothing to encrypt with."""
    doc = {**route_doc(pki, "rsa", encryption={"encrypt_signature": True}), "upstream": {"address": "127.0.0.1:1"}}
    with pytest.raises(ValueError, match="encrypt_signature needs encrypt_response"):
        Route.model_validate(doc)
