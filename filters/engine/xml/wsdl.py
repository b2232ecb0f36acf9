"""The WSDL 1.1 and XSD documents a route names (policy `wsdl.file`, `schema_validation.xsd_files`), loaded from
local files only.

A document and everything it imports (wsdl:import location, xsd:import/include/redefine/override
schemaLocation) is read once, when the policy is, and never again: schema validation (filters/engine/xml/schema_validation.py)
and the published WSDL (gateway/control/wsdl_publish.py) work on these trees. A reference must be a relative path that
stays in the named file's directory (symlinks resolved): no URL scheme, no host, no absolute path, no way out with
`..`. A DOCTYPE is refused (no entities, no external subset), and the parser refuses every load of its own
(filters/engine/xml/xmlsupport.py): nothing is fetched, from the network or the disk, but what this module read itself."""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

from lxml import etree

from filters.engine.ns import WSDL, XSD
from filters.engine.xml import xmlsupport

MAX_DOCUMENTS = 64
MAX_DOCUMENT_BYTES = 4 * 1024 * 1024

# Elements that pull in another document, and the attribute that names it.
_REFERENCES = {
    f"{{{WSDL}}}import": "location",
    f"{{{XSD}}}import": "schemaLocation",
    f"{{{XSD}}}include": "schemaLocation",
    f"{{{XSD}}}redefine": "schemaLocation",
    f"{{{XSD}}}override": "schemaLocation",
}
_FIND_REFERENCES = etree.XPath(
    "//wsdl:import[@location] | //xsd:import[@schemaLocation] | //xsd:include[@schemaLocation]"
    " | //xsd:redefine[@schemaLocation] | //xsd:override[@schemaLocation]",
    namespaces={"wsdl": WSDL, "xsd": XSD},
)
_PARSER = xmlsupport.parser(remove_comments=True)


class DocumentError(Exception):
    """A WSDL or XSD the gateway will not use (the message says which file and why)."""


@dataclass(frozen=True)
class Reference:
    element: etree._Element  # the import/include element in its document
    attribute: str  # `location` or `schemaLocation`
    target: int  # index of the referenced document in DocumentSet.documents


@dataclass
class Document:
    path: Path
    root: etree._Element
    references: list[Reference] = field(default_factory=list)

    @property
    def kind(self) -> Literal["wsdl", "xsd"]:
        return "wsdl" if self.root.tag == f"{{{WSDL}}}definitions" else "xsd"


@dataclass
class DocumentSet:
    """A named file (documents[0]) and every document it reaches, each once."""

    documents: list[Document]

    @property
    def root(self) -> Document:
        return self.documents[0]


def load(path: str | Path) -> DocumentSet:
    named = Path(path).resolve()
    base = named.parent
    documents: list[Document] = []
    index: dict[Path, int] = {}

    def add(p: Path) -> int:
        if p in index:
            return index[p]
        if len(documents) >= MAX_DOCUMENTS:
            raise DocumentError(f"{named}: more than {MAX_DOCUMENTS} documents imported")
        index[p] = len(documents)
        documents.append(Document(p, _parse(p)))
        return index[p]

    add(named)
    done = 0
    while done < len(documents):  # breadth first; the list grows as references are found
        doc = documents[done]
        for el in _FIND_REFERENCES(doc.root):
            attribute = _REFERENCES[el.tag]
            target = local_file(el.get(attribute), doc.path, base)
            doc.references.append(Reference(el, attribute, add(target)))
        done += 1
    return DocumentSet(documents)


def local_file(location: str, referrer: Path, base: Path) -> Path:
    """The file a reference names, if it is a relative path inside `base`; else DocumentError."""
    where = f"{referrer}: reference {location[:200]!r}"
    parts = urlsplit(location)
    if parts.scheme or parts.netloc or parts.query or parts.fragment:
        raise DocumentError(f"{where}: not a relative file path (imports are resolved from local files only)")
    relative = unquote(parts.path)
    if not relative or relative.startswith(("/", "\\")) or "\\" in relative or "\x00" in relative:
        raise DocumentError(f"{where}: not a relative file path")
    target = (referrer.parent / relative).resolve()
    if not target.is_relative_to(base):
        raise DocumentError(f"{where}: outside {base}")
    return target


def _parse(path: Path) -> etree._Element:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise DocumentError(f"{path}: {exc.strerror or exc}") from None
    if len(data) > MAX_DOCUMENT_BYTES:
        raise DocumentError(f"{path}: larger than {MAX_DOCUMENT_BYTES} bytes")
    return parse(data, str(path))


def parse(data: bytes, where: str) -> etree._Element:
    """A WSDL 1.1 or XSD document's root, parsed like a message: no DTD, no entities, no load of its own."""
    # A DTD could declare entities (billion laughs, XXE): a WSDL or schema never needs one. Refused on the bytes
    # (UTF-8 or UTF-16) before libxml2 sees them, and again on what it parsed.
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data or b"<\x00!\x00D\x00O\x00C" in data:
        raise DocumentError(f"{where}: has a DOCTYPE or an entity declaration (entities and DTDs are refused)")
    try:
        tree = etree.fromstring(data, _PARSER).getroottree()
    except (etree.XMLSyntaxError, xmlsupport.ExternalResourceRefused) as exc:
        raise DocumentError(f"{where}: not well-formed or loads an external resource: {exc}") from None
    if tree.docinfo.internalDTD is not None or tree.docinfo.doctype:
        raise DocumentError(f"{where}: has a DOCTYPE (entities and DTDs are refused)")
    root = tree.getroot()
    if root.tag not in (f"{{{WSDL}}}definitions", f"{{{XSD}}}schema"):
        raise DocumentError(f"{where}: neither a WSDL 1.1 definitions nor an XML Schema document ({root.tag})")
    return root


def copy_with_references(doc: Document, location: Callable[[Reference], str]) -> etree._Element:
    """A copy of the document whose every reference names `location(reference)` instead."""
    root = deepcopy(doc.root)
    elements, copies = list(doc.root.iter()), list(root.iter())
    for ref in doc.references:
        copies[elements.index(ref.element)].set(ref.attribute, location(ref))
    return root
