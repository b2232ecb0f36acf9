"""Two references to one element in a SignedInfo (issue 19 item 5): Metro's SecureConversation Cancel references
each signed WS-Addressing header twice. Accepted only as exact copies (same URI, transforms, PrefixList, digest
method and value), counted once; any other pair is a second reading of the element and refused, even when the
signature over it is cryptographically valid (each variant is shown to pass a bare xmlsec verification first).

Messages are signed by our signer (it writes exact copies when asked to sign an element twice) and re-signed by
hand with `cryptography` after a reference is changed, as an attacker holding a client key would."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable

import pytest
import xmlsec
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding
from lxml import etree

from filters.engine import faults, ns
from filters.engine.xml import threat_protection
from filters.engine.xml.soap import Envelope
from gateway.policy import SignaturePolicy
from tests.test_signature import (
    LIMITS,
    WSU_ID,
    Pki,
    envelope,
    p,
    raw,
    receive,
    refused,
    security,
    timestamp,
    verify_raw,
)

__all__ = ["p"]  # the module-scoped PKI fixture

WSA_HEADERS = (
    f'<wsa:To xmlns:wsa="{ns.WSA}">https://gateway.example/sc</wsa:To>'
    f'<wsa:Action xmlns:wsa="{ns.WSA}">http://docs.oasis-open.org/ws-sx/ws-trust/200512/RST/SCT/Cancel</wsa:Action>'
    f'<wsa:MessageID xmlns:wsa="{ns.WSA}">uuid:6b1e0c4e-0000-4000-8000-000000000001</wsa:MessageID>'
)
SI = f"{{{ns.DS}}}SignedInfo"
REF = f"{{{ns.DS}}}Reference"
BOTH_DIGESTS = SignaturePolicy(digests=["sha256", "sha1"])


def wsa_headers(env: Envelope) -> list[etree._Element]:
    assert env.header is not None
    return [h for h in env.header if etree.QName(h).namespace == ns.WSA]


def metro_cancel_shape(env: Envelope) -> list[etree._Element]:
    """Every WS-Addressing header twice (once as a SignedPart, once more), then the Body and the Timestamp."""
    headers = wsa_headers(env)
    return [*headers, *headers, env.body, timestamp(env)]


def references(root: etree._Element) -> list[etree._Element]:
    return root.findall(f".//{SI}/{REF}")


def resign(p: Pki, root: etree._Element) -> bytes:
    """Sign the (changed) SignedInfo again with the client's key, as its holder can."""
    info = root.find(f".//{SI}")
    assert info is not None
    prefixes = info.find(f"{{{ns.DS}}}CanonicalizationMethod/{{{ns.EXC_C14N}}}InclusiveNamespaces")
    canonical = etree.tostring(
        info,
        method="c14n",
        exclusive=True,
        inclusive_ns_prefixes=(prefixes.get("PrefixList") or "").split() if prefixes is not None else None,
    )
    value = p.client_key.sign(canonical, padding.PKCS1v15(), hashes.SHA256())
    sv = root.find(f".//{{{ns.DS}}}SignatureValue")
    assert sv is not None
    sv.text = base64.b64encode(value).decode()
    return etree.tostring(root)


def xmlsec_accepts(p: Pki, data: bytes) -> bool:
    """A bare xmlsec verification (every id registered, none of our rules): is the signature itself valid?"""
    root = etree.fromstring(data)
    ctx = xmlsec.SignatureContext()
    ctx.key = xmlsec.Key.from_file(str(p.folder / "client.pem"), xmlsec.KeyFormat.CERT_PEM)
    for el in root.iter():
        if el.get(WSU_ID):
            ctx.register_id(el, "Id", ns.WSU)
    try:
        ctx.verify(root.find(f".//{{{ns.DS}}}Signature"))
    except xmlsec.Error:
        return False
    return True


@pytest.mark.parametrize("soap", [ns.SOAP11, ns.SOAP12], ids=["soap11", "soap12"])
def test_exact_duplicate_references_to_signed_addressing_headers_are_counted_once(p: Pki, soap: str) -> None:
    data = p.signed(env=envelope(headers=WSA_HEADERS, soap=soap), parts=metro_cancel_shape)
    refs = references(etree.fromstring(data))
    uris = [r.get("URI") for r in refs]
    assert len(uris) == 8 and len(set(uris)) == 5  # the three headers twice each, Body, Timestamp
    env, verified = receive(p, data)
    assert verified.elements == [*wsa_headers(env), env.body, timestamp(env)]
    assert all(verified.covers(h) for h in wsa_headers(env))


def _second_copy(change: Callable[[etree._Element, etree._Element], None]) -> Callable[[Pki], bytes]:
    """A Metro-shaped message whose second reference to wsa:To is changed by `change(reference, element)`, then
    re-signed."""

    def make(p: Pki) -> bytes:
        root = etree.fromstring(p.signed(env=envelope(headers=WSA_HEADERS), parts=metro_cancel_shape))
        to = root.find(f".//{{{ns.WSA}}}To")
        assert to is not None
        second = [r for r in references(root) if r.get("URI") == "#" + to.get(WSU_ID)][1]
        change(second, to)
        return resign(p, root)

    return make


def _digest(ref: etree._Element, el: etree._Element, data: bytes, name: str = "sha256") -> None:
    value = ref.find(f"{{{ns.DS}}}DigestValue")
    assert value is not None
    value.text = base64.b64encode(hashlib.new(name, data).digest()).decode()


def _inclusive_transform(ref: etree._Element, el: etree._Element) -> None:
    transform = ref.find(f"{{{ns.DS}}}Transforms/{{{ns.DS}}}Transform")
    assert transform is not None
    transform.set("Algorithm", "http://www.w3.org/TR/2001/REC-xml-c14n-20010315")
    del transform[:]
    _digest(ref, el, etree.tostring(el, method="c14n"))


def _other_prefix_list(ref: etree._Element, el: etree._Element) -> None:
    inclusive = ref.find(f".//{{{ns.EXC_C14N}}}InclusiveNamespaces")
    assert inclusive is not None
    inclusive.set("PrefixList", "soap wsse")
    _digest(ref, el, etree.tostring(el, method="c14n", exclusive=True, inclusive_ns_prefixes=["soap", "wsse"]))


def _sha1(ref: etree._Element, el: etree._Element) -> None:
    method = ref.find(f"{{{ns.DS}}}DigestMethod")
    assert method is not None
    method.set("Algorithm", ns.DS + "sha1")
    inclusive = ref.find(f".//{{{ns.EXC_C14N}}}InclusiveNamespaces")
    prefixes = (inclusive.get("PrefixList") or "").split() if inclusive is not None else None
    _digest(ref, el, etree.tostring(el, method="c14n", exclusive=True, inclusive_ns_prefixes=prefixes), "sha1")


def _no_transforms(ref: etree._Element, el: etree._Element) -> None:
    ref.remove(ref.find(f"{{{ns.DS}}}Transforms"))
    _digest(ref, el, etree.tostring(el, method="c14n"))


def _wrong_digest(ref: etree._Element, el: etree._Element) -> None:
    _digest(ref, el, b"another reading")


def _reformatted(ref: etree._Element, el: etree._Element) -> None:
    value = ref.find(f"{{{ns.DS}}}DigestValue")
    assert value is not None and value.text
    value.text = value.text[:20] + "\n" + value.text[20:]  # the same bytes, spelled otherwise


@pytest.mark.parametrize(
    ("make", "valid"),
    [
        (_second_copy(_inclusive_transform), True),
        (_second_copy(_other_prefix_list), True),
        (_second_copy(_sha1), True),
        (_second_copy(_no_transforms), True),
        (_second_copy(_wrong_digest), False),
        (_second_copy(_reformatted), True),
    ],
    ids=["inclusive-c14n", "other-prefix-list", "sha1-digest", "no-transforms", "other-digest-value", "reformatted"],
)
def test_a_second_reading_of_a_signed_element_is_refused(p: Pki, make: Callable[[Pki], bytes], valid: bool) -> None:
    data = make(p)
    assert xmlsec_accepts(p, data) is valid  # the signature itself is sound: only the rule stops it
    with refused("InvalidSecurity"):
        receive(p, data, BOTH_DIGESTS)


def test_duplicate_references_to_an_id_two_elements_carry_are_refused(p: Pki) -> None:
    """The wrapped copy carries the signed Body's id too: duplicates or not, an id names one element."""
    root = etree.fromstring(p.signed(parts=lambda env: [env.body, env.body, timestamp(env)]))
    body = root.find(f"{{{ns.SOAP11}}}Body")
    header = root.find(f"{{{ns.SOAP11}}}Header")
    assert body is not None and header is not None
    copy = etree.SubElement(header, "{urn:attacker}Wrapper")
    copy.append(etree.fromstring(etree.tostring(body)))
    with refused("InvalidSecurity"):
        verify_raw(p, raw(etree.tostring(root)))  # past threat protection, which refuses a second Body first


def test_exact_duplicates_pointing_at_a_wrapped_original_are_refused(p: Pki) -> None:
    """The signed Body moved into a header wrapper (its id with it), a new Body in its place: the duplicated
    reference still names the moved original, which is not where a signed Body may be."""
    root = etree.fromstring(p.signed(parts=lambda env: [env.body, env.body, timestamp(env)]))
    body = root.find(f"{{{ns.SOAP11}}}Body")
    header = root.find(f"{{{ns.SOAP11}}}Header")
    assert body is not None and header is not None
    assert xmlsec_accepts(p, etree.tostring(root))
    etree.SubElement(header, "{urn:attacker}Wrapper").append(body)
    evil = etree.SubElement(root, f"{{{ns.SOAP11}}}Body")
    etree.SubElement(evil, "{urn:shop}Order").text = "yacht"
    data = etree.tostring(root)
    assert xmlsec_accepts(p, data)  # the classic wrapping: xmlsec alone is fooled
    with pytest.raises(faults.Fault, match="Body"):
        threat_protection.parse_envelope(data, LIMITS)  # a Body below the envelope
    with refused("InvalidSecurity"):
        verify_raw(p, raw(data))  # and the signature check on its own


def test_the_limit_counts_every_reference_duplicates_included(p: Pki) -> None:
    data = p.signed(parts=lambda env: [env.body] * 30 + [timestamp(env)])
    with refused("InvalidSecurity"):
        receive(p, data)
    assert threat_protection.parse_envelope(data, LIMITS) is not None
    assert security(receive(p, p.signed(parts=lambda env: [env.body] * 29 + [timestamp(env)]))[0]) is not None
