"""Schema validation of SOAP payloads (policy `schema_validation`): the Body's children against the WSDL's types
and the XSD files the policy names, with lxml's XMLSchema, compiled once per policy load.

The schemas come from filters/engine/xml/wsdl.py, already read from local files; libxml2 is handed them from memory under
names of our own (every schemaLocation rewritten), and its parser refuses any other load. What WS-Security put
into the payload (wsu:Id, wsse/wsse11 attributes on signed elements) is not the service's data: it is left out of
what is validated, in a copy, so the backend still gets the message as verified. Requests are validated after
the Security header is processed and removed (filters/engine/wss/wssecurity.py), responses before they are secured."""

from __future__ import annotations

import re
from collections import defaultdict
from copy import deepcopy
from dataclasses import dataclass

from lxml import etree

from filters.engine import faults, ns
from filters.engine.xml import wsdl, xmlsupport
from filters.engine.xml.wsdl import copy_with_references
from gateway.policy import Route

ROOT_NS = "urn:wsgate:schema-validation"
_XS = f"{{{ns.XSD}}}"
_WSSE_ATTRIBUTES = etree.XPath(
    "descendant-or-self::*/@*[namespace-uri()=$wsu or namespace-uri()=$wsse or namespace-uri()=$wsse11]"
)
_RPC = etree.XPath(
    "//soap:binding[@style='rpc'] | //soap:operation[@style='rpc'] | //soap12:binding[@style='rpc']"
    " | //soap12:operation[@style='rpc'] | //soap:body[@use='encoded'] | //soap12:body[@use='encoded']",
    namespaces={"soap": ns.WSDL_SOAP11, "soap12": ns.WSDL_SOAP12},
)
# libxml2's messages quote the offending value: it may be decrypted content, which never goes to the log.
_QUOTED = re.compile(r"(\w+ )?'[^']*'")
_NAMES = ("Element ", "element ", "attribute ", "type ", "facet ")


@dataclass
class _Source:
    namespace: str | None
    key: str


class PayloadSchema:
    """The compiled schema of one route; `check` raises the route's fault for an invalid payload."""

    def __init__(self, wsdl_set: wsdl.DocumentSet | None, xsd_sets: list[wsdl.DocumentSet]) -> None:
        self.documents: dict[str, bytes] = {}
        sources: list[_Source] = []
        for s, docs in enumerate(filter(None, [wsdl_set, *xsd_sets])):
            keys = [f"wsgate-doc:{s}/{i}" for i in range(len(docs.documents))]
            for i, doc in enumerate(docs.documents):
                if doc.kind == "wsdl" and _RPC(doc.root):
                    raise wsdl.DocumentError(
                        f"{doc.path}: rpc style or encoded bindings: their payloads are not described by the types"
                    )
                self._add(doc, keys, keys[i], sources)
                for ref in doc.references:  # an XSD reached by wsdl:import: no schema imports it by itself
                    target = docs.documents[ref.target]
                    if ref.element.tag == f"{{{ns.WSDL}}}import" and target.kind == "xsd":
                        sources.append(_Source(target.root.get("targetNamespace"), keys[ref.target]))
            if docs is not wsdl_set:  # a named XSD file
                sources.append(_Source(docs.root.root.get("targetNamespace"), keys[0]))
        if not sources:
            raise wsdl.DocumentError("no schema to validate against: the WSDL has no types and no xsd_files")
        self.schema = self._compile(sources)

    def _add(self, doc: wsdl.Document, keys: list[str], key: str, sources: list[_Source]) -> None:
        """Register `doc` under `key` with its references rewritten to keys; a WSDL's inline schemas are sources."""
        root = copy_with_references(doc, lambda ref: keys[ref.target])
        if doc.kind == "xsd":
            self.documents[key] = etree.tostring(root)
            return
        types = root.find(f"{{{ns.WSDL}}}types")
        for n, schema in enumerate(types.iterfind(f"{{{ns.XSD}}}schema") if types is not None else ()):
            inline = f"{key}/types/{n}"
            self.documents[inline] = etree.tostring(_standalone(schema))
            sources.append(_Source(schema.get("targetNamespace"), inline))

    def _compile(self, sources: list[_Source]) -> etree.XMLSchema:
        by_ns: dict[str | None, list[str]] = defaultdict(list)
        for src in sources:
            if src.key not in by_ns[src.namespace]:
                by_ns[src.namespace].append(src.key)
        root = etree.Element(_XS + "schema", targetNamespace=ROOT_NS, nsmap={"xs": ns.XSD})
        for n, (namespace, keys) in enumerate(by_ns.items()):
            location = keys[0]
            if len(keys) > 1:  # libxml2 imports a namespace once: one schema that includes them all
                location = f"wsgate-ns:{n}"
                wrapper = etree.Element(_XS + "schema", nsmap={"xs": ns.XSD})
                if namespace:
                    wrapper.set("targetNamespace", namespace)
                for k in keys:
                    etree.SubElement(wrapper, _XS + "include", schemaLocation=k)
                self.documents[location] = etree.tostring(wrapper)
            imported = etree.SubElement(root, _XS + "import", schemaLocation=location)
            if namespace:
                imported.set("namespace", namespace)
        # Parsed again by the parser that answers our documents: libxml2 resolves the imports through it.
        parser = xmlsupport.memory_parser(self.documents)
        doc = etree.fromstring(etree.tostring(root), parser, base_url="wsgate-root:")
        try:
            return etree.XMLSchema(doc)
        except etree.XMLSchemaParseError as exc:
            raise wsdl.DocumentError(f"schema does not compile: {exc}") from None

    def check(self, body: etree._Element, request: bool) -> None:
        """Validate every element child of the SOAP Body; a fault (Client for a request, Server 502 for a
        backend's response) names the first error in the log."""
        for payload in body:
            if not isinstance(payload.tag, str):
                continue
            if _WSSE_ATTRIBUTES(payload, wsu=ns.WSU, wsse=ns.WSSE, wsse11=ns.WSSE11):
                payload = _without_wsse_attributes(payload)
            if self.schema(payload):
                continue
            error = self.schema.error_log.last_error
            detail = f"line {error.line}: {_redacted(error.message)}" if error else "invalid"
            if request:
                raise faults.client(f"schema invalid: request payload: {detail}")
            raise faults.server(f"schema invalid: backend response payload: {detail}", status=502)


def for_route(route: Route) -> PayloadSchema | None:
    """The route's compiled schema, or None when it validates nothing. Raises wsdl.DocumentError."""
    sv = route.schema_validation
    if not sv.enabled:
        return None
    return PayloadSchema(wsdl.load(route.wsdl.file) if route.wsdl else None, [wsdl.load(f) for f in sv.xsd_files])


def _redacted(message: str) -> str:
    """libxml2's message with quoted values replaced; element, attribute, type and facet names kept."""
    return _QUOTED.sub(lambda m: m.group(0) if m.group(1) in _NAMES else f"{m.group(1) or ''}'...'", message)


def _standalone(schema: etree._Element) -> etree._Element:
    """An inline schema as a document of its own, declaring the prefixes it inherited from wsdl:definitions (its
    QName values, type="t:T", use them where no serializer can see it)."""
    out = etree.Element(schema.tag, attrib=dict(schema.attrib), nsmap=schema.nsmap)
    out.text = schema.text
    out.extend(deepcopy(child) for child in schema)
    return out


def _without_wsse_attributes(payload: etree._Element) -> etree._Element:
    copy = deepcopy(payload)
    for value in _WSSE_ATTRIBUTES(copy, wsu=ns.WSU, wsse=ns.WSSE, wsse11=ns.WSSE11):
        del value.getparent().attrib[value.attrname]
    return copy
