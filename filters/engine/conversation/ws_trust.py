"""WS-Trust for WS-SecureConversation: the RequestSecurityToken exchanges that issue and cancel a security
context. Gateway side: `find_rst` and `parse_rst` read a RequestSecurityToken, `answer_issue` establishes a context
and builds the RSTR (the backend never sees either), `answer_cancel` ends one. Client side: `build_issue_rst`,
`read_rstr`, `build_cancel_rst`, `read_cancel_rstr`. And the envelopes of the exchanges the gateway answers."""

from __future__ import annotations

import base64
import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa
from lxml import etree

from filters.engine import faults, ns
from filters.engine.conversation.contexts import ContextStore, random_identifier, unknown_context
from filters.engine.wss import encryption
from filters.engine.wss.saml_issuer import AC_X509, NAMEID_X509, Identity, Issuer, saml_id_reference
from filters.engine.wss.secure_conversation import (
    BY_WST,
    DEFAULT_KEY_BITS,
    MAX_CONTEXT_ATTRIBUTE,
    MAX_ENTROPY_BYTES,
    MAX_KEY_BITS,
    MIN_ENTROPY_BYTES,
    MIN_KEY_BITS,
    WSC_1_3,
    Context,
    Fail,
    Sct,
    SctRef,
    Version,
    at_most_one,
    base64_of,
    child_elements,
    integer_of,
    invalid_token,
    is_sct,
    new_id,
    one,
    p_sha1,
    parse_sct,
    parse_sct_ref,
    resolve_identifier,
    sct_element,
    sct_reference,
    sub,
    text_of,
    wsc_fault,
    wst_fault,
)
from filters.engine.wss.timestamp import format_datetime, parse_datetime
from filters.engine.xml.soap import Envelope
from gateway.policy import SamlTokenService

# ---------------------------------------------------------------------------------------------------------
# RequestSecurityToken (gateway side)


@dataclass(frozen=True)
class Rst:
    """A parsed wst:RequestSecurityToken for an SCT, or (WS-Trust 1.3, `saml` set) for a SAML 2.0 assertion."""

    version: Version
    request_type: Literal["issue", "cancel"]
    context: str | None  # the Context attribute, echoed in the RSTR
    key_size_bits: int  # Issue: the KeySize asked for, DEFAULT_KEY_BITS when absent
    entropy: bytes | None = field(repr=False)  # Issue: the requestor's Entropy/BinarySecret
    cancel_target: SctRef | None  # Cancel
    saml: SamlRequest | None = None  # Issue of a SAML 2.0 assertion


Confirmation = Literal["holder-of-key", "bearer"]


@dataclass(frozen=True)
class SamlRequest:
    """What an Issue RST for a SAML 2.0 assertion asks: a confirmation (None: the route's first) and where the
    token is to be used (wsp:AppliesTo's address, None when absent)."""

    confirmation: Confirmation | None
    applies_to: str | None


# WS-Trust 1.3 (the SAML token type is issued with this version only: 2005/02 has no Bearer key type).
WST_1_3 = WSC_1_3.wst
SAML_KEY_TYPES: dict[str, Confirmation] = {f"{WST_1_3}/PublicKey": "holder-of-key", f"{WST_1_3}/Bearer": "bearer"}
SAML_ISSUE_ACTION = f"{WST_1_3}/RST/Issue"
SAML_ISSUE_REPLY_ACTION = f"{WST_1_3}/RSTRC/IssueFinal"
MAX_APPLIES_TO = 1024


_RST_TAGS = frozenset(ns.q(wst, "RequestSecurityToken") for wst in BY_WST)  # compared as strings: no QName per message


def find_rst(env: Envelope) -> etree._Element | None:
    """The Body's wst:RequestSecurityToken (either version) when it is the Body's one element, else None."""
    children = child_elements(env.body)
    return children[0] if len(children) == 1 and children[0].tag in _RST_TAGS else None


def parse_rst(el: etree._Element) -> Rst:
    """Read an RST: the version from its WS-Trust namespace; Issue or Cancel. wst:InvalidRequest when
    malformed, wsc:UnableToRenew for Renew."""
    qn = etree.QName(el)
    version = BY_WST.get(qn.namespace or "")
    if version is None or qn.localname != "RequestSecurityToken":
        raise faults.client(f"not a WS-Trust RequestSecurityToken: {str(el.tag)[:120]}")
    wst = version.wst

    def invalid(reason: str) -> faults.Fault:
        return wst_fault(version, "InvalidRequest", f"RST: {reason}")

    context = el.get("Context")
    if context is not None and len(context) > MAX_CONTEXT_ATTRIBUTE:
        raise invalid(f"Context attribute of {len(context)} characters")
    request_type = text_of(one(el, ns.q(wst, "RequestType"), invalid), invalid)
    token_type = at_most_one(el, ns.q(wst, "TokenType"), invalid)
    asked = None if token_type is None else text_of(token_type, invalid)
    if asked == ns.SAML_V2_TOKEN and version is WSC_1_3 and request_type == version.issue:
        return Rst(version, "issue", context, DEFAULT_KEY_BITS, None, None, _saml_request(el, invalid))
    if asked is not None and asked != version.sct_token_type:
        raise invalid(f"TokenType {asked[:120]!r} is not the {version.name} SCT")
    if request_type == version.renew:
        raise wsc_fault(version, "UnableToRenew", "RST Renew: the gateway does not renew contexts")
    if request_type == version.cancel:
        target = one(el, ns.q(wst, "CancelTarget"), invalid)
        inner = child_elements(target)
        if len(inner) != 1:
            raise invalid("CancelTarget must hold one token or reference")
        if is_sct(inner[0]):  # CXF puts the token itself there
            sct = parse_sct(inner[0])
            if sct.version is not version:
                raise invalid(f"CancelTarget holds a {sct.version.name} SCT")
            ref = SctRef(version, identifier=sct.identifier)
        else:
            ref = parse_sct_ref(inner[0], version, invalid)
        return Rst(version, "cancel", context, DEFAULT_KEY_BITS, None, ref)
    if request_type != version.issue:
        raise invalid(f"RequestType {request_type[:120]!r}")
    bits = DEFAULT_KEY_BITS
    key_size = at_most_one(el, ns.q(wst, "KeySize"), invalid)
    if key_size is not None:
        bits = integer_of(key_size, invalid)
        if not MIN_KEY_BITS <= bits <= MAX_KEY_BITS or bits % 8:
            raise invalid(f"KeySize {bits}")
    key_type = at_most_one(el, ns.q(wst, "KeyType"), invalid)
    if key_type is not None and text_of(key_type, invalid) != version.symmetric_key_type:
        raise invalid(f"KeyType {text_of(key_type, invalid)[:120]!r}: an SCT has a symmetric key")
    algorithm = at_most_one(el, ns.q(wst, "ComputedKeyAlgorithm"), invalid)
    if algorithm is not None and text_of(algorithm, invalid) != version.computed_key_psha1:
        raise invalid(f"ComputedKeyAlgorithm {text_of(algorithm, invalid)[:120]!r}")
    entropy = None
    entropy_el = at_most_one(el, ns.q(wst, "Entropy"), invalid)
    if entropy_el is not None:
        inner = child_elements(entropy_el)
        if len(inner) != 1 or inner[0].tag != ns.q(wst, "BinarySecret"):
            raise invalid("Entropy must be one BinarySecret (encrypted entropy is not supported)")
        if inner[0].get("Type") not in (None, version.nonce_type, version.symmetric_key_type):
            raise invalid(f"Entropy BinarySecret Type {inner[0].get('Type', '')[:120]!r}")
        entropy = base64_of(inner[0], invalid)
        if not MIN_ENTROPY_BYTES <= len(entropy) <= MAX_ENTROPY_BYTES:
            raise invalid(f"Entropy of {len(entropy)} bytes")
    return Rst(version, "issue", context, bits, entropy, None)


def _saml_request(el: etree._Element, invalid: Fail) -> SamlRequest:
    """The SAML part of an Issue RST. Holder-of-key confirms the certificate the request is signed with: a
    UseKey naming another key, proof of possession of which the gateway never saw, is refused."""
    wst = WST_1_3
    if at_most_one(el, ns.q(wst, "UseKey"), invalid) is not None:
        raise invalid("UseKey: a holder-of-key assertion confirms the certificate that signed the request")
    confirmation = None
    key_type = at_most_one(el, ns.q(wst, "KeyType"), invalid)
    if key_type is not None:
        confirmation = SAML_KEY_TYPES.get(text_of(key_type, invalid))
        if confirmation is None:
            raise invalid(f"KeyType {text_of(key_type, invalid)[:120]!r} for a SAML 2.0 assertion")
    applies_to = None
    holder = at_most_one(el, ns.q(ns.WSP, "AppliesTo"), invalid) or at_most_one(
        el, ns.q(ns.WSP_2004, "AppliesTo"), invalid
    )
    if holder is not None:
        addresses = holder.findall("{*}EndpointReference/{*}Address")
        if len(addresses) != 1 or {etree.QName(a).namespace for a in (addresses[0], addresses[0].getparent())} - {
            *ns.ADDRESSING
        }:
            raise invalid("AppliesTo must hold one WS-Addressing EndpointReference")
        applies_to = text_of(addresses[0], invalid).strip()
        if not applies_to or len(applies_to) > MAX_APPLIES_TO:
            raise invalid("AppliesTo address empty or too long")
    return SamlRequest(confirmation, applies_to)


@dataclass(frozen=True)
class IssueAnswer:
    response: etree._Element  # the RSTR (2005/02) or RSTR collection (1.3), for the reply's Body
    context: Context
    # The key itself is in the RSTR (a BinarySecret proof): the reply's Body must go encrypted to the requester.
    key_in_body: bool = False


def answer_issue(
    rst: Rst,
    store: ContextStore,
    requester: x509.Certificate,
    subject: str,
    now: datetime,
    *,
    entropy_confidential: bool,
) -> IssueAnswer:
    """Establish a context for an Issue RST whose sender the bootstrap authenticated (`requester`, `subject`).

    With requestor entropy, and `entropy_confidential` (the request Body arrived encrypted, or over TLS), the
    key is computed: P_SHA1(requestor entropy, fresh issuer entropy), the issuer entropy in the RSTR. Otherwise
    the key is fresh and travels as a BinarySecret proof token (`key_in_body`: the caller encrypts the reply's
    Body to `requester`): requestor entropy sent in the clear would give the computed key to any eavesdropper of
    both. A BinarySecret, not an EncryptedKey, because every stack parses it (Metro 4 takes no EncryptedKey proof)."""
    if rst.request_type != "issue":
        raise ValueError("answer_issue needs an Issue RST")
    version, size = rst.version, rst.key_size_bits // 8
    server_entropy = None
    if rst.entropy is not None and entropy_confidential:
        server_entropy = os.urandom(size)
        secret = p_sha1(rst.entropy, server_entropy, size)
    else:
        secret = os.urandom(size)
    ctx = store.issue(secret, subject, version, now)
    proof = etree.Element(ns.q(version.wst, "RequestedProofToken"))
    if server_entropy is not None:
        sub(proof, ns.q(version.wst, "ComputedKey"), version.computed_key_psha1)
    else:
        if not isinstance(requester.public_key(), rsa.RSAPublicKey):
            raise wst_fault(version, "RequestFailed", "the requester's certificate has no RSA key to encrypt to")
        binary = sub(proof, ns.q(version.wst, "BinarySecret"), base64.b64encode(secret).decode())
        binary.set("Type", version.symmetric_key_type)
    return IssueAnswer(_rstr(rst, ctx, proof, server_entropy), ctx, key_in_body=server_entropy is None)


def _rstr(rst: Rst, ctx: Context, proof: etree._Element, server_entropy: bytes | None) -> etree._Element:
    version = rst.version
    wst = version.wst
    nsmap = {"wst": wst, "wsc": version.wsc, "wsu": ns.WSU, "wsse": ns.WSSE}
    rstr_tag = ns.q(wst, "RequestSecurityTokenResponse")
    if version is WSC_1_3:  # WS-Trust 1.3 wraps a final Issue response in a collection (CXF does)
        outer = etree.Element(ns.q(wst, "RequestSecurityTokenResponseCollection"), nsmap=nsmap)
        rstr = etree.SubElement(outer, rstr_tag)
    else:
        outer = rstr = etree.Element(rstr_tag, nsmap=nsmap)
    if rst.context is not None:
        rstr.set("Context", rst.context)
    sub(rstr, ns.q(wst, "TokenType"), version.sct_token_type)
    sct_id = new_id("sct")
    sub(rstr, ns.q(wst, "RequestedSecurityToken")).append(sct_element(version, ctx.identifier, sct_id))
    sub(rstr, ns.q(wst, "RequestedAttachedReference")).append(sct_reference(version, local_id=sct_id))
    sub(rstr, ns.q(wst, "RequestedUnattachedReference")).append(sct_reference(version, identifier=ctx.identifier))
    rstr.append(proof)
    if server_entropy is not None:
        secret = sub(
            sub(rstr, ns.q(wst, "Entropy")), ns.q(wst, "BinarySecret"), base64.b64encode(server_entropy).decode()
        )
        secret.set("Type", version.nonce_type)
    lifetime = sub(rstr, ns.q(wst, "Lifetime"))
    sub(lifetime, ns.q(ns.WSU, "Created"), format_datetime(ctx.created))
    sub(lifetime, ns.q(ns.WSU, "Expires"), format_datetime(ctx.expires))
    sub(rstr, ns.q(wst, "KeySize"), str(rst.key_size_bits))
    return outer


def answer_saml_issue(
    rst: Rst, issuer: Issuer, policy: SamlTokenService, requester: x509.Certificate, subject: str, now: datetime
) -> tuple[etree._Element, bool]:
    """The RSTR collection for an Issue RST of a SAML 2.0 assertion, to a requester the bootstrap authenticated
    (its signature with `requester`, whose subject is `subject`): bearer, or holder-of-key for `requester`, for
    the audience AppliesTo names (one the policy lists; the policy's own when absent). And whether it is a
    bearer assertion (usable by whoever reads it)."""
    if rst.saml is None:
        raise ValueError("answer_saml_issue needs a SAML Issue RST")
    confirmation = rst.saml.confirmation or policy.confirmations[0]
    if confirmation not in policy.confirmations:
        raise wst_fault(rst.version, "RequestFailed", f"SAML {confirmation} assertions are not issued here")
    audience = rst.saml.applies_to or policy.audience
    if audience not in (policy.audience, *policy.other_audiences):
        raise wst_fault(rst.version, "RequestFailed", f"no SAML assertions for AppliesTo {audience[:120]!r}")
    identity = Identity(subject, NAMEID_X509, AC_X509, now)
    if confirmation == "holder-of-key":
        assertion = issuer.issue(identity, audience=audience, now=now, confirmation=ns.SAML2_HOLDER_OF_KEY,
                                 holder=requester)  # fmt: skip
    else:
        assertion = issuer.issue(identity, audience=audience, now=now, confirmation=ns.SAML2_BEARER)
    wst = rst.version.wst
    outer = etree.Element(ns.q(wst, "RequestSecurityTokenResponseCollection"), nsmap={"wst": wst, "wsu": ns.WSU})
    rstr = sub(outer, ns.q(wst, "RequestSecurityTokenResponse"))
    if rst.context is not None:
        rstr.set("Context", rst.context)
    sub(rstr, ns.q(wst, "TokenType"), ns.SAML_V2_TOKEN)
    key_type = next(uri for uri, name in SAML_KEY_TYPES.items() if name == confirmation)
    sub(rstr, ns.q(wst, "KeyType"), key_type)
    sub(rstr, ns.q(wst, "RequestedSecurityToken")).append(assertion)
    # The SAML Token Profile references an assertion by its ID, attached (in the same message) or not.
    sub(rstr, ns.q(wst, "RequestedAttachedReference")).append(saml_id_reference(assertion))
    sub(rstr, ns.q(wst, "RequestedUnattachedReference")).append(saml_id_reference(assertion))
    lifetime = sub(rstr, ns.q(wst, "Lifetime"))
    sub(lifetime, ns.q(ns.WSU, "Created"), format_datetime(now))
    sub(lifetime, ns.q(ns.WSU, "Expires"), format_datetime(now + issuer.lifetime))
    if rst.saml.applies_to:
        endpoint = sub(sub(rstr, ns.q(ns.WSP_2004, "AppliesTo")), ns.q(ns.WSA, "EndpointReference"))
        sub(endpoint, ns.q(ns.WSA, "Address"), audience)
    return outer, confirmation == "bearer"


def answer_cancel(
    rst: Rst, store: ContextStore, proven: Context, now: datetime, local: Mapping[str, Sct] | None = None
) -> etree._Element:
    """End the context a Cancel RST names and return the RSTR (RequestedTokenCancelled) for the reply's Body.

    `proven`: the context whose derived key verified this message's signature. Only that context may be
    cancelled (BadContextToken otherwise): an Identifier is no secret. `local`: header_scts of the message,
    for a CancelTarget that references an SCT in the header."""
    if rst.request_type != "cancel" or rst.cancel_target is None:
        raise ValueError("answer_cancel needs a Cancel RST")
    version = rst.version
    identifier = resolve_identifier(rst.cancel_target, local, "BadContextToken")
    if identifier != proven.identifier or proven.version is not version:
        raise unknown_context(version, identifier, "cancel of a context the message is not secured with")
    store.cancel(identifier, version, now)
    rstr = etree.Element(ns.q(version.wst, "RequestSecurityTokenResponse"), nsmap={"wst": version.wst})
    if rst.context is not None:
        rstr.set("Context", rst.context)
    sub(rstr, ns.q(version.wst, "RequestedTokenCancelled"))
    return rstr


# ---------------------------------------------------------------------------------------------------------
# Client side


def build_issue_rst(
    version: Version, *, entropy: bytes | None, key_size_bits: int = DEFAULT_KEY_BITS, context: str | None = None
) -> etree._Element:
    """An Issue RST for an SCT, as WCF and CXF send it. With `entropy` (keep it: read_rstr needs it), the
    gateway may compute the key from both parties' entropy."""
    wst = version.wst
    el = etree.Element(ns.q(wst, "RequestSecurityToken"), nsmap={"wst": wst})
    if context is not None:
        el.set("Context", context)
    sub(el, ns.q(wst, "TokenType"), version.sct_token_type)
    sub(el, ns.q(wst, "RequestType"), version.issue)
    if entropy is not None:
        secret = sub(sub(el, ns.q(wst, "Entropy")), ns.q(wst, "BinarySecret"), base64.b64encode(entropy).decode())
        secret.set("Type", version.nonce_type)
        sub(el, ns.q(wst, "ComputedKeyAlgorithm"), version.computed_key_psha1)
    sub(el, ns.q(wst, "KeySize"), str(key_size_bits))
    return el


@dataclass(frozen=True)
class IssuedContext:
    """What the client learns from an Issue RSTR."""

    context: Context  # subject ""
    token: etree._Element  # the wsc:SecurityContextToken, to put in a Security header when referencing '#id'


def _only_rstr(el: etree._Element) -> tuple[Version, etree._Element]:
    """The RSTR of a response: `el` itself, or the one RSTR of a (1.3) collection."""
    qn = etree.QName(el)
    version = BY_WST.get(qn.namespace or "")
    if version is None:
        raise invalid_token(f"not a WS-Trust response: {str(el.tag)[:120]}")
    if qn.localname == "RequestSecurityTokenResponseCollection":
        inner = child_elements(el)
        if len(inner) != 1:
            raise invalid_token(f"RSTR collection with {len(inner)} responses")
        el = inner[0]
    if el.tag != ns.q(version.wst, "RequestSecurityTokenResponse"):
        raise invalid_token(f"not an RSTR: {str(el.tag)[:120]}")
    return version, el


def read_rstr(
    el: etree._Element,
    *,
    entropy: bytes | None,
    private_key: rsa.RSAPrivateKey | None,
    transports: Sequence[str] = ("rsa-oaep-mgf1p", "rsa-oaep"),
    key_size_bits: int = DEFAULT_KEY_BITS,
) -> IssuedContext:
    """The context an Issue RSTR (or RSTR collection) establishes. The key: computed from `entropy` (what
    build_issue_rst sent) and the issuer's Entropy, or decrypted from the EncryptedKey with `private_key`
    (`transports`: policy key transport names allowed). `key_size_bits`: what was asked, when the RSTR has
    no KeySize. InvalidSecurityToken when the RSTR is unusable."""
    version, rstr = _only_rstr(el)
    wst = version.wst
    token_holder = one(rstr, ns.q(wst, "RequestedSecurityToken"), invalid_token)
    tokens = child_elements(token_holder)
    if len(tokens) != 1 or not is_sct(tokens[0]):
        raise invalid_token("RequestedSecurityToken does not hold one SecurityContextToken")
    sct = parse_sct(tokens[0])
    if sct.version is not version:
        raise invalid_token(f"{version.name} RSTR with a {sct.version.name} SCT")
    lifetime = one(rstr, ns.q(wst, "Lifetime"), invalid_token)
    try:
        created = parse_datetime(text_of(one(lifetime, ns.q(ns.WSU, "Created"), invalid_token), invalid_token))
        expires = parse_datetime(text_of(one(lifetime, ns.q(ns.WSU, "Expires"), invalid_token), invalid_token))
    except ValueError as exc:
        raise invalid_token(f"Lifetime: {exc}") from None
    size_el = at_most_one(rstr, ns.q(wst, "KeySize"), invalid_token)
    size = (key_size_bits if size_el is None else integer_of(size_el, invalid_token)) // 8
    proof = child_elements(one(rstr, ns.q(wst, "RequestedProofToken"), invalid_token))
    if len(proof) != 1:
        raise invalid_token("RequestedProofToken must hold one proof")
    if proof[0].tag == ns.q(wst, "ComputedKey"):
        if text_of(proof[0], invalid_token) != version.computed_key_psha1:
            raise invalid_token("ComputedKey is not P_SHA1")
        holder = one(rstr, ns.q(wst, "Entropy"), invalid_token)
        if entropy is None:
            raise invalid_token("ComputedKey, but no entropy was sent")
        server_entropy = base64_of(one(holder, ns.q(wst, "BinarySecret"), invalid_token), invalid_token)
        secret = p_sha1(entropy, server_entropy, size)
    elif proof[0].tag == ns.q(wst, "BinarySecret"):  # in a reply whose Body was encrypted to us
        secret = base64_of(proof[0], invalid_token)
        if len(secret) != size:
            raise invalid_token(f"BinarySecret proof of {len(secret)} bytes, {size} expected")
    elif proof[0].tag == ns.q(ns.XENC, "EncryptedKey"):
        if private_key is None:
            raise invalid_token("EncryptedKey proof token, but no private key to open it")
        secret = encryption.decrypt_key(proof[0], private_key, transports, size)
    else:
        raise invalid_token(f"unsupported proof token {str(proof[0].tag)[:120]}")
    ctx = Context(sct.identifier, secret, "", version, created, expires)
    return IssuedContext(ctx, copy.deepcopy(tokens[0]))


def build_saml_issue_rst(*, bearer: bool, applies_to: str | None = None) -> etree._Element:
    """An Issue RST (WS-Trust 1.3) for a SAML 2.0 assertion: holder-of-key for the certificate that signs the
    request, or bearer; for `applies_to` (None: the service's default audience)."""
    wst = WST_1_3
    el = etree.Element(ns.q(wst, "RequestSecurityToken"), nsmap={"wst": wst})
    sub(el, ns.q(wst, "TokenType"), ns.SAML_V2_TOKEN)
    sub(el, ns.q(wst, "RequestType"), f"{wst}/Issue")
    sub(el, ns.q(wst, "KeyType"), next(k for k, v in SAML_KEY_TYPES.items() if (v == "bearer") == bearer))
    if applies_to is not None:
        holder = etree.SubElement(el, ns.q(ns.WSP_2004, "AppliesTo"), nsmap={"wsp": ns.WSP_2004, "wsa": ns.WSA})
        sub(sub(holder, ns.q(ns.WSA, "EndpointReference")), ns.q(ns.WSA, "Address"), applies_to)
    return el


def read_saml_rstr(el: etree._Element) -> etree._Element:
    """The assertion of a SAML Issue RSTR collection (the caller verifies it: its signature is the issuer's)."""
    _, rstr = _only_rstr(el)
    holder = one(rstr, ns.q(WST_1_3, "RequestedSecurityToken"), invalid_token)
    tokens = child_elements(holder)
    if len(tokens) != 1 or tokens[0].tag != ns.q(ns.SAML2, "Assertion"):
        raise invalid_token("RequestedSecurityToken does not hold one SAML 2.0 Assertion")
    return copy.deepcopy(tokens[0])


def build_cancel_rst(ctx: Context, *, context: str | None = None) -> etree._Element:
    """A Cancel RST for `ctx`, naming it by Identifier. Secure the message with keys derived from `ctx`."""
    wst = ctx.version.wst
    el = etree.Element(ns.q(wst, "RequestSecurityToken"), nsmap={"wst": wst})
    if context is not None:
        el.set("Context", context)
    sub(el, ns.q(wst, "RequestType"), ctx.version.cancel)
    sub(el, ns.q(wst, "CancelTarget")).append(sct_reference(ctx.version, identifier=ctx.identifier))
    return el


def read_cancel_rstr(el: etree._Element) -> Version:
    """Check a Cancel response (RSTR or RSTR collection) says RequestedTokenCancelled; its version."""
    version, rstr = _only_rstr(el)
    one(rstr, ns.q(version.wst, "RequestedTokenCancelled"), invalid_token)
    return version


# ---------------------------------------------------------------------------------------------------------
# Envelopes for the exchanges the gateway answers itself


def message_id(env: Envelope) -> str | None:
    """The request's wsa:MessageID (WS-Addressing 1.0), for the reply's RelatesTo."""
    header = env.header
    found = header.find(ns.q(ns.WSA, "MessageID")) if header is not None else None
    if found is None:
        return None
    return (found.text or "").strip() or None


def envelope(soap_version: str, body_child: etree._Element, *, action: str, relates_to: str | None = None) -> Envelope:
    """A SOAP `soap_version` ("1.1" or "1.2") envelope around `body_child`, with wsa:Action, a fresh
    wsa:MessageID and, when given, wsa:RelatesTo. Secure it like any other message (wssecurity_sending.secure)."""
    soap = ns.SOAP12 if soap_version == "1.2" else ns.SOAP11
    root = etree.Element(ns.q(soap, "Envelope"), nsmap={"soap": soap, "wsa": ns.WSA})
    header = sub(root, ns.q(soap, "Header"))
    sub(header, ns.q(ns.WSA, "Action"), action)
    sub(header, ns.q(ns.WSA, "MessageID"), random_identifier())
    if relates_to is not None:
        sub(header, ns.q(ns.WSA, "RelatesTo"), relates_to)
    sub(root, ns.q(soap, "Body")).append(body_child)
    return Envelope(root=root, version="1.2" if soap_version == "1.2" else "1.1")
