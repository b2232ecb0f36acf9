"""The STR-Transform (OASIS WSS 1.1 SOAP Message Security, 8.3; SAML Token Profile 1.1, 3.4.3), receiving side.

A ds:Reference to a wsse:SecurityTokenReference with this transform signs the token the STR names instead of
the STR: the STR is replaced by that token, which is canonicalized with the method its
wsse:TransformationParameters give and digested. Metro and WSS4J sign a sender-vouches assertion this way.

Taken narrowly: the STR-Transform must be the reference's only transform, its parameters exactly one exclusive
C14N method (an InclusiveNamespaces PrefixList at most), and the STR is resolved by the caller (`Dereference`) to
a token it has already verified, by identity (wssecurity: the header's one SAML assertion): never a new search
by id, so no second element of the same id can be what is digested."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping

from lxml import etree

from filters.engine import faults, ns
from filters.engine.xml import c14n, values

ALGORITHM = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-soap-message-security-1.0#STR-Transform"
EXC_C14N = "http://www.w3.org/2001/10/xml-exc-c14n#"
PARAMETERS = ns.q(ns.WSSE, "TransformationParameters")
CANONICALIZATION = ns.q(ns.DS, "CanonicalizationMethod")
INCLUSIVE_NAMESPACES = ns.q(ns.EXC_C14N, "InclusiveNamespaces")
STR = ns.q(ns.WSSE, "SecurityTokenReference")

# The STR -> the token it names, verified before (or a Fault): the caller's, which knows what the header proved.
Dereference = Callable[[etree._Element], etree._Element]


def _children(el: etree._Element) -> list[etree._Element]:
    return [c for c in el if isinstance(c.tag, str)]


def prefix_list(transform: etree._Element) -> list[str]:
    """The PrefixList of an STR-Transform's exclusive C14N, after checking its one allowed shape."""
    params = _children(transform)
    if [p.tag for p in params] != [PARAMETERS]:
        raise faults.security("InvalidSecurity", "STR-Transform without wsse:TransformationParameters")
    methods = _children(params[0])
    if [m.tag for m in methods] != [CANONICALIZATION]:
        raise faults.security("InvalidSecurity", "STR-Transform parameters are not one ds:CanonicalizationMethod")
    method = methods[0]
    if method.get("Algorithm") != EXC_C14N:
        uri = (method.get("Algorithm") or "")[:120]
        raise faults.security("UnsupportedAlgorithm", f"STR-Transform canonicalization {uri!r} is not allowed")
    inclusive = _children(method)
    if [i.tag for i in inclusive] not in ([], [INCLUSIVE_NAMESPACES]):
        raise faults.security("InvalidSecurity", "STR-Transform canonicalization has unexpected parameters")
    prefixes = (inclusive[0].get("PrefixList") or "").split() if inclusive else []
    if not c14n.direct(prefixes):
        raise faults.security("UnsupportedAlgorithm", "STR-Transform PrefixList naming the default namespace")
    return prefixes


def output(token: etree._Element, prefixes: list[str]) -> bytes:
    """The transform's octets: the token's exclusive canonical form. WSS 1.1 (8.3) has the apex carry a default
    namespace declaration; exclusive C14N renders none when the token does not use one, so xmlns="" is added
    there, as WSS4J and Metro do."""
    form = c14n.canonical(token, prefixes)
    head = form[: form.index(b">")]
    if b' xmlns="' in head:
        return form
    name_end = next((i for i, ch in enumerate(head) if ch in b" />"), len(head))
    return form[:name_end] + b' xmlns=""' + form[name_end:]


def verify(
    ref: etree._Element, str_el: etree._Element, dereference: Dereference | None, digests: Mapping[str, str]
) -> etree._Element:
    """Check one STR-Transform reference to `str_el` (its shape checked by signature._check_reference): the token
    the STR names, whose transformed digest matches. `digests`: allowed digest URIs -> hashlib names."""
    if str_el.tag != STR:
        raise faults.security("InvalidSecurity", f"STR-Transform reference to {str_el.tag[:120]}")
    if dereference is None:
        raise faults.security("InvalidSecurity", "STR-Transform where no token was verified to name")
    transforms, method, value = _children(ref)
    (transform,) = _children(transforms)
    prefixes = prefix_list(transform)
    token = dereference(str_el)
    name = digests[method.get("Algorithm") or ""]
    got = hashlib.new(name, output(token, prefixes)).digest()
    if not hmac.compare_digest(got, values.base64_bytes(value, "ds:DigestValue")):
        raise faults.security("FailedCheck", "STR-Transform reference: digest does not match the token it names")
    return token
