"""WS-SecureConversation: security contexts on `secureconversation` routes, and the tokens that use them.

Two spec versions, each with its own WS-Trust: 2005/02 (WS-Trust 2005/02) and 1.3 (WS-Trust 1.3); see VERSIONS.
Here: the versions, the faults of each, P_SHA1, the Context, SecurityContextTokens and references to them
(`header_scts`, `sct_reference`), DerivedKeyTokens (`derive` on the gateway side, `build_dkt` / `message_keys` on
the client side). Where contexts live: filters/stores/contexts.py. The WS-Trust exchanges that issue and cancel
them: filters/engine/conversation/ws_trust.py.

Everything is synchronous and takes `now` (an aware datetime) from the caller. Refusals are faults.Fault: wsc
codes in the namespace of the spec version at hand, wst codes for malformed RSTs, wsse codes for malformed
tokens."""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple

from lxml import etree

from filters.engine import faults, ns

# ---------------------------------------------------------------------------------------------------------
# Spec versions


@dataclass(frozen=True)
class Version:
    """The URIs of one WS-SecureConversation version and the WS-Trust version it goes with."""

    name: str
    wsc: str  # WS-SecureConversation namespace
    wst: str  # WS-Trust namespace
    sct_token_type: str
    dk_token_type: str
    p_sha1: str  # DerivedKeyToken Algorithm
    computed_key_psha1: str  # ComputedKeyAlgorithm / ComputedKey
    nonce_type: str  # BinarySecret Type of entropy
    symmetric_key_type: str  # BinarySecret Type and KeyType
    issue: str  # RequestType values
    cancel: str
    renew: str
    issue_action: str  # WS-Addressing actions
    issue_reply_action: str
    cancel_action: str
    cancel_reply_action: str

    def __hash__(self) -> int:
        # Its name alone (equal versions have equal names): the generated hash of all sixteen fields cost a sealed
        # context's lookup (its cache is keyed by identifier and version) a fifth of its instructions.
        return hash(self.name)


def _version(name: str, wsc: str, wst: str) -> Version:
    # Both versions build their URIs the same way from their two namespaces (see the notes' table).
    return Version(
        name=name,
        wsc=wsc,
        wst=wst,
        sct_token_type=f"{wsc}/sct",
        dk_token_type=f"{wsc}/dk",
        p_sha1=f"{wsc}/dk/p_sha1",
        computed_key_psha1=f"{wst}/CK/PSHA1",
        nonce_type=f"{wst}/Nonce",
        symmetric_key_type=f"{wst}/SymmetricKey",
        issue=f"{wst}/Issue",
        cancel=f"{wst}/Cancel",
        renew=f"{wst}/Renew",
        issue_action=f"{wst}/RST/SCT",
        issue_reply_action=f"{wst}/RSTR/SCT",
        cancel_action=f"{wst}/RST/SCT/Cancel",
        cancel_reply_action=f"{wst}/RSTR/SCT/Cancel",
    )


WSC_2005_02 = _version(
    "2005/02", "http://schemas.xmlsoap.org/ws/2005/02/sc", "http://schemas.xmlsoap.org/ws/2005/02/trust"
)
WSC_1_3 = _version(
    "1.3",
    "http://docs.oasis-open.org/ws-sx/ws-secureconversation/200512",
    "http://docs.oasis-open.org/ws-sx/ws-trust/200512",
)
VERSIONS: tuple[Version, ...] = (WSC_2005_02, WSC_1_3)  # the index is the version's code in packed contexts
BY_WSC = {v.wsc: v for v in VERSIONS}
BY_WST = {v.wst: v for v in VERSIONS}

DEFAULT_KEY_BITS = 256
MIN_KEY_BITS, MAX_KEY_BITS = 128, 512
MIN_ENTROPY_BYTES, MAX_ENTROPY_BYTES = 16, 512  # WCF and CXF send as many bytes as the key has
DEFAULT_DK_LENGTH = 32  # WSS4J's default
DEFAULT_LABEL = b"WS-SecureConversationWS-SecureConversation"
DK_NONCE_BYTES = 16  # what WSS4J and WCF send
MIN_DK_NONCE_BYTES = 8  # no nonce (or a tiny one) would give every message of a context the same key
MIN_DK_LENGTH, MAX_DK_LENGTH = 16, 64
MAX_DK_OUTPUT = 4096  # offset + length: bounds the P_SHA1 work one token can ask for
MAX_IDENTIFIER = 4096
CONTEXT_TEMPLATES = 128  # contexts whose DerivedKeyToken is kept built (each at most MAX_IDENTIFIER characters more)
MAX_CONTEXT_ATTRIBUTE = 1024
# How long an expired context is still recognised (memory, redis), so its client hears RenewNeeded rather than
# BadContextToken; sealed identifiers are recognised for ever.
EXPIRED_GRACE_S = 600

_WSU_ID = ns.q(ns.WSU, "Id")
_STR = ns.q(ns.WSSE, "SecurityTokenReference")
_REFERENCE = ns.q(ns.WSSE, "Reference")
_LOCAL_ID = re.compile(r"[^\W\d][\w.\-]*")  # an NCName, as keys.py accepts in '#id' references


# ---------------------------------------------------------------------------------------------------------
# Faults

# WS-Trust fault codes this module uses, with their generic client messages (WS-Trust section 11).
WST_CODES: dict[str, str] = {
    "InvalidRequest": "The request was invalid or malformed",
    "RequestFailed": "The specified request failed",
}


def wsc_fault(version: Version, code: str, reason: str) -> faults.Fault:
    """A WS-SecureConversation fault (wsc:code in `version`'s namespace); `reason` is for the log only."""
    assert code in faults.WSC_CODES, code
    return faults.Fault(code=code, reason=reason, code_ns=version.wsc)


def wst_fault(
    version: Version, code: str, reason: str, *, message: str = "", status: int = 500, sender: bool = True
) -> faults.Fault:
    return faults.Fault(
        code=code,
        reason=reason,
        message=message or WST_CODES[code],
        code_ns=version.wst,
        http_status=status,
        sender=sender,
    )


def store_full(version: Version, reason: str) -> faults.Fault:
    # The gateway's limit, not the client's mistake: a Receiver fault it may retry later.
    return wst_fault(
        version,
        "RequestFailed",
        reason,
        message="The gateway holds as many security contexts as it may; retry later",
        sender=False,  # HTTP 500 as every SOAP fault (503 is Envoy's own "service unavailable")
    )


Fail = Callable[[str], faults.Fault]


def _invalid_security(reason: str) -> faults.Fault:
    return faults.security("InvalidSecurity", reason)


def invalid_token(reason: str) -> faults.Fault:
    return faults.security("InvalidSecurityToken", reason)


# ---------------------------------------------------------------------------------------------------------
# P_SHA1


class KeyedSha1:
    """HMAC-SHA1 (RFC 2104) under one key, its inner and outer SHA-1 states computed once: each HMAC is then two
    copies and three C calls (hashlib), where hmac.digest redoes the key schedule and an hmac.HMAC copy costs more
    in Python than the hashing. For P_SHA1, which makes four HMACs per 32-byte key. (CPython's own `_sha1` counts
    fewer instructions under callgrind but runs slower: OpenSSL uses the CPU's SHA extensions, which valgrind's
    CPU lacks; docs/outbound.md.)"""

    __slots__ = ("_inner", "_outer")
    _BLOCK = 64  # SHA-1's block size

    def __init__(self, key: bytes) -> None:
        if len(key) > self._BLOCK:
            key = hashlib.sha1(key).digest()
        key = key.ljust(self._BLOCK, b"\0")
        self._inner = hashlib.sha1(key.translate(_IPAD))
        self._outer = hashlib.sha1(key.translate(_OPAD))

    def mac(self, data: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(data)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))


def p_sha1(secret: bytes | KeyedSha1, seed: bytes, length: int) -> bytes:
    """RFC 2246 P_SHA1: HMAC-SHA1(secret, A(i) + seed) for A(0) = seed, A(i) = HMAC-SHA1(secret, A(i-1)).
    `secret` as bytes, or keyed once (a context's: Context.prf).

    Computed keys are p_sha1(requestor entropy, issuer entropy, size); derived keys p_sha1(context secret,
    label + nonce, offset + length)."""
    if length < 0:
        raise ValueError(f"P_SHA1 length must not be negative, got {length}")
    mac = (secret if isinstance(secret, KeyedSha1) else KeyedSha1(secret)).mac
    a = mac(seed)
    out = mac(a + seed)
    while len(out) < length:
        a = mac(a)
        out += mac(a + seed)
    return out[:length]


# ---------------------------------------------------------------------------------------------------------
# Contexts


@dataclass(frozen=True)
class Context:
    """An established security context. `subject` is the requester the bootstrap authenticated (RFC 4514);
    on the client side it is empty. Times are UTC, to the millisecond."""

    identifier: str
    secret: bytes = field(repr=False)
    subject: str
    version: Version
    created: datetime
    expires: datetime
    # HMAC-SHA1 keyed with the secret, made with the context: every derived key starts from it (per context, not
    # per message).
    prf: KeyedSha1 = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prf", KeyedSha1(self.secret))

    def __reduce__(self) -> tuple[type[Context], tuple[str, bytes, str, Version, datetime, datetime]]:
        # SHA-1 states do not pickle: a copy (the bench hands contexts to its worker processes) keys its own.
        return Context, (self.identifier, self.secret, self.subject, self.version, self.created, self.expires)


# ---------------------------------------------------------------------------------------------------------
# XML helpers


def child_elements(el: etree._Element) -> list[etree._Element]:
    return [c for c in el if isinstance(c.tag, str)]


def at_most_one(parent: etree._Element, tag: str, fail: Fail) -> etree._Element | None:
    found = parent.findall(tag)
    if len(found) > 1:
        raise fail(f"more than one {etree.QName(tag).localname}")
    return found[0] if found else None


def one(parent: etree._Element, tag: str, fail: Fail) -> etree._Element:
    found = at_most_one(parent, tag, fail)
    if found is None:
        raise fail(f"{etree.QName(parent).localname} without {etree.QName(tag).localname}")
    return found


def text_of(el: etree._Element, fail: Fail) -> str:
    text = (el.text or "").strip()
    if len(el) or not text:
        raise fail(f"{etree.QName(el).localname}: expected non-empty text")
    return text


def integer_of(el: etree._Element, fail: Fail) -> int:
    """At most nine ASCII digits (isdigit alone takes other scripts' digits; int() signs, spaces and '_')."""
    text = text_of(el, fail)
    if len(text) > 9 or not text.isascii() or not text.isdigit():
        raise fail(f"{etree.QName(el).localname} is not a small non-negative integer")
    return int(text)


def base64_of(el: etree._Element, fail: Fail) -> bytes:
    try:  # strict: what b64decode(validate=True) refuses, without its Python-level checks
        return binascii.a2b_base64("".join(text_of(el, fail).split()), strict_mode=True)
    except ValueError:  # binascii.Error, and any character outside ASCII
        raise fail(f"{etree.QName(el).localname} is not base64") from None


def sub(parent: etree._Element, tag: str, text: str | None = None) -> etree._Element:
    el = etree.SubElement(parent, tag)
    el.text = text
    return el


def new_id(prefix: str) -> str:
    """A globally unique id, for what nothing registers as an XML ID (tokens, EncryptedKey, EncryptedData): 128
    random bits, as unguessable as a uuid4 at a quarter of its cost (~15K instructions a call less, several a reply)."""
    return f"{prefix}-{os.urandom(16).hex()}"


# ---------------------------------------------------------------------------------------------------------
# SecurityContextToken and references to it


@dataclass(frozen=True)
class Sct:
    """A wsc:SecurityContextToken as a message carries it."""

    version: Version
    identifier: str
    id: str | None  # its wsu:Id


_SCT_TAGS = {ns.q(v.wsc, "SecurityContextToken") for v in VERSIONS}


def is_sct(el: etree._Element) -> bool:
    """Whether `el` is a wsc:SecurityContextToken of either version (a Security header processor's test)."""
    return isinstance(el.tag, str) and el.tag in _SCT_TAGS


def parse_sct(el: etree._Element) -> Sct:
    """Read a wsc:SecurityContextToken: one non-empty wsc:Identifier; BadContextToken if malformed,
    UnsupportedContextToken for a renewed instance (wsc:Instance: the gateway does not renew)."""
    qn = etree.QName(el)
    version = BY_WSC.get(qn.namespace or "")
    if version is None or qn.localname != "SecurityContextToken":
        raise invalid_token(f"not a SecurityContextToken: {str(el.tag)[:120]}")

    def bad(reason: str) -> faults.Fault:
        return wsc_fault(version, "BadContextToken", f"SecurityContextToken: {reason}")

    if el.find(ns.q(version.wsc, "Instance")) is not None:
        raise wsc_fault(version, "UnsupportedContextToken", "SecurityContextToken with an Instance (renewed key)")
    identifier = text_of(one(el, ns.q(version.wsc, "Identifier"), bad), bad)
    if len(identifier) > MAX_IDENTIFIER:
        raise bad(f"Identifier of {len(identifier)} characters")
    return Sct(version, identifier, el.get(_WSU_ID))


def header_scts(security: etree._Element) -> dict[str, Sct]:
    """The SCTs a wsse:Security header carries, by wsu:Id: what '#id' references in that message mean.

    An id that names more than one element of the message is refused (InvalidSecurity): which would count?"""
    scts = [parse_sct(c) for c in security if is_sct(c)]
    wanted = {s.id for s in scts if s.id}
    if not wanted:
        return {}
    root = security.getroottree().getroot()
    counts = dict.fromkeys(wanted, 0)
    for el in root.iter():
        for value in {el.get(_WSU_ID), el.get("Id")}:
            if value in counts:
                counts[value] += 1
    twice = sorted(i for i, n in counts.items() if n > 1)
    if twice:
        raise _invalid_security(f"id {twice[0][:80]!r} names more than one element")
    return {s.id: s for s in scts if s.id}


class SctRef(NamedTuple):
    """How a message names an SCT: by the wsu:Id of one in the same Security header, or by its Identifier. (A
    NamedTuple, as DerivedKeyToken: made per message, where a frozen dataclass's __init__ costs more.)"""

    version: Version
    local_id: str | None = None
    identifier: str | None = None


def parse_sct_ref(str_el: etree._Element, version: Version, fail: Fail) -> SctRef:
    """The SCT a wsse:SecurityTokenReference names: Reference URI="#id" (ValueType absent or the SCT token
    type) or Reference URI=<Identifier> with ValueType the SCT token type. Anything else is `fail`."""
    if str_el.tag != _STR:
        raise fail(f"expected a SecurityTokenReference, got {str(str_el.tag)[:120]}")
    # A lone child needs no filtering (a comment or PI alone is no Reference either).
    forms = [str_el[0]] if len(str_el) == 1 else child_elements(str_el)
    if len(forms) != 1 or forms[0].tag != _REFERENCE:
        raise fail("the reference is not a single wsse:Reference")
    uri = forms[0].get("URI") or ""
    value_type = forms[0].get("ValueType")
    if uri.startswith("#"):
        if not _LOCAL_ID.fullmatch(uri, 1) or value_type not in (None, version.sct_token_type):
            raise fail(f"reference {uri[:80]!r} (ValueType {str(value_type)[:120]!r}) names no {version.name} SCT")
        return SctRef(version, uri[1:], None)
    if value_type != version.sct_token_type or not uri or len(uri) > MAX_IDENTIFIER:
        raise fail(f"reference {uri[:80]!r} (ValueType {str(value_type)[:120]!r}) names no {version.name} SCT")
    return SctRef(version, None, uri)


def resolve_identifier(ref: SctRef, local: Mapping[str, Sct] | None, code: str) -> str:
    if ref.identifier is not None:
        return ref.identifier
    sct = (local or {}).get(ref.local_id or "")
    if sct is None or sct.version is not ref.version:
        raise wsc_fault(ref.version, code, f"no {ref.version.name} SCT #{(ref.local_id or '')[:80]} in the header")
    return sct.identifier


def identifier_of(ref: SctRef, local: Mapping[str, Sct] | None) -> str:
    """The Identifier a reference names (through `local`, the header's SCTs, for '#id')."""
    return resolve_identifier(ref, local, "UnknownDerivationSource")


def sct_reference(version: Version, *, identifier: str | None = None, local_id: str | None = None) -> etree._Element:
    """A wsse:SecurityTokenReference to an SCT: by Identifier (ValueType the SCT token type) or by the wsu:Id
    of one in the same header. Exactly one of the two."""
    if (identifier is None) == (local_id is None):
        raise ValueError("name the SCT by identifier or by local_id")
    el = _sct_reference_template(version.sct_token_type).__copy__()
    el[0].set("URI", identifier if identifier is not None else f"#{local_id}")
    return el


@functools.cache
def _sct_reference_template(value_type: str) -> etree._Element:
    el = etree.Element(_STR, nsmap={"wsse": ns.WSSE})
    etree.SubElement(el, _REFERENCE, URI="", ValueType=value_type)
    return el


def sct_element(version: Version, identifier: str, sct_id: str) -> etree._Element:
    el = etree.Element(
        ns.q(version.wsc, "SecurityContextToken"), {_WSU_ID: sct_id}, nsmap={"wsc": version.wsc, "wsu": ns.WSU}
    )
    sub(el, ns.q(version.wsc, "Identifier"), identifier)
    return el


SctResolver = Callable[[SctRef], Context]
_BY_SCT_TYPE = {v.sct_token_type: v for v in VERSIONS}


def names_sct(str_el: etree._Element, local: Mapping[str, Sct]) -> Version | None:
    """The version of the SCT a SecurityTokenReference names (its Reference's ValueType, or '#id' of an SCT of the
    header, `local`); None where it names something else. parse_sct_ref then reads the reference."""
    forms = child_elements(str_el)
    if len(forms) != 1 or forms[0].tag != _REFERENCE:
        return None
    version = _BY_SCT_TYPE.get(forms[0].get("ValueType") or "")
    uri = forms[0].get("URI") or ""
    if version is None and uri.startswith("#") and uri[1:] in local:
        version = local[uri[1:]].version
    return version


def in_context(security: etree._Element, *, direct: bool) -> bool:
    """Whether a message claims a security context: a DerivedKeyToken in its Security header, or, where the
    context's own key may be used (`direct`), an SCT there or a reference with the SCT token type."""
    tags = _TOKEN_TAGS if direct else _DKT_TAGS
    for c in security:  # a loop, not any() over a generator of is_dkt/is_sct calls: a third of the cost
        if c.tag in tags:  # a comment's or PI's tag is a function: in no set of names
            return True
    return direct and any(r.get("ValueType") in _BY_SCT_TYPE for r in security.iter(_REFERENCE))


# ---------------------------------------------------------------------------------------------------------
# DerivedKeyToken


class DerivedKeyToken(NamedTuple):
    """A parsed wsc:DerivedKeyToken. `offset` already accounts for a Generation (Generation x Length)."""

    version: Version
    id: str | None  # its wsu:Id
    source: SctRef
    offset: int
    length: int
    label: bytes
    nonce: bytes


_DKT_TAGS = {ns.q(v.wsc, "DerivedKeyToken") for v in VERSIONS}
_TOKEN_TAGS = frozenset(_DKT_TAGS | _SCT_TAGS)
_DKT_PARAMETERS = ("Generation", "Offset", "Length", "Label", "Nonce")


def is_dkt(el: etree._Element) -> bool:
    """Whether `el` is a wsc:DerivedKeyToken of either version (a Security header processor's test)."""
    return isinstance(el.tag, str) and el.tag in _DKT_TAGS


def _dkt_reading(version: Version) -> tuple[Version, dict[str, int], Fail]:
    """What parse_dkt needs for a version's DerivedKeyTokens: the children one may have -> their place in its one
    walk, and its UnknownDerivationSource fault."""
    places = {tag: i for i, tag in enumerate((_STR, *(ns.q(version.wsc, n) for n in _DKT_PARAMETERS)))}
    return version, places, lambda reason: wsc_fault(version, "UnknownDerivationSource", f"DerivedKeyToken: {reason}")


_DKT_READING = {ns.q(v.wsc, "DerivedKeyToken"): _dkt_reading(v) for v in VERSIONS}


def parse_dkt(el: etree._Element) -> DerivedKeyToken:
    """Read a wsc:DerivedKeyToken. InvalidSecurity if malformed, UnsupportedAlgorithm for an Algorithm other
    than the version's P_SHA1, UnknownDerivationSource when it does not reference an SCT."""
    tag = el.tag  # lxml makes the string anew at each access
    reading = _DKT_READING.get(tag) if isinstance(tag, str) else None
    if reading is None:
        raise _invalid_security(f"not a DerivedKeyToken: {str(tag)[:120]}")
    version, places, unknown_source = reading
    algorithm = dk_id = None
    for name, value in el.items():  # one walk of its attributes: get() of a namespaced name alone costs more
        if name == _WSU_ID:
            dk_id = value
        elif name == "Algorithm":
            algorithm = value
    if algorithm is not None and algorithm != version.p_sha1:
        raise faults.security("UnsupportedAlgorithm", f"key derivation algorithm {algorithm[:120]!r}")
    found: list[etree._Element | None] = [None] * len(places)  # one walk over the children, each kind at most once
    for child in el:
        tag = child.tag
        at = places.get(tag)  # a comment's or PI's tag is a function: in no dict of names
        if at is None:
            if isinstance(tag, str):
                raise _invalid_security(f"DerivedKeyToken: unsupported child {tag[:120]}")
        elif found[at] is None:
            found[at] = child
        else:
            raise _invalid_security(f"more than one {etree.QName(child).localname}")
    str_el, generation, offset, length_el, label_el, nonce_el = found
    if str_el is None:
        raise _invalid_security("DerivedKeyToken without SecurityTokenReference")
    source = parse_sct_ref(str_el, version, unknown_source)
    if generation is not None and offset is not None:
        raise _invalid_security("DerivedKeyToken has both Offset and Generation")
    length = DEFAULT_DK_LENGTH if length_el is None else integer_of(length_el, _invalid_security)
    if not MIN_DK_LENGTH <= length <= MAX_DK_LENGTH:
        raise _invalid_security(f"DerivedKeyToken Length {length} outside {MIN_DK_LENGTH}..{MAX_DK_LENGTH}")
    # WSE's rule: without an Offset, the key starts at Generation x Length.
    start = integer_of(offset, _invalid_security) if offset is not None else 0
    if generation is not None:
        start = integer_of(generation, _invalid_security) * length
    if start + length > MAX_DK_OUTPUT:
        raise _invalid_security(f"DerivedKeyToken asks for {start + length} bytes of P_SHA1 output")
    label = DEFAULT_LABEL if label_el is None else text_of(label_el, _invalid_security).encode()
    if nonce_el is None:
        raise _invalid_security("DerivedKeyToken without Nonce")
    nonce = base64_of(nonce_el, _invalid_security)
    if len(nonce) < MIN_DK_NONCE_BYTES:
        raise _invalid_security(f"DerivedKeyToken Nonce of {len(nonce)} bytes")
    return DerivedKeyToken(version, dk_id, source, start, length, label, nonce)


def derive_key(dkt: DerivedKeyToken, secret: bytes | KeyedSha1) -> bytes:
    """P_SHA1(secret, label + nonce)[offset : offset + length]; `secret` as p_sha1 takes it."""
    return p_sha1(secret, dkt.label + dkt.nonce, dkt.offset + dkt.length)[dkt.offset :]


class ContextKey(NamedTuple):
    """A derived key a message uses, and the context it comes from. (A NamedTuple, as DerivedKey: one or two per
    message.) Its repr leaves the key out."""

    id: str | None  # the DerivedKeyToken's wsu:Id: how the message's signature or EncryptedData names it
    key: bytes
    context: Context

    def __repr__(self) -> str:
        return f"ContextKey(id={self.id!r}, context={self.context!r})"


def derive(el: etree._Element, resolve: SctResolver) -> ContextKey:
    """The key a wsc:DerivedKeyToken of a message in a context stands for (parse_dkt's and `resolve`'s faults)."""
    dkt = parse_dkt(el)
    ctx = resolve(dkt.source)
    return ContextKey(dkt.id, derive_key(dkt, ctx.prf), ctx)


class DerivedKey(NamedTuple):
    """A DerivedKeyToken built for a message we send, and its key. Its repr leaves the key out."""

    element: etree._Element
    id: str
    key: bytes

    def __repr__(self) -> str:
        return f"DerivedKey(id={self.id!r})"


def build_dkt(
    version: Version,
    source: etree._Element,
    secret: bytes | KeyedSha1,
    *,
    length: int = DEFAULT_DK_LENGTH,
    offset: int = 0,
    generation: int | None = None,
    label: str | None = None,
    nonce: bytes | None = None,
) -> DerivedKey:
    """A wsc:DerivedKeyToken (wsu:Id, the `source` SecurityTokenReference, Generation or Offset, Length and
    Label where not the default, Nonce: a fresh 16-byte one unless given) and the key it derives from
    `secret` (as p_sha1 takes it). Reference it with keys.str_reference(result.id, version.dk_token_type)."""
    if generation is not None and offset:
        raise ValueError("Offset and Generation exclude each other")
    el = _dkt_template(version.wsc, length, offset, generation, label).__copy__()  # lxml: a deep copy
    el.insert(0, source)
    start = offset if generation is None else generation * length
    return _keyed(el, secret, DEFAULT_LABEL if label is None else label.encode(), nonce, start, length)


def _keyed(el: etree._Element, secret: bytes | KeyedSha1, label: bytes, nonce: bytes | None, start: int,
           length: int) -> DerivedKey:  # fmt: skip
    """A copied DerivedKeyToken template given its wsu:Id and Nonce (its last child), and the key it derives."""
    nonce = os.urandom(DK_NONCE_BYTES) if nonce is None else nonce
    dk_id = new_id("DK")
    el.set(_WSU_ID, dk_id)
    el[-1].text = base64.b64encode(nonce).decode()
    return DerivedKey(el, dk_id, p_sha1(secret, label + nonce, start + length)[start:])


@functools.lru_cache(maxsize=32)
def _dkt_template(wsc: str, length: int, offset: int, generation: int | None, label: str | None) -> etree._Element:
    """A DerivedKeyToken's parameters, its Nonce empty (build_dkt copies it: cheaper than building each). Offset 0
    and Length 32 are the spec's defaults, left out as WCF leaves them out (WSS4J and WCF read them so): every
    message carries one or two tokens, and two elements fewer each cost 61,000 instructions less per outbound
    SecureConversation exchange, both sides (docs/outbound.md)."""
    el = etree.Element(ns.q(wsc, "DerivedKeyToken"), nsmap={"wsc": wsc, "wsu": ns.WSU})
    if generation is not None:
        sub(el, ns.q(wsc, "Generation"), str(generation))
    elif offset:
        sub(el, ns.q(wsc, "Offset"), str(offset))
    if length != DEFAULT_DK_LENGTH:
        sub(el, ns.q(wsc, "Length"), str(length))
    if label is not None:
        sub(el, ns.q(wsc, "Label"), label)
    sub(el, ns.q(wsc, "Nonce"))
    return el


@dataclass(frozen=True)
class MessageKeys:
    signing: DerivedKey
    encryption: DerivedKey


def context_key(ctx: Context, *, local_id: str | None = None, length: int = DEFAULT_DK_LENGTH) -> DerivedKey:
    """A DerivedKeyToken for a message in `ctx`, with a fresh nonce, and its key. It references the SCT by
    Identifier, or by `local_id` when the message carries the SCT in its header."""
    el = _context_dkt(ctx.version.wsc, ctx.identifier if local_id is None else f"#{local_id}", length).__copy__()
    return _keyed(el, ctx.prf, DEFAULT_LABEL, None, 0, length)


@functools.lru_cache(maxsize=CONTEXT_TEMPLATES)
def _context_dkt(wsc: str, uri: str, length: int) -> etree._Element:
    """The DerivedKeyToken a context's messages send, but for its wsu:Id and Nonce: built once per context (and
    SCT reference) and copied per message, where building the reference too cost a copy and an insert more.
    (Keyed by strings: a Version's hash is its sixteen fields'.)"""
    el = _dkt_template(wsc, length, 0, None, None).__copy__()
    ref = _sct_reference_template(BY_WSC[wsc].sct_token_type).__copy__()
    ref[0].set("URI", uri)
    el.insert(0, ref)
    return el


def message_keys(ctx: Context, *, local_id: str | None = None, length: int = DEFAULT_DK_LENGTH) -> MessageKeys:
    """Two DerivedKeyTokens for one message in `ctx`, with distinct nonces: one to sign, one to encrypt."""
    return MessageKeys(signing=context_key(ctx, local_id=local_id, length=length),
                       encryption=context_key(ctx, local_id=local_id, length=length))  # fmt: skip
