"""XML Signature for WS-Security with python-xmlsec: hardened verification (signing: signing.py).

Verification checks the signature's shape before xmlsec sees it, as Apache Santuario's secure validation does
(allowed algorithms, at most 30 references and 5 transforms each, no HMACOutputLength, no ds:Object, Manifest
or RetrievalMethod, same-document "#id" references only), then defends against signature wrapping: ids must be
unique across the whole document, and each reference must land on an element where a signed part may live.
Only those elements are registered as ids for xmlsec, so what xmlsec digests is exactly what
`VerifiedSignature.elements` names; callers check their required parts against that list by identity, never by a
fresh lookup. (`wssecurity.Verified` is what a whole Security header proved; one signature's is this.)

With a route's optimizations (filters/engine/wss/optimizations.py), references in the usual shape (one exclusive C14N
transform) are digested directly (filters/engine/xml/c14n.py) and the SignatureValue is checked over the canonical
SignedInfo (an HMAC by `hmac`, RSA by `cryptography`); a signature that does not verify that way goes through xmlsec's
full verification, which decides. Signing (signing.py) computes the same digests and signs the canonical
SignedInfo the same way.

References to attachments (`cid:`, the SwA profile: filters/engine/wss/attachments.py) are taken where the caller
passes the message's attachments; xmlsec cannot resolve them, so such a signature is checked here throughout
(`_verify_with_attachments`)."""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import xmlsec
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from lxml import etree

from filters.engine import faults, metrics, ns
from filters.engine.wss import attachments, str_transform
from filters.engine.xml import c14n, values, xmlsupport
from filters.engine.xml.soap import Envelope

if TYPE_CHECKING:
    from filters.engine.wss.optimizations import Optimizations
    from gateway.policy import SignaturePolicy


class Transform(Protocol):
    """An xmlsec transform, as read here. At run time an `xmlsec.constants.__Transform`, one object per transform
    (`xmlsec.Transform.X` is the same object); not the NamedTuple xmlsec's stubs say: no tuple at all."""

    @property
    def href(self) -> str: ...


SIGNATURE_METHODS: dict[str, Transform] = {
    "rsa-sha256": xmlsec.constants.TransformRsaSha256,
    "rsa-sha1": xmlsec.constants.TransformRsaSha1,
    "hmac-sha256": xmlsec.constants.TransformHmacSha256,
    "hmac-sha1": xmlsec.constants.TransformHmacSha1,
}
DIGEST_METHODS: dict[str, Transform] = {
    "sha256": xmlsec.constants.TransformSha256,
    "sha1": xmlsec.constants.TransformSha1,
}
_RSA_HASHES: dict[str, Callable[[], hashes.HashAlgorithm]] = {"rsa-sha256": hashes.SHA256, "rsa-sha1": hashes.SHA1}
# HMAC signature methods -> hashlib names: on the direct paths the MAC is `hmac`'s, no xmlsec key or context.
HMAC_HASHES = {"hmac-sha256": "sha256", "hmac-sha1": "sha1"}
DIGEST_NAMES = {t.href: name for name, t in DIGEST_METHODS.items()}
DIGEST_SIZES = {t.href: hashlib.new(name).digest_size for name, t in DIGEST_METHODS.items()}
EXCL_C14N: Transform = xmlsec.constants.TransformExclC14N
_INCL_C14N: Transform = xmlsec.constants.TransformInclC14N
_ENVELOPED: Transform = xmlsec.constants.TransformEnveloped
C14N_METHODS: dict[str, Transform] = {t.href: t for t in (EXCL_C14N, _INCL_C14N)}
REFERENCE_TRANSFORMS: dict[str, Transform] = {t.href: t for t in (EXCL_C14N, _INCL_C14N, _ENVELOPED)}
MAX_REFERENCES = 30
MAX_TRANSFORMS = 5
MIN_HMAC_KEY = 16  # bytes; anything shorter is guessable, whoever supplied it


@functools.cache  # the hot path names a dozen ds: tags per signature
def _ds(local: str) -> str:
    return ns.q(ns.DS, local)


SIGNATURE = _ds("Signature")
# A Reference's tags, compared for each reference of each signature: made once.
_REFERENCE, _TRANSFORMS, _TRANSFORM = _ds("Reference"), _ds("Transforms"), _ds("Transform")
_DIGEST_TAGS = [_ds("DigestMethod"), _ds("DigestValue")]
SECURITY = ns.q(ns.WSSE, "Security")
ENCRYPTED_DATA = ns.q(ns.XENC, "EncryptedData")
INCLUSIVE_NAMESPACES = ns.q(ns.EXC_C14N, "InclusiveNamespaces")
WSU_ID = ns.q(ns.WSU, "Id")
# Tokens that mean something only inside the wsse:Security header: one found elsewhere is a moved copy.
SECURITY_ONLY = {
    ns.q(ns.WSU, "Timestamp"),
    ns.q(ns.WSSE, "UsernameToken"),
    ns.q(ns.WSSE, "BinarySecurityToken"),
    ns.q(ns.WSSE, "SecurityTokenReference"),
    ns.q(ns.WSSE11, "SignatureConfirmation"),
    ns.q(ns.XENC, "EncryptedKey"),
    ns.q(ns.XENC, "ReferenceList"),
    SIGNATURE,
}
# Never needed by WS-Security and each a known attack surface (Santuario refuses them in secure validation).
FORBIDDEN = {
    _ds("Object"): "ds:Object",
    _ds("Manifest"): "ds:Manifest",
    _ds("RetrievalMethod"): "ds:RetrievalMethod",
    _ds("HMACOutputLength"): "ds:HMACOutputLength (CVE-2009-0217)",
}
_LOCAL_REF = re.compile(r"#([^\W\d][\w.\-]*)")
# Every attribute some processor may treat as an id, in any namespace (wsu:Id, Id, ID, id, xml:id, AssertionID).
# One local-name() per attribute, matched as "|name|" in the list (no NCName holds "|"): a third cheaper than four
# comparisons, on two whole-document walks per exchange.
_ID_ATTRIBUTES = etree.XPath("//@*[contains('|Id|ID|id|AssertionID|', concat('|', local-name(), '|'))]")
# A SAML assertion is named by its own id attribute (SAML Token Profile 1.1: a direct reference to it).
SAML_ID_ATTRIBUTES = {ns.q(ns.SAML2, "Assertion"): "ID", ns.q(ns.SAML1, "Assertion"): "AssertionID"}


class SwaPlan(NamedTuple):
    """How an attachment reference is digested: its SwA transform's URI and the hashlib name of its digest."""

    transform: str
    digest: str


@dataclass(frozen=True)
class VerifiedSignature:
    """A verified signature. `elements` are the very element objects whose digests matched, in reference
    order; `signature_value` feeds the replay store; `algorithm` is the policy name ("rsa-sha256"...);
    `attachments`: the Content-IDs of the attachments whose digests matched (attachments.py), in reference order."""

    elements: list[etree._Element]
    signature_value: bytes
    algorithm: str
    attachments: tuple[str, ...] = ()

    def covers(self, el: etree._Element) -> bool:
        """Whether `el` itself (by identity, not by id) was signed."""
        return any(e is el for e in self.elements)


def _children(el: etree._Element) -> list[etree._Element]:
    return list(el.iterchildren(etree.Element))  # elements only, filtered in C: a third cheaper than isinstance


def _has_children(el: etree._Element) -> bool:
    return len(el) > 0 and next(el.iterchildren(etree.Element), None) is not None  # most have none: len() says so


def id_index(root: etree._Element) -> dict[str, etree._Element]:
    """Every id value in the document -> its element; InvalidSecurity when two elements share a value."""
    index: dict[str, etree._Element] = {}
    for attr in _ID_ATTRIBUTES(root):
        owner = attr.getparent()
        if index.setdefault(str(attr), owner) is not owner:
            raise faults.security("InvalidSecurity", f"id {str(attr)[:80]!r} is carried by more than one element")
    return index


# ---------------------------------------------------------------------------------------------------------
# Verification


def _algorithm(el: etree._Element, allowed: dict[str, Transform], what: str) -> Transform:
    uri = el.get("Algorithm") or ""
    found = allowed.get(uri)
    if found is None:
        raise faults.security("UnsupportedAlgorithm", f"{what} {uri[:120]!r} is not allowed")
    return found


def _check_c14n_children(el: etree._Element, algorithm: Transform, what: str) -> None:
    children = _children(el)
    # Exclusive C14N may carry its InclusiveNamespaces; no algorithm here takes any other parameter.
    if algorithm is EXCL_C14N and [c.tag for c in children] in ([], [INCLUSIVE_NAMESPACES]):
        return
    if children:
        raise faults.security("InvalidSecurity", f"{what} has unexpected parameters")


def _check_reference(
    ref: etree._Element, digests: dict[str, Transform], cid: bool
) -> tuple[str, bytes, SwaPlan | None]:
    """The id a ds:Reference points to ("cid:..." for an attachment, where `cid` allows them), its DigestValue
    decoded and, for an attachment, how it is digested; after checking its URI, transforms and digest method."""
    uri = ref.get("URI") or ""
    attachment = cid and uri.startswith("cid:")
    swa_transform = None
    if attachment:
        target = uri
    else:
        m = _LOCAL_REF.fullmatch(uri)
        if m is None:
            raise faults.security("InvalidSecurity", f"reference URI {uri[:80]!r} is not a same-document '#id'")
        target = m[1]
    parts = _children(ref)
    tags = [p.tag for p in parts]
    if attachment:  # exactly one SwA transform, without parameters (attachments.py)
        steps = _children(parts[0]) if tags and tags[0] == _TRANSFORMS else []
        if len(steps) != 1 or steps[0].tag != _TRANSFORM or _has_children(steps[0]):
            raise faults.security("InvalidSecurity", f"reference {uri[:80]!r} must have one SwA transform")
        swa_transform = steps[0].get("Algorithm")
        if swa_transform not in attachments.SIGNATURE_TRANSFORMS:
            raise faults.security("UnsupportedAlgorithm", f"attachment transform {swa_transform!r:.120}")
        parts, tags = parts[1:], tags[1:]
    elif tags and tags[0] == _TRANSFORMS:
        transforms = _children(parts[0])
        if len(transforms) > MAX_TRANSFORMS:
            raise faults.security("InvalidSecurity", f"reference #{target} has {len(transforms)} transforms")
        for t in transforms:
            if t.tag != _TRANSFORM:
                raise faults.security("InvalidSecurity", f"unexpected {t.tag} in ds:Transforms")
            if t.get("Algorithm") == str_transform.ALGORITHM:
                if len(transforms) != 1:
                    raise faults.security(
                        "InvalidSecurity", f"reference #{target}: STR-Transform with other transforms"
                    )
                str_transform.prefix_list(t)
                continue
            _check_c14n_children(t, _algorithm(t, REFERENCE_TRANSFORMS, "transform"), "ds:Transform")
        parts, tags = parts[1:], tags[1:]
    if tags != _DIGEST_TAGS:
        raise faults.security(
            "InvalidSecurity", f"reference {target[:80]} is not Transforms?, DigestMethod, DigestValue"
        )
    digest = _algorithm(parts[0], digests, "digest method")
    if _has_children(parts[0]):
        raise faults.security("InvalidSecurity", "ds:DigestMethod has unexpected parameters")
    expected = values.base64_bytes(parts[1], "ds:DigestValue")
    if len(expected) != DIGEST_SIZES[digest.href]:
        raise faults.security("InvalidSecurity", f"reference {target[:80]}: DigestValue of the wrong length")
    return target, expected, SwaPlan(swa_transform, DIGEST_NAMES[digest.href]) if swa_transform else None


def _check_signature(
    sig: etree._Element, key: x509.Certificate | bytes, policy: SignaturePolicy, cid: bool = False
) -> tuple[str, list[str], bytes, list[bytes], list[SwaPlan | None]]:
    """Algorithm name, referenced ids, signature value, the references' DigestValues (decoded: once) and how each
    attachment reference is digested (None for the others) of a ds:Signature that passed secure validation."""
    forbidden = next(sig.iter(*FORBIDDEN), None)
    if forbidden is not None:
        raise faults.security("InvalidSecurity", f"{FORBIDDEN[forbidden.tag]} in a signature")
    parts = _children(sig)
    tags = [p.tag for p in parts]
    if tags not in (
        [_ds("SignedInfo"), _ds("SignatureValue")],
        [_ds("SignedInfo"), _ds("SignatureValue"), _ds("KeyInfo")],
    ):
        raise faults.security("InvalidSecurity", "ds:Signature must hold SignedInfo, SignatureValue and KeyInfo only")
    info = _children(parts[0])
    if len(info) < 3 or info[0].tag != _ds("CanonicalizationMethod") or info[1].tag != _ds("SignatureMethod"):
        raise faults.security(
            "InvalidSecurity", "ds:SignedInfo is not CanonicalizationMethod, SignatureMethod, Reference+"
        )
    refs = info[2:]
    if len(refs) > MAX_REFERENCES:
        raise faults.security("InvalidSecurity", f"{len(refs)} references in one signature (at most {MAX_REFERENCES})")
    if any(r.tag != _REFERENCE for r in refs):
        raise faults.security("InvalidSecurity", "ds:SignedInfo holds something other than ds:Reference")
    _check_c14n_children(info[0], _algorithm(info[0], C14N_METHODS, "canonicalization"), "CanonicalizationMethod")

    allowed = {SIGNATURE_METHODS[a].href: a for a in policy.algorithms}
    uri = info[1].get("Algorithm") or ""
    algorithm = allowed.get(uri)
    if algorithm is None:
        raise faults.security("UnsupportedAlgorithm", f"signature method {uri[:120]!r} is not allowed")
    if _has_children(info[1]):
        raise faults.security("InvalidSecurity", "ds:SignatureMethod has unexpected parameters")
    # The key decides the algorithm family, never the message: no HMAC keyed with a public certificate.
    if isinstance(key, bytes):
        fits = algorithm.startswith("hmac")
    else:
        fits = not algorithm.startswith("hmac") and isinstance(key.public_key(), rsa.RSAPublicKey)
    if not fits:
        raise faults.security("UnsupportedAlgorithm", f"signature method {algorithm} does not fit the key")
    if isinstance(key, bytes) and len(key) < MIN_HMAC_KEY:
        raise faults.security("InvalidSecurity", f"HMAC key of {len(key)} bytes (at least {MIN_HMAC_KEY})")

    digests = {DIGEST_METHODS[d].href: DIGEST_METHODS[d] for d in policy.digests}
    checked = [_check_reference(r, digests, cid) for r in refs]
    ids = [target for target, _, _ in checked]
    _check_duplicates(refs, ids)
    # The value xmlsec verifies is this one (its text, whole), and the replay store remembers these bytes: a
    # signature has exactly one accepted length (an RSA value as long as the modulus, an HMAC as its hash), so
    # no other spelling of the same signature (leading zeros, a truncated MAC) passes as a new message.
    value = values.base64_bytes(parts[1], "ds:SignatureValue")
    if len(value) != _signature_length(algorithm, key):
        raise faults.security("InvalidSecurity", f"ds:SignatureValue of {len(value)} bytes for {algorithm}")
    return algorithm, ids, value, [expected for _, expected, _ in checked], [swa for _, _, swa in checked]


def _check_duplicates(refs: list[etree._Element], ids: list[str]) -> None:
    """A second reference to an element passes only as an exact copy of the first: same URI, transforms,
    digest method and value, spelled the same (Metro's Cancel references each signed WS-Addressing header twice).
    Such a copy digests the same bytes as the first, so it proves nothing more and is counted once. Any other
    pair (another transform, PrefixList, digest or value) would let two readings of one element be signed: refused."""
    first: dict[str, bytes] = {}
    repeated = {i for i in ids if ids.count(i) > 1}  # at most 30 references: canonicalized only where one repeats
    for ref, ref_id in zip(refs, ids, strict=True):
        if ref_id not in repeated:
            continue
        form = etree.tostring(ref, method="c14n", exclusive=True, with_comments=True)
        if first.setdefault(ref_id, form) != form:
            raise faults.security("InvalidSecurity", f"reference #{ref_id[:80]} appears twice, not as an exact copy")


def _signature_length(algorithm: str, key: x509.Certificate | bytes) -> int:
    if isinstance(key, bytes):
        return hashlib.new(algorithm.removeprefix("hmac-")).digest_size
    public = key.public_key()
    assert isinstance(public, rsa.RSAPublicKey)  # _check_signature checked the key's family
    return (public.key_size + 7) // 8


def _security_of(sig: etree._Element, env: Envelope) -> etree._Element:
    if sig.tag != SIGNATURE:
        raise faults.security("InvalidSecurity", f"not a ds:Signature: {sig.tag}")
    security = sig.getparent()
    if security is None or security.tag != SECURITY or security.getparent() is not env.header:
        raise faults.security("InvalidSecurity", "ds:Signature is not a direct child of a wsse:Security header")
    if sig.getroottree().getroot() is not env.root:
        raise faults.security("InvalidSecurity", "ds:Signature is not in this envelope")
    return security


def _in_place(el: etree._Element, env: Envelope, security: etree._Element, sig: etree._Element) -> bool:
    """Whether `el` sits where a signed part may live; see the module docstring for why this matters."""
    body, header = env.body, env.header
    if el is body:
        return True
    # A second Body, a Security header, or the signature itself is never a legitimate target.
    if el is sig or el.tag in (body.tag, SECURITY):
        return False
    parent = el.getparent()
    if parent is None:
        return False
    if parent is security:  # Timestamp, tokens, EncryptedKey, an endorsed signature...
        return True
    if parent is header:  # header blocks: WS-Addressing, application headers
        return el.tag not in SECURITY_ONLY
    # Encrypted content signed after encryption: EncryptedData replacing the Body's or a header block's content.
    return el.tag == ENCRYPTED_DATA and (parent is body or (parent.getparent() is header and parent.tag != SECURITY))


def _id_attribute(el: etree._Element, value: str) -> tuple[str, str | None]:
    if el.get(WSU_ID) == value:
        return "Id", ns.WSU
    if el.get("Id") == value:
        return "Id", None
    saml_id = SAML_ID_ATTRIBUTES.get(el.tag)
    if saml_id is not None and el.get(saml_id) == value:
        return saml_id, None
    raise faults.security("InvalidSecurity", f"#{value[:80]} is not a wsu:Id or Id attribute")


@functools.lru_cache(maxsize=512)
def _certificate_key(cert: x509.Certificate) -> xmlsec.Key:
    # xmlsec copies the key into each context, so one parsed key serves every message from this client.
    return xmlsec.Key.from_memory(cert.public_bytes(serialization.Encoding.PEM), xmlsec.constants.KeyDataFormatCertPem)


def _context(key: xmlsec.Key, method: Transform, digests: Sequence[Transform]) -> xmlsec.SignatureContext:
    """A context that accepts only our algorithms, so xmlsec itself enforces what we checked."""
    ctx = xmlsec.SignatureContext()
    ctx.key = key
    for t in (*REFERENCE_TRANSFORMS.values(), *digests):
        ctx.enable_reference_transform(t)  # type: ignore[arg-type]  # xmlsec's stubs: a NamedTuple (Transform)
    for t in (*C14N_METHODS.values(), method):
        ctx.enable_signature_transform(t)  # type: ignore[arg-type]  # xmlsec's stubs: a NamedTuple (Transform)
    return ctx


def _register(ctx: xmlsec.SignatureContext, el: etree._Element, value: str) -> None:
    name, attr_ns = _id_attribute(el, value)
    try:
        ctx.register_id(el, name, attr_ns)
    except xmlsec.Error as exc:
        raise faults.security("InvalidSecurity", f"cannot register id #{value[:80]}: {exc}") from None


def _exclusive_prefixes(el: etree._Element) -> list[str] | None:
    """The PrefixList of an exclusive C14N (without comments) method or transform that c14n.canonical does;
    None for any other."""
    if el.get("Algorithm") != EXCL_C14N.href:
        return None
    inclusive = _children(el)  # nothing or one InclusiveNamespaces (_check_c14n_children)
    prefixes = (inclusive[0].get("PrefixList") or "").split() if inclusive else []
    return prefixes if c14n.direct(prefixes) else None


def _prefix_list(ref: etree._Element) -> list[str]:
    """Every prefix the PrefixLists of a checked ds:Reference's transforms name."""
    return [p for inclusive in ref.iter(INCLUSIVE_NAMESPACES) for p in (inclusive.get("PrefixList") or "").split()]


def _direct_reference(ref: etree._Element) -> tuple[list[str], str] | None:
    """(PrefixList, digest name) of a checked ds:Reference whose only transform is exclusive C14N; None for any
    other shape (left to xmlsec). Its DigestValue is the one _check_reference decoded."""
    parts = _children(ref)  # Transforms?, DigestMethod, DigestValue (_check_reference)
    if len(parts) != 3:
        return None  # no transform: inclusive C14N of the node set
    transforms, method, _ = parts
    steps = _children(transforms)
    prefixes = _exclusive_prefixes(steps[0]) if len(steps) == 1 else None
    if prefixes is None:
        return None
    return prefixes, DIGEST_NAMES[method.get("Algorithm") or ""]


def _verify_direct(
    sig: etree._Element,
    elements: list[etree._Element],
    security: etree._Element,
    key: x509.Certificate | bytes,
    algorithm: str,
    value: bytes,
    optimizations: Optimizations,
    digest_values: list[bytes],
) -> bool | None:
    """True when every reference's digest and the SignatureValue over the canonical SignedInfo check out,
    computed directly; False when they do not, None when the signature is not in a shape done directly. Both
    leave the signature to xmlsec's full verification, which decides."""
    info = _children(sig)[0]
    parts = _children(info)
    info_prefixes = _exclusive_prefixes(parts[0])
    plans = [_direct_reference(ref) for ref in parts[2:]]
    if info_prefixes is None or None in plans:
        return None
    learned = []
    for el, plan, expected in zip(elements, plans, digest_values, strict=True):
        assert plan is not None
        # Tokens of the Security header (the Timestamp...) are per message: never worth remembering.
        ok, memo = optimizations.check(el, *plan, expected, cacheable=el.getparent() is not security)
        if not ok:
            optimizations.fell_back()
            return False
        if memo is not None:
            learned.append(memo)
    if not _signature_matches(c14n.canonical(info, info_prefixes), key, algorithm, value):
        optimizations.fell_back()
        return False
    optimizations.verified(learned)
    return True


def _str_transformed(ref: etree._Element) -> bool:
    transforms = xmlsupport.child(ref, _TRANSFORMS)
    return transforms is not None and transforms[0].get("Algorithm") == str_transform.ALGORITHM


def _verify_str_transformed(
    sig: etree._Element,
    elements: list[etree._Element],
    key: x509.Certificate | bytes,
    algorithm: str,
    value: bytes,
    policy: SignaturePolicy,
    dereference: str_transform.Dereference | None,
    digest_values: list[bytes],
) -> list[etree._Element]:
    """The tokens signed through STR-Transform references, once every digest and the SignatureValue check out,
    all computed here (xmlsec knows no STR-Transform): so the SignedInfo and the other references must be in the
    direct shape, exclusive C14N (Metro's and WSS4J's)."""
    info = _children(sig)[0]
    parts = _children(info)
    info_prefixes = _exclusive_prefixes(parts[0])
    if info_prefixes is None:
        raise faults.security("UnsupportedAlgorithm", "STR-Transform under a SignedInfo not in exclusive C14N")
    digests = {DIGEST_METHODS[d].href: d for d in policy.digests}
    tokens = []
    for el, ref, digest_value in zip(elements, parts[2:], digest_values, strict=True):
        if _str_transformed(ref):
            tokens.append(str_transform.verify(ref, el, dereference, digests))
            continue
        plan = _direct_reference(ref)
        if plan is None:
            raise faults.security("UnsupportedAlgorithm", "STR-Transform beside a reference not in exclusive C14N")
        if not hmac.compare_digest(c14n.digest(el, *plan), digest_value):
            raise faults.security("FailedCheck", "signature does not verify: a reference's digest does not match")
    if not _signature_matches(c14n.canonical(info, info_prefixes), key, algorithm, value):
        raise faults.security("FailedCheck", "signature does not verify: SignatureValue")
    return tokens


def _signature_matches(signed_info: bytes, key: x509.Certificate | bytes, algorithm: str, value: bytes) -> bool:
    """Whether `value` is the signature of the canonical SignedInfo `signed_info` with `key`."""
    if isinstance(key, bytes):
        return hmac.compare_digest(hmac.new(key, signed_info, HMAC_HASHES[algorithm]).digest(), value)
    # RSA by `cryptography`: an xmlsec context copies its key in on every use, 3x the cost of the RSA verify itself.
    public = key.public_key()
    if not isinstance(public, rsa.RSAPublicKey):
        return False
    try:
        public.verify(value, signed_info, padding.PKCS1v15(), _RSA_HASHES[algorithm]())
    except InvalidSignature:
        return False
    return True


@metrics.timed("signature_check")
def verify(
    sig: etree._Element,
    env: Envelope,
    key: x509.Certificate | bytes,
    policy: SignaturePolicy,
    optimizations: Optimizations | None = None,
    parts: attachments.Attachments | None = None,
    dereference: str_transform.Dereference | None = None,
    index: dict[str, etree._Element] | None = None,
) -> VerifiedSignature:
    """Verify `sig` (a ds:Signature in a wsse:Security header of `env`) with `key`: a certificate for RSA,
    the secret for HMAC. The key comes from the caller, never from the signature's KeyInfo. `optimizations`:
    the route's (None: xmlsec's reference processing). `parts`: the message's attachments, which `cid:`
    references may name (None: such a reference is refused). `dereference`: the token an STR-Transform
    reference's STR names (None: such references are refused); the STR and that token count as signed.
    `index`: `id_index(env.root)` as the document is now, where the caller made it already (a walk of the
    whole document); None: made here."""
    security = _security_of(sig, env)
    algorithm, ids, value, digest_values, swa = _check_signature(sig, key, policy, cid=parts is not None)
    if index is None:
        index = id_index(env.root)
    if parts is not None and any(i.startswith("cid:") for i in ids):
        return _verify_with_attachments(
            sig, env, security, key, algorithm, ids, value, parts, index, digest_values, swa
        )
    elements = _signed_elements(ids, index, env, security, sig)
    if any(_str_transformed(r) for r in _children(_children(sig)[0])[2:]):
        tokens = _verify_str_transformed(sig, elements, key, algorithm, value, policy, dereference, digest_values)
        return _verified([*elements, *tokens], value, algorithm)
    direct = None
    if optimizations is not None:
        direct = _verify_direct(sig, elements, security, key, algorithm, value, optimizations, digest_values)
        if direct:
            return _verified(elements, value, algorithm)
    xkey = (
        xmlsec.Key.from_binary_data(xmlsec.constants.KeyDataHmac, key)
        if isinstance(key, bytes)
        else _certificate_key(key)
    )
    method = SIGNATURE_METHODS[algorithm]
    # xmlsec canonicalizes each reference through a node set, per element and PrefixList prefix: bounded first.
    for el, ref in zip(elements, _children(_children(sig)[0])[2:], strict=True):
        prefixes = _prefix_list(ref)
        if prefixes:
            c14n.check_affordable(c14n.received_form(el), prefixes)
    ctx = _context(xkey, method, [DIGEST_METHODS[d] for d in policy.digests])
    for ref_id, el in dict(zip(ids, elements, strict=True)).items():
        _register(ctx, el, ref_id)
    try:
        ctx.verify(sig)
    except xmlsec.Error as exc:
        raise faults.security("FailedCheck", f"signature does not verify: {exc}") from None
    if direct is False and optimizations is not None:
        optimizations.diverged()
    return _verified(elements, value, algorithm)


def _signed_elements(
    ids: list[str], index: dict[str, etree._Element], env: Envelope, security: etree._Element, sig: etree._Element
) -> list[etree._Element]:
    """The elements the "#id" references name, each where a signed part may be."""
    elements: list[etree._Element] = []
    for ref_id in ids:
        el = index.get(ref_id)
        if el is None:
            raise faults.security("InvalidSecurity", f"reference #{ref_id[:80]} resolves to no element")
        if not _in_place(el, env, security, sig):
            raise faults.security(
                "InvalidSecurity", f"reference #{ref_id[:80]}: {el.tag[:120]} is not where a signed part may be"
            )
        _id_attribute(el, ref_id)  # named by wsu:Id or Id, the attributes xmlsec registers (never xml:id...)
        elements.append(el)
    return elements


def _verify_with_attachments(
    sig: etree._Element,
    env: Envelope,
    security: etree._Element,
    key: x509.Certificate | bytes,
    algorithm: str,
    ids: list[str],
    value: bytes,
    parts: attachments.Attachments,
    index: dict[str, etree._Element],
    digest_values: list[bytes],
    swa: list[SwaPlan | None],
) -> VerifiedSignature:
    """A signature with `cid:` references, which xmlsec cannot resolve: every digest computed here (the
    attachments' by their SwA transform, the elements' in the one-exclusive-C14N shape WSS4J sends, any other
    shape refused), then the SignatureValue over the canonical SignedInfo. The attachments are marked signed
    (with the transform that covered them) only once all of it checked out."""
    info = _children(sig)[0]
    children = _children(info)
    info_prefixes = _exclusive_prefixes(children[0])
    if info_prefixes is None:
        raise faults.security("InvalidSecurity", "signature over attachments: SignedInfo not in exclusive C14N")
    element_ids = [i for i in ids if not i.startswith("cid:")]
    elements = iter(_signed_elements(element_ids, index, env, security, sig))
    covered: list[tuple[attachments.Attachment, str]] = []
    signed: list[etree._Element] = []
    for ref, target, digest_value, plan_swa in zip(children[2:], ids, digest_values, swa, strict=True):
        if plan_swa is not None:  # a cid: reference, its transform and digest method read by _check_reference
            part = parts.by_uri(target)
            got = attachments.digest(part, plan_swa.transform, plan_swa.digest)
            covered.append((part, attachments.SIGNATURE_TRANSFORMS[plan_swa.transform]))
        else:
            plan = _direct_reference(ref)
            if plan is None:
                raise faults.security(
                    "InvalidSecurity", f"reference #{target[:80]} beside attachments: not one exclusive C14N"
                )
            el = next(elements)
            got = c14n.digest(el, *plan)
            signed.append(el)
        if not hmac.compare_digest(got, digest_value):
            raise faults.security("FailedCheck", f"reference {target[:80]}: digest mismatch")
    if not _signature_matches(c14n.canonical(info, info_prefixes), key, algorithm, value):
        raise faults.security("FailedCheck", "signature does not verify: SignatureValue over attachments")
    _check_order([part for part, _ in covered], parts)
    for part, how in covered:
        part.signed = how
    verified = _verified(signed, value, algorithm)
    return VerifiedSignature(verified.elements, value, algorithm, tuple(p.content_id for p, _ in covered))


def _check_order(signed: list[attachments.Attachment], parts: attachments.Attachments) -> None:
    """Signed attachments travel in the order they were signed: a receiver that reads parts by position (SwA
    without cid: links in the body) must not get them reordered under a valid signature."""
    if len(signed) < 2:  # one attachment: neither repeated nor out of order
        return
    if len({id(p) for p in signed}) != len(signed):
        raise faults.security("InvalidSecurity", "an attachment is referenced twice by one signature")
    positions = {id(p): i for i, p in enumerate(parts)}
    order = [positions[id(p)] for p in signed]
    if order != sorted(order):
        raise faults.security("InvalidSecurity", "attachments are not in the order they were signed")


def _verified(elements: list[etree._Element], value: bytes, algorithm: str) -> VerifiedSignature:
    """Each signed element once, in the order of its first reference (exact duplicates are counted once)."""
    return VerifiedSignature(
        elements=list({id(e): e for e in elements}.values()), signature_value=value, algorithm=algorithm
    )
