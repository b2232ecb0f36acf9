"""The filter worker's spans (docs/tracing.md): one per exchange phase, a child of Envoy's ext_proc span, with a
child per engine stage (parse: the threat checks, security_header with decrypt, signature_check, c14n and
digest inside it, secure_conversation, schema, serialize, secure...), exported over OTLP/HTTP to the collector
the policy names (edge.tracing).

The engine knows no tracer: it tells `filters.engine.metrics.stages.hook` of its stages. The frame hands the ext_proc
stream's W3C traceparent (from its gRPC metadata: Envoy's span) to the request phase as the `traceparent` header
only when it is well formed and sampled, so an unsampled exchange costs a worker one dict lookup (Envoy sends its
context for unsampled requests too). Sampling is Envoy's: a phase is traced only when its parent is sampled.
Spans carry the route, the profile, the phase, the stage and the fault's reason code: never a key, a password,
an identity or any of the message.

A sampled phase costs little: a stage is a list of four items while it runs (no span object, context or
attribute dict); the phase's OTLP spans (opentelemetry-proto's messages) are made once, when it ends, and an
exporter thread posts what gathered in batches (the OpenTelemetry SDK's spans and exporter cost a sampled request
as much again as its own work: docs/tracing.md "What tracing costs")."""

from __future__ import annotations

import http.client
import logging
import random
import threading
import time
from collections.abc import Mapping

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, SpanFlags, Status

from gateway.policy import Tracing

SERVICE = "wsgate-filter"
SCOPE = "wsgate.filter"
TRACE_HEADER = "traceparent"  # filters/frame/src/service.rs sets it from the ext_proc stream's metadata
EXPORT_PATH = "/v1/traces"
BATCH_SPANS = 512  # posted at once when this many gathered, else every EXPORT_DELAY_S (as the SDK's batches)
EXPORT_DELAY_S = 5.0
MAX_QUEUED = 4096  # spans beyond this are dropped (a collector down or slow must not grow the worker)
TIMEOUT_S = 2.0
_INTERNAL = Span.SpanKind.SPAN_KIND_INTERNAL
_ERROR = Status(code=Status.StatusCode.STATUS_CODE_ERROR)
_SAMPLED = 0x01
# The phase's parent is Envoy's span, from another process; its stages' parents are the worker's own.
_REMOTE_PARENT = (
    _SAMPLED | SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK | SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
)
_LOCAL_PARENT = _SAMPLED | SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK

log = logging.getLogger("wsgate.tracing")


def _attribute(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def sampled_parent(value: str) -> tuple[bytes, bytes] | None:
    """(trace id, span id) of a W3C traceparent that is well formed and sampled, else None."""
    parts = value.split("-")
    if len(parts) != 4 or parts[0] != "00" or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = bytes.fromhex(parts[1]), bytes.fromhex(parts[2]), int(parts[3], 16)
    except ValueError:
        return None
    if not flags & _SAMPLED or not any(trace_id) or not any(span_id):
        return None
    return trace_id, span_id


class PhaseSpans:
    """The spans of one exchange phase: `StageHook` for the engine's stages. Each span is [name, parent's index,
    start, end] (nanoseconds since the epoch) until `finish` makes them OTLP spans."""

    __slots__ = ("attributes", "exporter", "open", "parent_id", "records", "trace_id")

    def __init__(
        self, exporter: Exporter, trace_id: bytes, parent_id: bytes, name: str, attributes: list[KeyValue]
    ) -> None:
        self.exporter = exporter
        self.trace_id, self.parent_id, self.attributes = trace_id, parent_id, attributes
        self.records: list[list] = [[name, -1, time.time_ns(), 0]]
        self.open = [0]  # the open spans' indexes, innermost last

    def enter(self, name: str) -> None:
        self.open.append(len(self.records))
        self.records.append([name, self.open[-2], time.time_ns(), 0])

    def exit(self) -> None:
        if len(self.open) > 1:
            self.records[self.open.pop()][3] = time.time_ns()

    def finish(self, fault_reason: str | None) -> None:
        now = time.time_ns()
        for i in self.open:  # the phase, and any stage a fault left open
            self.records[i][3] = now
        ids = random.getrandbits(64 * len(self.records)).to_bytes(8 * len(self.records))  # as the SDK's ids
        spans = []
        for i, (name, parent, start, end) in enumerate(self.records):
            spans.append(Span(trace_id=self.trace_id, span_id=ids[8 * i : 8 * i + 8], name=name, kind=_INTERNAL,
                              parent_span_id=self.parent_id if parent < 0 else ids[8 * parent : 8 * parent + 8],
                              flags=_REMOTE_PARENT if parent < 0 else _LOCAL_PARENT,
                              start_time_unix_nano=start, end_time_unix_nano=end))  # fmt: skip
        phase = spans[0]
        phase.attributes.extend(self.attributes)
        if fault_reason is not None:
            phase.attributes.append(_attribute("wsgate.fault", fault_reason))
            phase.status.CopyFrom(_ERROR)
        self.exporter.add(spans)


class Exporter:
    """Posts the finished spans to the collector's OTLP/HTTP endpoint from a thread of its own, in batches; a
    failed post drops its batch and is logged (tracing never holds up or fails a request)."""

    def __init__(self, collector: str) -> None:
        self.collector = collector
        self.resource = Resource(attributes=[_attribute("service.name", SERVICE)])
        self.scope = InstrumentationScope(name=SCOPE)
        self.queued: list[Span] = []
        self.dropped = 0
        self.lock = threading.Condition()
        self.stopping = False
        self.conn: http.client.HTTPConnection | None = None
        self.thread = threading.Thread(target=self._run, name="wsgate-trace-export", daemon=True)
        self.thread.start()

    def add(self, spans: list[Span]) -> None:
        with self.lock:
            if len(self.queued) + len(spans) > MAX_QUEUED:
                self.dropped += len(spans)
                return
            self.queued.extend(spans)
            if len(self.queued) >= BATCH_SPANS:
                self.lock.notify()

    def _run(self) -> None:
        while True:
            with self.lock:
                if not self.stopping and len(self.queued) < BATCH_SPANS:
                    self.lock.wait(EXPORT_DELAY_S)
                batch, self.queued = self.queued, []
                dropped, self.dropped = self.dropped, 0
                stopping = self.stopping
            if dropped:
                log.warning("tracing: %d spans dropped (the collector %s is slow or down)", dropped, self.collector)
            if batch:
                self._post(batch)
            if stopping:
                return

    def _post(self, batch: list[Span]) -> None:
        request = ExportTraceServiceRequest(resource_spans=[
            ResourceSpans(resource=self.resource, scope_spans=[ScopeSpans(scope=self.scope, spans=batch)])
        ])  # fmt: skip
        body = request.SerializeToString()
        for attempt in (1, 2):  # a kept-alive connection the collector closed is reopened once
            try:
                if self.conn is None:
                    host, _, port = self.collector.rpartition(":")
                    self.conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
                self.conn.request("POST", EXPORT_PATH, body, {"Content-Type": "application/x-protobuf"})
                resp = self.conn.getresponse()
                resp.read()
                if resp.status // 100 != 2:
                    log.warning("tracing: the collector %s answered HTTP %d: %d spans dropped",
                                self.collector, resp.status, len(batch))  # fmt: skip
                return
            except (OSError, http.client.HTTPException) as exc:
                if self.conn is not None:
                    self.conn.close()
                    self.conn = None
                if attempt == 2:
                    log.warning("tracing: export to %s failed (%s): %d spans dropped", self.collector, exc, len(batch))

    def shutdown(self) -> None:
        """Posts what is queued and stops the thread."""
        with self.lock:
            self.stopping = True
            self.lock.notify()
        self.thread.join(TIMEOUT_S * 3)
        if self.conn is not None:
            self.conn.close()


class Tracer:
    """The worker's tracer, or nothing when the policies trace nothing (`start` then returns None)."""

    def __init__(self, policy: Tracing | None) -> None:
        self.policy = policy
        self.exporter = Exporter(policy.collector) if policy is not None else None
        self.attributes: dict[tuple[str, str, str], list[KeyValue]] = {}  # a phase span's, by route, profile, phase

    def start(self, headers: Mapping[str, str], route: str, profile: str, phase: str) -> PhaseSpans | None:
        """The phase's spans when Envoy traces this exchange (a sampled parent in `headers`), else None."""
        if self.exporter is None or TRACE_HEADER not in headers:
            return None
        parent = sampled_parent(headers[TRACE_HEADER])
        if parent is None:
            return None
        attributes = self.attributes.get((route, profile, phase))
        if attributes is None:  # the policies' routes: a few
            attributes = self.attributes[route, profile, phase] = [
                _attribute("wsgate.route", route), _attribute("wsgate.profile", profile),
                _attribute("wsgate.phase", phase)]  # fmt: skip
        return PhaseSpans(self.exporter, *parent, f"wsgate.{phase}", attributes)

    def shutdown(self) -> None:
        if self.exporter is not None:
            self.exporter.shutdown()  # what is batched goes out
