"""filters.engine.wss.signature: verification (secure validation, signature wrapping), signing, and interop with
xmlsec1 and signxml. Real keys from the session PKI, real crypto, no mocks."""

from __future__ import annotations

import base64
import datetime as dt
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import xmlsec
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from lxml import etree

from certs import pki as pki_mod
from filters.engine import faults, ns
from filters.engine.wss import keys, signature, signing
from filters.engine.xml import threat_protection
from filters.engine.xml.soap import Envelope
from gateway.policy import Limits, SignaturePolicy

LIMITS = Limits()
POLICY = SignaturePolicy()
SOAP = ns.SOAP11
SEC = ns.q(ns.WSSE, "Security")
SIG = ns.q(ns.DS, "Signature")
TS = ns.q(ns.WSU, "Timestamp")
WSU_ID = ns.q(ns.WSU, "Id")
ATTACK = "urn:attacker"
ORDER = '<m:Order xmlns:m="urn:shop"><m:Item>book</m:Item><m:Amount>10</m:Amount></m:Order>'
EVIL = '<m:Order xmlns:m="urn:shop"><m:Item>yacht</m:Item><m:Amount>9999999</m:Amount></m:Order>'
MD5 = "http://www.w3.org/2001/04/xmldsig-more#md5"

needs_xmlsec1 = pytest.mark.skipif(shutil.which("xmlsec1") is None, reason="xmlsec1 is not installed")


def refused(code: str) -> pytest.RaisesExc[faults.Fault]:
    return pytest.raises(faults.Fault, check=lambda f: f.code == code)


def ds(local: str) -> str:
    return ns.q(ns.DS, local)


# --- building messages ---------------------------------------------------------------------------------


def envelope(headers: str = "", body: str = ORDER, soap: str = SOAP) -> Envelope:
    xml = (
        f'<soap:Envelope xmlns:soap="{soap}"><soap:Header>{headers}'
        f'<wsse:Security xmlns:wsse="{ns.WSSE}" xmlns:wsu="{ns.WSU}" soap:mustUnderstand="1">'
        '<wsu:Timestamp wsu:Id="TS-1"><wsu:Created>2030-01-01T00:00:00.000Z</wsu:Created>'
        "<wsu:Expires>2030-01-01T00:05:00.000Z</wsu:Expires></wsu:Timestamp>"
        f"</wsse:Security></soap:Header><soap:Body>{body}</soap:Body></soap:Envelope>"
    )
    return threat_protection.parse_envelope(xml.encode(), LIMITS)


def security(env: Envelope) -> etree._Element:
    assert env.header is not None
    sec = env.header.find(SEC)
    assert sec is not None
    return sec


def timestamp(env: Envelope) -> etree._Element:
    ts = security(env).find(TS)
    assert ts is not None
    return ts


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def key_info_for(form: str, cert: x509.Certificate, env: Envelope) -> etree._Element:
    if form == "bst":
        security(env).insert(0, keys.make_bst(cert, "X509-1"))
        return keys.str_reference("X509-1", ns.X509V3)
    if form == "ski":
        return keys.str_key_identifier(ns.X509_SKI, b64(keys.ski(cert)))
    if form == "thumbprint":
        return keys.str_key_identifier(ns.THUMBPRINT_SHA1, b64(keys.thumbprint_sha1(cert)))
    assert form == "issuer_serial"
    return keys.str_issuer_serial(cert)


class Pki:
    """The session PKI, loaded."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.client_key = keys.load_private_key(folder / "client.key")
        self.client = keys.load_certificate(folder / "client.pem")
        self.client2 = keys.load_certificate(folder / "client2.pem")
        self.rogue_key = keys.load_private_key(folder / "rogue.key")
        self.rogue = keys.load_certificate(folder / "rogue.pem")
        self.hmac = keys.load_hmac_keys(folder / "hmac-keys.yaml")
        self.trust = keys.TrustStore(keys.load_certificates([folder / "ca.pem"]))

    def signed(
        self,
        *,
        form: str = "bst",
        parts: Callable[[Envelope], list[etree._Element]] = lambda env: [env.body, timestamp(env)],
        algorithm: str = "rsa-sha256",
        digest: str = "sha256",
        env: Envelope | None = None,
        rogue: bool = False,
    ) -> bytes:
        env = env or envelope()
        if algorithm.startswith("hmac"):
            key: signing.PrivateKey = self.hmac["demo-client"]
            child = keys.key_name("demo-client")
        else:
            key = self.rogue_key if rogue else self.client_key
            child = key_info_for(form, self.rogue if rogue else self.client, env)
        signing.sign(env, security(env), parts(env), key, algorithm, digest, child)
        return env.serialize()

    def resolve(self, env: Envelope, sig: etree._Element) -> x509.Certificate | bytes:
        """What a receiver does: find the key the KeyInfo names (never trusting it yet)."""
        ki = sig.find(ds("KeyInfo"))
        assert ki is not None
        ref = keys.parse_key_info(ki)
        if ref.kind == "key_name":
            return self.hmac[ref.value]
        if ref.kind == "reference":
            return keys.parse_bst(signature.id_index(env.root)[ref.value])
        return next(c for c in (self.client, self.client2, self.rogue) if keys.matches(ref, c))


@pytest.fixture(scope="module")
def p(pki: Path) -> Pki:
    return Pki(pki)


def the_signature(env: Envelope) -> etree._Element:
    return next(env.root.iter(SIG))


def receive(
    p: Pki, data: bytes, policy: SignaturePolicy = POLICY, key: x509.Certificate | bytes | None = None
) -> tuple[Envelope, signature.VerifiedSignature]:
    env = threat_protection.parse_envelope(data, LIMITS)
    sig = the_signature(env)
    return env, signature.verify(sig, env, key if key is not None else p.resolve(env, sig), policy)


def raw(data: bytes) -> Envelope:
    """An envelope without threat protection: shows verify() holds on its own."""
    root = etree.fromstring(data, etree.XMLParser(resolve_entities=False))
    return Envelope(root=root, version="1.1" if root.tag == ns.q(SOAP, "Envelope") else "1.2")


def tamper(data: bytes, change: Callable[[etree._Element], None]) -> Envelope:
    root = etree.fromstring(data)
    change(root)
    return raw(etree.tostring(root))


def verify_raw(p: Pki, env: Envelope, policy: SignaturePolicy = POLICY) -> signature.VerifiedSignature:
    return signature.verify(the_signature(env), env, p.client, policy)


def soap(root: etree._Element, local: str) -> etree._Element:
    el = root.find(ns.q(SOAP, local))
    assert el is not None
    return el


# --- happy paths ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["bst", "ski", "issuer_serial", "thumbprint"])
def test_rsa_round_trip(p: Pki, form: str) -> None:
    env, verified = receive(p, p.signed(form=form))
    assert verified.algorithm == "rsa-sha256"
    assert len(verified.elements) == 2
    assert verified.elements[0] is env.body and verified.elements[1] is timestamp(env)
    assert verified.covers(env.body) and verified.covers(timestamp(env))
    value = the_signature(env).findtext(f"{ds('SignatureValue')}")
    assert verified.signature_value == base64.b64decode("".join((value or "").split()))
    assert len(verified.signature_value) == 256
    assert p.trust.validate(p.client, [], dt.datetime.now(dt.UTC)) == "CN=Demo Client,O=WSGate Demo"


def test_hmac_sha256_with_key_name(p: Pki) -> None:
    env, verified = receive(p, p.signed(algorithm="hmac-sha256"))
    assert verified.algorithm == "hmac-sha256" and verified.covers(env.body)


def test_soap12(p: Pki) -> None:
    env, verified = receive(p, p.signed(env=envelope(soap=ns.SOAP12)))
    assert env.version == "1.2" and verified.covers(env.body)


def test_signed_shape_is_wss4j_like(p: Pki) -> None:
    env = threat_protection.parse_envelope(p.signed(), LIMITS)
    sig = the_signature(env)
    assert sig.getparent() is security(env) and sig.get("Id")
    c14n = sig.find(f"{ds('SignedInfo')}/{ds('CanonicalizationMethod')}")
    assert c14n is not None and c14n.get("Algorithm") == ns.EXC_C14N
    inc = c14n.find(ns.q(ns.EXC_C14N, "InclusiveNamespaces"))
    assert inc is not None and inc.prefix == "ec" and inc.get("PrefixList") == "soap"
    refs = sig.findall(f"{ds('SignedInfo')}/{ds('Reference')}")
    body_id = env.body.get(WSU_ID)
    assert body_id and [r.get("URI") for r in refs] == [f"#{body_id}", "#TS-1"]
    lists = [r.find(f"{ds('Transforms')}/{ds('Transform')}/{{{ns.EXC_C14N}}}InclusiveNamespaces") for r in refs]
    assert [el.get("PrefixList") for el in lists if el is not None] == ["", "soap wsse"]
    # The Body gets wsu:Id with the wsu prefix declared on it, as WSS4J does.
    assert env.body.nsmap.get("wsu") == ns.WSU
    str_el = sig.find(f"{ds('KeyInfo')}/{{{ns.WSSE}}}SecurityTokenReference/{{{ns.WSSE}}}Reference")
    assert str_el is not None and str_el.get("URI") == "#X509-1" and str_el.get("ValueType") == ns.X509V3


def test_encrypted_data_gets_plain_id_and_may_be_signed(p: Pki) -> None:
    enc = f'<xenc:EncryptedData xmlns:xenc="{ns.XENC}" Type="{ns.XENC}Content"><xenc:CipherData>'
    enc += "<xenc:CipherValue>AAAA</xenc:CipherValue></xenc:CipherData></xenc:EncryptedData>"
    env = envelope(body=enc)
    data = p.signed(env=env, parts=lambda e: [e.body, e.body[0]])
    env2, verified = receive(p, data)
    assert env2.body[0].get("Id") and env2.body[0].get(WSU_ID) is None
    assert verified.covers(env2.body[0])
    # The same EncryptedData nested one level deeper is not a place a signed part may be.
    env3 = tamper(data, lambda r: _wrap(soap(r, "Body")[0], ns.q(ATTACK, "Box")))
    with refused("InvalidSecurity"):
        verify_raw(p, env3)


def test_existing_ids_kept_and_fresh_ids_unique(p: Pki) -> None:
    env = envelope(headers=f'<h:A xmlns:h="urn:h" Id="id-1"/><h:B xmlns:h="urn:h" xmlns:wsu="{ns.WSU}" wsu:Id="id-2"/>')
    header = env.header
    assert header is not None
    data = p.signed(env=env, parts=lambda e: [e.body, header[0], header[1]])
    _, verified = receive(p, data)
    ids = [e.get(WSU_ID) or e.get("Id") for e in verified.elements]
    assert ids[1:] == ["id-1", "id-2"] and ids[0] not in ("id-1", "id-2")


def test_signer_reused(p: Pki) -> None:
    signer = signing.Signer(p.client_key, "rsa-sha256", "sha256")
    for _ in range(3):
        env = envelope()
        signer.sign(env, security(env), [env.body], keys.str_issuer_serial(p.client), id_prefix="gw")
        _, verified = receive(p, env.serialize())
        assert verified.covers(verified.elements[0]) and verified.elements[0].get(WSU_ID) == "gw-1"


def test_signer_refuses_mismatched_key(p: Pki) -> None:
    with pytest.raises(ValueError):
        signing.Signer(p.client_key, "hmac-sha256", "sha256")
    with pytest.raises(ValueError):
        signing.Signer(b"k" * 32, "rsa-sha256", "sha256")
    with pytest.raises(ValueError):
        signing.Signer(p.client_key, "rsa-md5", "sha256")


# --- cryptographic failures ----------------------------------------------------------------------------


def test_tampered_body_fails_check(p: Pki) -> None:
    data = p.signed().replace(b"<m:Amount>10<", b"<m:Amount>99<")
    with refused("FailedCheck"):
        receive(p, data)


def test_tampered_timestamp_fails_check(p: Pki) -> None:
    data = p.signed().replace(b"2030-01-01T00:05:00.000Z", b"2031-01-01T00:05:00.000Z")
    with refused("FailedCheck"):
        receive(p, data)


def test_wrong_key_fails_check(p: Pki) -> None:
    with refused("FailedCheck"):
        receive(p, p.signed(), key=p.client2)
    with refused("FailedCheck"):
        receive(p, p.signed(algorithm="hmac-sha256"), key=b"another secret, 32 bytes long..")


def test_rogue_certificate_verifies_but_is_not_trusted(p: Pki) -> None:
    # The signature is sound; what makes it worthless is who vouches for the key.
    _, verified = receive(p, p.signed(rogue=True))
    assert verified.algorithm == "rsa-sha256"
    with refused("FailedAuthentication"):
        p.trust.validate(p.rogue, [], dt.datetime.now(dt.UTC))


def test_expired_certificate_verifies_but_is_not_trusted(p: Pki) -> None:
    ca = pki_mod.Issued(keys.load_private_key(p.folder / "ca.key"), keys.load_certificate(p.folder / "ca.pem"))
    now = dt.datetime.now(dt.UTC)
    expired = pki_mod.issue(ca, "Demo Client", client_auth=True, not_before=now - dt.timedelta(days=3), days=1)
    env = envelope()
    security(env).insert(0, keys.make_bst(expired.cert, "X509-1"))
    signing.sign(
        env, security(env), [env.body], expired.key, "rsa-sha256", "sha256", keys.str_reference("X509-1", ns.X509V3)
    )
    _, verified = receive(p, env.serialize())
    assert verified.elements
    with refused("FailedAuthentication"):
        p.trust.validate(expired.cert, [], now)


def test_short_hmac_key_refused(p: Pki) -> None:
    env = envelope()
    signing.sign(env, security(env), [env.body], b"short", "hmac-sha256", "sha256", keys.key_name("weak"))
    with refused("InvalidSecurity"):
        receive(p, env.serialize(), key=b"short")


def test_key_decides_the_algorithm_family(p: Pki) -> None:
    # HMAC keyed with the (public) certificate: the classic key confusion.
    der = p.client.public_bytes(serialization.Encoding.DER)
    env = envelope()
    signing.sign(env, security(env), [env.body], der, "hmac-sha256", "sha256", keys.str_issuer_serial(p.client))
    with refused("UnsupportedAlgorithm"):
        receive(p, env.serialize())
    with refused("UnsupportedAlgorithm"):
        receive(p, p.signed(), key=p.hmac["demo-client"])


# --- algorithms and secure validation ------------------------------------------------------------------


def test_sha1_only_when_allowed(p: Pki) -> None:
    data = p.signed(algorithm="rsa-sha1", digest="sha1")
    with refused("UnsupportedAlgorithm"):
        receive(p, data)
    with refused("UnsupportedAlgorithm"):  # signature method allowed, digest still not
        receive(p, data, SignaturePolicy(algorithms=["rsa-sha1"]))
    _, verified = receive(p, data, SignaturePolicy(algorithms=["rsa-sha1"], digests=["sha1"]))
    assert verified.algorithm == "rsa-sha1"
    hmac_sha1 = p.signed(algorithm="hmac-sha1")
    with refused("UnsupportedAlgorithm"):
        receive(p, hmac_sha1)
    assert receive(p, hmac_sha1, SignaturePolicy(algorithms=["hmac-sha1"]))[1].algorithm == "hmac-sha1"


def _set_attr(path: str, value: str, attr: str = "Algorithm") -> Callable[[etree._Element], None]:
    def change(root: etree._Element) -> None:
        el = root.find(path, ns.ALL)
        assert el is not None, path
        el.set(attr, value)

    return change


SI = ".//ds:Signature/ds:SignedInfo"


@pytest.mark.parametrize(
    ("path", "value", "code"),
    [
        (f"{SI}/ds:Reference/ds:DigestMethod", MD5, "UnsupportedAlgorithm"),
        (f"{SI}/ds:SignatureMethod", "http://www.w3.org/2001/04/xmldsig-more#rsa-md5", "UnsupportedAlgorithm"),
        (f"{SI}/ds:SignatureMethod", "http://www.w3.org/2001/04/xmldsig-more#rsa-sha512", "UnsupportedAlgorithm"),
        (
            f"{SI}/ds:CanonicalizationMethod",
            "http://www.w3.org/2001/10/xml-exc-c14n#WithComments",
            "UnsupportedAlgorithm",
        ),
        (f"{SI}/ds:CanonicalizationMethod", "http://www.w3.org/2006/12/xml-c14n11", "UnsupportedAlgorithm"),
        (
            f"{SI}/ds:Reference/ds:Transforms/ds:Transform",
            "http://www.w3.org/TR/1999/REC-xslt-19991116",
            "UnsupportedAlgorithm",
        ),
        (
            f"{SI}/ds:Reference/ds:Transforms/ds:Transform",
            "http://www.w3.org/2002/06/xmldsig-filter2",
            "UnsupportedAlgorithm",
        ),
    ],
)
def test_algorithm_refusals(p: Pki, path: str, value: str, code: str) -> None:
    # MD5 stays refused even with every other weak option switched on.
    lax = SignaturePolicy(algorithms=["rsa-sha256", "rsa-sha1"], digests=["sha256", "sha1"])
    env = tamper(p.signed(), _set_attr(path, value))
    with refused(code):
        verify_raw(p, env, lax)


def test_xpath_transform_refused(p: Pki) -> None:
    def change(root: etree._Element) -> None:
        transform = root.find(f"{SI}/ds:Reference/ds:Transforms/ds:Transform", ns.ALL)
        assert transform is not None
        transform.clear()  # drop the InclusiveNamespaces; an XPath transform carries ds:XPath instead
        transform.set("Algorithm", "http://www.w3.org/TR/1999/REC-xpath-19991116")
        etree.SubElement(transform, ds("XPath")).text = "ancestor-or-self::m:Item"

    with refused("UnsupportedAlgorithm"):
        verify_raw(p, tamper(p.signed(), change))


def test_hmac_output_length_refused(p: Pki) -> None:
    # CVE-2009-0217: a truncated HMAC is refused whatever its length, before any crypto.
    for bits in ("0", "160", "256"):
        env = tamper(
            p.signed(algorithm="hmac-sha256"),
            lambda r, bits=bits: _sub(r, f"{SI}/ds:SignatureMethod", ds("HMACOutputLength"), bits),
        )
        with refused("InvalidSecurity"):
            signature.verify(the_signature(env), env, p.hmac["demo-client"], POLICY)


def _sub(root: etree._Element, path: str, tag: str, text: str | None = None) -> etree._Element:
    parent = root.find(path, ns.ALL)
    assert parent is not None, path
    el = etree.SubElement(parent, tag)
    el.text = text
    return el


def test_thirty_references_allowed_thirty_one_refused(p: Pki) -> None:
    def blocks(n: int) -> Envelope:
        return envelope(headers="".join(f'<h:Item{i} xmlns:h="urn:h">{i}</h:Item{i}>' for i in range(n)))

    def header_blocks(env: Envelope) -> list[etree._Element]:
        assert env.header is not None
        return [env.body, *[el for el in env.header if el.tag != SEC]]

    _, verified = receive(p, p.signed(env=blocks(29), parts=header_blocks))
    assert len(verified.elements) == 30
    with refused("InvalidSecurity"):
        receive(p, p.signed(env=blocks(30), parts=header_blocks))


def test_more_than_five_transforms_refused(p: Pki) -> None:
    def change(root: etree._Element) -> None:
        for _ in range(5):
            _sub(root, f"{SI}/ds:Reference/ds:Transforms", ds("Transform")).set("Algorithm", ns.EXC_C14N)

    with refused("InvalidSecurity"):
        verify_raw(p, tamper(p.signed(), change))


@pytest.mark.parametrize(
    "uri",
    [
        "",
        "#",
        "#xpointer(/)",
        "#xpointer(id('TS-1'))",
        "http://example.org/order.xml",
        "cid:part1",
        "file:///etc/passwd",
        "#a b",
    ],
)
def test_reference_uri_must_be_local_id(p: Pki, uri: str) -> None:
    with refused("InvalidSecurity"):
        verify_raw(p, tamper(p.signed(), _set_attr(f"{SI}/ds:Reference", uri, "URI")))


def test_reference_without_uri_refused(p: Pki) -> None:
    def change(root: etree._Element) -> None:
        ref = root.find(f"{SI}/ds:Reference", ns.ALL)
        assert ref is not None
        del ref.attrib["URI"]

    with refused("InvalidSecurity"):
        verify_raw(p, tamper(p.signed(), change))


@pytest.mark.parametrize(
    ("path", "tag"),
    [(".//ds:Signature", ds("Object")), (".//ds:Signature/ds:KeyInfo", ds("RetrievalMethod")), (SI, ds("Manifest"))],
)
def test_object_manifest_retrieval_method_refused(p: Pki, path: str, tag: str) -> None:
    def change(root: etree._Element) -> None:
        _sub(root, path, tag)

    with refused("InvalidSecurity"):
        verify_raw(p, tamper(p.signed(), change))


def test_same_element_twice_and_dangling_reference_refused(p: Pki) -> None:
    with refused("InvalidSecurity"):
        verify_raw(p, tamper(p.signed(), _set_attr(f"{SI}/ds:Reference[1]", "#TS-1", "URI")))
    env = tamper(p.signed(), _set_attr(f"{SI}/ds:Reference[2]", "#nowhere", "URI"))
    with refused("InvalidSecurity"):
        verify_raw(p, env)


def test_signature_value_must_be_base64(p: Pki) -> None:
    def change(root: etree._Element) -> None:
        value = root.find(".//ds:SignatureValue", ns.ALL)
        assert value is not None
        value.text = "%%%"

    with refused("InvalidSecurity"):
        verify_raw(p, tamper(p.signed(), change))


def _value_split(tag: str, node: Callable[[], etree._Element]) -> Callable[[etree._Element], None]:
    """Split the first `tag` value after 8 characters (each piece valid base64) with `node`."""

    def change(root: etree._Element) -> None:
        value = root.find(f".//ds:{tag}", ns.ALL)
        assert value is not None and value.text
        head, tail = value.text[:8], value.text[8:]
        value.text = head
        split = node()
        split.tail = tail
        value.append(split)

    return change


@pytest.mark.parametrize("tag", ["SignatureValue", "DigestValue"])
@pytest.mark.parametrize("node", [lambda: etree.Comment(""), lambda: etree.Element("x")], ids=["comment", "element"])
@pytest.mark.parametrize("algorithm", ["rsa-sha256", "hmac-sha256"])
def test_split_value_is_refused_not_read_in_part(p: Pki, tag: str, node: Callable, algorithm: str) -> None:
    # xmlsec reads all of a value's text, a naive reader only the first node: verify() reads neither, it refuses
    # (wssecurity.process removes comments before, so a comment-split value is read whole there).
    env = tamper(p.signed(algorithm=algorithm), _value_split(tag, node))
    with refused("InvalidSecurity"):
        signature.verify(the_signature(env), env, p.resolve(env, the_signature(env)), POLICY)


def _signature_value(data: bytes, change: Callable[[bytes], bytes]) -> Envelope:
    def edit(root: etree._Element) -> None:
        value = root.find(".//ds:SignatureValue", ns.ALL)
        assert value is not None
        value.text = base64.b64encode(change(base64.b64decode(value.text or ""))).decode()

    return tamper(data, edit)


@pytest.mark.parametrize(
    ("algorithm", "change"),
    [
        ("rsa-sha256", lambda v: b"\0" + v),  # a longer spelling of the same RSA integer
        ("rsa-sha256", lambda v: v[1:]),
        ("hmac-sha256", lambda v: v[:16]),  # a truncated MAC (CVE-2009-0217's shape, without HMACOutputLength)
        ("hmac-sha256", lambda v: v + b"\0"),
    ],
    ids=["rsa-leading-zero", "rsa-short", "hmac-truncated", "hmac-long"],
)
def test_signature_value_has_exactly_one_accepted_length(p: Pki, algorithm: str, change: Callable) -> None:
    # The replay store remembers the decoded value: no other spelling of one signature may pass as new.
    env = _signature_value(p.signed(algorithm=algorithm), change)
    with refused("InvalidSecurity"):
        signature.verify(the_signature(env), env, p.resolve(env, the_signature(env)), POLICY)


def test_digest_value_of_the_wrong_length_is_refused(p: Pki) -> None:
    def change(root: etree._Element) -> None:
        value = root.find(".//ds:DigestValue", ns.ALL)
        assert value is not None
        value.text = base64.b64encode(base64.b64decode(value.text or "")[:20]).decode()

    with refused("InvalidSecurity"):
        verify_raw(p, tamper(p.signed(), change))


@pytest.mark.parametrize(
    ("separator", "accepted"), [("\r\n ", True), ("\t", True), ("\u00a0", False), ("\u2028", False)]
)
def test_signature_value_is_decoded_once_whatever_its_line_breaks(p: Pki, separator: str, accepted: bool) -> None:
    # XML whitespace is no part of a base64 value (the same bytes, the same replay key); any other character
    # outside the alphabet is refused, not skipped.
    data = p.signed()
    original = receive(p, data)[1].signature_value

    def change(root: etree._Element) -> None:
        value = root.find(".//ds:SignatureValue", ns.ALL)
        assert value is not None and value.text
        value.text = separator.join(value.text[i : i + 40] for i in range(0, len(value.text), 40))

    env = tamper(data, change)
    if accepted:
        assert verify_raw(p, env).signature_value == original
    else:
        with refused("InvalidSecurity"):
            verify_raw(p, env)


# --- signature wrapping --------------------------------------------------------------------------------


def _wrap(el: etree._Element, wrapper_tag: str) -> etree._Element:
    """Put `wrapper_tag` where `el` was and `el` inside it."""
    wrapper = etree.Element(wrapper_tag)
    el.addprevious(wrapper)
    wrapper.append(el)
    return wrapper


def _evil_body(root: etree._Element, **attrs: str) -> etree._Element:
    body = etree.SubElement(root, ns.q(SOAP, "Body"), attrs)
    body.append(etree.fromstring(EVIL))
    return body


def _body_into_header_wrapper(root: etree._Element) -> None:
    # McIntosh & Austel: the signed Body lives on in a new header, the processed Body is the attacker's.
    body = soap(root, "Body")
    etree.SubElement(soap(root, "Header"), ns.q(ATTACK, "Wrapper")).append(body)
    _evil_body(root)


def _body_directly_into_header(root: etree._Element) -> None:
    soap(root, "Header").append(soap(root, "Body"))
    _evil_body(root)


def _duplicate_id(attr: str) -> Callable[[etree._Element], None]:
    def change(root: etree._Element) -> None:
        body = soap(root, "Body")
        body_id = body.get(WSU_ID) or ""
        etree.SubElement(soap(root, "Header"), ns.q(ATTACK, "Wrapper")).append(body)
        _evil_body(root, **{attr: body_id})

    return change


def _signed_copy_in_header(root: etree._Element) -> None:
    # A copy (not a move) of the signed Body in the header; the real Body keeps its id but changes content.
    body = soap(root, "Body")
    soap(root, "Header").append(etree.fromstring(etree.tostring(body)))
    body[0].getparent().replace(body[0], etree.fromstring(EVIL))


def _body_into_signature_object(root: etree._Element) -> None:
    sig = next(root.iter(SIG))
    etree.SubElement(sig, ds("Object")).append(soap(root, "Body"))
    _evil_body(root)


def _body_into_other_security_header(root: etree._Element) -> None:
    other = etree.SubElement(soap(root, "Header"), SEC, {ns.q(SOAP, "actor"): "urn:someone-else"})
    other.append(soap(root, "Body"))
    _evil_body(root)


def _timestamp_out_of_security(root: etree._Element) -> None:
    # The signed Timestamp becomes a header block; a fresh, unsigned one takes its place.
    sec = next(root.iter(SEC))
    ts = sec.find(TS)
    assert ts is not None
    soap(root, "Header").append(ts)
    fresh = etree.SubElement(sec, TS)
    etree.SubElement(fresh, ns.q(ns.WSU, "Created")).text = "2099-01-01T00:00:00Z"


def _timestamp_into_other_security_header(root: etree._Element) -> None:
    sec = next(root.iter(SEC))
    ts = sec.find(TS)
    assert ts is not None
    etree.SubElement(soap(root, "Header"), SEC, {ns.q(SOAP, "actor"): "urn:someone-else"}).append(ts)


def _signature_into_body(root: etree._Element) -> None:
    soap(root, "Body").append(next(root.iter(SIG)))


def _signature_directly_in_header(root: etree._Element) -> None:
    soap(root, "Header").append(next(root.iter(SIG)))


MISPLACED = "is not where a signed part may be"
DUPLICATE = "more than one element"
OUTSIDE = "not a direct child of a wsse:Security header"
WRAPPING: dict[str, tuple[Callable[[etree._Element], None], str]] = {
    "body moved into a new header element": (_body_into_header_wrapper, MISPLACED),
    "body moved directly into the header": (_body_directly_into_header, MISPLACED),
    "duplicate wsu:Id on the new body": (_duplicate_id(WSU_ID), DUPLICATE),
    "duplicate id as plain Id": (_duplicate_id("Id"), DUPLICATE),
    "duplicate id as ID": (_duplicate_id("ID"), DUPLICATE),
    "duplicate id as xml:id": (_duplicate_id("{http://www.w3.org/XML/1998/namespace}id"), DUPLICATE),
    "duplicate id in another namespace": (_duplicate_id(ns.q(ATTACK, "Id")), DUPLICATE),
    "signed copy of the body in the header": (_signed_copy_in_header, DUPLICATE),
    "body wrapped in ds:Object": (_body_into_signature_object, "ds:Object"),
    "body in another wsse:Security header": (_body_into_other_security_header, MISPLACED),
    "signed timestamp moved out of wsse:Security": (_timestamp_out_of_security, MISPLACED),
    "signed timestamp moved into another wsse:Security": (_timestamp_into_other_security_header, MISPLACED),
    "signature moved into the body": (_signature_into_body, OUTSIDE),
    "signature moved out of wsse:Security": (_signature_directly_in_header, OUTSIDE),
}


@pytest.mark.parametrize(("attack", "reason"), WRAPPING.values(), ids=WRAPPING.keys())
def test_signature_wrapping_refused(p: Pki, attack: Callable[[etree._Element], None], reason: str) -> None:
    env = tamper(p.signed(), attack)
    with pytest.raises(faults.Fault, check=lambda f: f.code == "InvalidSecurity" and reason in f.reason):
        verify_raw(p, env)


def test_wrapping_fools_a_naive_verifier(p: Pki) -> None:
    # Why the checks above exist: xmlsec alone, told "wsu:Id is an id", verifies the wrapped message, and
    # the application then reads the attacker's Body.
    env = tamper(p.signed(), _body_into_header_wrapper)
    xmlsec.tree.add_ids(env.root, ["Id"])
    ctx = xmlsec.SignatureContext()
    ctx.key = xmlsec.Key.from_file(str(p.folder / "client.pem"), xmlsec.constants.KeyDataFormatCertPem)
    ctx.verify(the_signature(env))
    assert env.body.findtext("{urn:shop}Order/{urn:shop}Item") == "yacht"


def test_wrapped_body_also_stopped_by_threat_protection(p: Pki) -> None:
    root = etree.fromstring(p.signed())
    _body_into_header_wrapper(root)
    with pytest.raises(faults.Fault):
        threat_protection.parse_envelope(etree.tostring(root), LIMITS)


def test_reference_nested_in_body_refused(p: Pki) -> None:
    # Signing only an element inside the Body leaves the rest of the Body open to change.
    data = p.signed(parts=lambda env: [env.body[0], timestamp(env)])
    with refused("InvalidSecurity"):
        receive(p, data)


def test_wrapped_header_block_refused(p: Pki) -> None:
    to = f'<wsa:To xmlns:wsa="{ns.WSA}">https://shop.example/orders</wsa:To>'
    env = envelope(headers=to)
    header = env.header
    assert header is not None
    data = p.signed(env=env, parts=lambda e: [e.body, header[0]])
    env2, verified = receive(p, data)
    assert env2.header is not None and verified.elements == [env2.body, env2.header[0]]

    def redirect(root: etree._Element) -> None:
        signed_to = soap(root, "Header")[0]
        _wrap(signed_to, ns.q(ATTACK, "Wrapper"))
        evil = etree.Element(ns.q(ns.WSA, "To"))
        evil.text = "https://attacker.example/"
        soap(root, "Header").insert(0, evil)

    with refused("InvalidSecurity"):
        verify_raw(p, tamper(data, redirect))


def test_signed_timestamp_with_unsigned_body_is_visible(p: Pki) -> None:
    # Cryptographically fine; the caller sees from VerifiedSignature.elements that the Body is not covered.
    env, verified = receive(p, p.signed(parts=lambda env: [timestamp(env)]))
    assert verified.covers(timestamp(env))
    assert not verified.covers(env.body)


def test_covers_is_by_identity(p: Pki) -> None:
    env, verified = receive(p, p.signed())
    copy = etree.fromstring(etree.tostring(env.body))
    assert not verified.covers(copy)


# --- interop -------------------------------------------------------------------------------------------


def _xmlsec1(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["xmlsec1", *args], capture_output=True, text=True, timeout=60, check=False)


ID_ATTRS = [
    "--id-attr:Id",
    f"{SOAP}:Body",
    "--id-attr:Id",
    f"{ns.WSU}:Timestamp",
    "--id-attr:Id",
    f"{ns.WSSE11}:SignatureConfirmation",
]


@needs_xmlsec1
@pytest.mark.parametrize("algorithm", ["rsa-sha256", "hmac-sha256"])
def test_xmlsec1_verifies_ours(p: Pki, tmp_path: Path, algorithm: str) -> None:
    data = p.signed(algorithm=algorithm)
    signed, tampered = tmp_path / "signed.xml", tmp_path / "tampered.xml"
    signed.write_bytes(data)
    tampered.write_bytes(data.replace(b">book<", b">yacht<"))
    if algorithm == "hmac-sha256":
        secret = tmp_path / "hmac.bin"
        secret.write_bytes(p.hmac["demo-client"])
        key_args = ["--hmackey", str(secret)]
    else:
        key_args = ["--pubkey-cert-pem", str(p.folder / "client.pem")]
    ok = _xmlsec1("--verify", *ID_ATTRS, *key_args, str(signed))
    assert ok.returncode == 0, ok.stderr
    assert "SignedInfo References (ok/all): 2/2" in ok.stderr + ok.stdout
    bad = _xmlsec1("--verify", *ID_ATTRS, *key_args, str(tampered))
    assert bad.returncode != 0


def _wss4j_template(p: Pki, c14n: str) -> str:
    """A request laid out as WSS4J/CXF lays it out (Ids on Signature, KeyInfo and STR; IssuerSerial;
    SignatureConfirmation; EncryptedData in the Body), as an unsigned xmlsec1 template."""
    if c14n == ns.EXC_C14N:
        c14n_el = (
            f'<ds:CanonicalizationMethod Algorithm="{c14n}"><ec:InclusiveNamespaces xmlns:ec="{ns.EXC_C14N}" '
            'PrefixList="soap"/></ds:CanonicalizationMethod>'
        )
    else:
        c14n_el = f'<ds:CanonicalizationMethod Algorithm="{c14n}"/>'

    def ref(uri: str, prefixes: str) -> str:
        return (
            f'<ds:Reference URI="#{uri}"><ds:Transforms><ds:Transform Algorithm="{ns.EXC_C14N}">'
            f'<ec:InclusiveNamespaces xmlns:ec="{ns.EXC_C14N}" PrefixList="{prefixes}"/></ds:Transform>'
            f'</ds:Transforms><ds:DigestMethod Algorithm="http://www.w3.org/2001/04/xmlenc#sha256"/>'
            "<ds:DigestValue/></ds:Reference>"
        )

    return (
        f'<soap:Envelope xmlns:soap="{SOAP}"><soap:Header>'
        f'<wsse:Security xmlns:wsse="{ns.WSSE}" xmlns:wsu="{ns.WSU}" soap:mustUnderstand="1">'
        '<wsu:Timestamp wsu:Id="TS-A1B2"><wsu:Created>2030-01-01T00:00:00.000Z</wsu:Created>'
        "<wsu:Expires>2030-01-01T00:05:00.000Z</wsu:Expires></wsu:Timestamp>"
        f'<ds:Signature xmlns:ds="{ns.DS}" Id="SIG-A1B5"><ds:SignedInfo>{c14n_el}'
        '<ds:SignatureMethod Algorithm="http://www.w3.org/2001/04/xmldsig-more#rsa-sha256"/>'
        f"{ref('id-A1B4', '')}{ref('TS-A1B2', 'wsse soap')}{ref('SC-A1B3', 'wsse soap')}"
        '</ds:SignedInfo><ds:SignatureValue/><ds:KeyInfo Id="KI-A1B6">'
        '<wsse:SecurityTokenReference wsu:Id="STR-A1B7"><ds:X509Data><ds:X509IssuerSerial>'
        f"<ds:X509IssuerName>{p.client.issuer.rfc4514_string()}</ds:X509IssuerName>"
        f"<ds:X509SerialNumber>{p.client.serial_number}</ds:X509SerialNumber>"
        "</ds:X509IssuerSerial></ds:X509Data></wsse:SecurityTokenReference></ds:KeyInfo></ds:Signature>"
        f'<wsse11:SignatureConfirmation xmlns:wsse11="{ns.WSSE11}" Value="c2lnbmF0dXJl" wsu:Id="SC-A1B3"/>'
        f'</wsse:Security></soap:Header><soap:Body xmlns:wsu="{ns.WSU}" wsu:Id="id-A1B4">'
        f'<xenc:EncryptedData xmlns:xenc="{ns.XENC}" Id="ED-A1B8" Type="{ns.XENC}Content">'
        f'<xenc:EncryptionMethod Algorithm="{ns.XENC11}aes256-gcm"/><xenc:CipherData>'
        "<xenc:CipherValue>AAECAwQFBgcICQoLDA0ODw==</xenc:CipherValue></xenc:CipherData></xenc:EncryptedData>"
        "</soap:Body></soap:Envelope>"
    )


@needs_xmlsec1
@pytest.mark.parametrize("c14n", [ns.EXC_C14N, "http://www.w3.org/TR/2001/REC-xml-c14n-20010315"])
def test_we_verify_xmlsec1_signatures_of_wss4j_layout(p: Pki, tmp_path: Path, c14n: str) -> None:
    template, out = tmp_path / "template.xml", tmp_path / "signed.xml"
    template.write_text(_wss4j_template(p, c14n))
    done = _xmlsec1(
        "--sign", *ID_ATTRS, "--privkey-pem", str(p.folder / "client.key"), "--output", str(out), str(template)
    )
    assert done.returncode == 0, done.stderr
    env, verified = receive(p, out.read_bytes())
    key_info = the_signature(env).find(ds("KeyInfo"))
    assert key_info is not None
    ref = keys.parse_key_info(key_info)
    assert ref.kind == "issuer_serial" and keys.matches(ref, p.client)
    sec = security(env)
    assert [e.get(WSU_ID) for e in verified.elements] == ["id-A1B4", "TS-A1B2", "SC-A1B3"]
    assert verified.elements[0] is env.body and all(e.getparent() is sec for e in verified.elements[1:])
    tampered = out.read_bytes().replace(b"AAECAwQFBgcICQoLDA0ODw==", b"AAECAwQFBgcICQoLDA0ODx==")
    with refused("FailedCheck"):
        receive(p, tampered)


def test_signxml_interop(p: Pki) -> None:
    signxml = pytest.importorskip("signxml")
    from signxml import methods

    root = etree.fromstring(p.signed(parts=lambda env: [env.body]))
    sig = next(root.iter(SIG))
    sig.getparent().remove(sig)  # keep the ids our signer added, sign again with signxml
    signer = signxml.XMLSigner(
        method=methods.detached,
        signature_algorithm=signxml.SignatureMethod.RSA_SHA256,
        digest_algorithm=signxml.DigestAlgorithm.SHA256,
        c14n_algorithm=signxml.CanonicalizationMethod.EXCLUSIVE_XML_CANONICALIZATION_1_0,
    )
    body_id = soap(root, "Body").get(WSU_ID)
    theirs = signer.sign(
        root,
        key=(p.folder / "client.key").read_bytes(),
        cert=(p.folder / "client.pem").read_text(),
        reference_uri=[f"#{body_id}"],
        id_attribute="Id",
    )
    next(root.iter(SEC)).append(theirs)
    env, verified = receive(p, etree.tostring(root), key=p.client)
    assert verified.elements == [env.body]


def test_every_id_spelling_in_any_namespace_is_an_id_and_no_near_miss_is() -> None:
    """id_index (the wrapping defence: ids unique across the document) takes exactly the local names Id, ID, id
    and AssertionID, in any namespace: a near miss (a part or extension of one, another case) is no id, so it
    neither collides nor names a signed part."""
    names = ["Id", "ID", "id", "AssertionID"]
    near = ["I", "d", "D", "iD", "Idx", "xId", "AssertionI", "ssertionID", "Id|ID", "ID|id"]
    ids = "".join(f'<e{i} {n}="v-{i}"/>' for i, n in enumerate(names))
    spaced = "".join(f'<f{i} xmlns:a="urn:a" a:{n}="w-{i}"/>' for i, n in enumerate(names))
    misses = "".join(f'<g{i} {n.replace("|", "")}="x-{i}"/>' for i, n in enumerate(near))
    root = etree.fromstring(f'<r xml:id="xml-id">{ids}{spaced}{misses}</r>')
    index = signature.id_index(root)
    assert sorted(index) == sorted([*(f"v-{i}" for i in range(4)), *(f"w-{i}" for i in range(4)), "xml-id"])
    assert index["v-3"].tag == "e3" and index["w-0"].tag == "f0" and index["xml-id"] is root
