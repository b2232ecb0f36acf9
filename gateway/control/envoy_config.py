"""Policies -> Envoy configuration, deterministically (same policies and topology, same bytes).

Envoy runs from a small bootstrap whose listeners and clusters come from two watched files (lds.yaml, cds.yaml):
a policy change is rendered into new files that replace the old ones atomically, and Envoy applies them
without dropping in-flight requests (old listeners drain)."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from filters.engine.xml.wsdl import DocumentError
from gateway.control import outbound_config, rate_limit, tracing, wsdl_publish
from gateway.policy import OPERATION_HEADER, Edge, PolicyError, PolicySet, Route

EXT_PROC = "envoy.filters.http.ext_proc"
RBAC = "envoy.filters.http.rbac"
ROUTE_METADATA = "x-wsgate-route"  # the filter workers' frame reads it (filters/frame/src/service.rs)
FILTER_CLUSTER = "wsgate_filter"
HEAP = "envoy.resource_monitors.fixed_heap"
SOAP11 = "http://schemas.xmlsoap.org/soap/envelope/"
SOAP12 = "http://www.w3.org/2003/05/soap-envelope"


@dataclass(frozen=True)
class Topology:
    """Where things are. The local topology and the Compose one differ only here, never in the routes."""

    filter_endpoints: tuple[str, ...] = ("127.0.0.1:9100", "127.0.0.1:9101")
    filter_dns: bool = False  # Compose: one name that resolves to every filter replica
    bind: str = "127.0.0.1"
    http_port: int = 8080
    https_port: int = 8443
    admin_port: int = 9901
    certs_dir: str = "certs/out"
    config_dir: str = "run/envoy"
    max_connections: int = 50_000
    filter_timeout_ms: int = 3000  # RSA work at saturation needs more than Envoy's 200 ms default
    max_heap_mb: int = 1024  # Envoy's heap: over 95% of it, new requests get 503 (overload manager)
    ratelimit: str = "127.0.0.1:8089"  # the Envoy rate-limit service's gRPC (routes with quotas)
    # Where outbound listeners bind (their routes' ports): None, the route's own address; Compose and Kubernetes
    # bind every interface of the container, which only the applications reach (an unpublished port; a
    # NetworkPolicy, gateway/control/kubernetes.py).
    outbound_bind: str | None = None


def compose_topology() -> Topology:
    return Topology(
        filter_endpoints=("filter:9000",),
        filter_dns=True,
        bind="0.0.0.0",
        certs_dir="/certs",
        config_dir="/config",
        outbound_bind="0.0.0.0",
        ratelimit="ratelimit:8081",  # docker-compose.yml's ratelimit service
    )


def _address(addr: str) -> dict[str, Any]:
    host, port = addr.rsplit(":", 1)
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _soap_fault(version: str, code: str, text: str) -> str:
    if version == "1.2":
        return (
            f'<env:Envelope xmlns:env="{SOAP12}"><env:Body><env:Fault><env:Code><env:Value>{code}</env:Value>'
            f'</env:Code><env:Reason><env:Text xml:lang="en">{text}</env:Text></env:Reason></env:Fault>'
            "</env:Body></env:Envelope>"
        )
    return (
        f'<soap:Envelope xmlns:soap="{SOAP11}"><soap:Body><soap:Fault><faultcode>{code}</faultcode>'
        f"<faultstring>{text}</faultstring></soap:Fault></soap:Body></soap:Envelope>"
    )


# Envoy's own refusals (no route, too large, upstream down or slow, filter down, mTLS missing) become SOAP faults
# with a generic text; the precise reason (%RESPONSE_CODE_DETAILS%) goes to the access log only. The filter's own
# faults are 500/502 and already SOAP, so those codes are left alone.
ENVOY_REPLIES: dict[int, str] = {
    400: "Bad request",
    403: "Access denied",
    404: "No such service",
    405: "Only SOAP POST requests are accepted",
    408: "Request timeout",
    413: "Message too large",
    426: "This service requires HTTPS",
    429: "Too many requests",
    431: "Request headers too large",
    503: "Service unavailable",
    504: "Service timed out",
}
FILTER_FAILURE_STATUS = 503
RETRY_AFTER = {
    "header": {"key": "retry-after", "value": "%RESP(x-ratelimit-reset)%"},
    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
}
# A backend response over the stream's buffer: Envoy answers 500 itself. To the client it is the same 502 as when
# the filter refuses it first (filters.engine.faults.server's text): which one does depends on timing.
RESPONSE_TOO_LARGE = "response.code_details == 'response_payload_too_large'"
RESPONSE_TOO_LARGE_TEXT = "The gateway could not process the message"
# Envoy's edge recommendation for connections; routes that buffer bodies raise their own stream's limit.
CONNECTION_BUFFER_BYTES = 32 * 1024
# A streamed route's backend connection: Envoy hands the filter what one read of it holds, and the frame copies each
# chunk into the whole package, so a read of the whole reply (a buffer sized to the body) was held twice (measured:
# a 50 MB reply as one 46 MiB chunk, the worker's peak 2x). Small reads push back on the backend instead.
STREAMED_UPSTREAM_BUFFER_BYTES = 1024 * 1024
# Routes taking attachments: Envoy streams the bodies to the filter and takes them back in chunks
# (FULL_DUPLEX_STREAMED, which demands trailers SEND) instead of buffering them and taking a replaced package back
# as one message: measured with Envoy 1.40 and 10 MB, about 23 ms of Envoy CPU per exchange against 32-48 ms
# (docs/performance.md). The filter holds every chunk and answers the headers only after the whole message passed:
# nothing goes on before. Envoy then sends the body chunked (it drops content-length in this mode).
STREAMED_MODE = {
    "request_header_mode": "SEND",
    "response_header_mode": "SEND",
    "request_body_mode": "FULL_DUPLEX_STREAMED",
    "response_body_mode": "FULL_DUPLEX_STREAMED",
    "request_trailer_mode": "SEND",
    "response_trailer_mode": "SEND",
}
# extproc=: Envoy's own account of the ext_proc exchange, e.g. rh:1037:0,rb:1:613:0,sh:343:0,sb:1:374:0 (per phase:
# calls and microseconds until the filter answered; loadtest/bench_gateway.py reads it for the round-trip breakdown).
ACCESS_LOG_FORMAT = (
    '[%START_TIME%] "%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%" %RESPONSE_CODE% '
    "%RESPONSE_CODE_DETAILS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION%ms route=%ROUTE_NAME% "
    'upstream=%UPSTREAM_HOST% peer="%DOWNSTREAM_PEER_SUBJECT%" '
    "extproc=%FILTER_STATE(envoy.filters.http.ext_proc:PLAIN)%\n"
)


def _local_reply_config() -> dict[str, Any]:
    soap12_request = {"header_filter": {"header": {
        "name": "content-type", "string_match": {"contains": "application/soap+xml", "ignore_case": True}}}}  # fmt: skip
    too_large = {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
        "expression": RESPONSE_TOO_LARGE}}}  # fmt: skip
    mappers = [
        {"filter": {"and_filter": {"filters": [too_large, soap12_request]}}, "status_code": 502,
         "body_format_override": {"text_format_source": {"inline_string": _soap_fault("1.2", "env:Receiver", RESPONSE_TOO_LARGE_TEXT)},
                                  "content_type": "application/soap+xml; charset=utf-8"}},
        {"filter": too_large, "status_code": 502,
         "body_format_override": {"text_format_source": {"inline_string": _soap_fault("1.1", "soap:Server", RESPONSE_TOO_LARGE_TEXT)},
                                  "content_type": "text/xml; charset=utf-8"}},
    ]  # fmt: skip
    for code, text in ENVOY_REPLIES.items():
        status = {"status_code_filter": {"comparison": {
            "op": "EQ", "value": {"default_value": code, "runtime_key": f"wsgate.local_reply.{code}"}}}}  # fmt: skip
        sender = code < 500
        # A quota refusal says when to come back: the rate-limit filter's x-ratelimit-reset (seconds).
        retry = {"headers_to_add": [RETRY_AFTER]} if code == 429 else {}
        mappers.append({
            "filter": {"and_filter": {"filters": [status, soap12_request]}}, **retry,
            "body_format_override": {
                "text_format_source": {"inline_string": _soap_fault("1.2", "env:Sender" if sender else "env:Receiver", text)},
                "content_type": "application/soap+xml; charset=utf-8",
            },
        })  # fmt: skip
        mappers.append({
            "filter": status, **retry,
            "body_format_override": {
                "text_format_source": {"inline_string": _soap_fault("1.1", "soap:Client" if sender else "soap:Server", text)},
                "content_type": "text/xml; charset=utf-8",
            },
        })  # fmt: skip
    return {"mappers": mappers}


_DISABLED = {EXT_PROC: {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                        "disabled": True}}  # fmt: skip


_POST = {"name": ":method", "string_match": {"exact": "POST"}}
_GET_OR_HEAD = {"name": ":method", "string_match": {"safe_regex": {"regex": "GET|HEAD"}}}

Published = dict[str, list[wsdl_publish.Document]]  # route name -> its published WSDL documents


def _published(policies: PolicySet, topo: Topology) -> Published:
    out: Published = {}
    for r in policies.routes:
        if r.wsdl and r.wsdl.publish:
            base = wsdl_publish.base_url(r, policies.edge, topo.bind, topo.http_port, topo.https_port)
            try:
                out[r.name] = wsdl_publish.documents(r, base)
            except DocumentError as exc:
                raise PolicyError(f"{policies.sources[r.name]}: route {r.name}: field wsdl.file: {exc}") from None
    return out


def _wsdl_entries(route: Route, docs: list[wsdl_publish.Document], per_filter: dict[str, Any]) -> list[dict[str, Any]]:
    """GET/HEAD on the route's own path with ?wsdl, ?wsdl=n or ?xsd=n: answered by Envoy from the rendered
    document. Any other method falls through to the route (a POST with ?wsdl is an ordinary secured request)."""
    return [
        {
            "name": f"{route.name}-wsdl",
            "match": {
                "path": route.match.path_prefix,
                "case_sensitive": False,
                "headers": [_GET_OR_HEAD],
                "query_parameters": [{"name": d.query, "string_match": {"exact": d.value}}],
            },
            "direct_response": {"status": 200, "body": {"inline_string": d.body.decode()}},
            "response_headers_to_add": [
                {
                    "header": {"key": "content-type", "value": wsdl_publish.CONTENT_TYPE},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
            ],
            "typed_per_filter_config": per_filter,
        }
        for d in docs
    ]


def _route_entries(route: Route, tls_listener: bool, published: Published) -> list[dict[str, Any]]:
    """Envoy routes for one policy route (three per SOAPAction matched: the 1.1 header, bare or quoted, or the 1.2
    content-type action; a fourth where the route takes MTOM), after its published documents' GET routes."""
    matches: list[dict[str, Any]] = []
    actions: list[str | None] = []  # each match's SOAPAction
    # Case-insensitive: a backend that ignores case (IIS) must not read /RSA/ as a route Envoy did not choose.
    base = {"prefix": route.match.path_prefix, "case_sensitive": False}
    # The operations an outbound route retries get their own matches, before the route's catch-all.
    retried = route.outbound.retry.operations if route.outbound and route.match.soap_action is None else []
    for action in [*route.match.soap_actions, *retried]:
        for header, value in (("soapaction", action), ("soapaction", f'"{action}"')):
            matches.append({**base, "headers": [{"name": header, "string_match": {"exact": value}}]})
        spellings = [f'action="{action}"']
        if route.attachments.accept:  # SOAP 1.2 MTOM: the action is quoted again inside start-info="..."
            spellings.append(f'action=\\"{action}\\"')
        matches += [
            {**base, "headers": [{"name": "content-type", "string_match": {"contains": spelling}}]}
            for spelling in spellings
        ]
        actions += [action] * (2 + len(spellings))
    if route.match.soap_action is None:
        matches.append(base)
        actions.append(None)

    refusals = []
    if route.touches_xml:
        # Only POSTs reach the filter: anything else is answered here without opening an ext_proc stream.
        refusals = [{"name": route.name, "match": m, "direct_response": {"status": 405},
                     "typed_per_filter_config": _DISABLED} for m in matches]  # fmt: skip
        matches = [{**m, "headers": [*m.get("headers", []), _POST]} for m in matches]
    entries = []
    if route.name in published and (tls_listener or not route.https_only):
        entries += _wsdl_entries(route, published[route.name], _access(route))
    for m, action in zip(matches, actions, strict=True):
        entry: dict[str, Any] = {"name": route.name, "match": m}
        if route.https_only and not tls_listener:
            # An HTTPS-only route is not served over plain HTTP: 426 Upgrade Required (a SOAP fault), never the backend.
            entry["direct_response"] = {"status": 426}
            entry["typed_per_filter_config"] = _DISABLED
            entries.append(entry)
            continue
        entry["route"] = {"cluster": f"upstream_{route.name}", "timeout": f"{route.upstream.timeout_s:g}s"}
        if route.quotas.enabled:
            entry["route"]["rate_limits"] = rate_limit.route_rate_limits(route)
        if retry := outbound_config.retry_policy(route, action):
            entry["route"]["retry_policy"] = retry
        if route.touches_xml and not route.streams_bodies:
            # The filter needs whole bodies: Envoy buffers up to this route's own limit (413 or 502 beyond).
            entry["request_body_buffer_limit"] = max(route.limits.max_body_bytes, route.response_limits.max_body_bytes)
        per_filter = _access(route)
        if route.touches_xml:
            overrides: dict[str, Any] = {"grpc_initial_metadata": [{"key": ROUTE_METADATA, "value": route.name}]}
            if route.streams_bodies:  # the frame holds the chunks (filters.worker's Route `streamed`)
                overrides["processing_mode"] = STREAMED_MODE
            per_filter[EXT_PROC] = {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                "overrides": overrides,
            }
        entry["typed_per_filter_config"] = per_filter
        # The worker's operation header is for the rate-limit filter only (removed by the router, after it).
        quota_only = [OPERATION_HEADER] if route.quotas.operations else []
        if quota_only:
            entry["request_headers_to_remove"] = quota_only
        if route.tls.subject_header and tls_listener:
            entry["request_headers_to_remove"] = [route.tls.subject_header, *quota_only]
            entry["request_headers_to_add"] = [
                {"header": {"key": route.tls.subject_header, "value": "%DOWNSTREAM_PEER_SUBJECT%"},
                 "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            ]  # fmt: skip
        elif route.tls.subject_header:
            entry["request_headers_to_remove"] = [route.tls.subject_header, *quota_only]
        if route.is_outbound:  # the partner learns nothing of the internal network
            entry["request_headers_to_remove"] = [*entry.get("request_headers_to_remove", []), *INTERNAL_HEADERS]
        entries.append(entry)
    return entries + refusals


def _access(route: Route) -> dict[str, Any]:
    """Per-route filter settings before the route's own processing: no ext_proc, and the client certificate a
    route requires (verified at the handshake when sent; RBAC refuses connections without one)."""
    per_filter: dict[str, Any] = dict(_DISABLED)
    if route.tls.require_client_certificate:
        per_filter[RBAC] = {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBACPerRoute",
            "rbac": {"rules": {"action": "ALLOW", "policies": {"client-certificate": {
                "permissions": [{"any": True}],
                "principals": [{"authenticated": {"principal_name": {"safe_regex": {"regex": ".+"}}}}],
            }}}},
        }  # fmt: skip
    return per_filter


# Envoy normalizes before routing: dot segments (also %2e and `..;`) removed, percent-encoded unreserved characters
# decoded, `\` turned into `/`, slashes merged, %2F and %5C refused (400). What is left that a backend could still
# read as another path is refused here (400): a `;` path parameter (Tomcat and Jetty drop `;...` from a segment),
# a percent-encoded control, `%`, `;`, `?`, `#` or overlong UTF-8 lead (%C0.., %E0%80.., %F0%80..), a bad escape.
AMBIGUOUS_PATH = r"(?i).*(?:;|%(?:[01][0-9a-f]|7f|2[35]|3[bf]|c[01]|e0%[89]|f0%8)|%(?:[^0-9a-f]|.[^0-9a-f]|.?$)).*"
# What Envoy writes about the internal caller, removed from outbound calls to a partner.
INTERNAL_HEADERS = ["x-forwarded-for", "x-forwarded-proto", "x-request-id", "x-envoy-external-address"]
# Headers the gateway vouches for or Envoy writes: never taken from a client, on every route, before routing.
GATEWAY_HEADER_PREFIXES = ("x-wsgate-", "x-envoy-")
FORWARDING_PREFIX = "x-forwarded-"
ODD_HEADER_NAME = r"[^:a-z0-9-].*|[^:].*[^a-z0-9-].*"  # x-forwarded-for/-proto/-host/-port/-client-cert...


def _early_header_mutation(policies: PolicySet, trusted_trace: bool) -> dict[str, Any]:
    edge = policies.edge
    prefixes = [*GATEWAY_HEADER_PREFIXES]
    names = {"x-forwarded-client-cert"}
    if edge.tracing and not trusted_trace:  # only trusted callers choose or join a trace
        names |= set(tracing.TRACE_HEADERS)
    if edge.xff_num_trusted_hops == 0:
        # No proxy in front: the client's forwarding claims are dropped, Envoy writes x-forwarded-for/-proto itself.
        prefixes.append(FORWARDING_PREFIX)
        names |= {"forwarded", "x-real-ip"}
    for r in policies.routes:
        names |= {h for h in (r.identity_header, r.tls.subject_header) if h}
        names |= {r.backend_assertion.header} if r.backend_assertion else set()
    mutations: list[dict[str, Any]] = [{"remove_on_match": {"key_matcher": {"prefix": p}}} for p in prefixes]
    # Names some backend could map onto another (x.wsgate.subject, as x_wsgate_subject: CGI variables): only
    # [a-z0-9-] passes (Envoy lowercases names; pseudo-headers start with `:`).
    mutations.append({"remove_on_match": {"key_matcher": {"safe_regex": {"regex": ODD_HEADER_NAME}}}})
    mutations += [{"remove": n} for n in sorted(names) if not n.startswith(tuple(prefixes))]
    return {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": mutations,
        },
    }


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _edge_settings(edge: Edge) -> dict[str, Any]:
    """Paths, client headers and timeouts (docs/threat-model.md): the same on both listeners."""
    return {
        # Routes match the RFC 3986 normalized path with slashes merged, and the backend gets that same path.
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "REJECT_REQUEST",  # %2F, %5C: 400
        # x-forwarded-for/-proto are Envoy's: the peer address and the listener's own scheme.
        "use_remote_address": True,
        "xff_num_trusted_hops": edge.xff_num_trusted_hops,
        "forward_client_cert_details": "SANITIZE",
        "max_request_headers_kb": edge.max_request_headers_kb,
        "request_headers_timeout": _seconds(edge.request_headers_timeout_s),
        "request_timeout": _seconds(edge.request_timeout_s),
        "stream_idle_timeout": _seconds(edge.stream_idle_timeout_s),
        "common_http_protocol_options": {
            "idle_timeout": _seconds(edge.connection_idle_timeout_s),
            "max_headers_count": edge.max_headers_count,
            # x_wsgate_subject is x-wsgate-subject to CGI, WSGI and nginx: such names never pass.
            "headers_with_underscores_action": "DROP_HEADER",
        },
    }


def _http_connection_manager(
    policies: PolicySet, topo: Topology, tls_listener: bool, published: Published, trusted_trace: bool = False,
    served: list[Route] | None = None, name: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """`served`: the listener's routes (None: the inbound ones, on the public listeners)."""
    name = name or ("https" if tls_listener else "http")
    served = [r for r in policies.routes if not r.is_outbound] if served is None else served
    refused = {"name": "ambiguous-path", "match": {"safe_regex": {"regex": AMBIGUOUS_PATH}},
               "direct_response": {"status": 400}, "typed_per_filter_config": _DISABLED}  # fmt: skip
    # The most specific match first, whatever the file order: a `none` route on `/` never shadows `/rsa/`.
    ordered = sorted(served, key=lambda r: (-len(r.match.path_prefix), r.match.soap_action is None))
    routes = [refused, *(e for r in ordered for e in _route_entries(r, tls_listener, published))]
    # Anything no policy names is answered here, as a SOAP fault, and never reaches the filter or a backend.
    routes.append({
        "name": "no-policy",
        "match": {"prefix": "/"},
        "direct_response": {"status": 404},
        "typed_per_filter_config": _DISABLED,
    })  # fmt: skip
    quotas = rate_limit.enabled(policies)
    # Client-address quotas before ext_proc (no XML work for a shaped flood), caller quotas after it (verified).
    http_filters: list[dict[str, Any]] = [rate_limit.http_filter(rate_limit.ADDRESS_STAGE)] if quotas else []
    http_filters += [
        {
            "name": EXT_PROC,
            # Only on the routes that enable it (XML routes): a request refused before routing (an escaped slash)
            # keeps Envoy's own 400 instead of opening an ext_proc stream for no route.
            "disabled": True,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {
                    "envoy_grpc": {
                        "cluster_name": FILTER_CLUSTER,
                        "max_receive_message_length": _max_body(policies) + 65536,
                    },
                    "timeout": f"{topo.filter_timeout_ms / 1000:g}s",
                },
                "failure_mode_allow": False,  # fail closed: nothing reaches a secured backend unprocessed
                "status_on_error": {"code": FILTER_FAILURE_STATUS},
                "message_timeout": f"{topo.filter_timeout_ms / 1000:g}s",
                # Both headers phases stay (measured with Envoy 1.40): skipped, Envoy sends the request headers
                # upstream before the body's verdict, drops the filter's header mutations, and lets the response
                # status out before the response is checked.
                "processing_mode": {
                    "request_header_mode": "SEND",
                    "response_header_mode": "SEND",
                    "request_body_mode": "BUFFERED",
                    "response_body_mode": "BUFFERED",
                    "request_trailer_mode": "SKIP",
                    "response_trailer_mode": "SKIP",
                },
                "mutation_rules": {"allow_all_routing": False, "disallow_system": True},
            },
        }
    ]
    if any(r.tls.require_client_certificate for r in policies.routes):
        http_filters.append({
            "name": RBAC,
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC"},
        })  # fmt: skip
    if quotas:
        http_filters.append(rate_limit.http_filter(rate_limit.CALLER_STAGE))
    http_filters.append(
        {"name": "envoy.filters.http.router",
         "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                          # Traced: the backend's time is a span of its own.
                          **({"start_child_span": True} if policies.edge.tracing else {})}}
    )  # fmt: skip
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": name,
            "codec_type": "AUTO",
            "server_header_transformation": "PASS_THROUGH",
            **_edge_settings(policies.edge),
            "early_header_mutation_extensions": [_early_header_mutation(policies, trusted_trace)],
            **({"tracing": tracing.connection_manager(policies.edge.tracing)} if policies.edge.tracing else {}),
            "route_config": {
                "name": f"{name}_routes",
                # Envoy applies lds.yaml and cds.yaml in no fixed order: a new route's listener update must not be
                # rejected for a cluster it has not read yet (the update would be lost: the file does not change
                # again). Until the cluster arrives the route answers 503.
                "validate_clusters": False,
                "virtual_hosts": [{"name": "soap", "domains": ["*"], "routes": routes}],
                **_direct_response_limit(published),
            },
            "local_reply_config": _local_reply_config(),
            "access_log": [
                {
                    "name": "envoy.access_loggers.stdout",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                        "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}},
                    },
                }
            ],
            "http_filters": http_filters,
        },
    }


def _direct_response_limit(published: Published) -> dict[str, Any]:
    """Envoy answers at most 4 KB from a route unless told: the largest published document."""
    sizes = [len(d.body) for docs in published.values() for d in docs]
    return {"max_direct_response_body_size_bytes": max(sizes)} if sizes else {}


def _max_body(policies: PolicySet) -> int:
    return max(max(r.limits.max_body_bytes, r.response_limits.max_body_bytes) for r in policies.routes)


def _listeners(policies: PolicySet, topo: Topology) -> list[dict[str, Any]]:
    buffer_limit = CONNECTION_BUFFER_BYTES
    published = _published(policies, topo)
    trusted = tracing.trusted_match(policies.edge.tracing)

    def chains(tls_listener: bool, **chain: Any) -> list[dict[str, Any]]:
        """The listener's filter chain; with trusted tracing callers, first a copy for them that keeps their
        trace headers (Envoy picks the most specific match: theirs, else the default)."""

        def hcm(trust: bool) -> dict[str, Any]:
            return _http_connection_manager(policies, topo, tls_listener, published, trusted_trace=trust)

        default = {"filters": [hcm(False)], **chain}
        return [{"filter_chain_match": trusted, "filters": [hcm(True)], **chain}, default] if trusted else [default]

    plain = {
        "name": "http",
        "address": _address(f"{topo.bind}:{topo.http_port}"),
        "per_connection_buffer_limit_bytes": buffer_limit,
        "filter_chains": chains(tls_listener=False),
    }
    certs = topo.certs_dir
    tls = {
        "name": "https",
        "address": _address(f"{topo.bind}:{topo.https_port}"),
        "per_connection_buffer_limit_bytes": buffer_limit,
        "filter_chains": chains(
            tls_listener=True,
            **{
                "transport_socket": {
                    "name": "envoy.transport_sockets.tls",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                        "common_tls_context": {
                            "alpn_protocols": ["http/1.1"],
                            "tls_certificates": [
                                {
                                    "certificate_chain": {"filename": f"{certs}/gateway-tls.pem"},
                                    "private_key": {"filename": f"{certs}/gateway-tls.key"},
                                }
                            ],
                            # Client certificates are verified when presented; routes that require one say so.
                            "validation_context": {"trusted_ca": {"filename": f"{certs}/ca.pem"}},
                        },
                        "require_client_certificate": False,
                    },
                },
            },
        ),
    }
    outbound_config.check_ports(policies, {(topo.bind, topo.http_port), (topo.bind, topo.https_port)},
                                topo.outbound_bind)  # fmt: skip
    outbound = []
    for address, routes in outbound_config.listeners(policies).items():
        name = "outbound_" + re.sub(r"[^0-9A-Za-z]+", "_", address).strip("_")
        tls_socket = outbound_config.listener_tls(routes[0])
        hcm = _http_connection_manager(policies, topo, tls_socket is not None, published, served=routes, name=name)
        chain: dict[str, Any] = {"filters": [hcm]}
        if tls_socket is not None:
            chain["transport_socket"] = tls_socket
        bound = f"{topo.outbound_bind}:{address.rsplit(':', 1)[1]}" if topo.outbound_bind else address
        outbound.append({"name": name, "address": _address(bound), "per_connection_buffer_limit_bytes": buffer_limit,
                         "filter_chains": [chain]})  # fmt: skip
    return [plain, tls, *outbound]


def _cluster(name: str, endpoints: list[str], dns: bool) -> dict[str, Any]:
    hosts = [e.rsplit(":", 1)[0].strip("[]") for e in endpoints]
    return {
        "name": name,
        "type": "STRICT_DNS" if dns or not all(is_ip(h) for h in hosts) else "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(e)}} for e in endpoints]}],
        },
    }


_HTTP2 = {
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }
}


def _filter_endpoints(topo: Topology) -> dict[str, Any]:
    return {
        "cluster_name": FILTER_CLUSTER,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(e)}} for e in topo.filter_endpoints]}],
    }


def _clusters(policies: PolicySet, topo: Topology) -> list[dict[str, Any]]:
    buffer_limit = _max_body(policies) + 65536
    if topo.filter_dns:
        filt = _cluster(FILTER_CLUSTER, list(topo.filter_endpoints), dns=True)
    else:
        # Locally the workers come from eds.yaml: replacing a worker changes only the endpoints, and Envoy drains
        # the old one's exchanges (a new cluster definition would reset them).
        filt = {
            "name": FILTER_CLUSTER,
            "type": "EDS",
            "connect_timeout": "1s",
            "lb_policy": "LEAST_REQUEST",
            "eds_cluster_config": {"eds_config": _file_source(topo, "eds.yaml")},
        }
    filt["per_connection_buffer_limit_bytes"] = buffer_limit
    # Every request on an XML route holds an ext_proc stream from its headers on: Envoy's default of 1024 would let
    # that many idle clients refuse everyone else (503). The listener's connection limit and timeouts bound them.
    filt["circuit_breakers"] = {"thresholds": [{"max_connections": topo.max_connections,
                                                "max_pending_requests": topo.max_connections,
                                                "max_requests": topo.max_connections}]}  # fmt: skip
    # ext_proc is gRPC: the cluster must speak HTTP/2 or every exchange fails.
    filt["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {
                "initial_stream_window_size": 16 * 1024 * 1024, "initial_connection_window_size": 32 * 1024 * 1024}},
        }
    }  # fmt: skip
    clusters = [filt]
    if policies.edge.tracing:
        clusters.append(_cluster(tracing.CLUSTER, [policies.edge.tracing.collector], dns=topo.filter_dns))
    if rate_limit.enabled(policies):
        rls = _cluster(rate_limit.CLUSTER, [topo.ratelimit], dns=topo.filter_dns)
        rls["typed_extension_protocol_options"] = _HTTP2
        clusters.append(rls)
    for r in policies.routes:
        c = _cluster(f"upstream_{r.name}", [r.upstream.address], dns=False)
        c["per_connection_buffer_limit_bytes"] = (
            STREAMED_UPSTREAM_BUFFER_BYTES if r.streams_bodies else r.response_limits.max_body_bytes + 65536
        )
        if r.upstream.tls:
            validation: dict[str, Any] = (
                {"trusted_ca": {"filename": r.upstream.ca}}
                if r.upstream.ca
                else {"trusted_ca": {"filename": "/etc/ssl/certs/ca-certificates.crt"}}
            )
            c["transport_socket"] = (
                outbound_config.upstream_tls(r, validation)
                if r.is_outbound
                else {
                    "name": "envoy.transport_sockets.tls",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                        "sni": r.upstream.sni or r.upstream.host,
                        "common_tls_context": {"validation_context": validation},
                    },
                }
            )
        clusters.append(c)
    return clusters


def _file_source(topo: Topology, name: str) -> dict[str, Any]:
    cfg = topo.config_dir
    return {
        "path_config_source": {"path": f"{cfg}/{name}", "watched_directory": {"path": cfg}},
        "resource_api_version": "V3",
    }


def bootstrap(topo: Topology) -> dict[str, Any]:
    return {
        "node": {"id": "wsgate", "cluster": "wsgate"},
        "admin": {"address": _address(f"127.0.0.1:{topo.admin_port}" if topo.bind == "127.0.0.1" else f"0.0.0.0:{topo.admin_port}")},
        "dynamic_resources": {"lds_config": _file_source(topo, "lds.yaml"), "cds_config": _file_source(topo, "cds.yaml")},
        "overload_manager": {
            "refresh_interval": "0.25s",
            "resource_monitors": [{
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                    "max_active_downstream_connections": topo.max_connections}},
                {"name": HEAP, "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                    "max_heap_size_bytes": topo.max_heap_mb * 1024 * 1024}}],
            # The filter's body budget bounds what XML routes buffer; this bounds Envoy whatever the traffic:
            # give freed memory back first, then refuse new requests (503, a SOAP fault) until the heap shrinks.
            "actions": [
                {"name": "envoy.overload_actions.shrink_heap", "triggers": [{"name": HEAP, "threshold": {"value": 0.9}}]},
                {"name": "envoy.overload_actions.stop_accepting_requests",
                 "triggers": [{"name": HEAP, "threshold": {"value": 0.95}}]}],
        },
    }  # fmt: skip


def render(policies: PolicySet, topo: Topology) -> dict[str, str]:
    """The files Envoy reads: envoy.yaml (bootstrap), lds.yaml, cds.yaml and, locally, eds.yaml (the workers)."""
    listeners = [{"@type": "type.googleapis.com/envoy.config.listener.v3.Listener", **lis}
                 for lis in _listeners(policies, topo)]  # fmt: skip
    clusters = [
        {"@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster", **c} for c in _clusters(policies, topo)
    ]
    files = {"envoy.yaml": _dump(bootstrap(topo)), "lds.yaml": _resources(listeners), "cds.yaml": _resources(clusters)}
    if not topo.filter_dns:
        files["eds.yaml"] = _resources([{"@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
                                         **_filter_endpoints(topo)}])  # fmt: skip
    return files


def _resources(resources: list[dict[str, Any]]) -> str:
    """A file-based xDS DiscoveryResponse. Its version_info is a digest of the resources: Envoy reports the version
    it applied (<subscription>.version_text), which is how a reload knows a file was taken (gateway/control/envoy_delivery.py)."""
    body = _dump({"resources": resources})
    return _dump({"version_info": hashlib.sha256(body.encode()).hexdigest()[:16]}) + body


def version(text: str) -> str:
    """The version_info of a rendered xDS file."""
    return str(yaml.safe_load(text)["version_info"])


def cluster_union(old: str, new: str) -> str:
    """The clusters of `new` plus those of `old` that `new` drops: what Envoy holds while routes move from the old
    clusters to the new (a route naming a cluster Envoy lacks is refused, and never retried)."""
    kept = yaml.safe_load(new)["resources"]
    names = {c["name"] for c in kept}
    return _resources(kept + [c for c in yaml.safe_load(old)["resources"] if c["name"] not in names])


def _dump(doc: dict[str, Any]) -> str:
    return yaml.safe_dump(doc, sort_keys=False, width=200)


def write(files: dict[str, str], directory: Path) -> None:
    """Write atomically (rename), bootstrap first, so Envoy's directory watch never reads a half file."""
    directory.mkdir(parents=True, exist_ok=True)
    # Endpoints before the clusters that use them, clusters before the listeners that use them.
    for name in (n for n in ("envoy.yaml", "eds.yaml", "cds.yaml", "lds.yaml") if n in files):
        tmp = directory / f".{name}.tmp"
        tmp.write_text(files[name])
        os.replace(tmp, directory / name)
