"""Key material and token references.

PEM loading (cached by path), the trust store that turns a certificate into an authenticated subject,
wsse:BinarySecurityToken, and the ds:KeyInfo / wsse:SecurityTokenReference forms WSS4J, CXF and WCF send:
a direct Reference to a token, a KeyIdentifier (SKI, SHA-1 thumbprint, EncryptedKeySHA1), an X509IssuerSerial,
or a ds:KeyName naming a pre-shared key. Parsing refuses ambiguity: one KeyInfo child, one reference form."""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import functools
import hashlib
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509 import verification
from cryptography.x509.oid import NameOID
from lxml import etree

from filters.engine import faults, ns
from filters.engine.wss import token

# lxml names a namespace it has to declare on its own after this table (ns0 otherwise); WSS4J's prefixes.
for _prefix in ("wsse", "wsu", "wsse11", "ds", "xenc", "ec"):
    etree.register_namespace(_prefix, ns.ALL[_prefix])

# ---------------------------------------------------------------------------------------------------------
# PEM files


@functools.lru_cache(maxsize=64)
def _read_private_key(path: str) -> rsa.RSAPrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"{path}: not an RSA private key")
    return key


@functools.lru_cache(maxsize=256)
def _read_certificates(path: str) -> tuple[x509.Certificate, ...]:
    certs = x509.load_pem_x509_certificates(Path(path).read_bytes())
    if not certs:
        raise ValueError(f"{path}: no certificate")
    return tuple(certs)


@functools.lru_cache(maxsize=64)
def _token_key(uri: str) -> token.TokenKey:
    return token.TokenKey(uri)


def load_private_key(path: str | Path) -> rsa.RSAPrivateKey:
    """An unencrypted PEM RSA private key (PKCS#8 or PKCS#1), or a key in a PKCS#11 token named by its pkcs11:
    URI (filters/engine/wss/token.py), which signs and decrypts there."""
    if token.is_uri(str(path)):
        return _token_key(str(path))
    return _read_private_key(str(path))


def private_key_available(path: str) -> bool:
    """Whether a key is configured: a token key always is (its absence is a fault when it is used), a file if
    it exists."""
    return token.is_uri(path) or Path(path).exists()


def load_certificate(path: str | Path) -> x509.Certificate:
    """The first certificate of a PEM file."""
    return _read_certificates(str(path))[0]


def load_certificates(paths: Sequence[str | Path]) -> list[x509.Certificate]:
    """Every certificate of every PEM file (bundles welcome), in order."""
    return [c for p in paths for c in _read_certificates(str(p))]


# A key name travels as the fragment of a wsse:Reference URI (a shorthand XPointer: an NCName, BSP R5204).
_KEY_NAME = re.compile(r"[^\W\d][\w.\-]*")


def load_hmac_keys(path: str | Path) -> dict[str, bytes]:
    """Pre-shared HMAC keys from YAML `keys: {name: base64}`; keys shorter than 128 bits are refused, and so are
    names that cannot be a reference's fragment (letters, digits, '.', '-', '_'; not starting with a digit)."""
    doc = yaml.safe_load(Path(path).read_text())
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"{path}: expected a non-empty mapping `keys: {{name: base64}}`")
    out: dict[str, bytes] = {}
    for name, value in entries.items():
        if not isinstance(name, str) or not name or not isinstance(value, str):
            raise ValueError(f"{path}: key {name!r}: name and value must be strings")
        if not _KEY_NAME.fullmatch(name):
            raise ValueError(f"{path}: key name {name!r} is not an XML NCName (it is sent as a reference '#name')")
        try:
            secret = base64.b64decode(value, validate=True)
        except binascii.Error:
            raise ValueError(f"{path}: key {name}: not base64") from None
        if len(secret) < 16:
            raise ValueError(f"{path}: key {name}: shorter than 16 bytes")
        out[name] = secret
    return out


# ---------------------------------------------------------------------------------------------------------
# Distinguished names

# Real clients write issuer names their own way: Java "CN=a,O=b", .NET "CN=a, O=b" and "E=" for e-mail.
_RDN_START = re.compile(r"(^|(?<!\\),)\s*([A-Za-z][A-Za-z0-9-]*)\s*=")
_DN_NAMES = {"E": NameOID.EMAIL_ADDRESS, "EMAILADDRESS": NameOID.EMAIL_ADDRESS, "S": NameOID.STATE_OR_PROVINCE_NAME}


def parse_dn(text: str) -> x509.Name:
    """An RFC 4514 string (with the common Java/.NET liberties) as an x509.Name; ValueError if unparsable."""
    norm = _RDN_START.sub(lambda m: f"{m.group(1)}{m.group(2).upper()}=", text.strip())
    return x509.Name.from_rfc4514_string(norm, _DN_NAMES)


# ---------------------------------------------------------------------------------------------------------
# Trust store

CACHE_TTL = dt.timedelta(minutes=5)
CACHE_SIZE = 10_000


@dataclass(frozen=True)
class _Decision:
    subject: str
    valid_from: dt.datetime
    expires: dt.datetime
    chain: tuple[x509.Certificate, ...]  # leaf first, anchor last: its revocation status is asked every time


# Web PKI rules, except that a client certificate needs no subjectAltName: WS-Security signers are people and
# systems named by their subject, not host names.
_CA_POLICY = verification.ExtensionPolicy.webpki_defaults_ca()
_EE_POLICY = verification.ExtensionPolicy.webpki_defaults_ee().may_be_present(
    x509.SubjectAlternativeName, verification.Criticality.AGNOSTIC, None
)


class RevocationCheck(Protocol):
    """Whether the certificates of a validated chain are still in good standing (filters/stores/revocation.py:
    CRL files, OCSP)."""

    def check(self, chain: Sequence[x509.Certificate], now: dt.datetime) -> None:
        """Raise a fault when a certificate of `chain` (leaf first) is revoked or its status cannot be had."""
        ...


class TrustStore:
    """Decides whether a certificate chains to one of `anchors` and, when `allowed_subjects` is given,
    whether its subject is on that list.

    Positive decisions are cached by SHA-256 fingerprint until the earliest of the chain's not-after dates or
    CACHE_TTL, so the hot path does not rebuild chains; the cache is bounded (least recently used goes). With a
    `revocation` checker, a cached chain is still checked on every use: the checker's own cache holds answers
    only for their validity, so a trusted decision never outlives a revocation."""

    def __init__(
        self,
        anchors: list[x509.Certificate],
        allowed_subjects: list[str] | None = None,
        *,
        intermediates: Sequence[x509.Certificate] = (),
        revocation: RevocationCheck | None = None,
        cache_ttl: dt.timedelta = CACHE_TTL,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        if not anchors:
            raise ValueError("a trust store needs at least one anchor")
        self._store = verification.Store(anchors)
        self._intermediates = list(intermediates)
        self._revocation = revocation
        self._allowed = None if allowed_subjects is None else [parse_dn(s) for s in allowed_subjects]
        self._ttl = cache_ttl
        self._size = cache_size
        self._cache: OrderedDict[bytes, _Decision] = OrderedDict()

    def validate(self, cert: x509.Certificate, intermediates: Sequence[x509.Certificate], now: dt.datetime) -> str:
        """The certificate's subject as an RFC 4514 string, or FailedAuthentication."""
        now = now.astimezone(dt.UTC) if now.tzinfo else now.replace(tzinfo=dt.UTC)
        fingerprint = cert.fingerprint(hashes.SHA256())
        hit = self._cache.get(fingerprint)
        if hit is not None and hit.valid_from <= now < hit.expires:
            self._cache.move_to_end(fingerprint)
            if self._revocation is not None:
                self._revocation.check(hit.chain, now)
            return hit.subject
        subject = cert.subject.rfc4514_string()
        verifier = (
            verification.PolicyBuilder()
            .store(self._store)
            .time(now)
            .extension_policies(ca_policy=_CA_POLICY, ee_policy=_EE_POLICY)
            .build_client_verifier()
        )
        try:
            chain = verifier.verify(cert, [*intermediates, *self._intermediates]).chain
        except verification.VerificationError as exc:
            raise faults.security("FailedAuthentication", f"certificate {subject!r} not trusted: {exc}") from None
        if self._allowed is not None and cert.subject not in self._allowed:
            raise faults.security("FailedAuthentication", f"subject {subject!r} is not on the allow-list")
        if self._revocation is not None:
            self._revocation.check(chain, now)
        self._cache[fingerprint] = _Decision(
            subject=subject,
            valid_from=max(c.not_valid_before_utc for c in chain),
            expires=min([now + self._ttl, *(c.not_valid_after_utc for c in chain)]),
            chain=tuple(chain),
        )
        self._cache.move_to_end(fingerprint)
        while len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return subject

    def chain(self, cert: x509.Certificate) -> tuple[x509.Certificate, ...]:
        """The chain (leaf first) `validate` last found for `cert`; empty when it was not validated."""
        hit = self._cache.get(cert.fingerprint(hashes.SHA256()))
        return hit.chain if hit is not None else ()


# ---------------------------------------------------------------------------------------------------------
# BinarySecurityToken

BST = ns.q(ns.WSSE, "BinarySecurityToken")
STR = ns.q(ns.WSSE, "SecurityTokenReference")
WSU_ID = ns.q(ns.WSU, "Id")


def _b64decode(text: str | None, what: str, code: str) -> bytes:
    try:
        data = base64.b64decode("".join((text or "").split()), validate=True)
    except binascii.Error:
        raise faults.security(code, f"{what}: not base64") from None
    if not data:
        raise faults.security(code, f"{what}: empty")
    return data


def parse_bst(el: etree._Element) -> x509.Certificate:
    """The certificate in an X509v3 Base64Binary wsse:BinarySecurityToken."""
    if el.tag != BST:
        raise faults.security("InvalidSecurityToken", f"not a BinarySecurityToken: {el.tag}")
    value_type = el.get("ValueType")
    if value_type != ns.X509V3:
        raise faults.security("UnsupportedSecurityToken", f"BinarySecurityToken ValueType {value_type!r}")
    # The Basic Security Profile makes EncodingType mandatory (R3029); WSS4J enforces it, and so do we.
    if el.get("EncodingType") != ns.BASE64:
        raise faults.security("InvalidSecurityToken", f"BinarySecurityToken EncodingType {el.get('EncodingType')!r}")
    if len(el):
        raise faults.security("InvalidSecurityToken", "BinarySecurityToken has child elements")
    der = _b64decode(el.text, "BinarySecurityToken", "InvalidSecurityToken")
    try:
        return x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise faults.security("InvalidSecurityToken", f"BinarySecurityToken: not a certificate: {exc}") from None


def make_bst(cert: x509.Certificate, id: str) -> etree._Element:
    """A wsse:BinarySecurityToken carrying `cert`, shaped like WSS4J's."""
    el = etree.Element(BST, nsmap={"wsse": ns.WSSE, "wsu": ns.WSU})
    el.set("EncodingType", ns.BASE64)
    el.set("ValueType", ns.X509V3)
    el.set(WSU_ID, id)
    el.text = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
    return el


# ---------------------------------------------------------------------------------------------------------
# SecurityTokenReference

KeyRefKind = Literal["reference", "ski", "thumbprint", "issuer_serial", "encrypted_key_sha1", "key_name", "saml_id"]


@dataclass(frozen=True)
class KeyRef:
    """How a KeyInfo names its key.

    value: the token id without '#' (reference), the identifier in canonical base64 (ski, thumbprint,
    encrypted_key_sha1), the issuer name as sent (issuer_serial), the key name (key_name).
    value_type: the ValueType attribute (reference, key identifiers). serial: issuer_serial's serial number."""

    kind: KeyRefKind
    value: str
    value_type: str | None = None
    serial: int | None = None


_KEY_IDENTIFIERS: dict[str, KeyRefKind] = {
    ns.X509_SKI: "ski",
    ns.THUMBPRINT_SHA1: "thumbprint",
    ns.ENCKEY_SHA1: "encrypted_key_sha1",
}
# Same-document bare-name references only: no external URIs, no XPointer.
_LOCAL_REF = re.compile(r"#[^\W\d][\w.\-]*")
_SERIAL = re.compile(r"\d{1,64}")


def _children(el: etree._Element) -> list[etree._Element]:
    return [c for c in el if isinstance(c.tag, str)]


def _text_only(el: etree._Element, what: str) -> str:
    text = (el.text or "").strip()
    if len(el) or not text:
        raise faults.security("InvalidSecurity", f"{what}: expected non-empty text")
    return text


def parse_key_info(key_info: etree._Element) -> KeyRef:
    """The one key reference in a ds:KeyInfo: a wsse:SecurityTokenReference or a ds:KeyName."""
    if key_info.tag != ns.q(ns.DS, "KeyInfo"):
        raise faults.security("InvalidSecurity", f"not a ds:KeyInfo: {key_info.tag}")
    children = _children(key_info)
    if not children:
        raise faults.security("SecurityTokenUnavailable", "empty ds:KeyInfo")
    if len(children) > 1:
        raise faults.security("InvalidSecurity", f"ds:KeyInfo has {len(children)} children, one expected")
    child = children[0]
    if child.tag == ns.q(ns.DS, "KeyName"):
        return KeyRef("key_name", _text_only(child, "ds:KeyName"))
    if child.tag == STR:
        return parse_str(child)
    if child.tag == ns.q(ns.DS, "RetrievalMethod"):
        raise faults.security("InvalidSecurity", "ds:RetrievalMethod is not allowed")
    raise faults.security("SecurityTokenUnavailable", f"unsupported key reference {child.tag}")


def parse_str(str_el: etree._Element) -> KeyRef:
    """The one reference form in a wsse:SecurityTokenReference."""
    if str_el.tag != STR:
        raise faults.security("InvalidSecurity", f"not a SecurityTokenReference: {str_el.tag}")
    forms = _children(str_el)
    if len(forms) != 1:
        raise faults.security("InvalidSecurity", f"SecurityTokenReference has {len(forms)} reference forms")
    form = forms[0]
    if form.tag == ns.q(ns.WSSE, "Reference"):
        uri = form.get("URI") or ""
        if not _LOCAL_REF.fullmatch(uri):
            raise faults.security("SecurityTokenUnavailable", f"token reference {uri[:80]!r} is not '#id'")
        return KeyRef("reference", uri[1:], form.get("ValueType"))
    if form.tag == ns.q(ns.WSSE, "KeyIdentifier"):
        value_type = form.get("ValueType") or ""
        if value_type in (ns.SAML_ID, ns.SAML_ASSERTION_ID):  # the assertion's ID itself, not base64
            return KeyRef("saml_id", _text_only(form, "KeyIdentifier"), value_type)
        kind = _KEY_IDENTIFIERS.get(value_type)
        if kind is None:
            raise faults.security("SecurityTokenUnavailable", f"KeyIdentifier ValueType {value_type[:120]!r}")
        # EncodingType defaults to Base64Binary (WS-Security 1.0, 7.3).
        if form.get("EncodingType", ns.BASE64) != ns.BASE64:
            raise faults.security("InvalidSecurity", f"KeyIdentifier EncodingType {form.get('EncodingType')!r}")
        raw = _b64decode(_text_only(form, "KeyIdentifier"), "KeyIdentifier", "InvalidSecurity")
        return KeyRef(kind, base64.b64encode(raw).decode(), value_type)
    if form.tag == ns.q(ns.DS, "X509Data"):
        return _issuer_serial(form)
    raise faults.security("SecurityTokenUnavailable", f"unsupported reference form {form.tag}")


def _issuer_serial(x509_data: etree._Element) -> KeyRef:
    parts = _children(x509_data)
    if len(parts) != 1 or parts[0].tag != ns.q(ns.DS, "X509IssuerSerial"):
        raise faults.security("SecurityTokenUnavailable", "ds:X509Data must hold one X509IssuerSerial")
    fields = _children(parts[0])
    if [f.tag for f in fields] != [ns.q(ns.DS, "X509IssuerName"), ns.q(ns.DS, "X509SerialNumber")]:
        raise faults.security("InvalidSecurity", "X509IssuerSerial needs X509IssuerName then X509SerialNumber")
    issuer = _text_only(fields[0], "X509IssuerName")
    serial = _text_only(fields[1], "X509SerialNumber")
    if not _SERIAL.fullmatch(serial):
        raise faults.security("InvalidSecurity", "X509SerialNumber is not a decimal number")
    return KeyRef("issuer_serial", issuer, None, int(serial))


# ---------------------------------------------------------------------------------------------------------
# Builders and matching


def ski(cert: x509.Certificate) -> bytes:
    """The X509SubjectKeyIdentifier: the certificate's extension, else SHA-1 of the public key (as WSS4J)."""
    try:
        return cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value.digest
    except x509.ExtensionNotFound:
        return x509.SubjectKeyIdentifier.from_public_key(cert.public_key()).digest


def thumbprint_sha1(cert: x509.Certificate) -> bytes:
    return hashlib.sha1(cert.public_bytes(serialization.Encoding.DER)).digest()


def _str(token_type: str | None = None) -> etree._Element:
    el = etree.Element(STR, nsmap={"wsse": ns.WSSE})
    if token_type:
        el.set(ns.q(ns.WSSE11, "TokenType"), token_type)
    return el


def str_reference(uri_id: str, value_type: str) -> etree._Element:
    """<wsse:SecurityTokenReference><wsse:Reference URI="#id" ValueType=.../>; `uri_id` with or without '#'."""
    # WSS4J marks references to an EncryptedKey with the token type (WS-Security 1.1).
    el = _str(ns.ENCKEY_TOKEN if value_type == ns.ENCKEY_TOKEN else None)
    ref = etree.SubElement(el, ns.q(ns.WSSE, "Reference"))
    ref.set("URI", "#" + uri_id.removeprefix("#"))
    ref.set("ValueType", value_type)
    return el


def str_key_identifier(value_type: str, value_b64: str) -> etree._Element:
    """<wsse:SecurityTokenReference><wsse:KeyIdentifier EncodingType=Base64Binary ValueType=...>."""
    el = _str(ns.ENCKEY_TOKEN if value_type == ns.ENCKEY_SHA1 else None)
    ki = etree.SubElement(el, ns.q(ns.WSSE, "KeyIdentifier"))
    ki.set("EncodingType", ns.BASE64)
    ki.set("ValueType", value_type)
    ki.text = value_b64
    return el


def str_issuer_serial(cert: x509.Certificate) -> etree._Element:
    """<wsse:SecurityTokenReference><ds:X509Data><ds:X509IssuerSerial>... for `cert`."""
    el = _str()
    data = etree.SubElement(el, ns.q(ns.DS, "X509Data"), nsmap={"ds": ns.DS})
    pair = etree.SubElement(data, ns.q(ns.DS, "X509IssuerSerial"))
    etree.SubElement(pair, ns.q(ns.DS, "X509IssuerName")).text = cert.issuer.rfc4514_string()
    etree.SubElement(pair, ns.q(ns.DS, "X509SerialNumber")).text = str(cert.serial_number)
    return el


def str_pre_shared_key(name: str) -> etree._Element:
    """How the gateway names a pre-shared key (BSP R5417: a KeyInfo holds a SecurityTokenReference):
    <wsse:SecurityTokenReference><wsse:Reference URI="#name" ValueType=PRE_SHARED_KEY/>, the form WSS4J's
    SignatureSTRParser resolves through its CallbackHandler (identifier `name`, type SECRET_KEY)."""
    if not _KEY_NAME.fullmatch(name):
        raise ValueError(f"key name {name!r} cannot be a reference")
    return str_reference(name, ns.PRE_SHARED_KEY)


def key_name(name: str) -> etree._Element:
    """<ds:KeyName>name</ds:KeyName>: how earlier clients name a pre-shared key (still accepted, never sent)."""
    el = etree.Element(ns.q(ns.DS, "KeyName"), nsmap={"ds": ns.DS})
    el.text = name
    return el


def matches(ref: KeyRef, cert: x509.Certificate) -> bool:
    """Whether `ref` identifies `cert`. Only the certificate-identifying forms can match; a direct reference
    is resolved through its token, a key name or EncryptedKeySHA1 never names a certificate."""
    if ref.kind == "ski":
        return base64.b64decode(ref.value) == ski(cert)
    if ref.kind == "thumbprint":
        return base64.b64decode(ref.value) == thumbprint_sha1(cert)
    if ref.kind == "issuer_serial":
        if ref.serial != cert.serial_number:
            return False
        try:
            return parse_dn(ref.value) == cert.issuer
        except ValueError:
            return False
    return False
