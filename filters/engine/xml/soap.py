"""The SOAP envelope as the engine sees it: version, Header, Body, and serialization."""

from __future__ import annotations

from dataclasses import dataclass

from lxml import etree

from filters.engine import ns
from filters.engine.xml.xmlsupport import child

VERSIONS = {ns.SOAP11: "1.1", ns.SOAP12: "1.2"}
# Clark names per version: looked up a dozen times per exchange.
_HEADER = {v: ns.q(ns.SOAP12 if v == "1.2" else ns.SOAP11, "Header") for v in VERSIONS.values()}
_BODY = {v: ns.q(ns.SOAP12 if v == "1.2" else ns.SOAP11, "Body") for v in VERSIONS.values()}


@dataclass
class Envelope:
    root: etree._Element
    version: str  # "1.1" or "1.2"
    encoding: str = (
        "utf-8"  # the charset the message came in (filters/engine/xml/charset.py); serialize() is always UTF-8
    )

    @property
    def soap_ns(self) -> str:
        return ns.SOAP12 if self.version == "1.2" else ns.SOAP11

    @property
    def header(self) -> etree._Element | None:
        return _first(self.root, _HEADER[self.version])

    @property
    def body(self) -> etree._Element:
        body = _first(self.root, _BODY[self.version])
        assert body is not None  # threat_protection.parse_envelope guarantees one Body
        return body

    def ensure_header(self) -> etree._Element:
        header = self.header
        if header is None:
            header = etree.Element(_HEADER[self.version])
            self.root.insert(0, header)
        return header

    def is_fault(self) -> bool:
        body = self.body
        return len(body) > 0 and body[0].tag == ns.q(self.soap_ns, "Fault")

    def serialize(self) -> bytes:
        return etree.tostring(self.root, xml_declaration=False, encoding="utf-8")


def _first(root: etree._Element, tag: str) -> etree._Element | None:
    """The Envelope's first child named `tag`. Header and Body are its first two children in any ordinary message:
    those are compared first (half the cost of lxml's tag-matching iterator, which both properties paid a dozen
    times per exchange); the iterator, in C, searches any others."""
    for c in root[:2]:
        if c.tag == tag:
            return c
    return child(root, tag) if len(root) > 2 else None


def version_from_content_type(content_type: str | None) -> str:
    """The SOAP version a request's Content-Type names; used for faults about bodies too broken to tell."""
    if content_type and "application/soap+xml" in content_type.lower():
        return "1.2"
    return "1.1"
