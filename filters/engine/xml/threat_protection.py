"""XML threat protection: the first stage of every profile that touches XML.

The body must be one well-formed SOAP 1.1 or 1.2 envelope with one Body, in UTF-8 or UTF-16 (filters/engine/xml/charset.py
finds which and hands on UTF-8). DTDs, entity declarations and processing instructions are refused; size, nesting
depth, element count, attribute count, namespace declarations (per element and in scope) and the length of text,
attribute values, namespace names and comments are limited. A body whose bytes already prove the element count
and length limits (fewer '<' than elements allowed, fewer bytes than a text node or namespace name may have) is
parsed whole by libxml2 and its depth, attributes and processing instructions are checked with XPath, in C. Its
declarations in scope are counted (where the bytes hold more "xmlns" than allowed) by a walk on which only the
elements that declare namespaces give events; that count bounds each element's own as well, unless the policy
allows fewer on one element than in scope (then the bytes must prove both). Any other body is parsed
incrementally and refused as soon as it crosses a limit (bounded memory and time), before anything serializes or
canonicalizes it. Decrypted content (parse_fragment) takes the same two ways. Nothing is ever loaded from the
network or the file system (filters/engine/xml/xmlsupport.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import cache
from itertools import accumulate
from operator import itemgetter
from typing import Protocol
from xml.sax.saxutils import quoteattr

from lxml import etree

from filters.engine import faults, ns
from filters.engine.xml import charset, xmlsupport
from filters.engine.xml.soap import VERSIONS, Envelope
from filters.engine.xml.xmlsupport import ExternalResourceRefused


class Limits(Protocol):
    max_body_bytes: int
    max_depth: int
    max_elements: int
    max_attributes: int
    max_text_length: int
    max_namespace_declarations: int
    max_namespaces_in_scope: int


CHUNK = 64 * 1024

# Ids are registered, each in its own check, only where a signature needs them.
# Reused: a worker parses on one thread only (the engine is synchronous).
_WHOLE = xmlsupport.parser(collect_ids=False)


def _parser() -> etree.XMLPullParser:
    return xmlsupport.pull_parser(("start-ns", "start", "end", "comment", "pi"), collect_ids=False)


def _refused(exc: ExternalResourceRefused) -> faults.Fault:
    return faults.client(f"parser asked to load an {exc}")


class _Checks:
    """The limits, checked on a pull parser's events as they arrive (envelopes and decrypted fragments).

    Namespace declarations arrive (start-ns) before their element's start: counted there, per element and in
    scope (every declaration on the element and its ancestors; a redeclared prefix counts again, as it costs
    again), before anything walks the element's namespaces."""

    __slots__ = (
        "count_elements",
        "declared",
        "depth",
        "elements",
        "exempt",
        "in_scope",
        "last",
        "limits",
        "parser",
        "scopes",
    )

    def __init__(
        self, parser: etree.XMLPullParser, limits: Limits, *, count_elements: bool = True, depth: int = 0
    ) -> None:
        self.parser = parser
        self.limits = limits
        self.count_elements = count_elements
        self.depth = depth
        self.elements = 0
        self.declared = 0  # declarations seen for the element whose start comes next
        self.in_scope = 0
        self.scopes: list[int] = []  # declarations per open element
        self.exempt = False  # the first element's declarations count in scope only (a fragment's wrapper)
        self.last: etree._Element | None = None  # the element or comment that ended last, its tail not checked

    def feed(self, data: bytes) -> None:
        self.parser.feed(data)
        self.check()

    def check(self) -> None:
        limits = self.limits
        for event, item in self.parser.read_events():
            if event == "start-ns":
                self.declared += 1
                if len(item[1]) > limits.max_text_length:
                    raise faults.client(f"namespace name longer than {limits.max_text_length}")
                continue
            self.check_tail()
            if event == "start":
                self.depth += 1
                if self.depth > limits.max_depth:
                    raise faults.client(f"nesting depth over {limits.max_depth}")
                if self.count_elements:
                    self.elements += 1
                    if self.elements > limits.max_elements:
                        raise faults.client(f"element count over {limits.max_elements}")
                declared, self.declared = self.declared, 0
                if declared > limits.max_namespace_declarations and not self.exempt:
                    raise faults.client(
                        f"namespace declarations on one element over {limits.max_namespace_declarations}"
                    )
                self.exempt = False
                self.in_scope += declared
                self.scopes.append(declared)
                if self.in_scope > limits.max_namespaces_in_scope:
                    raise faults.client(f"namespace declarations in scope over {limits.max_namespaces_in_scope}")
                attrib = item.attrib
                if len(attrib) > limits.max_attributes:
                    raise faults.client(f"attribute count over {limits.max_attributes}")
                if attrib and max(map(len, attrib.values())) > limits.max_text_length:
                    raise faults.client(f"attribute value longer than {limits.max_text_length}")
            elif event == "end" or event == "comment":
                if event == "end":
                    self.depth -= 1
                    self.in_scope -= self.scopes.pop()
                if item.text and len(item.text) > limits.max_text_length:
                    raise faults.client(f"text node longer than {limits.max_text_length}")
                self.last = item  # its tail is whole once the parser reports what follows it
            else:
                raise faults.client("processing instruction in message")

    def check_tail(self) -> None:
        if self.last is not None:
            tail, self.last = self.last.tail, None
            if tail and len(tail) > self.limits.max_text_length:
                raise faults.client(f"text node longer than {self.limits.max_text_length}")


def parse_envelope(data: bytes, limits: Limits) -> Envelope:
    """Parse and check a SOAP envelope; raise a Client fault for anything not allowed."""
    if len(data) > limits.max_body_bytes:
        raise faults.client(f"body too large: {len(data)} > {limits.max_body_bytes} bytes", status=413)
    if not data.strip():
        raise faults.client("empty body")
    decoded = charset.decode(data)
    text = decoded.utf8
    # A DOCTYPE (and with it any entity declaration) is refused before the parser sees it, in UTF-8 whatever
    # the body came in.
    if b"<!DOCTYPE" in text or b"<!ENTITY" in text:
        raise faults.client("DTD or entity declaration in message")
    # Cheap upper bounds: every element needs a '<', every namespace declaration an "xmlns", every character of
    # text, attribute value or namespace name at least a byte.
    may_exceed_elements = text.count(b"<") > limits.max_elements
    # The whole parse counts the declarations in scope itself; where fewer are allowed on one element than in
    # scope, that count does not bound each element's own, so the bytes must.
    namespaces = min(limits.max_namespace_declarations, limits.max_namespaces_in_scope)
    bounded = limits.max_namespace_declarations >= limits.max_namespaces_in_scope or text.count(b"xmlns") <= namespaces
    if not may_exceed_elements and len(text) <= limits.max_text_length and bounded:
        env = _parse_whole(text, limits)
    else:
        env = _parse_incremental(text, limits, count_elements=may_exceed_elements)
    env.encoding = decoded.encoding
    return env


def _parse_incremental(data: bytes, limits: Limits, count_elements: bool = True) -> Envelope:
    parser = _parser()
    checks = _Checks(parser, limits, count_elements=count_elements)
    try:
        for start in range(0, len(data), CHUNK):
            checks.feed(data[start : start + CHUNK])
        root = parser.close()
        checks.check()  # anything the parser only let go of at close
        checks.check_tail()
    except etree.XMLSyntaxError as exc:
        raise faults.client(f"malformed XML: {exc.msg}") from None
    except ExternalResourceRefused as exc:
        raise _refused(exc) from None
    return _envelope(root)


@cache
def _tree_checks(max_depth: int, max_attributes: int) -> etree.XPath:
    # From C, as bits to tell which: 1 too deep, 2 too many attributes (an element with one attribute more than
    # allowed: position, not count(), which builds every element's attribute set), 4 a processing instruction
    # ('/' is the document: top-level ones count). Measured on 1 MB: 1.7 ms, against 6.7 for the parse itself.
    too_deep = "/*" * (max_depth + 1)
    return etree.XPath(
        f"number(boolean({too_deep})) + 2 * number(boolean(/descendant::*/@*[{max_attributes + 1}]))"
        " + 4 * number(boolean(/descendant::processing-instruction()))"
    )


def _check_tree(root: etree._Element, limits: Limits, max_depth: int) -> None:
    """The limits a parsed tree is checked against in C, its depth counted from `root` (`max_depth`)."""
    found = int(_tree_checks(max_depth, limits.max_attributes)(root))
    if found & 1:
        raise faults.client(f"nesting depth over {limits.max_depth}")
    if found & 2:
        raise faults.client(f"attribute count over {limits.max_attributes}")
    if found & 4:
        raise faults.client("processing instruction in message")


def _parse_whole(data: bytes, limits: Limits) -> Envelope:
    """The fast path: memory is bounded by the element count the bytes allow. The same refusals as the
    incremental parse (a document over several limits may be refused for another of them)."""
    try:
        root = etree.fromstring(data, _WHOLE)
    except etree.XMLSyntaxError as exc:
        raise faults.client(f"malformed XML: {exc.msg}") from None
    except ExternalResourceRefused as exc:
        raise _refused(exc) from None
    _check_tree(root, limits, limits.max_depth)
    namespaces = min(limits.max_namespace_declarations, limits.max_namespaces_in_scope)
    if data.count(b"xmlns") > namespaces and _over_in_scope(root, namespaces):
        if limits.max_namespace_declarations >= limits.max_namespaces_in_scope:
            # Also where one element declares too many: its own declarations are in its scope.
            raise faults.client(f"namespace declarations in scope over {limits.max_namespaces_in_scope}")
        return _parse_incremental(data, limits)  # fewer allowed on one element: over which limit, if any
    return _envelope(root)


def _over_in_scope(root: etree._Element, limit: int) -> bool:
    """Whether declarations in scope at some element (each on the element and its ancestors; a redeclared prefix
    counts again) pass `limit`, as the incremental parse counts them. Only elements that declare namespaces give
    events, one per declaration and one per declaration going out of scope. The walk stops at the first
    declaration over the limit: lxml queues an element's events and hands them out from the front, so reading
    all of a 10,000-declaration flood would cost its square."""
    events = map(itemgetter(0), etree.iterwalk(root, events=("start-ns", "end-ns")))
    return next(filter(limit.__lt__, accumulate(map(_STEP.__getitem__, events))), None) is not None  # in C


_STEP = {"start-ns": 1, "end-ns": -1}


def _envelope(root: etree._Element) -> Envelope:
    tree = root.getroottree()
    if tree.docinfo.internalDTD is not None or tree.docinfo.doctype:
        raise faults.client("DTD in message")
    return check_structure(root)


def parse_fragment(
    chunks: Iterable[bytes], nsmap: Mapping[str | None, str], limits: Limits, depth: int = 0
) -> etree._Element:
    """Parse XML content (elements, text, comments: what an element may hold) with the envelope's hardening.

    The content is parsed inside a wrapper element declaring `nsmap`, so it may use the prefixes in scope
    where it came from; the wrapper is returned and its children are the content. `depth` is the depth of the
    element the wrapper stands in for, so the depth limit counts from the content's place in the document;
    the element limit applies to the fragment alone. Raises a Client fault like parse_envelope, and like it
    parses whole, checked in C, content whose bytes prove the element, length and namespace limits (fewer '<'
    than elements allowed, fewer bytes than a text may have, fewer "xmlns" with the wrapper's own than one
    element may declare or have in scope): a decrypted Body, mostly."""
    decls = "".join(f" xmlns{':' + prefix if prefix else ''}={quoteattr(uri)}" for prefix, uri in nsmap.items())
    parts = [f"<wsgate-fragment{decls}>".encode(), *chunks, b"</wsgate-fragment>"]
    doc = b"".join(parts)
    size = len(doc) - len(parts[0]) - len(parts[-1])
    declarations = min(limits.max_namespace_declarations, limits.max_namespaces_in_scope)
    whole = (
        depth <= limits.max_depth  # else the wrapper's place is over the limit: the incremental parse says so
        and size <= limits.max_text_length
        and doc.count(b"<") - 2 <= limits.max_elements
        and doc.count(b"xmlns") <= declarations  # the wrapper's declarations and the content's, at most
    )
    try:
        root = _fragment_whole(doc, limits, depth) if whole else _fragment_incremental(parts, limits, depth)
    except etree.XMLSyntaxError as exc:
        # The error's kind and place only: its text quotes the fragment, which may be decrypted plaintext.
        last = exc.error_log.last_error if exc.error_log else None
        kind = last.type_name if last is not None else f"code {exc.code}"
        raise faults.client(f"malformed XML: {kind} at line {exc.lineno}") from None
    except ExternalResourceRefused as exc:
        raise _refused(exc) from None
    # Inside the wrapper the grammar has no place for a DOCTYPE; checked all the same.
    if root.getroottree().docinfo.doctype:
        raise faults.client("DTD in fragment")
    return root


def _fragment_whole(doc: bytes, limits: Limits, depth: int) -> etree._Element:
    root = etree.fromstring(doc, _WHOLE)
    # The wrapper is the document element, at `depth`: content at the document's level n is at depth - 1 + n.
    _check_tree(root, limits, limits.max_depth - depth + 1)
    return root


def _fragment_incremental(parts: list[bytes], limits: Limits, depth: int) -> etree._Element:
    parser = _parser()
    # The wrapper's own start event brings the depth to `depth`, and it is no element of the fragment.
    checks = _Checks(parser, limits, depth=depth - 1)
    checks.elements = -1
    checks.exempt = True  # the wrapper carries the namespaces in scope where the content was, not its own
    for part in parts:
        checks.feed(part)
    root = parser.close()
    checks.check()  # anything the parser only let go of at close
    checks.check_tail()
    return root


def check_structure(root: etree._Element) -> Envelope:
    if not isinstance(root.tag, str):
        raise faults.client("no document element")
    qn = etree.QName(root)
    if qn.localname != "Envelope" or qn.namespace not in VERSIONS:
        raise faults.client(f"document element is not a SOAP Envelope: {root.tag[:120]}")
    soap = qn.namespace
    children = [c for c in root if isinstance(c.tag, str)]
    tags = [c.tag for c in children]
    header, body = ns.q(soap, "Header"), ns.q(soap, "Body")
    if tags.count(body) != 1:
        raise faults.client(f"envelope has {tags.count(body)} Body elements")
    if tags not in ([body], [header, body]):
        raise faults.client("envelope children must be an optional Header followed by the Body")
    # A second Body hidden anywhere else (signature wrapping's favourite place) is refused as well.
    if sum(1 for _ in root.iter(body)) != 1:
        raise faults.client("a Body element appears below the envelope")
    return Envelope(root=root, version=VERSIONS[soap])
