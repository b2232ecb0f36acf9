"""`wsgate import`: a WSDL 1.1 document -> route policies (the YAML `wsgate check` reads).

This module reads the WSDL (services, ports, bindings, operations, soap/soap12 addresses and actions) and its
WS-Policy attachments (WS-Policy 1.2 and 1.5: wsp:Policy, wsp:PolicyReference by wsu:Id or Name, wsp:PolicyURIs,
wsp:ExactlyOne / wsp:All normalized to alternatives, wsp:Optional); gateway/tools/security_policy.py maps each
operation's effective policy to a route. A WSDL is untrusted input like any message: the hardened parser
(filters/engine/xml/xmlsupport.py), no DOCTYPE, bounded size, nesting and alternatives, and nothing fetched: a `wsdl:import`
is followed only to a local file beside the WSDL, and only when a binding or policy is not in the document."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml
from lxml import etree

from filters.engine import ns
from filters.engine.xml import wsdl
from gateway.tools.security_policy import PROFILE_STRENGTH, UNRESOLVED, Mapped, as_outbound, map_policy

WSP = (ns.WSP_2004, ns.WSP)  # 1.2, 1.5
XML_ID = "{http://www.w3.org/XML/1998/namespace}id"

MAX_BYTES = 8 * 1024 * 1024  # a WSDL with its policies; the largest real ones (WCF interop) are ~300 KB
MAX_ELEMENTS = 200_000
MAX_NESTING = 64  # policy operators and references within one another
MAX_ALTERNATIVES = 256  # after normalization: the cross product of ExactlyOnes grows fast
MAX_DOCUMENTS = 16  # the WSDL and the local files its wsdl:imports name


class WsdlImportError(Exception):
    """The WSDL cannot be imported: unreadable, hostile, or without a SOAP port. The message says why."""


def _is_wsp(el: etree._Element, local: str) -> bool:
    return isinstance(el.tag, str) and etree.QName(el).localname == local and etree.QName(el).namespace in WSP


def parse_document(data: bytes, where: str) -> etree._Element:
    """The WSDL's root, read as the gateway reads a route's WSDL (filters/engine/xml/wsdl.py), within the import's bounds."""
    if len(data) > MAX_BYTES:
        raise WsdlImportError(f"{where}: {len(data)} bytes, more than the {MAX_BYTES} a WSDL may have")
    try:
        root = wsdl.parse(data, where)
    except wsdl.DocumentError as exc:
        raise WsdlImportError(str(exc)) from None
    if sum(1 for _ in root.iter()) > MAX_ELEMENTS:
        raise WsdlImportError(f"{where}: more than {MAX_ELEMENTS} elements")
    if root.tag != ns.q(ns.WSDL, "definitions"):
        raise WsdlImportError(f"{where}: not a WSDL 1.1 document (root {root.tag})")
    return root


@dataclass
class Operation:
    name: str
    soap_action: str  # "" when the binding gives none
    request: list[list[etree._Element]]  # alternatives of the input's effective policy
    response: list[list[etree._Element]]


@dataclass
class Port:
    service: str
    name: str
    location: str
    soap_version: str  # "1.1" | "1.2"
    binding: str
    operations: list[Operation]
    notes: list[str] = field(default_factory=list)


class Definitions:
    """A WSDL document and the local documents its imports name, with their policies by id."""

    def __init__(self, root: etree._Element, path: Path | None, where: str) -> None:
        self.docs: list[tuple[etree._Element, str]] = [(root, where)]
        self.notes: list[str] = []
        self._path = path
        self._imports_read = False
        self.policies: dict[str, etree._Element] = {}
        self._index(root)

    def _index(self, root: etree._Element) -> None:
        for tag in (ns.q(wsp, "Policy") for wsp in WSP):
            for pol in root.iter(tag):
                for key in (pol.get(ns.q(ns.WSU, "Id")), pol.get(XML_ID), pol.get("Id")):
                    if key:
                        self.policies.setdefault("#" + key, pol)
                if pol.get("Name"):
                    self.policies.setdefault(pol.get("Name"), pol)

    def _read_imports(self) -> None:
        """Local wsdl:imports, read once, when something is not found in the document itself."""
        if self._imports_read:
            return
        self._imports_read = True
        if self._path is None:
            return
        base = self._path.parent.resolve()
        pending = [(self.docs[0][0], self._path.resolve())]
        seen: set[Path] = set()
        while pending:
            root, referrer = pending.pop()
            for imp in root.iter(ns.q(ns.WSDL, "import")):
                location = imp.get("location") or ""
                try:  # the gateway's own rule for a route's WSDL (filters/engine/xml/wsdl.py)
                    target = wsdl.local_file(location, referrer, base)
                except wsdl.DocumentError:
                    self.notes.append(f"wsdl:import {location!r} not followed (only files beside the WSDL are read)")
                    continue
                if target in seen:
                    continue
                if len(self.docs) >= MAX_DOCUMENTS:
                    raise WsdlImportError(f"more than {MAX_DOCUMENTS} imported documents")
                seen.add(target)
                if not target.is_file():
                    self.notes.append(f"wsdl:import {location!r}: no such file beside the WSDL")
                    continue
                child = parse_document(target.read_bytes(), str(target))
                self.docs.append((child, str(target)))
                self._index(child)
                pending.append((child, target))

    def find(self, local: str, qname: str, root_el: etree._Element) -> etree._Element | None:
        """A top-level wsdl:<local> named by a QName attribute value, in this document or a local import."""
        name = qname.split(":", 1)[-1]
        prefix = qname.split(":", 1)[0] if ":" in qname else None
        namespace = root_el.nsmap.get(prefix)
        for pass_ in (0, 1):
            if pass_:
                self._read_imports()
            for root, _ in self.docs:
                if namespace and root.get("targetNamespace") != namespace:
                    continue
                for el in root.iterchildren(ns.q(ns.WSDL, local)):
                    if el.get("name") == name:
                        return el
        return None

    def policy(self, uri: str) -> etree._Element | None:
        if uri not in self.policies and uri.startswith("#"):
            self._read_imports()
        return self.policies.get(uri)

    def ports(self) -> list[Port]:
        out = []
        for root, _ in list(self.docs[:1]):
            for service in root.iterchildren(ns.q(ns.WSDL, "service")):
                for port in service.iterchildren(ns.q(ns.WSDL, "port")):
                    got = self._port(service, port)
                    if got:
                        out.append(got)
        return out

    def _port(self, service: etree._Element, port: etree._Element) -> Port | None:
        address = port.find(ns.q(ns.WSDL_SOAP11, "address"))
        version = "1.1"
        if address is None:
            address, version = port.find(ns.q(ns.WSDL_SOAP12, "address")), "1.2"
        if address is None:
            return None  # an HTTP or other non-SOAP port: nothing for the gateway
        binding = self.find("binding", port.get("binding", ""), port)
        if binding is None:
            raise WsdlImportError(
                f"port {port.get('name')}: binding {port.get('binding')} is not in the WSDL or a local import"
            )
        soap_ns = ns.WSDL_SOAP12 if version == "1.2" else ns.WSDL_SOAP11
        endpoint = [*self._attached(service), *self._attached(port), *self._attached(binding)]
        operations = []
        for op in binding.iterchildren(ns.q(ns.WSDL, "operation")):
            soap_op = op.find(ns.q(soap_ns, "operation"))
            action = (soap_op.get("soapAction") if soap_op is not None else None) or ""
            on_op = [*endpoint, *self._attached(op)]
            request = [*on_op, *self._attached(op.find(ns.q(ns.WSDL, "input")))]
            response = [*on_op, *self._attached(op.find(ns.q(ns.WSDL, "output")))]
            operations.append(Operation(op.get("name", ""), action.strip(), self._alts(request), self._alts(response)))
        return Port(
            service=service.get("name", ""),
            name=port.get("name", ""),
            location=address.get("location", ""),
            soap_version=version,
            binding=binding.get("name", ""),
            operations=operations,
        )

    def _attached(self, el: etree._Element | None) -> list[etree._Element]:
        """The policies attached to a WSDL element: wsp:Policy and wsp:PolicyReference children, wsp:PolicyURIs."""
        if el is None:
            return []
        found = [c for c in el if _is_wsp(c, "Policy") or _is_wsp(c, "PolicyReference")]
        for wsp in WSP:
            for uri in (el.get(ns.q(wsp, "PolicyURIs")) or "").split():
                ref = etree.Element(ns.q(wsp, "PolicyReference"), URI=uri)
                found.append(ref)
        return found

    def _alts(self, policies: list[etree._Element]) -> list[list[etree._Element]]:
        return self.alternatives(policies, 0, ())

    def alternatives(
        self, items: list[etree._Element], depth: int, refs: tuple[str, ...]
    ) -> list[list[etree._Element]]:
        """The normal form of All(items): a list of alternatives, each a list of assertions."""
        result: list[list[etree._Element]] = [[]]
        for item in items:
            got = self._normal(item, depth, refs)
            result = [a + b for a, b in itertools.product(result, got)]
            if len(result) > MAX_ALTERNATIVES:
                raise WsdlImportError(f"policy has more than {MAX_ALTERNATIVES} alternatives")
        return result

    def _normal(self, el: etree._Element, depth: int, refs: tuple[str, ...]) -> list[list[etree._Element]]:
        if depth > MAX_NESTING:
            raise WsdlImportError(f"policy nested deeper than {MAX_NESTING} operators or references")
        if not isinstance(el.tag, str):
            return [[]]
        if _is_wsp(el, "Policy") or _is_wsp(el, "All"):
            return self.alternatives(list(_elements(el)), depth + 1, refs)
        if _is_wsp(el, "ExactlyOne"):
            alts: list[list[etree._Element]] = []
            for child in _elements(el):
                alts.extend(self._normal(child, depth + 1, refs))
                if len(alts) > MAX_ALTERNATIVES:
                    raise WsdlImportError(f"policy has more than {MAX_ALTERNATIVES} alternatives")
            return alts
        if _is_wsp(el, "PolicyReference"):
            uri = el.get("URI", "")
            if uri in refs:
                raise WsdlImportError(f"policy reference {uri} refers to itself")
            target = self.policy(uri)
            if target is None:
                where = "not fetched" if not uri.startswith("#") else "not found"
                return [[_unresolved(uri, where)]]
            return self._normal(target, depth + 1, (*refs, uri))
        optional = any(el.get(ns.q(wsp, "Optional")) in ("true", "1") for wsp in WSP)
        # Optional: the alternative with the assertion first, as the gateway prefers to enforce it.
        return [[el], []] if optional else [[el]]

    def nested(self, assertion: etree._Element, notes: list[str]) -> list[etree._Element]:
        """The first alternative of an assertion's nested wsp:Policy (what the assertion's parameters are)."""
        inner = [c for c in assertion if _is_wsp(c, "Policy") or _is_wsp(c, "PolicyReference")]
        if not inner:
            return []
        alts = self.alternatives(inner, 1, ())
        if len(alts) > 1:
            notes.append(f"{_local(assertion)}: {len(alts)} nested alternatives, the first one taken")
        return alts[0]


def _elements(el: etree._Element) -> list[etree._Element]:
    return [c for c in el if isinstance(c.tag, str)]


def _local(el: etree._Element) -> str:
    return etree.QName(el).localname


def _unresolved(uri: str, why: str) -> etree._Element:
    """A placeholder assertion for a reference not followed: the mapping names it as unmapped."""
    return etree.Element(UNRESOLVED, URI=uri, why=why)


@dataclass
class ImportedRoute:
    route: dict[str, object]
    soap_version: str
    operations: list[str]
    mapped: Mapped


@dataclass
class Imported:
    source: str
    routes: list[ImportedRoute]
    notes: list[str]  # about the document as a whole

    @property
    def unmapped(self) -> list[str]:
        return [u for r in self.routes for u in r.mapped.unmapped]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "route"


def _upstream(location: str, override: str | None) -> tuple[str, dict[str, object]]:
    parts = urlsplit(location)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WsdlImportError(f"soap:address {location!r} is not an http(s) URL")
    default = 443 if parts.scheme == "https" else 80
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    upstream: dict[str, object] = {"address": override or f"{host}:{parts.port or default}"}
    if parts.scheme == "https":
        upstream["tls"] = True
    return parts.path or "/", upstream


def import_wsdl(
    data: bytes,
    path: Path | None,
    source: str,
    *,
    service: str | None = None,
    port: str | None = None,
    upstream: str | None = None,
    validate: bool = False,
    outbound: str | None = None,
) -> Imported:
    """The routes for a WSDL's SOAP ports (one port or service when named). `path`: the local file, for imports
    beside it and for `wsdl.file`; `upstream` replaces the soap:address host and port. `outbound`: a partner's
    WSDL, for outbound routes on this listener (host:port; security_policy.as_outbound)."""
    defs = Definitions(parse_document(data, source), path, source)
    ports = [p for p in defs.ports() if (service is None or p.service == service) and (port is None or p.name == port)]
    if not ports:
        raise WsdlImportError(
            f"{source}: no SOAP port" + (f" matching service={service} port={port}" if service or port else "")
        )
    routes: list[ImportedRoute] = []
    names: set[str] = set()
    paths: dict[str, str] = {}
    for p in ports:
        routes.extend(_port_routes(defs, p, path, source, upstream, validate, names, paths, outbound))
    return Imported(source=source, routes=routes, notes=defs.notes)


def _port_routes(
    defs: Definitions,
    p: Port,
    path: Path | None,
    source: str,
    upstream_override: str | None,
    validate: bool,
    names: set[str],
    paths: dict[str, str],
    outbound: str | None = None,
) -> list[ImportedRoute]:
    prefix, upstream = _upstream(p.location, upstream_override)
    if prefix.lower() in paths:
        raise WsdlImportError(
            f"port {p.name}: address path {prefix} is also port {paths[prefix.lower()]}'s: import one"
        )
    paths[prefix.lower()] = p.name
    groups: dict[str, tuple[Mapped, list[Operation]]] = {}
    for op in p.operations:
        mapped = map_policy(defs, op.request, op.response)
        key = yaml.safe_dump(mapped.route, sort_keys=True)
        groups.setdefault(key, (mapped, []))[1].append(op)
    ordered = list(groups.values())
    # Operations without a SOAPAction cannot be told apart by Envoy: their group is matched by path alone, and
    # when such operations ask for different policies, the strongest one holds for all of them.
    unnamed = [g for g in ordered if any(not op.soap_action for op in g[1])]
    if len(unnamed) > 1:
        unnamed.sort(key=lambda g: -PROFILE_STRENGTH[str(g[0].route["profile"])])
        keep = unnamed[0]
        for mapped, ops in unnamed[1:]:
            for op in ops:
                keep[0].unmapped.append(
                    f"operation {op.name}: its own policy ({mapped.route['profile']}) cannot be told apart without "
                    f"a SOAPAction: served under operation {keep[1][0].name}'s ({keep[0].route['profile']})"
                )
            keep[1].extend(ops)
            ordered.remove((mapped, ops))
    out = []
    for mapped, ops in ordered:
        if not mapped.usable:
            defs.notes.append(f"port {p.name}: operations {', '.join(op.name for op in ops)} skipped: nothing the "
                              "gateway can enforce: " + "; ".join(mapped.unmapped))  # fmt: skip
            continue
        base = _slug(p.name)
        name = base if base not in names else _slug(f"{p.name}-{ops[0].name}")
        while name in names:
            name = name[:-2] + f"-{len(names)}"
        names.add(name)
        match: dict[str, object] = {"path_prefix": prefix}
        actions = sorted({op.soap_action for op in ops})
        if all(actions):
            match["soap_action"] = actions[0] if len(actions) == 1 else actions
        route: dict[str, object] = {"name": name, "match": match, "upstream": upstream, **mapped.route}
        # The gateway reads the WSDL (and everything it imports) when the policy loads: name it only if it can.
        unreadable = _unreadable(path) if path is not None else "the WSDL was not saved to a file"
        if unreadable is None:
            route["wsdl"] = {"file": str(path), "publish": True}
            if validate:
                route["schema_validation"] = {"requests": True, "responses": True, "xsd_files": []}
        else:
            mapped.unmapped.append(f"wsdl: not published and no schema validation: {unreadable}")
        if outbound is not None and not as_outbound(route, outbound, mapped):
            defs.notes.append(
                f"port {p.name}: operations {', '.join(op.name for op in ops)} skipped: " + mapped.unmapped[-1]
            )
            continue
        out.append(ImportedRoute(route, p.soap_version, [op.name for op in ops], mapped))
    return out


def _unreadable(path: Path) -> str | None:
    try:
        wsdl.load(path)
    except wsdl.DocumentError as exc:
        return str(exc)
    return None


def render(imported: Imported) -> str:
    """The policy file: routes in the YAML `wsgate check` reads, each preceded by comments saying where it came
    from, what was mapped with a decision, and what could not be mapped."""
    lines = [
        f"# Imported by `wsgate import` from {imported.source}.",
        "# Review before use: lines marked UNMAPPED are policy the gateway does not enforce as the WSDL asks.",
        *(f"# note: {n}" for n in imported.notes),
        "routes:",
    ]
    for r in imported.routes:
        lines.append(f"  # {r.route['name']}: SOAP {r.soap_version}, operations {', '.join(r.operations)}")
        lines.extend(f"  # note: {n}" for n in r.mapped.notes)
        lines.extend(f"  # UNMAPPED: {u}" for u in r.mapped.unmapped)
        text = yaml.safe_dump([r.route], sort_keys=False, default_flow_style=False, width=120)
        lines.extend("  " + line for line in text.splitlines())
    return "\n".join(lines) + "\n"
