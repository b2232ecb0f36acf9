"""Schema validation of SOAP payloads (policy `schema_validation`): the Body's children against the WSDL's types
and the XSD files the policy names, with lxml's XMLSchema, compiled once per policy load.

The schemas come from filters/engine/xml/wsdl.py, already read from local files; libxml2 is handed them from memory under
names of our own (every schemaLocation rewritten), and its parser refuses any other load.

What is validated is what is forwarded: the payload as it stands, every attribute included (a wsu:Id, a wsse: or
any look-alike attribute is the schema's to allow or refuse), and the Envelope and the Body carry no attributes
the schema cannot see (the only one WS-Security needs, the signed Body's wsu:Id, is removed with the Security
header before validation: filters/wssecurity.py). Requests are validated after their security is processed,
responses before they are secured.

libxml2's pattern and content-model matching backtracks on ambiguous schemas, without a limit of its own that
bounds a message. Where a schema is in the class it matches in linear time (filters/engine/xml/xsd_patterns.py `nonlinear`),
libxml2 validates in the worker; any other schema is validated in a child process under a CPU budget
(filters/engine/cpu_budget.py), and a message over its budget gets the same fault as an invalid one."""

from __future__ import annotations

import re
from collections import defaultdict
from copy import deepcopy
from dataclasses import dataclass
from typing import NoReturn

from lxml import etree

from filters.engine import faults, ns
from filters.engine.cpu_budget import Bounded, OverBudget
from filters.engine.xml import wsdl, xmlsupport, xsd_patterns
from filters.engine.xml.wsdl import copy_with_references
from gateway.policy import Route

ROOT_NS = "urn:wsgate:schema-validation"
_XS = f"{{{ns.XSD}}}"
# Re-reads our own bytes: schema documents at load, and the Body a child is sent (whose parse in the worker
# already enforced the route's limits).
_PARSER = xmlsupport.parser(collect_ids=False, huge_tree=True)
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

    def __init__(
        self,
        wsdl_set: wsdl.DocumentSet | None,
        xsd_sets: list[wsdl.DocumentSet],
        cpu_ms: float = 4.0,
        cpu_ms_per_mb: float = 100.0,
    ) -> None:
        self.cpu_ms, self.cpu_ms_per_mb = cpu_ms, cpu_ms_per_mb
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
        # Where libxml2 cannot backtrack it validates in the worker; elsewhere in a child under a CPU budget.
        self.nonlinear = xsd_patterns.nonlinear(etree.fromstring(d, _PARSER) for d in self.documents.values())
        self.bounded = Bounded(self._validate) if self.nonlinear else None

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
        """Validate the Envelope's and Body's attributes and every element child of the SOAP Body; a fault
        (Client for a request, Server 502 for a backend's response) names the first error in the log."""
        for el in (body.getparent(), body):
            if el is not None and len(el.attrib):
                self._refuse(request, f"attribute {next(iter(el.attrib))[:120]} on {etree.QName(el).localname}")
        if not any(isinstance(c.tag, str) for c in body):
            return
        if self.bounded is None:
            detail = self._first_error(body)
        else:
            data = etree.tostring(body)  # with every namespace in scope: QName values keep their prefixes
            try:
                detail = self.bounded(data, (self.cpu_ms + self.cpu_ms_per_mb * len(data) / 1e6) / 1000).decode()
            except OverBudget as exc:
                detail = f"validation {exc}"
        if detail:
            self._refuse(request, detail)

    def _validate(self, data: bytes) -> bytes:
        """In the child: `_first_error` of the Body it was sent."""
        return self._first_error(etree.fromstring(data, _PARSER)).encode()

    def _first_error(self, body: etree._Element) -> str:
        """The first error of the Body's element children, or "" when they are all valid."""
        for payload in body:
            if not isinstance(payload.tag, str):
                continue
            try:
                if self.schema(payload):
                    continue
            except etree.XMLSchemaValidateError:  # libxml2 gave up (its own backtracking limit): invalid
                return "matching gave up: over libxml2's internal limit"
            error = self.schema.error_log.last_error
            return f"line {error.line}: {_redacted(error.message)}" if error else "invalid"
        return ""

    @staticmethod
    def _refuse(request: bool, detail: str) -> NoReturn:
        if request:
            raise faults.client(f"schema invalid: request payload: {detail}")
        raise faults.server(f"schema invalid: backend response payload: {detail}", status=502)


def for_route(route: Route) -> PayloadSchema | None:
    """The route's compiled schema, or None when it validates nothing. Raises wsdl.DocumentError."""
    sv = route.schema_validation
    if not sv.enabled:
        return None
    return PayloadSchema(
        wsdl.load(route.wsdl.file) if route.wsdl else None,
        [wsdl.load(f) for f in sv.xsd_files],
        cpu_ms=sv.cpu_budget_ms,
        cpu_ms_per_mb=sv.cpu_budget_ms_per_mb,
    )


def pattern_warnings(route: Route) -> list[str]:
    """The route's pattern facets that can backtrack (filters/engine/xml/xsd_patterns.py), for `wsgate check`."""
    sets = [wsdl.load(route.wsdl.file)] if route.wsdl else []
    sets += [wsdl.load(f) for f in route.schema_validation.xsd_files]
    return [w for docs in sets for doc in docs.documents for w in xsd_patterns.warnings(doc.root, doc.path)]


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
