"""XML threat protection: the first stage of every profile that touches XML.

The body must be one well-formed SOAP 1.1 or 1.2 envelope with one Body. DTDs, entity declarations and
processing instructions are refused; size, nesting depth, element count, attribute count and text length are
limited. The parser is incremental, so a document is refused as soon as it crosses a limit (bounded memory and
time), and it never loads anything from the network or the file system."""

from __future__ import annotations

from typing import Protocol

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


def _parser() -> etree.XMLPullParser:
    return etree.XMLPullParser(
        events=("start", "end", "pi"),
        resolve_entities=False,
        no_network=True,
        load_dtd=False,
        dtd_validation=False,
        huge_tree=False,
        collect_ids=False,
        remove_blank_text=False,
    )


def parse_envelope(data: bytes, limits: Limits) -> Envelope:
    """Parse and check a SOAP envelope; raise a Client fault for anything not allowed."""
    if len(data) > limits.max_body_bytes:
        raise faults.client(f"body too large: {len(data)} > {limits.max_body_bytes} bytes")
    if not data.strip():
        raise faults.client("empty body")
    # A DOCTYPE (and with it any entity declaration) is refused before the parser sees it.
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        raise faults.client("DTD or entity declaration in message")
    # Cheap upper bound: every element needs a '<'. Only count precisely when the bound could be crossed.
    count_elements = data.count(b"<") > limits.max_elements
    parser = _parser()
    depth = elements = 0
    try:
        for start in range(0, len(data), CHUNK):
            parser.feed(data[start : start + CHUNK])
            for event, el in parser.read_events():
                if event == "start":
                    depth += 1
                    if depth > limits.max_depth:
                        raise faults.client(f"nesting depth over {limits.max_depth}")
                    if count_elements:
                        elements += 1
                        if elements > limits.max_elements:
                            raise faults.client(f"element count over {limits.max_elements}")
                    if len(el.attrib) > limits.max_attributes:
                        raise faults.client(f"attribute count over {limits.max_attributes}")
                elif event == "end":
                    depth -= 1
                    if (el.text and len(el.text) > limits.max_text_length) or (
                        el.tail and len(el.tail) > limits.max_text_length
                    ):
                        raise faults.client(f"text node longer than {limits.max_text_length}")
                else:
                    raise faults.client("processing instruction in message")
        root = parser.close()
    except etree.XMLSyntaxError as exc:
        raise faults.client(f"malformed XML: {exc.msg}") from None
    tree = root.getroottree()
    if tree.docinfo.internalDTD is not None or tree.docinfo.doctype:
        raise faults.client("DTD in message")
    return _check_structure(root)


def _check_structure(root: etree._Element) -> Envelope:
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
