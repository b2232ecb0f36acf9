"""The Envoy pieces of outbound routes (`direction: outbound`, docs/outbound.md), which envoy_config.py puts
together: each outbound listener address gets its own listener (never the public ones), HTTPS with required
client certificates where the route says `mtls`; the partner's cluster speaks TLS, checks the partner's name
against its certificate, and presents the gateway's client certificate where the route names one; retries
only for the operations the policy names idempotent."""

from __future__ import annotations

import ipaddress
from typing import Any

from gateway.policy import PolicyError, PolicySet, Route

# What a retry may follow: the call got no reply (a refused or reset connection, a stream the partner did not
# take) or a gateway-type status (502, 503, 504). Envoy resends the request as secured once: a partner that
# remembers nonces refuses the copy of a request it did receive, so retries are for idempotent operations only.
RETRY_ON = "connect-failure,refused-stream,reset,gateway-error"
UPSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
DOWNSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"


def listeners(policies: PolicySet) -> dict[str, list[Route]]:
    """Outbound routes by listener address; the routes of one listener agree on mtls and its certificates."""
    out: dict[str, list[Route]] = {}
    for r in policies.routes:
        if r.outbound is not None:
            out.setdefault(r.outbound.listen, []).append(r)
    for address, routes in out.items():
        first = routes[0].outbound
        assert first is not None
        for r in routes[1:]:
            o = r.outbound
            assert o is not None
            if (o.mtls, o.client_ca, o.server_certificate, o.server_key) != (
                first.mtls, first.client_ca, first.server_certificate, first.server_key,
            ):  # fmt: skip
                raise PolicyError(
                    f"{policies.sources[r.name]}: route {r.name}: field outbound: the listener {address} is shared "
                    f"with route {routes[0].name}, whose mtls and certificates differ"
                )
    return out


def check_ports(policies: PolicySet, public: set[tuple[str, int]], bind: str | None = None) -> None:
    """An outbound listener never takes a public listener's port (on its address or on every address); `bind`:
    where outbound listeners bind instead of their own address (Topology.outbound_bind)."""
    for r in policies.routes:
        if r.outbound is None:
            continue
        own = bind or r.outbound.host
        for host, port in public:
            if r.outbound.port == port and (own == host or _any(host) or _any(own)):
                raise PolicyError(
                    f"{policies.sources[r.name]}: route {r.name}: field outbound.listen: port {port} is a public "
                    "listener's"
                )


def _any(host: str) -> bool:
    return ipaddress.ip_address(host).is_unspecified


def listener_tls(route: Route) -> dict[str, Any] | None:
    """The applications' listener's TLS with required client certificates (mtls), or None (plain HTTP)."""
    o = route.outbound
    if o is None or not o.mtls:
        return None
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": DOWNSTREAM_TLS,
            "common_tls_context": {
                "alpn_protocols": ["http/1.1"],
                "tls_certificates": [{"certificate_chain": {"filename": o.server_certificate},
                                      "private_key": {"filename": o.server_key}}],
                "validation_context": {"trusted_ca": {"filename": o.client_ca}},
            },
            "require_client_certificate": True,
        },
    }  # fmt: skip


def upstream_tls(route: Route, validation: dict[str, Any]) -> dict[str, Any]:
    """The partner's TLS: its certificate must name the partner (SAN), the gateway's client certificate if any."""
    o = route.outbound
    assert o is not None
    host = route.upstream.sni or route.upstream.host
    san = {"san_type": "IP_ADDRESS" if _is_ip(host) else "DNS", "matcher": {"exact": host}}
    context: dict[str, Any] = {"validation_context": {**validation, "match_typed_subject_alt_names": [san]}}
    if o.client_certificate and o.client_key:
        context["tls_certificates"] = [{"certificate_chain": {"filename": o.client_certificate},
                                        "private_key": {"filename": o.client_key}}]  # fmt: skip
    tls: dict[str, Any] = {"@type": UPSTREAM_TLS, "common_tls_context": context}
    if not _is_ip(host):
        tls["sni"] = host
    return {"name": "envoy.transport_sockets.tls", "typed_config": tls}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def retry_policy(route: Route, action: str | None) -> dict[str, Any] | None:
    """Envoy's retry policy for calls with this SOAPAction: only the operations the policy names."""
    o = route.outbound
    if o is None or action is None or action not in o.retry.operations:
        return None
    return {"retry_on": RETRY_ON, "num_retries": o.retry.attempts,
            "per_try_timeout": f"{route.upstream.timeout_s / (o.retry.attempts + 1):g}s"}  # fmt: skip
