"""Exclusive XML Canonicalization of one element, directly: what a ds:Reference digests.

xmlsec canonicalizes a same-document reference through a node set (every node of the document asks whether it
belongs to the referenced subtree), which costs 3-6 times libxml2's C14N run on the element itself. lxml runs
that same libxml2 C14N on a temporary root that carries every namespace declaration in scope, so the exclusive
canonical form is byte for byte xmlsec's, with one catch: lxml hands libxml2 only the InclusiveNamespaces
prefixes its string dictionary already holds and drops the others without a word ("#default" always), which
depends on what the process parsed before. So with a PrefixList the element is parsed again from its
self-contained form (the parser interns every prefix in scope), and "#default" is left to xmlsec. Only
exclusive C14N without comments is done here (what WS-Security senders use); anything else stays with xmlsec.

libxml2 looks every PrefixList prefix up again at every element (about 3 us per element with 30 prefixes, 20 times
the C14N itself), and a signer chooses the list. The output differs from the plain exclusive form only in that
the listed prefixes in scope are rendered on the apex (and again below where an element rebinds one). So when no
listed prefix is declared below the apex and each is the only prefix of its namespace, the apex is made to use
each listed prefix with a marker attribute, canonicalized without a list and the markers cut out: the same bytes,
at the cost of a plain exclusive C14N. Anything else takes libxml2's way, and xmlsec's is slower still (about
0.5 us per element and prefix): both only while `affordable`, or the signature is refused. Before all that, a short
list (the Timestamp's "soap wsse", the SignedInfo's "soap") goes to libxml2's PrefixList C14N on the element in
place, kept only where the output proves lxml handed every prefix on (`_in_place`): a third to half the cost.

`received_form` is the element as it is, serialized with every namespace in scope (self-contained, so it
represents the element faithfully): the input of on-demand re-canonicalization (van Engelen 2.5), of the digest
cache (Algorithm 1) and of prehashing (2.4)."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Sequence

from lxml import etree

from filters.engine import faults, metrics
from filters.engine.xml import xmlsupport

# Policy digest names -> hashlib's constructors (the algorithms signature.DIGEST_METHODS allows): hashlib.new by
# name looks the digest up in OpenSSL on every call (~1 us, as much as hashing a KB).
HASHES = {"sha256": hashlib.sha256, "sha1": hashlib.sha1}
# Re-reads the gateway's own serialization of an element that passed threat protection already.
_PARSER = xmlsupport.parser(huge_tree=True, collect_ids=False)
_MARK = "wsgate-c14n-prefix-mark"
# A PrefixList canonicalized the slow way: ('<' in the element's serialization x listed prefixes) pairs allowed,
# one per PREFIX_LIST_BYTES bytes of it, or PREFIX_LIST_PAIRS whatever the size. Ordinary messages (10-15
# prefixes, text between elements) fit; an element-dense body under a long list (the CPU of several plain messages
# of its size) does not.
PREFIX_LIST_BYTES = 2
PREFIX_LIST_PAIRS = 4096
# PrefixLists of at most this many prefixes go to libxml2's own PrefixList C14N on the element in place, where
# lxml is proved to have handed them on (_in_place): the per-element lookups then cost at most about what the
# marker way's serialization and scan cost. The Timestamp's ("soap wsse") and the SignedInfo's ("soap") lists.
IN_PLACE_PREFIXES = 2


def direct(prefixes: Sequence[str]) -> bool:
    """Whether a PrefixList can be canonicalized here (not "#default", which lxml cannot pass on)."""
    return "#default" not in prefixes


@metrics.timed("c14n")
def canonical(el: etree._Element, prefixes: Sequence[str]) -> bytes:
    """Exclusive C14N 1.0 (without comments) of `el`; `prefixes`: the InclusiveNamespaces PrefixList."""
    return _canonical(el, prefixes)


def _canonical(el: etree._Element, prefixes: Sequence[str]) -> bytes:
    if not prefixes:
        return etree.tostring(el, method="c14n", exclusive=True, with_comments=False)
    if not direct(prefixes):
        raise ValueError("the default namespace in a PrefixList is left to xmlsec")
    in_place = _in_place(el, prefixes)
    if in_place is not None:
        return in_place
    form = received_form(el)
    marked = _marked(el, form, prefixes)
    if marked is not None:
        return marked
    check_affordable(form, prefixes)
    alone = etree.fromstring(form, _PARSER)
    return etree.tostring(alone, method="c14n", exclusive=True, with_comments=False,
                          inclusive_ns_prefixes=list(prefixes))  # fmt: skip


def _in_place(el: etree._Element, prefixes: Sequence[str]) -> bytes | None:
    """libxml2's own PrefixList C14N of `el` where it stands, when its output proves lxml handed every listed prefix
    on; None otherwise. The proof: each listed prefix is in scope on `el` and not used by `el` itself (its name,
    its attributes), so a declaration of it on the apex can only come from the list (exclusive C14N declares on an
    element only the namespaces it uses) and must be there (a listed prefix in scope is declared on the apex). At
    most IN_PLACE_PREFIXES prefixes: libxml2 looks each up again at every element."""
    listed = set(prefixes)
    listed.discard("xml")  # never declared
    if len(listed) > IN_PLACE_PREFIXES:
        return None
    in_scope = el.nsmap
    used = {etree.QName(name).namespace for name in (el.tag, *el.attrib)}
    if any(p not in in_scope or in_scope[p] in used for p in listed):
        return None
    out = etree.tostring(el, method="c14n", exclusive=True, with_comments=False, inclusive_ns_prefixes=list(listed))
    # The apex start tag up to its first '>': the declarations come before any attribute, and a declaration's
    # value has its '"' escaped, so ` xmlns:p="` there is p's declaration (a '>' in a value cuts it short: None).
    head = out[: out.find(b">")]
    if any(f' xmlns:{p}="'.encode() not in head for p in listed):
        return None
    return out


def check_affordable(form: bytes, prefixes: Sequence[str]) -> None:
    """Refuse to canonicalize `form` (an element's received form) with the PrefixList `prefixes` the slow way
    when that would cost more than a few plain messages of its size."""
    pairs = form.count(b"<") * len(set(prefixes))
    if pairs > max(PREFIX_LIST_PAIRS, len(form) // PREFIX_LIST_BYTES):
        raise faults.security(
            "InvalidSecurity", f"InclusiveNamespaces PrefixList of {len(set(prefixes))} over {len(form)} bytes"
        )


def _marked(el: etree._Element, form: bytes, prefixes: Sequence[str]) -> bytes | None:
    """The exclusive canonical form of `el` (`form`: its received form) with the PrefixList `prefixes`, by the
    marker attributes (module docstring), set on `el` itself for the run and removed; None where that does not
    apply. On `el`, not a copy parsed from `form`: the parse cost twice the C14N on a 1 KB Body."""
    in_scope = el.nsmap
    uris = list(in_scope.values())
    # One pass over `form` for every listed prefix: a count per prefix cost a scan of the body each (30 listed
    # prefixes over 320 KB: 13 ms).
    declarations = Counter(_DECLARATION.findall(form))
    listed = []
    for prefix in dict.fromkeys(prefixes):
        # `xmlns:p="` occurs once in `form` (on the apex) for a prefix in scope, never for one that is not, unless
        # an element below binds it (or text quotes it): the slow way then. A prefix bound nowhere renders nothing.
        declared = declarations[prefix.encode()]
        if prefix == "xml" or declared == 0:
            continue
        uri = in_scope.get(prefix)
        # The marker must carry this very prefix: lxml picks the prefix by namespace.
        if uri is None or declared != 1 or uris.count(uri) != 1 or el.get(_mark(uri)) is not None:
            return None
        listed.append(prefix)
    # With one in-scope prefix for the namespace, lxml finds that declaration: the marker adds none of its own.
    for prefix in listed:
        el.set(_mark(in_scope[prefix]), "")
    try:
        out = etree.tostring(el, method="c14n", exclusive=True, with_comments=False)
    finally:
        for prefix in listed:
            del el.attrib[_mark(in_scope[prefix])]
    for prefix in listed:
        # The first occurrence is in the apex start tag: no earlier attribute value can hold '=""' unescaped.
        marker = f' {prefix}:{_MARK}=""'.encode()
        at = out.find(marker)
        if at < 0:
            return None
        out = out[:at] + out[at + len(marker) :]
    return out


_DECLARATION = re.compile(rb"xmlns:([^\s=]+)=")


def _mark(uri: str) -> str:
    return f"{{{uri}}}{_MARK}"


@metrics.timed("c14n")
def digest(el: etree._Element, prefixes: Sequence[str], algorithm: str) -> bytes:
    """The DigestValue (raw bytes) of a reference to `el` with one exclusive C14N transform: timed as c14n, then as
    digest (one stage going on under another name, not a stage inside a stage: a tick less per reference)."""
    form = _canonical(el, prefixes)
    metrics.then("digest")
    return HASHES[algorithm](form).digest()


def received_form(el: etree._Element) -> bytes:
    """`el` serialized as it is, with the namespace declarations in scope copied onto it. Equal to its canonical
    form when the sender wrote the element canonically (declarations sorted on the element itself, attributes in
    order, no empty-element tags, UTF-8) and nothing reformatted it on the way."""
    return etree.tostring(el, encoding="utf-8", with_tail=False)
