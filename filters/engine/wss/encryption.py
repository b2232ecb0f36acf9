"""XML Encryption 1.0/1.1 the way WS-Security uses it (the shapes WSS4J/CXF and WCF send and expect).

Inbound: `decrypt_key` opens an xenc:EncryptedKey with our RSA key, `decrypt_data` opens an xenc:EncryptedData
(Type Content or Element) with a symmetric key and puts the plaintext back into the tree. Outbound:
`encrypt_content` and `encrypt_key` build the same shapes.

Rules kept here, whoever calls:
- The algorithm is checked against the policy before any decryption (CVE-2012-5575): UnsupportedAlgorithm.
- Every decryption failure (padding, tag, key, length, plaintext that does not parse or is refused) is the
  same FailedCheck for the client; only the fault's reason, which goes to the log, says which (CBC padding
  and parse-error oracles: Jager and Somorovsky 2011). The reason never holds key bytes or plaintext.
- RSA PKCS#1 v1.5 key transport never fails on its own: a bad block yields a random key of the expected
  length, so the failure surfaces later as the same FailedCheck as any wrong key (Bleichenbacher,
  CVE-2011-2487).
- Decrypted plaintext gets the envelope's hardening: no DTD, entities or PIs, and the size limits; it is put in
  place exactly as decrypted, every namespace declaration it carries kept where it is (a signature made before
  encryption covers that form).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal
from xml.sax.saxutils import escape

import xmlsec
from cryptography import x509
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.ciphers import AEADEncryptionContext, Cipher, CipherContext, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from lxml import etree

from filters.engine import faults, metrics
from filters.engine.ns import DS, XENC, XENC11, q
from filters.engine.xml import threat_protection, xmlsupport
from filters.engine.xml.threat_protection import Limits

TYPE_CONTENT = XENC + "Content"
TYPE_ELEMENT = XENC + "Element"

Digest = Literal["sha1", "sha256"]


@dataclass(frozen=True)
class _DataAlgorithm:
    uri: str
    key_size: int
    gcm: bool


# Policy names (gateway.policy.DataAlgorithm / KeyTransport) -> what they stand for.
DATA: dict[str, _DataAlgorithm] = {
    "aes128-gcm": _DataAlgorithm(XENC11 + "aes128-gcm", 16, gcm=True),
    "aes256-gcm": _DataAlgorithm(XENC11 + "aes256-gcm", 32, gcm=True),
    "aes128-cbc": _DataAlgorithm(XENC + "aes128-cbc", 16, gcm=False),
    "aes256-cbc": _DataAlgorithm(XENC + "aes256-cbc", 32, gcm=False),
}
_DATA_BY_URI = {a.uri: name for name, a in DATA.items()}
DATA_ALGORITHMS: dict[str, str] = {name: a.uri for name, a in DATA.items()}

KEY_TRANSPORTS: dict[str, str] = {
    "rsa-oaep-mgf1p": XENC + "rsa-oaep-mgf1p",
    "rsa-oaep": XENC11 + "rsa-oaep",
    "rsa-1_5": XENC + "rsa-1_5",
}
_TRANSPORT_BY_URI = {uri: name for name, uri in KEY_TRANSPORTS.items()}

_DIGEST_URIS: dict[str, str] = {"sha1": DS + "sha1", "sha256": XENC + "sha256"}
_MGF_URIS: dict[str, str] = {"sha1": XENC11 + "mgf1sha1", "sha256": XENC11 + "mgf1sha256"}
_HASHES: dict[str, type[hashes.HashAlgorithm]] = {"sha1": hashes.SHA1, "sha256": hashes.SHA256}
_DIGEST_BY_URI = {uri: name for name, uri in _DIGEST_URIS.items()}
_MGF_BY_URI = {uri: name for name, uri in _MGF_URIS.items()}

GCM_IV = 12
GCM_TAG = 16
BLOCK = 16
_CDATA = b"<![CDATA["


def failed(reason: str) -> faults.Fault:
    """The one decryption failure the client ever sees; `reason` is for the log only."""
    return faults.security("FailedCheck", reason)


def _child(parent: etree._Element, tag: str, what: str) -> etree._Element | None:
    """The one `tag` child of `parent`, or None; two of them are refused (which one would count?)."""
    found = None
    for child in parent.iterchildren(tag):  # in C: findall parses its path in Python (~15K instructions a call)
        if found is not None:
            raise faults.security("InvalidSecurity", f"{what}: more than one {etree.QName(tag).localname}")
        found = child
    return found


def _expect(el: etree._Element, tag: str) -> None:
    if el.tag != tag:
        got = str(el.tag)[:120]
        raise faults.security("InvalidSecurity", f"expected {etree.QName(tag).localname}, got {got}")


def _method_uri(el: etree._Element, what: str) -> tuple[etree._Element, str]:
    method = _child(el, q(XENC, "EncryptionMethod"), what)
    uri = _algorithm_uri(method, what)
    assert method is not None  # refused above
    return method, uri


def _algorithm_uri(method: etree._Element | None, what: str) -> str:
    uri = method.get("Algorithm") if method is not None else None
    if not uri:
        raise faults.security("UnsupportedAlgorithm", f"{what} without an EncryptionMethod Algorithm")
    return uri


def data_algorithm_name(ed: etree._Element, allowed: Sequence[str]) -> str:
    """The policy name of an EncryptedData's algorithm, refused unless `allowed`."""
    return allowed_data_algorithm(_child(ed, q(XENC, "EncryptionMethod"), "EncryptedData"), allowed)


def allowed_data_algorithm(method: etree._Element | None, allowed: Sequence[str]) -> str:
    """The policy name of the algorithm an EncryptedData's EncryptionMethod (None: it has none) names, refused unless
    `allowed` (attachments.py reads the element in its own pass over the EncryptedData)."""
    uri = _algorithm_uri(method, "EncryptedData")
    name = _DATA_BY_URI.get(uri)
    if name is None or name not in allowed:
        raise faults.security("UnsupportedAlgorithm", f"data encryption algorithm not allowed: {uri[:120]}")
    return name


def _data_algorithm(ed: etree._Element, allowed: Sequence[str]) -> _DataAlgorithm:
    return DATA[data_algorithm_name(ed, allowed)]


def cipher_value(el: etree._Element, what: str) -> bytes:
    """The decoded CipherValue. Broken base64 is a FailedCheck like any other broken ciphertext."""
    data = _child(el, q(XENC, "CipherData"), what)
    if data is None:
        raise faults.security("InvalidSecurity", f"{what} without CipherData")
    if _child(data, q(XENC, "CipherReference"), what) is not None:
        raise faults.security("InvalidSecurity", f"{what}: CipherReference is not supported")
    value = _child(data, q(XENC, "CipherValue"), what)
    if value is None:
        raise faults.security("InvalidSecurity", f"{what} without CipherValue")
    if len(value):
        raise failed(f"{what}: CipherValue has child nodes")
    try:
        # Non-strict: CipherValues are often line-wrapped; whitespace is skipped without a copy.
        return binascii.a2b_base64(value.text or "")
    except (binascii.Error, ValueError):
        raise failed(f"{what}: CipherValue is not base64") from None


def is_cbc(algorithm: str) -> bool:
    """Whether a data algorithm (policy name) is CBC: unauthenticated, its padding an oracle if decrypted unchecked."""
    return not DATA[algorithm].gcm


def cbc_data(ed: etree._Element, allowed: Sequence[str]) -> bool:
    """Whether an EncryptedData uses a CBC algorithm (checked against `allowed` first)."""
    return not _data_algorithm(ed, allowed).gcm


def data_key_size(ed: etree._Element, allowed: Sequence[str]) -> int:
    """The key length the EncryptedData's algorithm needs (checked against `allowed` first).

    Pass it to `decrypt_key` as `key_size`, so an rsa-1_5 failure yields a key of the right length."""
    return _data_algorithm(ed, allowed).key_size


def key_size(algorithm: str) -> int:
    """The key length a data algorithm (policy name) needs."""
    return DATA[algorithm].key_size


def new_key(algorithm: str) -> bytes:
    """A fresh random key for a data algorithm (policy name)."""
    return os.urandom(DATA[algorithm].key_size)


def key_for(ed: etree._Element) -> etree._Element | None:
    """The ds:KeyInfo of an EncryptedData or EncryptedKey, or None."""
    return _child(ed, q(DS, "KeyInfo"), etree.QName(ed).localname)


def embedded_encrypted_key(ed: etree._Element) -> etree._Element | None:
    """The xenc:EncryptedKey inside the EncryptedData's ds:KeyInfo, or None (the key comes from elsewhere)."""
    key_info = key_for(ed)
    if key_info is None:
        return None
    return _child(key_info, q(XENC, "EncryptedKey"), "EncryptedData KeyInfo")


def reference_list(ek_or_reflist: etree._Element) -> list[str]:
    """The ids (without '#') an xenc:ReferenceList, standalone or inside an xenc:EncryptedKey, points at."""
    if ek_or_reflist.tag == q(XENC, "EncryptedKey"):
        reflist = _child(ek_or_reflist, q(XENC, "ReferenceList"), "EncryptedKey")
        if reflist is None:
            return []
    else:
        _expect(ek_or_reflist, q(XENC, "ReferenceList"))
        reflist = ek_or_reflist
    ids: list[str] = []
    for ref in reflist:
        if not isinstance(ref.tag, str):
            continue  # comments
        if ref.tag != q(XENC, "DataReference"):
            # KeyReference (keys encrypting keys) is not something WS-Security senders use: fail closed.
            raise faults.security("InvalidSecurity", f"unsupported ReferenceList entry {ref.tag!r:.120}")
        uri = ref.get("URI") or ""
        if not uri.startswith("#") or len(uri) == 1:
            raise faults.security("InvalidSecurity", f"DataReference is not a local reference: {uri[:120]!r}")
        ids.append(uri[1:])
    return ids


# --- key transport -------------------------------------------------------------------------------------


def _key_transport_padding(method: etree._Element, transport: str) -> padding.AsymmetricPadding:
    """The padding an EncryptionMethod asks for; unknown digests or MGFs are unsupported algorithms."""
    if transport == "rsa-1_5":
        return padding.PKCS1v15()
    digest = "sha1"
    digest_method = _child(method, q(DS, "DigestMethod"), "EncryptionMethod")
    if digest_method is not None:
        uri = digest_method.get("Algorithm") or ""
        if uri not in _DIGEST_BY_URI:
            raise faults.security("UnsupportedAlgorithm", f"OAEP digest not supported: {uri[:120]}")
        digest = _DIGEST_BY_URI[uri]
    mgf = "sha1"  # rsa-oaep-mgf1p fixes MGF1-SHA1; xenc11 rsa-oaep defaults to it
    mgf_el = _child(method, q(XENC11, "MGF"), "EncryptionMethod")
    if mgf_el is not None:
        uri = mgf_el.get("Algorithm") or ""
        if transport != "rsa-oaep" or uri not in _MGF_BY_URI:
            raise faults.security("UnsupportedAlgorithm", f"OAEP MGF not supported: {uri[:120]}")
        mgf = _MGF_BY_URI[uri]
    label = None
    params = _child(method, q(XENC, "OAEPparams"), "EncryptionMethod")
    if params is not None:
        try:
            label = base64.b64decode(params.text or "", validate=True) or None
        except (binascii.Error, ValueError):
            raise faults.security("InvalidSecurity", "OAEPparams is not base64") from None
    return padding.OAEP(mgf=padding.MGF1(_HASHES[mgf]()), algorithm=_HASHES[digest](), label=label)


@metrics.timed("decrypt")
def decrypt_key(
    ek: etree._Element,
    private_key: rsa.RSAPrivateKey,
    allowed: Sequence[str],
    key_size: int | None = None,
) -> bytes:
    """The symmetric key an xenc:EncryptedKey carries, decrypted with our RSA key.

    `allowed`: policy key transport names. `key_size`: the length the data algorithm needs (see
    `data_key_size`); a key of another length is a FailedCheck. For rsa-1_5 a failure is never reported here:
    a random key of `key_size` (32 when unknown) comes back instead and the data decryption fails."""
    _expect(ek, q(XENC, "EncryptedKey"))
    method, uri = _method_uri(ek, "EncryptedKey")
    transport = _TRANSPORT_BY_URI.get(uri)
    if transport is None or transport not in allowed:
        raise faults.security("UnsupportedAlgorithm", f"key transport not allowed: {uri[:120]}")
    pad = _key_transport_padding(method, transport)
    ciphertext = cipher_value(ek, "EncryptedKey")
    if transport == "rsa-1_5":
        # Bleichenbacher countermeasure: same path and same outcome for a bad block and a wrong key.
        # (OpenSSL's implicit rejection already returns a pseudo-random message instead of failing.)
        fallback = os.urandom(key_size or 32)
        try:
            key = private_key.decrypt(ciphertext, pad)
        except ValueError:
            key = fallback
        ok_length = len(key) == key_size if key_size else len(key) in (16, 24, 32)
        return key if ok_length else fallback
    try:
        key = private_key.decrypt(ciphertext, pad)
    except ValueError:
        raise failed(f"EncryptedKey: {transport} decryption failed") from None
    if (key_size and len(key) != key_size) or not key:
        raise failed(f"EncryptedKey: key of {len(key)} bytes, {key_size} needed")
    return key


@metrics.timed("encryption")
def encrypt_key(
    key: bytes,
    certificate: x509.Certificate,
    transport: str,
    id: str,
    key_info: etree._Element,
    reference_ids: list[str],
    *,
    digest: Digest = "sha1",
    mgf: Digest = "sha1",
) -> etree._Element:
    """An xenc:EncryptedKey carrying `key` to the certificate's owner.

    `transport`: policy name; `digest` is the OAEP digest (both OAEP variants), `mgf` the MGF1 hash (only
    xenc11 rsa-oaep has a choice). `key_info` (e.g. a wsse:SecurityTokenReference) goes into ds:KeyInfo;
    `reference_ids` become a ReferenceList of DataReferences."""
    public_key = certificate.public_key()
    if not isinstance(public_key, rsa.RSAPublicKey):
        raise ValueError("key transport needs an RSA certificate")
    if transport == "rsa-1_5":
        if (digest, mgf) != ("sha1", "sha1"):
            raise ValueError("rsa-1_5 has no digest or MGF")
        pad: padding.AsymmetricPadding = padding.PKCS1v15()
    elif transport == "rsa-oaep-mgf1p":
        if mgf != "sha1":
            raise ValueError("rsa-oaep-mgf1p always uses MGF1-SHA1")
        pad = padding.OAEP(mgf=padding.MGF1(hashes.SHA1()), algorithm=_HASHES[digest](), label=None)
    elif transport == "rsa-oaep":
        pad = padding.OAEP(mgf=padding.MGF1(_HASHES[mgf]()), algorithm=_HASHES[digest](), label=None)
    else:
        raise ValueError(f"unknown key transport {transport!r}")
    ek = etree.Element(q(XENC, "EncryptedKey"), {"Id": id}, nsmap={"xenc": XENC, "ds": DS})
    method = etree.SubElement(ek, q(XENC, "EncryptionMethod"), Algorithm=KEY_TRANSPORTS[transport])
    # Defaults (SHA-1, MGF1-SHA1) are left implicit, as WSS4J does; only stronger choices are written.
    if digest != "sha1":
        etree.SubElement(method, q(DS, "DigestMethod"), Algorithm=_DIGEST_URIS[digest])
    if mgf != "sha1":
        etree.SubElement(method, q(XENC11, "MGF"), Algorithm=_MGF_URIS[mgf], nsmap={"xenc11": XENC11})
    etree.SubElement(ek, q(DS, "KeyInfo")).append(key_info)
    cipher_data = etree.SubElement(ek, q(XENC, "CipherData"))
    value = etree.SubElement(cipher_data, q(XENC, "CipherValue"))
    value.text = base64.b64encode(public_key.encrypt(key, pad)).decode("ascii")
    if reference_ids:
        reflist = etree.SubElement(ek, q(XENC, "ReferenceList"))
        for rid in reference_ids:
            etree.SubElement(reflist, q(XENC, "DataReference"), URI="#" + rid)
    return ek


# --- data ----------------------------------------------------------------------------------------------


def _decrypt(alg: _DataAlgorithm, key: bytes, data: bytes) -> tuple[bytes, ...]:
    """The plaintext, in pieces that are fed to the parser as they are (no copy to strip CBC padding)."""
    if len(key) != alg.key_size:
        raise failed(f"EncryptedData: key of {len(key)} bytes for a {alg.key_size}-byte algorithm")
    view = memoryview(data)
    if alg.gcm:
        if len(data) < GCM_IV + GCM_TAG:
            raise failed(f"EncryptedData: GCM CipherValue of {len(data)} bytes is too short")
        try:
            return (AESGCM(key).decrypt(view[:GCM_IV], view[GCM_IV:], None),)
        except InvalidTag:
            raise failed("EncryptedData: GCM authentication tag mismatch") from None
    if len(data) < 2 * BLOCK or len(data) % BLOCK:
        raise failed(f"EncryptedData: CBC CipherValue of {len(data)} bytes is not IV + whole blocks")
    decryptor = Cipher(algorithms.AES(key), modes.CBC(view[:BLOCK])).decryptor()
    head = decryptor.update(view[BLOCK:-BLOCK])
    last = decryptor.update(view[-BLOCK:]) + decryptor.finalize()
    # XML Encryption padding: the last byte is the pad length (1..16), the other pad bytes are arbitrary.
    pad = last[-1]
    if not 1 <= pad <= BLOCK:
        raise failed("EncryptedData: bad CBC padding")
    return (head, last[: BLOCK - pad])


@metrics.timed("decrypt")
def decrypt_data(ed: etree._Element, key: bytes, allowed: Sequence[str], limits: Limits) -> list[etree._Element]:
    """Decrypt an xenc:EncryptedData in place: the plaintext nodes replace it in the tree.

    `allowed`: policy data algorithm names. Returns what now holds the plaintext, for the caller's
    is-it-signed check: the decrypted element (Type Element) or the EncryptedData's parent (Type Content)."""
    _expect(ed, q(XENC, "EncryptedData"))
    kind = ed.get("Type")
    if kind not in (TYPE_CONTENT, TYPE_ELEMENT):
        raise faults.security("InvalidSecurity", f"EncryptedData Type not supported: {str(kind)[:120]}")
    alg = _data_algorithm(ed, allowed)  # before anything is decrypted (CVE-2012-5575)
    parent = ed.getparent()
    if parent is None:
        raise faults.security("InvalidSecurity", "EncryptedData is the document element")
    chunks = _decrypt(alg, key, cipher_value(ed, "EncryptedData"))
    depth = sum(1 for _ in parent.iterancestors()) + 1
    try:
        # The gate: the plaintext parsed with the envelope's hardening, where it will land (the parent's
        # namespaces in scope; not the EncryptedData's own: .NET declares xenc as the default namespace there).
        wrapper = threat_protection.parse_fragment(chunks, parent.nsmap, limits, depth)
    except faults.Fault as fault:
        raise failed(f"EncryptedData: decrypted content refused: {fault.reason}") from None
    nodes = list(wrapper)
    if kind == TYPE_ELEMENT and not (
        len(nodes) == 1
        and isinstance(nodes[0].tag, str)
        and not (wrapper.text or "").strip()
        and not (nodes[0].tail or "").strip()
    ):
        raise failed("EncryptedData: Type Element but the plaintext is not one element")
    if kind == TYPE_CONTENT and not nodes and not wrapper.text:
        xmlsupport.remove(ed)  # empty plaintext: nothing to parse in place (libxml2 refuses an empty chunk)
        return [parent]
    landed = _put_back(ed, key)
    if _has_cdata(chunks):
        _merge_cdata(landed if kind == TYPE_ELEMENT else parent)
    return [landed] if kind == TYPE_ELEMENT else [parent]


def _has_cdata(chunks: tuple[bytes, ...]) -> bool:
    """Whether the plaintext holds a CDATA section, its marker maybe split between two chunks."""
    edges = (a[-len(_CDATA) :] + b[: len(_CDATA)] for a, b in itertools.pairwise(chunks))
    return any(_CDATA in c for c in (*chunks, *edges))


def _merge_cdata(top: etree._Element) -> None:
    """CDATA sections become plain text, as the envelope's parser makes them (libxml2 keeps them when it parses
    the plaintext in place): a value is one text, read and forwarded one way (filters/values.py)."""
    for el in top.iter():
        if el.text and isinstance(el.tag, str):
            el.text = el.text  # lxml reads text and CDATA together and writes one text node
        if el.tail:
            el.tail = el.tail


def _put_back(ed: etree._Element, key: bytes) -> etree._Element:
    """Replace `ed` by its plaintext, parsed by libxml2 in the parent's context (xmlParseInNodeContext, through
    xmlsec's decrypt) and linked in as it is; returns the element that took `ed`'s place (Type Element).

    Not lxml: moving parsed nodes into the tree makes lxml drop every declaration whose URI is already bound
    above, whatever its prefix, and rebind the names to that prefix, which breaks QNames in attribute values and
    text (xsi:type="p:T") and changes the canonical form a signature covers. The bytes are the ones the gate
    above accepted (decryption is deterministic), so a failure here is unexpected, and the same FailedCheck."""
    ctx = xmlsec.EncryptionContext()
    ctx.key = xmlsec.Key.from_binary_data(xmlsec.constants.KeyDataAes, key)
    try:
        landed = ctx.decrypt(ed)
    except xmlsec.Error as exc:
        raise failed(f"EncryptedData: putting the plaintext back failed ({type(exc).__name__})") from None
    if not isinstance(landed, etree._Element):
        raise failed("EncryptedData: plaintext was not put back")
    return landed


def encrypt_pieces(alg: _DataAlgorithm, key: bytes, pieces: Sequence[bytes | bytearray | memoryview]) -> bytearray:
    """IV || ciphertext of the pieces in order (and CBC padding) (|| tag), written once into one buffer: no piece
    copied. The EncryptedData's CipherValue (base64) and an attachment's encrypted body are both this."""
    encryptor: CipherContext
    gcm: AEADEncryptionContext | None = None  # the same encryptor, for its tag
    size = sum(len(p) for p in pieces)
    if alg.gcm:
        iv = os.urandom(GCM_IV)
        encryptor = gcm = Cipher(algorithms.AES(key), modes.GCM(iv)).encryptor()
        tail = b""
    else:
        iv = os.urandom(BLOCK)
        encryptor = Cipher(algorithms.AES(key), modes.CBC(iv)).encryptor()
        pad = BLOCK - size % BLOCK  # XML Encryption's padding: random bytes, the last one the pad's length
        tail = os.urandom(pad - 1) + bytes([pad])
    # update_into wants a block of room beyond each piece's output: GCM's tag is that room, CBC's is trimmed off.
    out = bytearray(len(iv) + size + (GCM_TAG if gcm is not None else len(tail) + BLOCK - 1))
    view = memoryview(out)
    view[: len(iv)] = iv
    at = len(iv)
    for piece in pieces:
        if piece:  # an attachment's Content-Only has no head: no call for it
            at += encryptor.update_into(piece, view[at:])
    if tail:
        at += encryptor.update_into(tail, view[at:])
    encryptor.finalize()  # nothing is held back: GCM streams, the CBC plaintext is whole blocks by now
    if gcm is not None:
        view[at:] = gcm.tag
        at += GCM_TAG
    view.release()
    del out[at:]  # CBC's room left over; none after GCM's tag
    return out


@metrics.timed("encryption")
def encrypt_content(
    el: etree._Element, key: bytes, algorithm: str, id: str, key_info: etree._Element | None
) -> etree._Element:
    """Replace `el`'s content (e.g. the soap:Body's) by one xenc:EncryptedData of Type Content and return it.

    Each child is serialized with the namespace declarations in scope, so the plaintext stands on its own
    for any decrypting stack. `key_info` (EncryptedKey, SecurityTokenReference) goes into ds:KeyInfo."""
    parts = [escape(el.text).encode()] if el.text else []
    parts.extend(etree.tostring(child, encoding="utf-8", with_tail=True) for child in el)
    ed = _encrypted_data(parts, key, algorithm, id, TYPE_CONTENT, key_info)
    el.text = None
    del el[:]
    el.append(ed)
    return ed


@metrics.timed("encryption")
def encrypt_element(
    el: etree._Element, key: bytes, algorithm: str, id: str, key_info: etree._Element | None
) -> etree._Element:
    """Replace `el` itself (e.g. a UsernameToken in the Security header) by an xenc:EncryptedData of Type Element
    and return it (WS-SecurityPolicy EncryptedSupportingTokens, WSS4J's `{Element}` encryption parts)."""
    parent = el.getparent()
    if parent is None:
        raise ValueError("the element to encrypt needs a parent")
    ed = _encrypted_data([etree.tostring(el, encoding="utf-8", with_tail=False)], key, algorithm, id, TYPE_ELEMENT,
                         key_info)  # fmt: skip
    ed.tail = el.tail
    parent.replace(el, ed)
    return ed


def _encrypted_data(
    parts: list[bytes], key: bytes, algorithm: str, id: str, kind: str, key_info: etree._Element | None
) -> etree._Element:
    alg = DATA[algorithm]
    if len(key) != alg.key_size:
        raise ValueError(f"{algorithm} needs a {alg.key_size}-byte key, got {len(key)}")
    encoded = base64.b64encode(encrypt_pieces(alg, key, parts))
    ed = etree.Element(q(XENC, "EncryptedData"), {"Id": id, "Type": kind}, nsmap={"xenc": XENC})
    etree.SubElement(ed, q(XENC, "EncryptionMethod"), Algorithm=alg.uri)
    if key_info is not None:
        etree.SubElement(ed, q(DS, "KeyInfo"), nsmap={"ds": DS}).append(key_info)
    cipher_data = etree.SubElement(ed, q(XENC, "CipherData"))
    etree.SubElement(cipher_data, q(XENC, "CipherValue")).text = encoded.decode("ascii")
    return ed
