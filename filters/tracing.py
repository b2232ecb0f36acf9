"""The filter worker's spans (docs/tracing.md): one per exchange phase, a child of Envoy's ext_proc span, with a
child per engine stage (parse: the threat checks, security_header with decrypt, signature_check, c14n and
digest inside it, secure_conversation, schema, serialize, secure...), exported over OTLP/HTTP to the collector
the policy names (edge.tracing).

The engine knows no tracer: it tells `filters.engine.metrics.stages.hook` of its stages. The frame hands the ext_proc
stream's W3C traceparent (from its gRPC metadata: Envoy's span) to the request phase as the `traceparent` header
only when it is well formed and sampled, so an unsampled exchange costs a worker one dict lookup (Envoy sends its
context for unsampled requests too). Sampling is Envoy's: a phase is traced only when its parent is sampled.
Spans carry the route, the profile, the phase, the stage and the fault's reason code: never a key, a password,
an identity or any of the message."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.policy import Tracing

SERVICE = "wsgate-filter"
TRACE_HEADER = "traceparent"  # filters/frame/src/service.rs sets it from the ext_proc stream's metadata
_propagator = TraceContextTextMapPropagator()


class PhaseSpans:
    """The spans of one exchange phase: `StageHook` for the engine's stages, opened under the phase's span."""

    def __init__(self, tracer: trace.Tracer, phase: Span) -> None:
        self.tracer = tracer
        self.stack = [phase]

    def enter(self, name: str) -> None:
        parent = trace.set_span_in_context(self.stack[-1])
        self.stack.append(self.tracer.start_span(name, context=parent))

    def exit(self) -> None:
        if len(self.stack) > 1:
            self.stack.pop().end()

    def finish(self, fault_reason: str | None) -> None:
        while len(self.stack) > 1:  # a stage a fault left open
            self.stack.pop().end()
        phase = self.stack[0]
        if fault_reason is not None:
            phase.set_attribute("wsgate.fault", fault_reason)
            phase.set_status(Status(StatusCode.ERROR))
        phase.end()


class Tracer:
    """The worker's tracer, or nothing when the policies trace nothing (`start` then returns None)."""

    def __init__(self, policy: Tracing | None) -> None:
        self.policy = policy
        self.provider: TracerProvider | None = None
        if policy is not None:
            self.provider = TracerProvider(
                resource=Resource.create({"service.name": SERVICE}), sampler=ParentBased(root=ALWAYS_OFF)
            )
            exporter = OTLPSpanExporter(endpoint=f"http://{policy.collector}/v1/traces", timeout=2)
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
            self.tracer = self.provider.get_tracer("wsgate.filter")

    def start(self, headers: Mapping[str, str], route: str, profile: str, phase: str) -> PhaseSpans | None:
        """The phase's spans when Envoy traces this exchange (a sampled parent in `headers`), else None."""
        if self.provider is None or TRACE_HEADER not in headers:
            return None
        parent = _propagator.extract({TRACE_HEADER: headers[TRACE_HEADER]})
        if not trace.get_current_span(parent).get_span_context().trace_flags.sampled:
            return None
        attributes = {"wsgate.route": route, "wsgate.profile": profile, "wsgate.phase": phase}
        span = self.tracer.start_span(f"wsgate.{phase}", context=parent, attributes=attributes)
        return PhaseSpans(self.tracer, span)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()  # what is batched goes out
