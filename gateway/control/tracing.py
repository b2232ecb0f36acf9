"""edge.tracing -> Envoy's OpenTelemetry tracer (docs/tracing.md).

Envoy starts a trace for `sampling_percent` of the requests (or continues a trusted caller's), makes the request's
span and the ext_proc stream's, and sends the ext_proc span's context to the filter worker in the stream's gRPC
metadata; the worker's stage spans are its children (filters/tracing.py). A caller's trace headers are taken
only on the listeners' filter chain for `trusted_callers` (matched on the peer address); every other chain drops
them before Envoy reads them, so nobody else can choose a trace id, force sampling or join someone's trace."""

from __future__ import annotations

from typing import Any

from gateway.policy import Tracing

CLUSTER = "wsgate_otlp"
ENVOY_SERVICE = "wsgate-envoy"
# What tracers read from a request: W3C trace context and baggage, B3, Jaeger's, Envoy's forced-trace id.
TRACE_HEADERS = ("traceparent", "tracestate", "baggage", "b3", "x-b3-traceid", "x-b3-spanid", "x-b3-parentspanid",
                 "x-b3-sampled", "x-b3-flags", "uber-trace-id", "x-client-trace-id")  # fmt: skip


def connection_manager(tracing: Tracing) -> dict[str, Any]:
    """The HTTP connection manager's `tracing`."""
    return {
        "random_sampling": {"value": tracing.sampling_percent},
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                "http_service": {
                    "http_uri": {"uri": f"http://{tracing.collector}/v1/traces", "cluster": CLUSTER, "timeout": "1s"}
                },
                "service_name": ENVOY_SERVICE,
            },
        },
    }


def trusted_match(tracing: Tracing | None) -> dict[str, Any] | None:
    """The filter_chain_match of the chain whose callers' trace headers are taken, or None (no such chain)."""
    if tracing is None or not tracing.trusted_callers:
        return None
    ranges = []
    for cidr in tracing.trusted_callers:
        address, length = cidr.rsplit("/", 1)
        ranges.append({"address_prefix": address, "prefix_len": int(length)})
    return {"source_prefix_ranges": ranges}
