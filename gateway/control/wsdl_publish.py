"""The published WSDL (policy `wsdl.publish`): the route's WSDL and every document it imports, rewritten for
clients, served by Envoy itself (gateway/control/envoy_config.py: GET or HEAD on the route's path with `?wsdl`).

The named WSDL is served at `<path>?wsdl`, each document it reaches at `<path>?wsdl=<n>` (WSDL) or `?xsd=<n>`
(schema), n its position in filters/engine/xml/wsdl.py's breadth-first order (stable while the files are). Rewritten: every
import's location to those URLs, every soap:address and soap12:address to the gateway's URL for the route, and
the WS-SecurityPolicy to the gateway's (gateway/control/published_policy.py); the signing certificates are added
to each port (gateway/control/published_certificates.py). The gateway's URL is `edge.public_url`, or
the listener the route is served on; never the request's Host header, which the client writes."""

from __future__ import annotations

from dataclasses import dataclass

from lxml import etree

from filters.engine import ns
from filters.engine.xml import wsdl
from gateway.control import published_certificates, published_policy
from gateway.policy import Edge, Route

ADDRESSES = (ns.q(ns.WSDL_SOAP11, "address"), ns.q(ns.WSDL_SOAP12, "address"))
CONTENT_TYPE = "text/xml; charset=utf-8"


@dataclass(frozen=True)
class Document:
    query: str  # the query parameter that names it: `wsdl` or `xsd`
    value: str  # its value: "" for the named WSDL (`?wsdl`), else the document's number
    body: bytes


def base_url(route: Route, edge: Edge, host: str, http_port: int, https_port: int) -> str:
    """Scheme, host and port clients reach the route at: an outbound route's own listener (docs/outbound.md)."""
    if route.outbound is not None:
        out = route.outbound
        listen_host = f"[{out.host}]" if ":" in out.host else out.host
        return f"{'https' if out.mtls else 'http'}://{listen_host}:{out.port}"
    if edge.public_url:
        return edge.public_url
    if host in ("0.0.0.0", "::", ""):  # every interface: name the machine itself
        host = "localhost"
    elif ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{https_port}" if route.https_only else f"http://{host}:{http_port}"


def documents(route: Route, base: str) -> list[Document]:
    """The route's published documents (raises wsdl.DocumentError)."""
    assert route.wsdl is not None
    docs = wsdl.load(route.wsdl.file)
    service = base + route.match.path_prefix
    names = [("wsdl", "") if i == 0 else (d.kind, str(i)) for i, d in enumerate(docs.documents)]

    def url(ref: wsdl.Reference) -> str:
        query, value = names[ref.target]
        return f"{service}?{query}" + (f"={value}" if value else "")

    out = []
    for (query, value), doc in zip(names, docs.documents, strict=True):
        root = wsdl.copy_with_references(doc, url)
        if doc.kind == "wsdl":
            for address in root.iter(*ADDRESSES):
                address.set("location", service)
            published_policy.rewrite(root, route)
            published_certificates.publish(root, route)
        out.append(Document(query, value, etree.tostring(root, xml_declaration=True, encoding="UTF-8")))
    return out
