"""The one place XML parsers are made, and the start-up check that lxml and xmlsec share one libxml2.

Every parser in the gateway (requests, responses, decrypted content, re-read canonical forms, the demo backend,
the client) comes from here: no DTD loading, no entity resolution, no network, and a resolver that refuses every
URL. The resolver is what actually keeps files closed: with `collect_ids=False` lxml asks libxml2 to load the
external subset (its loadsubset flag), and libxml2 then opens a `<!DOCTYPE x SYSTEM "file:...">` or a parameter
entity despite load_dtd=False and no_network (which only covers the network). lxml hands every load to the
parser's resolvers first, so refusing there stops it before any open. Callers refuse a DOCTYPE before parsing
anyway (threat_protection); this is the layer below."""

from __future__ import annotations

from typing import TypeVar

import xmlsec
from lxml import etree

_P = TypeVar("_P", bound=etree.XMLParser)


class ExternalResourceRefused(Exception):
    """A parser was asked to load something (external DTD subset, entity, XInclude, schema): never allowed."""


class _RefuseAll(etree.Resolver):
    def resolve(self, system_url: str | None, public_id: str | None, context: object) -> None:
        raise ExternalResourceRefused(f"external resource {str(system_url)[:120]!r}")


OPTIONS: dict[str, object] = {
    "resolve_entities": False,
    "no_network": True,
    "load_dtd": False,
    "dtd_validation": False,
    "attribute_defaults": False,
    "decompress": False,
    "huge_tree": False,
    "remove_blank_text": False,
}


def _refusing(made: _P) -> _P:
    made.resolvers.add(_RefuseAll())
    return made


def parser(**options: object) -> etree.XMLParser:
    """A document parser: OPTIONS, overridden by `options` (e.g. collect_ids, huge_tree), refusing every load."""
    return _refusing(etree.XMLParser(**{**OPTIONS, **options}))


class _FromMemory(etree.Resolver):
    """Answers the names of documents held in memory, and refuses everything else."""

    def __init__(self, documents: dict[str, bytes]) -> None:
        super().__init__()
        self.documents = documents

    def resolve(self, system_url: str | None, public_id: str | None, context: object) -> object:
        data = self.documents.get(system_url or "")
        if data is None:
            raise ExternalResourceRefused(f"external resource {str(system_url)[:120]!r}")
        return self.resolve_string(data, context, base_url=system_url)


def memory_parser(documents: dict[str, bytes]) -> etree.XMLParser:
    """A parser (OPTIONS) whose loads, e.g. a schema's imports, are answered from `documents` (name -> bytes)
    only. Its one resolver refuses the rest: lxml asks a parser's resolvers in no fixed order, so a refusing
    resolver beside it would sometimes answer first."""
    made = etree.XMLParser(**OPTIONS)
    made.resolvers.add(_FromMemory(documents))
    return made


def pull_parser(events: tuple[str, ...], **options: object) -> etree.XMLPullParser:
    """An incremental parser with the same hardening, reporting `events`."""
    return _refusing(etree.XMLPullParser(events=events, **{**OPTIONS, **options}))


def check_libxml2() -> None:
    """Start-up check: lxml and xmlsec must use the same libxml2, or trees passed between them corrupt memory."""
    lxml_version = etree.LIBXML_VERSION
    xmlsec_version = xmlsec.get_libxml_version()
    if tuple(lxml_version) != tuple(xmlsec_version):
        raise SystemExit(
            f"lxml uses libxml2 {lxml_version} but xmlsec uses {xmlsec_version}: "
            "install matching wheels (see pyproject.toml pins)"
        )


def remove(el: etree._Element, blank_tail: bool = True) -> None:
    """Take `el` out, leaving the text after it where it was (lxml would take its tail along); a whitespace-only
    tail goes with it unless `blank_tail` (decrypted content keeps every character its signature saw)."""
    parent = el.getparent()
    assert parent is not None
    if el.tail and (blank_tail or el.tail.strip()):
        prev = el.getprevious()
        if prev is not None:
            prev.tail = (prev.tail or "") + el.tail
        else:
            parent.text = (parent.text or "") + el.tail
    parent.remove(el)


def child(el: etree._Element, tag: str) -> etree._Element | None:
    """The first child of `el` named `tag` (Clark notation): `el.find(tag)` without ElementPath's parsing and
    generic matcher, about a third of its cost (the hot path looks up the Header, Body, Timestamp... a dozen
    times per exchange)."""
    return next(el.iterchildren(tag), None)
