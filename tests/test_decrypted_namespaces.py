"""Decrypted content lands exactly as it was encrypted: its own prefixes, its default namespace, and the
declarations that only QNames in attribute values and text use (issue 19 item 3, Metro's encrypted Cancel).

A signature made before encryption covers the sender's canonical form; if the gateway rebinds a prefix or drops a
declaration while putting the plaintext back, a valid signature fails, or a QName (xsi:type="p:T") means
something else. Encrypted by our sending side and by python-xmlsec (libxmlsec1, a stack we did not write); signed
then encrypted by our client and verified by the engine, SOAP 1.1 and 1.2. Real keys and ciphers throughout."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
import xmlsec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from lxml import etree

from filters.engine.faults import Fault
from filters.engine.ns import SOAP11, SOAP12, WSU, XENC, q
from filters.engine.pipeline import Exchange
from filters.engine.profiles import SecuredPipeline
from filters.engine.wss import encryption as enc
from filters.stores.factory import RouteStores
from gateway.policy import Limits
from tests.wss_helpers import client_for, make_route

LIMITS = Limits()
XSI = "http://www.w3.org/2001/XMLSchema-instance"
H = "urn:example:h"

# The Envelope binds `a` (and, on the Body, `k`) to H and the default namespace to urn:example:d; the Body
# content below says the same things in other spellings. Element-only at the Body level: python-xmlsec cannot
# encrypt Type Content with text children (see tests/test_encryption.py).
CONTENTS = {
    # b is H again: the plaintext's own prefix, and the QNames in xsi:type and the text use it.
    "redeclared-prefix": f'<b:X xmlns:b="{H}" xmlns:xsi="{XSI}" xsi:type="b:T"><b:v>b:Q</b:v></b:X>',
    # A default namespace of its own (H, bound to `a` above), then undeclared again below.
    "changed-default": f'<X xmlns="{H}" xmlns:xsi="{XSI}" xsi:type="a:T"><Y/><Z xmlns=""><W/></Z></X>',
    # A prefix declared in the plaintext and used only in text.
    "qname-text-only": '<a:X xmlns:c="urn:example:c"><a:v>c:Name</a:v></a:X>',
    # The envelope's prefix rebound to another namespace inside the plaintext (a QName attribute uses it).
    "prefix-rebound-inside": f'<a:X><a:Y xmlns:a="urn:example:other" xmlns:xsi="{XSI}" xsi:type="a:T" a:at="1"/></a:X>',
    # Two prefixes bound to H in scope: an element uses the outer one, an attribute the inner one.
    "two-prefixes-one-namespace": '<a:X k:at="1"><k:Y a:at="2"/></a:X>',
}


def envelope(content: str, soap: str) -> bytes:
    return (
        f'<s:Envelope xmlns:s="{soap}" xmlns:a="{H}" xmlns="urn:example:d"><s:Header/>'
        f'<s:Body xmlns:k="{H}">{content}</s:Body></s:Envelope>'
    ).encode()


def canonical(el: etree._Element) -> tuple[bytes, ...]:
    """What a signature over `el` sees: its inclusive and exclusive C14N."""
    return tuple(etree.tostring(el, method="c14n", exclusive=e) for e in (False, True))


def body_of(root: etree._Element) -> etree._Element:
    return next(c for c in root if etree.QName(c).localname == "Body")


def encrypt_ours(body: etree._Element, key: bytes, kind: str) -> None:
    if kind == "Content":
        enc.encrypt_content(body, key, "aes128-gcm", "ED-1", None)
    else:
        enc.encrypt_element(body[0], key, "aes128-gcm", "ED-1", None)


def encrypt_xmlsec(body: etree._Element, key: bytes, kind: str) -> None:
    template = etree.fromstring(
        f'<xenc:EncryptedData xmlns:xenc="{XENC}" Id="ED-1" Type="{XENC}{kind}">'
        f'<xenc:EncryptionMethod Algorithm="{enc.DATA_ALGORITHMS["aes128-gcm"]}"/>'
        "<xenc:CipherData><xenc:CipherValue/></xenc:CipherData></xenc:EncryptedData>"
    )
    ctx = xmlsec.EncryptionContext()
    ctx.key = xmlsec.Key.from_binary_data(xmlsec.constants.KeyDataAes, key)
    ctx.encrypt_xml(template, body if kind == "Content" else body[0])


@pytest.mark.parametrize("soap", [SOAP11, SOAP12], ids=["soap11", "soap12"])
@pytest.mark.parametrize("encrypt", [encrypt_ours, encrypt_xmlsec], ids=["ours", "xmlsec"])
@pytest.mark.parametrize("kind", ["Content", "Element"])
@pytest.mark.parametrize("content", list(CONTENTS.values()), ids=list(CONTENTS))
def test_prefix_rebinding_by_decryption_does_not_change_the_signed_form(
    content: str, kind: str, encrypt: object, soap: str
) -> None:
    sent = etree.fromstring(envelope(content, soap))
    before = canonical(body_of(sent)[0])
    key = enc.new_key("aes128-gcm")
    encrypt(body_of(sent), key, kind)  # type: ignore[operator]
    wire = etree.tostring(sent)
    body = body_of(etree.fromstring(wire))
    assert [c.tag for c in body] == [q(XENC, "EncryptedData")]
    landed = enc.decrypt_data(body[0], key, ["aes128-gcm"], LIMITS)
    assert landed == ([body] if kind == "Content" else [body[0]])
    assert [canonical(c) for c in body] == [before]
    # QNames in attribute values and text resolve, where they are, to the namespace the sender meant.
    assert qnames(body[0]) == qnames(body_of(etree.fromstring(envelope(content, soap)))[0])


def qnames(top: etree._Element) -> list[tuple[str, str, str | None]]:
    """Every prefix:name in an attribute value or text below `top`, with what its prefix means there."""
    found = []
    for el in top.iter():
        for value in [*el.attrib.values(), el.text or ""]:
            if ":" in value:
                prefix = value.split(":")[0]
                found.append((el.tag, value, el.nsmap.get(prefix)))
    return found


@pytest.mark.parametrize("soap", [SOAP11, SOAP12], ids=["soap11", "soap12"])
@pytest.mark.parametrize("content", list(CONTENTS.values()), ids=list(CONTENTS))
def test_signed_then_encrypted_content_with_its_own_prefixes_verifies(pki: Path, content: str, soap: str) -> None:
    """Our client signs the Body, then encrypts its content (WS-SecurityPolicy's default SignBeforeEncrypting);
    the engine decrypts, verifies the signature over what landed, and forwards it as the sender wrote it."""
    route = make_route(pki, "rsa", encryption={"require_request": True})
    client = client_for(route, pki)
    plain = envelope(content, soap)
    secured, _ = client.secure(plain)
    assert b"CipherValue" in secured and content.split(">")[0].encode() not in secured
    ex = Exchange(route=route)
    outcome = SecuredPipeline(route, RouteStores()).request(secured, {}, ex)
    assert outcome.body is not None and ex.security is not None
    forwarded = body_of(etree.fromstring(outcome.body))
    sent = body_of(etree.fromstring(plain))
    # Exclusive C14N: the Body keeps the xmlns:wsu the client put there for its wsu:Id.
    assert [canonical(c)[1] for c in forwarded] == [canonical(c)[1] for c in sent]
    assert qnames(forwarded[0]) == qnames(sent[0])


# --- the hostile neighbours: plaintext that tries to change the namespaces of what is around it ------------------

SIGNED_NEIGHBOUR = '<a:Signed xmlns:xsi="' + XSI + '" xsi:type="a:T">a:Name</a:Signed>'


@pytest.mark.parametrize(
    "plaintext",
    [
        # Declarations on the decrypted element itself stay on it.
        b'<a:Evil xmlns:a="urn:example:evil" xmlns="urn:example:evil" xmlns:s="urn:example:evil"/>',
        # A prefix declared for the next element's sake, on an element that ends before it.
        b'<x:Evil xmlns:x="urn:example:evil" xmlns:a="urn:example:evil"><a:y/></x:Evil>',
    ],
)
def test_decrypted_element_cannot_hijack_a_prefix_its_signed_neighbours_use(plaintext: bytes) -> None:
    root = etree.fromstring(envelope("<a:op/>", SOAP11))
    header = root[0]
    header.append(etree.fromstring(envelope(SIGNED_NEIGHBOUR, SOAP11))[1][0])
    neighbour = header[0]
    before = (canonical(neighbour), canonical(header), canonical(body_of(root)), dict(header.nsmap))
    key = enc.new_key("aes128-gcm")
    holder = etree.SubElement(header, "tmp")
    holder.append(etree.fromstring(plaintext))
    enc.encrypt_element(holder[0], key, "aes128-gcm", "ED-1", None)
    ed = holder[0]
    header.replace(holder, ed)
    header.insert(0, ed)  # before the neighbour: a declaration leaking forward would reach it
    [landed] = enc.decrypt_data(ed, key, ["aes128-gcm"], LIMITS)
    assert header.index(landed) == 0 and header[1] is neighbour
    header.remove(landed)
    assert (canonical(neighbour), canonical(header), canonical(body_of(root)), dict(header.nsmap)) == before
    assert neighbour.nsmap["a"] == H and qnames(neighbour) == [
        (q(H, "Signed"), "a:T", H),
        (q(H, "Signed"), "a:Name", H),
    ]


@pytest.mark.parametrize(
    "plaintext",
    [
        b"</s:Body><s:Body><a:Other/>",  # leave the place it was put, open another Body
        b'<a:X/></s:Header><s:Header xmlns:a="urn:example:evil">',
        b"<a:X>",  # unbalanced
        b"<evil:X/>",  # a prefix bound nowhere (not even by the sender's C14N)
    ],
)
def test_decrypted_content_cannot_break_out_of_its_place(plaintext: bytes) -> None:
    root = etree.fromstring(envelope("<a:op/>", SOAP11))
    body = body_of(root)
    key = enc.new_key("aes128-gcm")
    enc.encrypt_content(body, key, "aes128-gcm", "ED-1", None)
    ed = body[0]
    ed.find(f"{q(XENC, 'CipherData')}/{q(XENC, 'CipherValue')}").text = _sealed(key, plaintext)
    before = etree.tostring(root)
    with pytest.raises(Fault) as info:
        enc.decrypt_data(ed, key, ["aes128-gcm"], LIMITS)
    assert info.value.code == "FailedCheck"
    assert etree.tostring(root) == before  # nothing was put in


def _sealed(key: bytes, plaintext: bytes) -> str:
    iv = os.urandom(12)
    return base64.b64encode(iv + AESGCM(key).encrypt(iv, plaintext, None)).decode()


def _sealed_cbc(key: bytes, plaintext: bytes) -> str:
    pad = 16 - len(plaintext) % 16
    iv = os.urandom(16)
    encryptor = Cipher(algorithms.AES(key), modes.CBC(iv)).encryptor()
    return base64.b64encode(
        iv + encryptor.update(plaintext + os.urandom(pad - 1) + bytes([pad])) + encryptor.finalize()
    ).decode()


@pytest.mark.parametrize("algorithm", ["aes128-gcm", "aes128-cbc"])
@pytest.mark.parametrize("offset", range(16))  # the last CDATA at every place against the last CBC block
@pytest.mark.parametrize("lead", [b"<![CDATA[a<]]>b", b"a&lt;b"], ids=["cdata-throughout", "cdata-last-only"])
def test_cdata_in_decrypted_content_is_one_text_as_in_the_envelope(algorithm: str, offset: int, lead: bytes) -> None:
    """libxml2 keeps CDATA sections when it parses the plaintext in place; the envelope's parser merges them into
    text. Values are read and forwarded one way: decrypted content gets the envelope's form."""
    plaintext = lead + b"<a:v>c<![CDATA[d]]></a:v>" * (lead != b"a&lt;b") + b"<a:v>cd</a:v>" * (lead == b"a&lt;b")
    plaintext += b"x" * offset + b"<![CDATA[e]]>"
    root = etree.fromstring(envelope("<a:op/>", SOAP11))
    body = body_of(root)
    key = enc.new_key(algorithm)
    enc.encrypt_content(body, key, algorithm, "ED-1", None)
    seal = _sealed(key, plaintext) if algorithm.endswith("gcm") else _sealed_cbc(key, plaintext)
    body[0].find(f"{q(XENC, 'CipherData')}/{q(XENC, 'CipherValue')}").text = seal
    enc.decrypt_data(body[0], key, [algorithm], LIMITS)
    assert b"CDATA" not in etree.tostring(body)
    assert (body.text, body[0].text, body[0].tail) == ("a<b", "cd", "x" * offset + "e")
    expected = envelope("a&lt;b<a:v>cd</a:v>" + "x" * offset + "e", SOAP11)
    assert etree.tostring(body, method="c14n") == etree.tostring(body_of(etree.fromstring(expected)), method="c14n")


@pytest.mark.parametrize(
    ("content", "wsu_kept"),
    [
        ('<a:X xmlns:c="urn:example:c"><a:v>c:Name</a:v></a:X>', False),  # c: used only in text
        (f'<X xmlns="{H}"><Z xmlns=""><W/></Z></X>', True),  # an undeclaration lxml's cleanup would drop
        (f'<a:X xmlns:xsi="{XSI}" xsi:type="wsu:Thing"/>', True),  # a QName using the Body's own wsu
    ],
    ids=["qname-text", "undeclared-default", "qname-uses-wsu"],
)
def test_removing_the_bodys_wsu_id_keeps_what_the_backend_reads(pki: Path, content: str, wsu_kept: bool) -> None:
    """The signer's wsu:Id leaves the Body, and its declaration only when no value or default namespace could
    need it: the backend reads every name and QName as the client sent them."""
    route = make_route(pki, "rsa")
    secured, _ = client_for(route, pki).secure(envelope(content, SOAP11))
    outcome = SecuredPipeline(route, RouteStores()).request(secured, {}, Exchange(route=route))
    assert outcome.body is not None
    forwarded = body_of(etree.fromstring(outcome.body))  # parsed again, as the backend does
    sent = body_of(etree.fromstring(envelope(content, SOAP11)))
    assert forwarded.get(q(WSU, "Id")) is None
    assert ("wsu" in forwarded.nsmap) is wsu_kept
    assert [e.tag for e in forwarded.iter()][1:] == [e.tag for e in sent.iter()][1:]
    assert qnames(forwarded[0]) == [(t, v, WSU if v.startswith("wsu:") else u) for t, v, u in qnames(sent[0])]
