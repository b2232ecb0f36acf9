"""SAML assertions in wsse:Security (OASIS WSS SAML Token Profile 1.1): SAML 2.0 and 1.1, the receiving side.

One processor, in the WSS4J manner: `Validator.verify` reads the assertion the Security header carries (decrypted
first when it came as an EncryptedAssertion: wssecurity does that under the XML Encryption rules), checks the
issuer's signature, the conditions and the subject; `Validator.confirm` then checks, once the message's own
signature is known, that one of the subject confirmations the route allows is met.

Against signature wrapping ("On Breaking SAML", 2012) the signature checked is the assertion's own child, with
exactly one Reference whose URI is the assertion's own ID, enveloped-signature and exclusive C14N only, and that
ID is carried by no other element of the whole document; xmlsec gets that id registered on that element only. So
the element verified is, by identity, the element NameID, conditions and attributes are read from. The key is the
configured issuer's, never one because KeyInfo carries it. Text is read whole: comments are gone before (and
C14N without comments ignores them), CDATA is merged by the parser, a child element in a value is refused."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypeAlias

import xmlsec
from cryptography import x509
from lxml import etree

from filters.engine import faults, ns
from filters.engine.wss import keys, signature
from filters.engine.wss.timestamp import parse_datetime
from filters.engine.xml import c14n, values
from gateway.policy import SamlPolicy

ASSERTION2 = ns.q(ns.SAML2, "Assertion")
ASSERTION1 = ns.q(ns.SAML1, "Assertion")
ENCRYPTED_ASSERTION = ns.q(ns.SAML2, "EncryptedAssertion")
ASSERTIONS = {ASSERTION2: "2.0", ASSERTION1: "1.1"}
SIGNATURE = ns.q(ns.DS, "Signature")
STR = ns.q(ns.WSSE, "SecurityTokenReference")
ENCRYPTED_KEY = ns.q(ns.XENC, "EncryptedKey")
METHODS = {
    f"urn:oasis:names:tc:SAML:{v}:cm:{m}": m
    for v in ("2.0", "1.0")
    for m in ("bearer", "sender-vouches", "holder-of-key")
}
ENVELOPED = xmlsec.constants.TransformEnveloped.href
EXC_C14N = xmlsec.constants.TransformExclC14N.href
# The issuer's signature, element by element (ds: names only).
_SIGNATURE_PARTS = [[ns.q(ns.DS, n) for n in names] for names in
                    (("SignedInfo", "SignatureValue"), ("SignedInfo", "SignatureValue", "KeyInfo"))]  # fmt: skip
_SIGNED_INFO_PARTS = [ns.q(ns.DS, n) for n in ("CanonicalizationMethod", "SignatureMethod", "Reference")]
_REFERENCE_PARTS = [ns.q(ns.DS, n) for n in ("Transforms", "DigestMethod", "DigestValue")]
# Set on the assertion's ds:Signature for the C14N that cuts it out (_enveloped): no namespace, so no declaration.
_ENVELOPED_MARK = "wsgate-enveloped-signature"
_ENVELOPED_MARKER = f' {_ENVELOPED_MARK}=""'.encode()
# Header values: printable ASCII; anything else (control characters first: no header splitting) percent-encoded.
_HEADER_SAFE = frozenset(chr(c) for c in range(0x20, 0x7F)) - {"%", ","}


def _s2(local: str) -> str:
    return ns.q(ns.SAML2, local)


def _s1(local: str) -> str:
    return ns.q(ns.SAML1, local)


def invalid(reason: str) -> faults.Fault:
    return faults.security("InvalidSecurity", f"SAML assertion: {reason}")


def refused(reason: str) -> faults.Fault:
    return faults.security("FailedAuthentication", f"SAML assertion: {reason}")


@dataclass(frozen=True)
class Issuer:
    """A configured issuer: its signing certificates, or the trust store its KeyInfo certificate must chain to."""

    certificates: Sequence[x509.Certificate]
    trust: keys.TrustStore | None = None


# The key a holder-of-key confirmation names: an X.509 certificate, or an xenc:EncryptedKey to the gateway holding
# a symmetric key (SAML Token Profile 1.1, 3.5), kept unopened: wssecurity opens it under the XML Encryption rules.
HolderKey: TypeAlias = x509.Certificate | etree._Element


@dataclass(frozen=True)
class Assertion:
    """What a verified assertion says. `element` is the very element whose signature verified."""

    element: etree._Element
    id: str
    version: str
    issuer: str
    subject: str  # NameID / NameIdentifier, encoded for a header
    # (method, the holder-of-key key) for each confirmation the route allows, in document order.
    confirmations: tuple[tuple[str, HolderKey | None], ...]
    headers: Mapping[str, str]  # the route's attribute headers this assertion fills
    issue_instant: datetime
    not_on_or_after: datetime
    one_time_use: bool

    def named_by(self, str_el: etree._Element) -> bool:
        """Whether a wsse:SecurityTokenReference names this assertion (KeyIdentifier or Reference)."""
        try:
            ref = keys.parse_str(str_el)
        except faults.Fault:
            return False
        return (ref.kind == "saml_id" or ref.kind == "reference") and ref.value == self.id


class Validator:
    """A route's SAML checks, built once with the policy (certificates loaded)."""

    def __init__(self, policy: SamlPolicy, issuers: Mapping[str, Issuer], attesting: Sequence[x509.Certificate]):
        self.policy = policy
        self.issuers = issuers
        self.attesting = list(attesting)

    def verify(self, el: etree._Element, index: Mapping[str, etree._Element], now: datetime) -> Assertion:
        """`index`: signature.id_index of the whole document as it is now (every id value, each on one element)."""
        version = ASSERTIONS[el.tag]
        if version not in self.policy.versions:
            raise invalid(f"SAML {version} is not taken on this route")
        read = _read2 if version == "2.0" else _read1
        id_attr, issuer_name = ("ID", None) if version == "2.0" else ("AssertionID", el.get("Issuer"))
        assertion_id = el.get(id_attr) or ""
        if not assertion_id:
            raise invalid(f"no {id_attr}")
        if version == "2.0":
            first = next((c for c in el if isinstance(c.tag, str)), None)
            if first is None or first.tag != _s2("Issuer"):
                raise invalid("saml:Issuer must come first")
            issuer_name = _text(first, "Issuer")
        issuer = self.issuers.get(issuer_name or "")
        if issuer is None:
            raise refused(f"issuer {(issuer_name or '')[:120]!r} is not trusted on this route")
        _check_signature(el, assertion_id, id_attr, index, issuer, self.policy, now)
        fields = read(el)
        self._check_time(fields, now)
        confirmations = tuple(
            (method, cert) for method, cert in fields.confirmations if method in self.policy.confirmation
        )
        if not confirmations:
            raise refused("no subject confirmation method the route allows")
        return Assertion(
            element=el,
            id=assertion_id,
            version=version,
            issuer=issuer_name or "",
            subject=_header_value(fields.subject, self.policy.max_attribute_bytes, "NameID"),
            confirmations=confirmations,
            headers=self._headers(fields.attributes),
            issue_instant=fields.issue_instant,
            not_on_or_after=fields.not_on_or_after,
            one_time_use=fields.one_time_use,
        )

    def _check_time(self, f: _Fields, now: datetime) -> None:
        p = self.policy
        skew = timedelta(seconds=p.clock_skew_s)
        if f.not_before is not None and now + skew < f.not_before:
            raise faults.security("MessageExpired", "SAML assertion not yet valid (NotBefore)")
        if now - skew >= f.not_on_or_after:
            raise faults.security("MessageExpired", "SAML assertion expired (NotOnOrAfter)")
        if f.issue_instant > now + skew:
            raise faults.security("MessageExpired", "SAML assertion issued in the future")
        if now - f.issue_instant > timedelta(seconds=p.max_age_s) + skew:
            raise faults.security("MessageExpired", f"SAML assertion older than {p.max_age_s}s")
        if not f.audiences:
            raise refused("no AudienceRestriction")
        for restriction in f.audiences:
            if not set(restriction) & set(p.audiences):
                raise refused("audience restriction names none of the route's audiences")

    def _headers(self, attributes: Mapping[str, list[str]]) -> dict[str, str]:
        out = {}
        for name, header in self.policy.attribute_headers.items():
            got = attributes.get(name)
            if got:  # no value, no header (never an empty one a backend might read as "no role")
                encoded = ",".join(_percent(v, _HEADER_SAFE) for v in got)
                out[header] = _bounded(encoded, self.policy.max_attribute_bytes, f"attribute {name[:80]!r}")
        return out

    def confirm(
        self,
        a: Assertion,
        signer: x509.Certificate | None,
        signed: Sequence[etree._Element],
        security: etree._Element,
        tls: bool,
        trusted_signer: Callable[[x509.Certificate], bool],
        proof: etree._Element | None = None,
    ) -> str:
        """The confirmation method the message meets, else FailedAuthentication. `signer`: the certificate of the
        message's one verified signature (its parts checked by wssecurity); `signed`: what it covers; `proof`: the
        EncryptedKey (of this assertion, by identity) whose symmetric key that signature verified with."""
        covered = any(e is a.element or (e.tag == STR and e.getparent() is security and a.named_by(e)) for e in signed)
        for method, key in a.confirmations:
            if method == "holder-of-key" and key is not None and _holds(key, signer, proof):
                return method
            if method == "sender-vouches" and signer is not None and covered and signer in self.attesting:
                return method
            if method == "bearer" and (tls or (signer is not None and trusted_signer(signer))):
                return method
        raise refused("no subject confirmation the route allows is met by this message")

    def holder_key(self, a: Assertion) -> HolderKey:
        """The key a holder-of-key assertion confirms: the key a message signature naming it is made with. One
        key: were there two, the message would choose which (and with it the signature's algorithm family)."""
        found = [k for m, k in a.confirmations if m == "holder-of-key" and k is not None]
        if len(found) != 1:
            raise refused(f"a signature names the assertion, which confirms {len(found)} keys (one expected)")
        return found[0]


def _holds(key: HolderKey, signer: x509.Certificate | None, proof: etree._Element | None) -> bool:
    if isinstance(key, x509.Certificate):
        return signer is not None and signer == key
    return proof is not None and proof is key


def replay_key(a: Assertion) -> bytes:
    return b"saml:" + a.issuer.encode() + b"\x00" + a.id.encode()


# --------------------------------------------------------------------------------------------------------
# The issuer's signature


def _check_signature(
    el: etree._Element,
    assertion_id: str,
    id_attr: str,
    index: Mapping[str, etree._Element],
    issuer: Issuer,
    policy: SamlPolicy,
    now: datetime,
) -> None:
    sigs = [c for c in el if c.tag == SIGNATURE]
    if len(sigs) != 1 or sum(1 for _ in el.iter(SIGNATURE)) != 1:
        raise invalid("must carry exactly one ds:Signature, as its own child")
    sig = sigs[0]
    forbidden = next(sig.iter(*signature.FORBIDDEN), None)
    if forbidden is not None:
        raise invalid(f"{signature.FORBIDDEN[forbidden.tag]} in its signature")
    parts = _elements(sig)
    if [p.tag for p in parts] not in _SIGNATURE_PARTS:
        raise invalid("ds:Signature must hold SignedInfo, SignatureValue and KeyInfo only")
    info = _elements(parts[0])
    if [i.tag for i in info] != _SIGNED_INFO_PARTS:
        raise invalid("its signature must have exactly one Reference")
    c14n_method, sig_method, ref = info
    if c14n_method.get("Algorithm") != EXC_C14N or not _c14n_params_ok(c14n_method):
        raise faults.security("UnsupportedAlgorithm", "SAML assertion: canonicalization other than exclusive C14N")
    allowed = {signature.SIGNATURE_METHODS[a].href: a for a in policy.algorithms}
    algorithm = allowed.get(sig_method.get("Algorithm") or "")
    if algorithm is None or _elements(sig_method):
        raise faults.security("UnsupportedAlgorithm", "SAML assertion: signature method not allowed")
    if ref.get("URI") != f"#{assertion_id}":
        raise invalid("its signature does not reference the assertion itself")
    ref_parts = _elements(ref)
    if [p.tag for p in ref_parts] != _REFERENCE_PARTS:
        raise invalid("Reference is not Transforms, DigestMethod, DigestValue")
    transforms = _elements(ref_parts[0])
    if [t.get("Algorithm") for t in transforms] != [ENVELOPED, EXC_C14N] or _elements(transforms[0]):
        raise invalid("transforms other than enveloped-signature then exclusive C14N")
    if not _c14n_params_ok(transforms[1]):
        raise invalid("unexpected transform parameters")
    digests = {signature.DIGEST_METHODS[d].href: signature.DIGEST_METHODS[d] for d in policy.digests}
    if ref_parts[1].get("Algorithm") not in digests or _elements(ref_parts[1]):
        raise faults.security("UnsupportedAlgorithm", "SAML assertion: digest method not allowed")
    # The reference resolves to this element and no other: one carrier of the ID in the whole document (any Id, ID,
    # id or AssertionID: id_index refuses a document where two elements share an id value).
    if index.get(assertion_id) is not el:
        raise invalid(f"ID {assertion_id[:80]!r} is carried by more than one element")
    candidates = list(issuer.certificates)
    if issuer.trust is not None:
        cert = _key_info_certificate(parts[2] if len(parts) == 3 else None)
        issuer.trust.validate(cert, [], now)  # FailedAuthentication when no anchor vouches for it
        candidates = [cert]
    if _verify_direct(el, sig, algorithm, candidates):
        return
    # Not in the direct shape, or not verified that way: xmlsec's full verification decides (and says why).
    method = signature.SIGNATURE_METHODS[algorithm]
    for cert in candidates:
        ctx = signature._context(signature._certificate_key(cert), method, list(digests.values()))
        ctx.register_id(el, id_attr, None)
        try:
            ctx.verify(sig)
            return
        except xmlsec.Error:
            continue
    raise faults.security("FailedCheck", "SAML assertion: the issuer's signature does not verify")


def _verify_direct(
    el: etree._Element, sig: etree._Element, algorithm: str, candidates: Sequence[x509.Certificate]
) -> bool:
    """The issuer's signature (its shape checked by _check_signature) computed here, as signature.verify's direct
    path does for a message: the assertion's digest (enveloped-signature, exclusive C14N: `_enveloped`), then the
    SignatureValue over the canonical SignedInfo with a candidate's key. True when both match; False sends
    the signature to xmlsec, which decides: a PrefixList naming the default namespace, a form `_enveloped` cannot
    cut, or a signature that does not verify this way."""
    info, signature_value = _elements(sig)[:2]
    c14n_method, _, ref = _elements(info)
    transforms, digest_method, digest_value = _elements(ref)
    info_prefixes = signature._exclusive_prefixes(c14n_method)
    prefixes = signature._exclusive_prefixes(_elements(transforms)[1])
    if info_prefixes is None or prefixes is None:
        return False
    signed = _enveloped(el, sig, prefixes)
    if signed is None:
        return False
    try:
        expected = values.base64_bytes(digest_value, "ds:DigestValue")
        value = values.base64_bytes(signature_value, "ds:SignatureValue")
    except faults.Fault:
        return False
    digest = hashlib.new(signature.DIGEST_NAMES[digest_method.get("Algorithm") or ""], signed).digest()
    if not hmac.compare_digest(digest, expected):
        return False
    signed_info = c14n.canonical(info, info_prefixes)
    return any(signature._signature_matches(signed_info, cert, algorithm, value) for cert in candidates)


def _enveloped(el: etree._Element, sig: etree._Element, prefixes: Sequence[str]) -> bytes | None:
    """The octets of the enveloped-signature transform then exclusive C14N of `el` (`prefixes`: its PrefixList):
    the canonical form of `el` with that of `sig`, its own child, cut out (exclusive C14N renders an element the
    same whatever follows or precedes it, and the text around `sig` stays). No copy of the tree: `sig` carries a
    marker attribute for the one C14N, which finds where its canonical form starts; it ends with the first end tag
    of its name that closes it, counting tags (in canonical form, '<' is only ever a tag's: text and attribute
    values escape it, comments are left out and a processing instruction, refused by threat protection, makes
    this None). None where the cut is not certain (the marker's name taken, or found twice): xmlsec then."""
    if sig.get(_ENVELOPED_MARK) is not None:
        return None
    sig.set(_ENVELOPED_MARK, "")
    try:
        out = c14n.canonical(el, prefixes)
    finally:
        del sig.attrib[_ENVELOPED_MARK]
    # An attribute value escapes '"', so ` name=""` is an attribute or text: found once, it is the marker.
    at = out.find(_ENVELOPED_MARKER)
    if at < 0 or out.find(_ENVELOPED_MARKER, at + 1) >= 0 or b"<?" in out:
        return None
    start = out.rfind(b"<", 0, at)  # sig's start tag: nothing before the marker in it can hold '<'
    close = b"</" + out[start + 1 : out.index(b" ", start)] + b">"  # its name is followed by attributes
    end = out.find(close, start)
    while end >= 0:  # the end tag of its name where only sig is still open: every '<' between opens or closes
        closes = out.count(b"</", start, end)
        if out.count(b"<", start, end) == 2 * closes + 1:
            return out[:start] + out[end + len(close) :]
        end = out.find(close, end + 1)
    return None


def _c14n_params_ok(method: etree._Element) -> bool:
    children = _elements(method)
    return not children or [c.tag for c in children] == [signature.INCLUSIVE_NAMESPACES]


def _key_info_certificate(key_info: etree._Element | None) -> x509.Certificate:
    certs = [] if key_info is None else list(key_info.iter(ns.q(ns.DS, "X509Certificate")))
    if len(certs) != 1:
        raise refused("an issuer known by trust anchors must send one X509Certificate in KeyInfo")
    try:
        return x509.load_der_x509_certificate(values.base64_bytes(certs[0], "X509Certificate"))
    except ValueError:
        raise invalid("X509Certificate is not a certificate") from None


# --------------------------------------------------------------------------------------------------------
# Reading SAML 2.0 and 1.1


@dataclass
class _Fields:
    subject: str
    confirmations: list[tuple[str, HolderKey | None]]
    attributes: dict[str, list[str]]
    issue_instant: datetime
    not_before: datetime | None
    not_on_or_after: datetime
    audiences: list[list[str]]
    one_time_use: bool


_ALLOWED2 = {SIGNATURE, *(_s2(n) for n in ("Issuer", "Subject", "Conditions", "AuthnStatement",
                                             "AttributeStatement", "AuthzDecisionStatement"))}  # fmt: skip


def _read2(el: etree._Element) -> _Fields:
    if el.get("Version") != "2.0":
        raise invalid("Version is not 2.0")
    # Advice, Statement extensions and anything else: refused, never skipped (a place to hide a wrapped copy).
    for c in _elements(el):
        if c.tag not in _ALLOWED2:
            raise invalid(f"unexpected element {str(c.tag)[:120]}")
    subject = _one(el, _s2("Subject"), "Subject")
    name_ids = [c for c in _elements(subject) if c.tag == _s2("NameID")]
    if len(name_ids) != 1:
        raise invalid("Subject must have one NameID (BaseID, EncryptedID are not taken)")
    confirmations: list[tuple[str, HolderKey | None]] = []
    conditions = _one(el, _s2("Conditions"), "Conditions")
    windows = [conditions]  # a confirmation's own window narrows the assertion's (the tightest of all is kept)
    for sc in subject.iterchildren(_s2("SubjectConfirmation")):
        method = METHODS.get(sc.get("Method") or "")
        data = sc.find(_s2("SubjectConfirmationData"))
        if method is None:
            continue
        key = None
        if data is not None:
            windows.append(data)
            key = _hok_key(data, method)
        confirmations.append((method, key))
    audiences, one_time = [], False
    for c in _elements(conditions):
        name = etree.QName(c).localname
        if c.tag == _s2("AudienceRestriction"):
            audiences.append([_text(a, "Audience") for a in c.iterchildren(_s2("Audience"))])
        elif c.tag == _s2("OneTimeUse"):
            one_time = True
        elif c.tag != _s2("ProxyRestriction"):
            raise invalid(f"unknown condition {name[:80]}")  # SAML: an unknown condition is Indeterminate
    attributes = _attributes(el, _s2, "Name")
    return _Fields(
        subject=_text(name_ids[0], "NameID"),
        confirmations=confirmations,
        attributes=attributes,
        issue_instant=_instant(el.get("IssueInstant"), "IssueInstant"),
        not_before=max((_instant(w.get("NotBefore"), "NotBefore") for w in windows if w.get("NotBefore")), default=None),
        not_on_or_after=min(_instant(w.get("NotOnOrAfter"), "NotOnOrAfter") for w in windows if w is conditions
                            or w.get("NotOnOrAfter")),
        audiences=audiences,
        one_time_use=one_time,
    )  # fmt: skip


def _attributes(el: etree._Element, tag: Callable[[str], str], name_attribute: str) -> dict[str, list[str]]:
    """The assertion's attributes by name (SAML 2.0 Name, 1.1 AttributeName), each name once."""
    attributes: dict[str, list[str]] = {}
    for a in el.iter(tag("Attribute")):
        name = a.get(name_attribute) or ""
        if name in attributes:
            raise invalid(f"attribute {name[:80]!r} twice")
        attributes[name] = [_text(v, "AttributeValue") for v in a.iterchildren(tag("AttributeValue"))]
    return attributes


def _read1(el: etree._Element) -> _Fields:
    if (el.get("MajorVersion"), el.get("MinorVersion")) != ("1", "1"):
        raise invalid("not SAML 1.1")
    statements = ("AuthenticationStatement", "AttributeStatement", "AuthorizationDecisionStatement")
    children = _elements(el)
    if any(c.tag not in (*(_s1(s) for s in ("Conditions", *statements)), SIGNATURE) for c in children):
        raise invalid("unexpected element (Advice and statement extensions are not taken)")
    # Every statement names its subject: all must be the same one, its confirmations read once.
    subjects = [s.find(_s1("Subject")) for s in children if s.tag in {_s1(x) for x in statements}]
    if not subjects or any(s is None for s in subjects):
        raise invalid("a statement without Subject")
    forms = {etree.tostring(s, method="c14n", exclusive=True) for s in subjects if s is not None}
    if len(forms) != 1:
        raise invalid("statements about different subjects")
    subject = subjects[0]
    assert subject is not None
    name_id = _one(subject, _s1("NameIdentifier"), "NameIdentifier")
    confirmations: list[tuple[str, HolderKey | None]] = []
    for sc in subject.iterchildren(_s1("SubjectConfirmation")):
        for m in sc.iterchildren(_s1("ConfirmationMethod")):
            method = METHODS.get(_text(m, "ConfirmationMethod"))
            if method is not None:
                confirmations.append((method, _hok_key(sc, method)))
    conditions = _one(el, _s1("Conditions"), "Conditions")
    audiences, one_time = [], False
    for c in _elements(conditions):
        if c.tag == _s1("AudienceRestrictionCondition"):
            audiences.append([_text(a, "Audience") for a in c.iterchildren(_s1("Audience"))])
        elif c.tag == _s1("DoNotCacheCondition"):
            one_time = True
        else:
            raise invalid(f"unknown condition {etree.QName(c).localname[:80]}")
    attributes = _attributes(el, _s1, "AttributeName")
    return _Fields(
        subject=_text(name_id, "NameIdentifier"),
        confirmations=confirmations,
        attributes=attributes,
        issue_instant=_instant(el.get("IssueInstant"), "IssueInstant"),
        not_before=_instant(conditions.get("NotBefore"), "NotBefore") if conditions.get("NotBefore") else None,
        not_on_or_after=_instant(conditions.get("NotOnOrAfter"), "NotOnOrAfter"),
        audiences=audiences,
        one_time_use=one_time,
    )


def _hok_key(confirmation: etree._Element, method: str) -> HolderKey | None:
    """The key a confirmation's KeyInfo (SAML 2.0: SubjectConfirmationData's, 1.1: SubjectConfirmation's) names:
    an X.509 certificate (X509Data/X509Certificate), or an xenc:EncryptedKey holding a symmetric key for us; None
    for other keys. A holder-of-key confirmation names one key, or is refused: two EncryptedKeys, or one beside a
    certificate, would leave the choice to whoever reads first."""
    key_infos = list(confirmation.iterchildren(ns.q(ns.DS, "KeyInfo")))
    if not key_infos:
        return None
    encrypted = [k for ki in key_infos for k in ki.iter(ENCRYPTED_KEY)]
    certs = [c for ki in key_infos for c in ki.iter(ns.q(ns.DS, "X509Certificate"))]
    if method == "holder-of-key" and (len(key_infos) > 1 or len(encrypted) + min(len(certs), 1) > 1):
        raise invalid("a holder-of-key confirmation must name one key")
    if encrypted:
        ek = encrypted[0]
        if ek.getparent() is not key_infos[0]:
            raise invalid("holder-of-key EncryptedKey must be its KeyInfo's own child")
        if ek.find(ns.q(ns.XENC, "ReferenceList")) is not None:
            raise invalid("holder-of-key EncryptedKey encrypts nothing: no ReferenceList")
        return ek
    if len(certs) != 1:
        return None
    try:
        return x509.load_der_x509_certificate(values.base64_bytes(certs[0], "X509Certificate"))
    except ValueError:
        raise invalid("holder-of-key X509Certificate is not a certificate") from None


def _elements(el: etree._Element) -> list[etree._Element]:
    return [c for c in el if isinstance(c.tag, str)]


def _one(el: etree._Element, tag: str, what: str) -> etree._Element:
    found = [c for c in el if c.tag == tag]
    if len(found) != 1:
        raise invalid(f"{len(found)} {what} elements, one expected")
    return found[0]


def _text(el: etree._Element, what: str) -> str:
    """A value's whole text (comments removed and CDATA merged before: see the module docstring)."""
    got = values.text(el, f"SAML {what}").strip()
    if not got:
        raise invalid(f"empty {what}")
    return got


def _instant(text: str | None, what: str) -> datetime:
    if not text:
        raise invalid(f"no {what}")
    try:
        return parse_datetime(text)
    except ValueError:
        raise invalid(f"{what} is not an xsd:dateTime with a time zone") from None


def _header_value(value: str, limit: int, what: str) -> str:
    return _bounded(_percent(value, _HEADER_SAFE | {","}), limit, what)


def _percent(value: str, keep: frozenset[str]) -> str:
    """Percent-encoding (of the UTF-8 bytes) of every character not in `keep`."""
    if keep.issuperset(value):  # the usual value, nothing to encode: one pass in C
        return value
    return "".join(c if c in keep else "".join(f"%{b:02X}" for b in c.encode()) for c in value)


def _bounded(value: str, limit: int, what: str) -> str:
    if len(value) > limit:
        raise invalid(f"{what} longer than {limit} bytes")
    return value


def validator(policy: SamlPolicy, trust: Callable[[list[str], list[str]], keys.TrustStore]) -> Validator:
    """The route's Validator: certificates loaded; `trust(anchors, intermediates)` builds an issuer's trust store
    (with the route's revocation)."""
    issuers = {
        i.name: Issuer(keys.load_certificates(i.certificates), trust(i.trust_anchors, i.intermediates))
        if i.trust_anchors
        else Issuer(keys.load_certificates(i.certificates))
        for i in policy.issuers
    }
    return Validator(policy, issuers, keys.load_certificates(policy.attesting_certificates))
