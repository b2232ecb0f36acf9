"""WS-Security over SOAP attachments: the OASIS SwA profile 1.1 (wss-SwAProfile-v1.1.1), as Apache WSS4J does it.

Signatures: a ds:Reference URI="cid:..." with one transform, `Attachment-Content-Signature-Transform` (the content)
or `Attachment-Complete-Signature-Transform` (the listed MIME headers, canonicalized, then the content). Content is
digested as it travels, except XML types (exclusive C14N of the parsed content) and other text/* types (line ends
made CRLF), as WSS4J's AttachmentContentSignatureTransform does. Header canonicalization follows WSS4J's
AttachmentUtils.canonizeMimeHeaders (profile 5.4.1): only Content-Description, -Disposition, -ID, -Location and
-Type, in that order, folding and (comments) removed, parameters sorted and quoted; RFC 2231 parameter
continuations and charsets (`name*`) are refused rather than guessed.

Encryption: an xenc:EncryptedData of Type `Attachment-Content-Only` or `Attachment-Complete` whose
CipherReference names the part (`Attachment-Ciphertext-Transform`): the part's body is IV || ciphertext (|| tag),
for Complete the plaintext starts with the encrypted headers and a blank line. Same algorithms, same single
failure for the client and the same CBC rules as XML Encryption (filters/engine/wss/encryption.py; the caller
applies wssecurity._check_cbc before `decrypt`).

Bytes are hashed where they lie and ciphered in CHUNK slices of one memoryview: nothing is copied whole except the
result of a decryption or encryption (which replaces the part's body)."""

from __future__ import annotations

import base64
import copy
import functools
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from email.header import decode_header, make_header

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from lxml import etree

from filters.engine import faults, metrics, ns
from filters.engine.mime import package as mime
from filters.engine.mime import xop
from filters.engine.wss import encryption
from filters.engine.xml import c14n, xmlsupport

SWA = "http://docs.oasis-open.org/wss/oasis-wss-SwAProfile-1.1"
CONTENT_SIGNATURE = SWA + "#Attachment-Content-Signature-Transform"
COMPLETE_SIGNATURE = SWA + "#Attachment-Complete-Signature-Transform"
SIGNATURE_TRANSFORMS = {CONTENT_SIGNATURE: "content", COMPLETE_SIGNATURE: "complete"}
CIPHERTEXT = SWA + "#Attachment-Ciphertext-Transform"
CONTENT_ONLY = SWA + "#Attachment-Content-Only"
COMPLETE = SWA + "#Attachment-Complete"
ENCRYPTED_TYPES = {CONTENT_ONLY: "content", COMPLETE: "complete"}
CHUNK = 1 << 16

# The headers the profile signs and encrypts (5.3.2, 5.5.2), in their canonical spelling and order.
LISTED = ("Content-Description", "Content-Disposition", "Content-ID", "Content-Location", "Content-Type")
_LISTED = {h.lower(): h for h in LISTED}
DEFAULT_CONTENT_TYPE = 'text/plain;charset="us-ascii"'
# Parameters whose values are case-insensitive (lowercased by the canonical form).
_CASELESS_PARAMS = {"charset", "creation-date", "filename", "modification-date", "padding", "read-date", "size", "type"}
_XML_TYPES = r"text/xml|application/xml|(application|image)/.*\+xml"
_XML_TYPE = re.compile(rf"(?i)({_XML_TYPES})")
_TEXT_TYPE = re.compile(r"(?i)text/")
_TRANSFORMED_TYPE = re.compile(rf"(?i)(text/|{_XML_TYPES})")  # either of the two: one match on the usual path
_PERCENT = re.compile(rb"%([0-9A-Fa-f]{2})")
_BROKEN_PERCENT = re.compile(rb"%(?![0-9A-Fa-f]{2})")
_NOT_BARE_IN_URI = re.compile(r"[^\w.@\-!$&'*+=^`{|}~]")  # a Content-ID's characters a cid: URI escapes
# A MIME type as EncryptedData/@MimeType may give it back to a part: type/subtype and parameters, one line.
_MIME_TYPE = re.compile(r"[\w.+\-]+/[\w.+\-]+(\s*;[^\r\n]*)?")
MAX_HEADER_LINES = 100  # in the plaintext of an Attachment-Complete encryption, as WSS4J
MAX_LINE = 998
_ENCRYPTION_METHOD = ns.q(ns.XENC, "EncryptionMethod")
_CIPHER_DATA = ns.q(ns.XENC, "CipherData")
_CIPHER_REFERENCE = ns.q(ns.XENC, "CipherReference")
_TRANSFORMS = ns.q(ns.XENC, "Transforms")
_TRANSFORM = ns.q(ns.DS, "Transform")


def _twice(content_id: str, name: str) -> faults.Fault:
    return faults.security("InvalidSecurity", f"attachment {content_id[:80]!r}: {name} twice")


@dataclass(slots=True)
class Attachment:
    """One attachment as the Security header processing sees it and changes it (decryption)."""

    content_id: str  # without the angle brackets
    headers: Sequence[tuple[str, str]]  # replaced, never changed in place: the part's own tuple until then
    body: bytes | bytearray | memoryview  # decrypted or encrypted here: a bytearray
    signed: str | None = None  # "content" or "complete": how a verified signature covered it
    decrypted: bool = False
    encrypted: bool = False  # here: its body is our ciphertext
    changed: bool = False  # decrypted or encrypted here: its part is written anew (to_package)
    encrypted_data: etree._Element | None = field(default=None, repr=False)  # what it was decrypted from

    def header(self, name: str) -> str | None:
        name = name.lower()
        found = None
        for n, v in self.headers:  # a loop, not a list: read for every attachment of every message
            if n.lower() == name:
                if found is not None:
                    raise _twice(self.content_id, name)
                found = v
        return found

    @property
    def content_type(self) -> str:
        return (self.header("Content-Type") or DEFAULT_CONTENT_TYPE).strip()


class Attachments:
    """The message's attachments in package order, found by the `cid:` URIs that name them."""

    def __init__(self, parts: Iterable[Attachment]) -> None:
        self.parts = list(parts)
        self._by_id: dict[str, Attachment] = {}
        for part in self.parts:
            if self._by_id.setdefault(part.content_id, part) is not part:
                raise faults.security("InvalidSecurity", f"Content-ID {part.content_id[:80]!r} twice")

    def __iter__(self) -> Iterator[Attachment]:
        return iter(self.parts)

    def __len__(self) -> int:
        return len(self.parts)

    def by_uri(self, uri: str) -> Attachment:
        found = self._by_id.get(content_id(uri))
        if found is None:
            raise faults.security("InvalidSecurity", f"{uri[:80]!r} names no attachment")
        return found


def from_parts(parts: Sequence[mime.Part]) -> Attachments:
    """A multipart message's attachments as the Security header processing sees them: their octets, the
    transfer encoding undone (what the profile signs and encrypts); a binary part's bytes are not copied."""
    return Attachments(
        Attachment(p.content_id or "", p.headers, p.body if p.transfer_encoding != "base64" else xop.octets(p))
        for p in parts
    )


def to_package(package: mime.Package, parts: Attachments) -> mime.Package:
    """`package` with each attachment that was decrypted or encrypted written back, binary, with its new headers.
    A plaintext holding the received boundary (its sender's choice) cannot end its part early: a package written
    anew goes under a boundary drawn when it is written (related.forward, `mime.rebound`)."""
    out = []
    for old, new in zip(package.attachments, parts, strict=True):
        if not new.changed:
            out.append(old)
            continue
        # One pass: the headers and the Content-Type (its own lookup lowercased every name again); the header
        # block is rendered where the package is written (mime.segments).
        headers: list[tuple[str, str]] = []
        content_type = None
        for n, v in new.headers:
            name = n.lower()
            if name == "content-transfer-encoding":
                continue
            if name == "content-type":
                if content_type is not None:
                    raise _twice(new.content_id, name)
                content_type = v
            headers.append((n, v))
        headers.append(("Content-Transfer-Encoding", "binary"))
        out.append(mime.Part(tuple(headers), new.content_id, (content_type or DEFAULT_CONTENT_TYPE).strip(), new.body))
    return package.with_attachments(tuple(out))


@dataclass(frozen=True)
class Expanded:
    """An xop:Include replaced by its part's content as base64 text (`expand_xop`)."""

    parent: etree._Element
    href: str
    content_id: str
    text: str


def expand_xop(includes: Sequence[etree._Element], parts: Sequence[mime.Part]) -> list[Expanded]:
    """Each xop:Include replaced by the base64 text of the part it names: the infoset an MTOM sender signed and
    encrypted (XOP 1.0; WSS4J's expandXopInclude), so signatures are verified and made over it, and a CipherValue
    WSS4J stored in an attachment (storeBytesInAttachment) is read like any other. `restore_xop` undoes it."""
    by_id = {p.content_id: p for p in parts}
    out = []
    for inc in includes:  # xop.check_includes: each the only, empty child of its parent, naming an attachment
        href = inc.get("href", "")
        part = by_id.get(mime.cid(href))
        parent = inc.getparent()
        if part is None or part.content_id is None or parent is None or len(parent) != 1:
            raise mime.refused("xop:Include naming no attachment, or not alone in its element")
        text = base64.b64encode(xop.octets(part)).decode("ascii")
        parent.remove(inc)
        parent.text = text
        out.append(Expanded(parent, href, part.content_id, text))
    return out


def restore_xop(expanded: Sequence[Expanded], root: etree._Element) -> tuple[list[etree._Element], set[str]]:
    """The xop:Include elements put back where the expanded text is still in the envelope, unchanged (the message
    keeps MTOM as it came); the new Include elements, and the Content-IDs of the parts whose text is gone (a
    CipherValue decrypted, content encrypted into a reply's Body): those leave the package."""
    includes: list[etree._Element] = []
    kept: set[str] = set()
    for e in expanded:
        # An element taken out of the tree still has the document's root as getroottree's: ask its ancestors.
        attached = any(a is root for a in e.parent.iterancestors())
        if not attached or e.parent.text != e.text or len(e.parent):
            continue
        e.parent.text = None
        inc = etree.SubElement(e.parent, ns.q(xop.XOP, "Include"), nsmap={"xop": xop.XOP})
        inc.set("href", e.href)
        includes.append(inc)
        kept.add(e.content_id)
    return includes, {e.content_id for e in expanded} - kept


def bare_id(header_value: str) -> str:
    """A Content-ID header's value without its angle brackets."""
    value = header_value.strip()
    return value[1:-1] if value.startswith("<") and value.endswith(">") else value


def content_id(uri: str) -> str:
    """The Content-ID a `cid:` URI names (RFC 2392: percent-encoded; WSS4J URL-decodes it)."""
    if not uri.startswith("cid:"):
        raise faults.security("InvalidSecurity", f"{uri[:80]!r} is not a cid: URI")
    if "%" not in uri:
        return uri[4:]  # nothing to decode
    raw = uri[4:].encode("utf-8")
    if _BROKEN_PERCENT.search(raw):
        raise faults.security("InvalidSecurity", f"{uri[:80]!r}: broken percent-encoding")
    try:
        return _PERCENT.sub(lambda m: bytes([int(m[1], 16)]), raw).decode("utf-8")
    except UnicodeDecodeError:
        raise faults.security("InvalidSecurity", f"{uri[:80]!r}: not UTF-8") from None


def cid_uri(value: str) -> str:
    """The `cid:` URI for a Content-ID (percent-encoding what RFC 2392 does not allow bare)."""
    return "cid:" + _NOT_BARE_IN_URI.sub(_escape, value)


def _escape(m: re.Match[str]) -> str:
    return "".join(f"%{b:02X}" for b in m[0].encode("utf-8"))


# ---------------------------------------------------------------------------------------------------------
# Canonical forms (profile 5.4)


def _unfold(text: str) -> str:
    """Remove each line break that a space or tab follows, or that ends the value (Jakarta Mail's unfold)."""
    return re.sub(r"(\r\n|\r|\n)(?=[ \t]|$)", "", text)


def _uncomment(text: str) -> str:
    """Remove (comments), nested ones too, outside quoted strings."""
    out: list[str] = []
    depth = 0
    quoted = False
    for ch in text:
        if quoted:
            out.append(ch)
            quoted = ch != '"'
        elif depth:
            depth += {"(": 1, ")": -1}.get(ch, 0)
        elif ch == "(":
            depth = 1
        else:
            out.append(ch)
            quoted = ch == '"'
    return "".join(out)


def _quote(text: str) -> str:
    start, end = text[:1] == '"', text[-1:] == '"'
    return text if start and end else ("" if start else '"') + text + ("" if end else '"')


def _unquote_inner(text: str) -> str:
    """WSS4J's unquoteInnerText over a quoted value: inner quotes escaped, other escapes resolved."""
    out: list[str] = []
    n = len(text)
    i = 0
    while i < n - 1:
        c, c1 = text[i], text[i + 1]
        if i == 0 and c == '"':
            out.append(c)
        elif c == "\\" and c1 in '"\\':
            if i not in (0, n - 2):
                out.append(c)
            out.append(c1)
            i += 1
        elif c == '"':
            out.append("\\" + c)
        elif c == "\\":
            out.append(c1)
            i += 1
        else:
            out.append(c)
            if i == n - 2 and c1 == '"':
                out.append(c1)
        i += 1
    return "".join(out)


def _parameters(text: str) -> str:
    """A Content-Type or Content-Disposition value with parameters: the value lowercased, parameters sorted, values
    quoted."""
    head, *params = text.split(";")
    canonical: dict[str, str] = {}
    for param in params:
        name, eq, value = param.partition("=")
        name, value = name.strip().lower(), value.strip()
        if not eq or not name or not value or "*" in name:
            raise faults.security("InvalidSecurity", f"MIME parameter {param.strip()[:80]!r} cannot be canonicalized")
        canonical[name] = _unquote_inner(_quote(value.lower() if name in _CASELESS_PARAMS else value))
    return head.lower() + "".join(f";{name}={canonical[name]}" for name in sorted(canonical))


def canonical_headers(headers: Sequence[tuple[str, str]]) -> bytes:
    """The profile's canonical MIME headers (5.4.1) as WSS4J writes them: `Name:value` CRLF each, sorted (LISTED
    is in that order). Folds, comments and parameters are looked for before a call to undo them: the usual part's
    two headers have none, and the calls and a sort cost half of it (~10K instructions a part, each way)."""
    found: dict[str, str] = {}
    for name, value in headers:
        canonical_name = _LISTED.get(name.strip().lower())
        if canonical_name is None:
            continue
        if canonical_name in found:
            raise faults.security("InvalidSecurity", f"{canonical_name} twice in one attachment")
        if "\r" in value or "\n" in value:
            value = _unfold(value)
        if canonical_name == "Content-Description":
            decoded = str(make_header(decode_header(value))) if "=?" in value else value
            found[canonical_name] = _uncomment(decoded) if "(" in decoded else decoded
            continue
        text = value.lstrip(" \t")
        if "(" in text:
            text = _uncomment(text)
        if ";" in text and canonical_name in ("Content-Type", "Content-Disposition"):
            text = _parameters(text)
        found[canonical_name] = text
    found.setdefault("Content-Type", DEFAULT_CONTENT_TYPE)
    out = ""
    for name in LISTED:
        canonical = found.get(name)
        if canonical is not None:
            out += f"{name}:{canonical}" if canonical.endswith("\r\n") else f"{name}:{canonical}\r\n"
    return out.encode("utf-8")


def _chunks(body: bytes | bytearray | memoryview) -> Iterator[memoryview]:
    view = memoryview(body)
    for start in range(0, len(view), CHUNK):
        yield view[start : start + CHUNK]


def _crlf(chunks: Iterable[memoryview]) -> Iterator[bytes]:
    """Every line end (CR, LF or CRLF) written as CRLF, across chunk boundaries."""
    after_cr = False
    for chunk in chunks:
        data = bytes(chunk)
        if after_cr and data.startswith(b"\n"):
            data = data[1:]
        after_cr = data.endswith(b"\r")
        yield data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").replace(b"\n", b"\r\n")


def content_form(attachment: Attachment) -> Iterator[bytes | bytearray | memoryview]:
    """The Attachment-Content-Signature-Transform's output, in pieces."""
    mime = attachment.content_type
    if _XML_TYPE.match(mime):
        try:
            doc = etree.fromstring(bytes(attachment.body), xmlsupport.parser())
        except (etree.XMLSyntaxError, xmlsupport.ExternalResourceRefused) as exc:
            raise faults.security("InvalidSecurity", f"XML attachment does not parse: {str(exc)[:120]}") from None
        if doc.getroottree().docinfo.doctype:  # entities and DTDs: refused as in envelopes (threat_protection)
            raise faults.security("InvalidSecurity", "XML attachment with a DOCTYPE")
        yield etree.tostring(doc, method="c14n", exclusive=True, with_comments=False)
    elif _TEXT_TYPE.match(mime):
        yield from _crlf(_chunks(attachment.body))
    else:
        yield attachment.body  # whole: a hash reads the buffer where it is


@metrics.timed("digest")  # one stage with the elements' digests (docs/performance.md lists the stages)
def digest(attachment: Attachment, transform: str, algorithm: str) -> bytes:
    """The DigestValue of a reference to `attachment` with one SwA signature transform; `algorithm`: hashlib name."""
    h = c14n.HASHES[algorithm]()
    if SIGNATURE_TRANSFORMS[transform] == "complete":
        h.update(canonical_headers(attachment.headers))
    if not _TRANSFORMED_TYPE.match(attachment.content_type):
        h.update(attachment.body)  # the usual content: digested as it travels, no generator around it
        return h.digest()
    for piece in content_form(attachment):
        h.update(piece)
    return h.digest()


# ---------------------------------------------------------------------------------------------------------
# Encryption


def _read_encrypted_data(ed: etree._Element, allowed: Sequence[str]) -> tuple[str, str]:
    """An attachment EncryptedData's algorithm (policy name, refused unless `allowed`) and the cid: URI of its
    CipherReference, after checking that reference's one transform: one pass over the children (comments are gone
    by now, processing instructions refused: every child counts), the checks XML Encryption's reading makes."""
    method = data = None
    for child in ed:
        tag = child.tag
        if tag == _ENCRYPTION_METHOD:
            if method is not None:
                raise faults.security("InvalidSecurity", "EncryptedData: more than one EncryptionMethod")
            method = child
        elif tag == _CIPHER_DATA and data is None:
            data = child
    algorithm = encryption.allowed_data_algorithm(method, allowed)  # before anything is decrypted (CVE-2012-5575)
    ref = data[0] if data is not None and len(data) == 1 else None
    if ref is None or ref.tag != _CIPHER_REFERENCE:
        raise faults.security("InvalidSecurity", "attachment EncryptedData without one CipherReference")
    transforms = ref[0] if len(ref) == 1 else None
    step = transforms[0] if transforms is not None and transforms.tag == _TRANSFORMS and len(transforms) == 1 else None
    if step is None or step.tag != _TRANSFORM or step.get("Algorithm") != CIPHERTEXT or len(step):
        raise faults.security("InvalidSecurity", "attachment CipherReference must have the one Ciphertext transform")
    return algorithm, ref.get("URI") or ""


def is_attachment_data(ed: etree._Element) -> bool:
    return ed.get("Type") in ENCRYPTED_TYPES


def _decrypt_stream(key: bytes, alg_name: str, body: bytes | bytearray | memoryview) -> bytearray:
    """The plaintext, deciphered in one pass into one buffer (`*_into`: no per-chunk bytes, no regrowth).
    GCM: the tag is checked before the caller sees any of it."""
    algorithm = encryption.DATA[alg_name]
    if len(key) != algorithm.key_size:
        raise encryption.failed(f"attachment: key of {len(key)} bytes for a {algorithm.key_size}-byte algorithm")
    view = memoryview(body)
    block = encryption.BLOCK
    if algorithm.gcm:
        if len(view) < encryption.GCM_IV + encryption.GCM_TAG:
            raise encryption.failed("attachment: GCM ciphertext too short")
        out = bytearray(len(view) - encryption.GCM_IV - encryption.GCM_TAG)
        try:
            AESGCM(key).decrypt_into(view[: encryption.GCM_IV], view[encryption.GCM_IV :], None, out)
        except InvalidTag:
            raise encryption.failed("attachment: GCM authentication tag mismatch") from None
        return out
    if len(view) < 2 * block or len(view) % block:
        raise encryption.failed("attachment: CBC ciphertext is not IV + whole blocks")
    decryptor = Cipher(algorithms.AES(key), modes.CBC(view[:block])).decryptor()
    # update_into wants a block of room beyond the data; trimmed off with the padding.
    out = bytearray(len(view) - 1)
    size = decryptor.update_into(view[block:], out)
    decryptor.finalize()  # whole blocks and no padding mode: nothing is held back
    pad = out[size - 1]
    if not 1 <= pad <= block:
        raise encryption.failed("attachment: bad CBC padding")
    del out[size - pad :]
    return out


def _split_headers(plain: bytearray, part: Attachment) -> dict[str, str]:
    """The encrypted headers of an Attachment-Complete plaintext by canonical name, taken off its front (the content
    stays)."""
    end = plain.find(b"\r\n\r\n", 0, (MAX_LINE + 2) * MAX_HEADER_LINES)
    if plain.startswith(b"\r\n"):
        end = -2
    if end < -2 or end == -1:
        raise encryption.failed("attachment: Attachment-Complete plaintext without a header block")
    lines = plain[: max(end, 0)].decode("ascii", "replace").split("\r\n") if end > 0 else []
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        canonical = _LISTED.get(name.strip().lower())
        if not colon or canonical is None or len(line) > MAX_LINE or canonical in headers:
            raise encryption.failed("attachment: Attachment-Complete plaintext with a header not listed, twice or long")
        headers[canonical] = value
    inner_id = headers.get("Content-ID")
    if inner_id is not None and bare_id(inner_id) != part.content_id:
        raise encryption.failed("attachment: encrypted Content-ID differs from the part's")
    del plain[: end + 4]  # in place: no second copy of the content
    return headers


@metrics.timed("decrypt")
def decrypt(
    ed: etree._Element,
    key: bytes,
    allowed: Sequence[str],
    parts: Attachments,
    before: Callable[[str], None] | None = None,
) -> Attachment:
    """Decrypt the attachment an EncryptedData (Type Attachment-Content-Only or -Complete) names, in place: its body
    becomes the plaintext, its headers what the encryption says. `allowed`: policy data algorithm names; `before`
    is given the algorithm once allowed, before anything is decrypted (the caller's CBC rules)."""
    kind = ENCRYPTED_TYPES.get(ed.get("Type") or "")
    if kind is None:
        raise faults.security("InvalidSecurity", "not an attachment EncryptedData")
    alg_name, uri = _read_encrypted_data(ed, allowed)
    part = parts.by_uri(uri)
    if part.decrypted:
        raise faults.security("InvalidSecurity", f"attachment {part.content_id[:80]!r} decrypted twice")
    if before is not None:
        before(alg_name)
    plain = _decrypt_stream(key, alg_name, part.body)
    if kind == "content":
        mime = (ed.get("MimeType") or "").strip()
        if not _MIME_TYPE.fullmatch(mime):
            raise encryption.failed("attachment: Attachment-Content-Only without a usable MimeType")
        part.headers = [(n, v) for n, v in part.headers if n.lower() != "content-type"] + [("Content-Type", mime)]
        part.body = plain
    else:
        inner = _split_headers(plain, part)  # canonical names: an outer header of a listed name gives way
        part.headers = [(n, v) for n, v in part.headers if _LISTED.get(n.lower()) not in inner] + list(inner.items())
        part.body = plain
    part.decrypted = True
    part.changed = True
    part.encrypted_data = ed
    return part


# An attachment's EncryptedData (no KeyInfo: the EncryptedKey's ReferenceList names it), copied per part: a
# copy of this tree costs half of building it element by element; one per algorithm and Type (`_template`), so a
# copy needs only its Id, MimeType and URI set.
_ENCRYPTED_DATA = etree.fromstring(
    f'<xenc:EncryptedData xmlns:xenc="{ns.XENC}" Id="" MimeType="" Type=""><xenc:EncryptionMethod Algorithm=""/>'
    f'<xenc:CipherData><xenc:CipherReference URI=""><xenc:Transforms><ds:Transform xmlns:ds="{ns.DS}" '
    f'Algorithm="{CIPHERTEXT}"/></xenc:Transforms></xenc:CipherReference></xenc:CipherData></xenc:EncryptedData>'
)


@functools.cache
def _template(algorithm: str, complete: bool) -> etree._Element:
    ed = copy.deepcopy(_ENCRYPTED_DATA)
    ed.set("Type", COMPLETE if complete else CONTENT_ONLY)
    ed[0].set("Algorithm", encryption.DATA[algorithm].uri)
    return ed


def _gcm_once(key: bytes, pieces: Sequence[bytes | bytearray | memoryview]) -> bytearray:
    """IV || ciphertext || tag of a small plaintext in one AESGCM call over the pieces joined: a copy of at most CHUNK
    bytes, for half the Python-level setup of a streaming Cipher."""
    iv = os.urandom(encryption.GCM_IV)
    out = bytearray(iv)
    out += AESGCM(key).encrypt(iv, b"".join(pieces), None)
    return out


@metrics.timed("encryption")
def encrypt(part: Attachment, key: bytes, algorithm: str, complete: bool, ed_id: str) -> etree._Element:
    """Encrypt `part` in place (body: IV || ciphertext (|| tag), Content-Type application/octet-stream) and return
    its xenc:EncryptedData."""
    alg = encryption.DATA[algorithm]
    if len(key) != alg.key_size:
        raise ValueError(f"a {alg.key_size}-byte key is needed for {algorithm}")
    mime = None
    lines: list[str] = []  # Attachment-Complete: the listed headers go inside, the Content-ID stays outside too
    kept: list[tuple[str, str]] = []
    for n, v in part.headers:  # one loop, the Content-Type too (as `content_type` reads it): every part of every reply
        canonical = _LISTED.get(n.lower())
        if canonical is None:
            kept.append((n, v))
            continue
        if canonical == "Content-Type":
            if mime is not None:
                raise _twice(part.content_id, "content-type")
            mime = v
        if complete:
            lines.append(f"{canonical}:{v}\r\n")
        if canonical != "Content-Type" and (canonical == "Content-ID" or not complete):
            kept.append((n, v))
    kept.append(("Content-Type", "application/octet-stream"))
    head = ("".join(lines) + "\r\n").encode("ascii") if complete else b""
    if alg.gcm and len(part.body) <= CHUNK:
        part.body = _gcm_once(key, (head, part.body))
    else:
        part.body = encryption.encrypt_pieces(alg, key, (head, part.body))
    part.encrypted = part.changed = True
    part.headers = kept
    ed = copy.copy(_template(algorithm, complete))  # lxml copies the whole tree either way; deepcopy adds its memo
    ed.set("Id", ed_id)
    ed.set("MimeType", (mime or DEFAULT_CONTENT_TYPE).strip())
    ed[1][0].set("URI", cid_uri(part.content_id))
    return ed
