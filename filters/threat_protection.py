"""XML threat protection: the first stage of every profile that touches XML.

The body must be one well-formed SOAP 1.1 or 1.2 envelope with one Body. DTDs, entity declarations and
processing instructions are refused; size, nesting depth, element count, attribute count and text length are
limited. A body whose bytes already prove the element count and text length limits (fewer '<' than elements
allowed, fewer bytes than a text node may have) is parsed whole by libxml2 and its depth, attributes and
processing instructions are checked with XPath, in C; any other is parsed incrementally and refused as soon as it
crosses a limit (bounded memory and time). Nothing is ever loaded from the network or the file system."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import cache
from typing import Protocol
from xml.sax.saxutils import quoteattr

from lxml import etree

from filters import faults, ns
from filters.soap import VERSIONS, Envelope


class Limits(Protocol):
    max_body_bytes: int
    max_depth: int
    max_elements: int
    max_attributes: int
    max_text_length: int


CHUNK = 64 * 1024


_OPTIONS = {
    "resolve_entities": False,
    "no_network": True,
    "load_dtd": False,
    "dtd_validation": False,
    "huge_tree": False,
    "collect_ids": False,  # ids are registered, each in its own check, only where a signature needs them
    "remove_blank_text": False,
}
# Reused: a worker parses on one thread only (the engine is synchronous).
_WHOLE = etree.XMLParser(**_OPTIONS)


def _parser() -> etree.XMLPullParser:
    return etree.XMLPullParser(events=("start", "end", "pi"), **_OPTIONS)


class _Checks:
    """The limits, checked on a pull parser's events as they arrive (envelopes and decrypted fragments)."""

    __slots__ = ("count_elements", "depth", "elements", "limits", "parser")

    def __init__(
        self, parser: etree.XMLPullParser, limits: Limits, *, count_elements: bool = True, depth: int = 0
    ) -> None:
        self.parser = parser
        self.limits = limits
        self.count_elements = count_elements
        self.depth = depth
        self.elements = 0

    def feed(self, data: bytes) -> None:
        self.parser.feed(data)
        self.check()

    def check(self) -> None:
        limits = self.limits
        for event, el in self.parser.read_events():
            if event == "start":
                self.depth += 1
                if self.depth > limits.max_depth:
                    raise faults.client(f"nesting depth over {limits.max_depth}")
                if self.count_elements:
                    self.elements += 1
                    if self.elements > limits.max_elements:
                        raise faults.client(f"element count over {limits.max_elements}")
                if len(el.attrib) > limits.max_attributes:
                    raise faults.client(f"attribute count over {limits.max_attributes}")
            elif event == "end":
                self.depth -= 1
                if (el.text and len(el.text) > limits.max_text_length) or (
                    el.tail and len(el.tail) > limits.max_text_length
                ):
                    raise faults.client(f"text node longer than {limits.max_text_length}")
            else:
                raise faults.client("processing instruction in message")


def parse_envelope(data: bytes, limits: Limits) -> Envelope:
    """Parse and check a SOAP envelope; raise a Client fault for anything not allowed."""
    if len(data) > limits.max_body_bytes:
        raise faults.client(f"body too large: {len(data)} > {limits.max_body_bytes} bytes", status=413)
    if not data.strip():
        raise faults.client("empty body")
    # A DOCTYPE (and with it any entity declaration) is refused before the parser sees it.
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        raise faults.client("DTD or entity declaration in message")
    # Cheap upper bounds: every element needs a '<', every character of text at least a byte.
    may_exceed_elements = data.count(b"<") > limits.max_elements
    if not may_exceed_elements and len(data) <= limits.max_text_length:
        return _parse_whole(data, limits)
    return _parse_incremental(data, limits, count_elements=may_exceed_elements)


def _parse_incremental(data: bytes, limits: Limits, count_elements: bool = True) -> Envelope:
    parser = _parser()
    checks = _Checks(parser, limits, count_elements=count_elements)
    try:
        for start in range(0, len(data), CHUNK):
            checks.feed(data[start : start + CHUNK])
        root = parser.close()
    except etree.XMLSyntaxError as exc:
        raise faults.client(f"malformed XML: {exc.msg}") from None
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


def _parse_whole(data: bytes, limits: Limits) -> Envelope:
    """The fast path: memory is bounded by the element count the bytes allow. The same refusals as the
    incremental parse (a document over several limits may be refused for another of them)."""
    try:
        root = etree.fromstring(data, _WHOLE)
    except etree.XMLSyntaxError as exc:
        raise faults.client(f"malformed XML: {exc.msg}") from None
    found = int(_tree_checks(limits.max_depth, limits.max_attributes)(root))
    if found & 1:
        raise faults.client(f"nesting depth over {limits.max_depth}")
    if found & 2:
        raise faults.client(f"attribute count over {limits.max_attributes}")
    if found & 4:
        raise faults.client("processing instruction in message")
    return _envelope(root)


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
    the element limit applies to the fragment alone. Raises a Client fault like parse_envelope."""
    decls = "".join(f" xmlns{':' + prefix if prefix else ''}={quoteattr(uri)}" for prefix, uri in nsmap.items())
    parser = _parser()
    # The wrapper's own start event brings the depth to `depth`, and it is no element of the fragment.
    checks = _Checks(parser, limits, depth=depth - 1)
    checks.elements = -1
    try:
        checks.feed(f"<wsgate-fragment{decls}>".encode())
        for chunk in chunks:
            checks.feed(chunk)
        checks.feed(b"</wsgate-fragment>")
        root = parser.close()
        checks.check()  # anything the parser only let go of at close
    except etree.XMLSyntaxError as exc:
        # The error's kind and place only: its text quotes the fragment, which may be decrypted plaintext.
        last = exc.error_log.last_error if exc.error_log else None
        kind = last.type_name if last is not None else f"code {exc.code}"
        raise faults.client(f"malformed XML: {kind} at line {exc.lineno}") from None
    # Inside the wrapper the grammar has no place for a DOCTYPE; checked all the same.
    if root.getroottree().docinfo.doctype:
        raise faults.client("DTD in fragment")
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
