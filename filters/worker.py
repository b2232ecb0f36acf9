"""A filter worker: the compiled ext_proc frame serves Envoy, the engine does the XML work; this is the glue.

The frame (filters/frame, the `wsgate_frame` module: Rust, tonic, tokio) answers the header phases itself from the
route table given here at start and on reload: 405 for other methods, 411 without a body, 413 (502 for a backend
response) for a declared length over the route's limit, the removal of the headers the gateway vouches for, and
the body budget (503, busy). Each body phase is one call, `Worker.handle`: bytes and headers in, an `Answer` out
(pass on or reply; the new body and headers; a `ReplayCheck`): a route whose replay store is Redis has the frame
set those keys (SET NX, one pipelined round trip, off this thread) before it answers; `replay_refused` gives the
fault for the `ReplayOutcome` when that refused. The engine knows nothing of gRPC; this module knows nothing of
XML. One process per core (`wsgate up` starts them); Envoy balances over them.

The contract's classes are the frame's own (filters/frame/src, typed in filters/frame/wsgate_frame.pyi, which
`make lint` checks this module and the compiled frame against). Their words, one meaning each:
- exchange: one HTTP request with its response. The frame takes it through its phases on one ext_proc `Stream`
  (service.rs); the engine's record of it is `filters.engine.pipeline.Exchange` (route, SOAP version, security context).
- in flight: an exchange between its request body and its response body; `InFlight` is what this module keeps
  of it then (the engine's `Exchange`, the pipeline, the replay keys' faults), held by the frame, opaque to it.
- verified: `wssecurity.Verified` is what a request's security header proved; its parts are a
  `signature.VerifiedSignature` and a `username_token.VerifiedUsernameToken`.
- pending: only the client's (gateway/tools/client.py `Pending`: a secured request awaiting its reply)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import wsgate_frame
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily
from wsgate_frame import Answer, Body, RenderedFault, ReplayCheck, ReplayOutcome, Route, Table

from filters.engine import faults, metrics, turn
from filters.engine.engine import Engine, Exchange, RoutePipeline, fault_soap_version
from filters.engine.mime.package import Segments, is_multipart
from filters.engine.profiles import SecuredPipeline
from filters.engine.wss.replay import DeferredKey, before_epoch
from filters.engine.xml.xmlsupport import check_libxml2
from filters.stores.archive.writer import Archives
from filters.stores.factory import RouteStores
from filters.stores.replay import EPOCH_KEY, DeferredRedisReplay
from filters.tracing import Tracer
from gateway.policy import (
    DEFAULT_BODY_BUDGET_MB,
    GRACE_SECONDS,
    MAX_BODY_BYTES,
    PolicyError,
    check_body_budget,
    load_dir,
)
from gateway.policy import Route as RoutePolicy
from gateway.policy import Tracing as TracingPolicy

log = logging.getLogger("wsgate.filter")

# The largest body any policy may allow, not the current policies' largest: a worker's gRPC limits are fixed when
# it starts, and a reload that raises a route's limit must not fail its larger messages until a restart.
# The body budget and Envoy's per-route buffers bound what actually arrives.
MAX_MESSAGE_BYTES = MAX_BODY_BYTES + 64 * 1024

# What the frame refuses by itself (a fixed set: filters/frame/src/table.rs), as the client sees it. The frame
# reports the precise reason, which replaces these for the log and the metrics.
REFUSALS: dict[str, faults.Fault] = {
    "method": faults.client("method not POST", "Only SOAP POST requests are accepted", status=405),
    "no_body": faults.client("request without a body", "A SOAP request needs a body", status=411),
    "too_large": faults.client("body too large", status=413),
    "bad_length": faults.client("content-length not a number"),
    "response_too_large": faults.server("backend response refused: body too large", status=502),
    "busy": faults.server("busy", message="Service unavailable", status=503),
    "no_route": faults.server("no XML policy for route"),
    "internal": faults.server("internal error"),
    # A streamed route's body ends at its last chunk: a message that goes on with trailers is not SOAP's.
    "trailers": faults.client("request with trailers"),
}


def _rendered(fault: faults.Fault) -> RenderedFault:
    return RenderedFault(
        fault.http_status, *((faults.content_type(v), faults.render(fault, v)) for v in ("1.1", "1.2"))
    )


FAULT_TABLE = {kind: _rendered(fault) for kind, fault in REFUSALS.items()}


@dataclass(slots=True)
class InFlight:
    """One exchange between its request body and its response body (the frame keeps it in between)."""

    headers: dict[str, str]
    pipeline: RoutePipeline | None = None  # in-flight exchanges keep the pipeline they started with
    exchange: Exchange | None = None
    label: tuple[str, str] = ("?", "?")
    replay: list[DeferredKey] = field(default_factory=list)  # the keys the frame sets, with their refusals


class _Refused(Exception):
    """A phase's refusal on its way out of `_handle`: the answer, and its bounded reason code for the span."""

    def __init__(self, reason: str, answer: Answer) -> None:
        self.reason, self.answer = reason, answer


class Worker:
    """What the frame calls back: `handle` per body phase, `refused` per refusal of its own, `replay_refused` when
    its replay check refuses, `reload` on SIGHUP, `ready` once it listens. `handle` comes from the frame's gRPC
    thread or, for a call that may wait on the network, its engine threads; the others from its gRPC thread; each
    but `refused` and `ready` (a log line, counters, a file) holds the engine's turn: one at a time, as the engine
    is written (filters/engine/turn.py)."""

    def __init__(self, policies_dir: Path, budget_bytes: int, ready_file: Path | None = None) -> None:
        self.policies_dir = policies_dir
        self.budget_bytes = budget_bytes
        self.ready_file = ready_file
        self.archives = Archives()
        self.engine, tracing = self._load()
        self.tracer = Tracer(tracing)
        self.routes = set(self.engine.pipelines)  # the policies' own routes (without those kept from before)
        self.reloads = 0

    def _load(self) -> tuple[Engine, TracingPolicy | None]:
        policies = check_body_budget(load_dir(self.policies_dir), self.budget_bytes)
        engine = Engine(policies, RouteStores(defer_replay=True))
        self.archives.configure(policies.routes)
        return engine, policies.edge.tracing

    def table(self) -> Table:
        routes = {
            name: Route(
                max_request_bytes=p.route.limits.max_body_bytes,
                max_response_bytes=p.route.response_limits.max_body_bytes,
                identity_header=p.route.identity_header,
                waits_on_network=waits_on_network(p.route),
                streamed=p.route.streams_bodies,  # as gateway/control/envoy_config.py sets Envoy's body modes
            )
            for name, p in self.engine.pipelines.items()
        }
        return Table(routes, FAULT_TABLE)

    def ready(self) -> None:
        """Called once the worker listens, and after each reload once its table is installed: the ready file says
        how many reloads are behind it (the supervisor waits for a reload before Envoy routes to new routes)."""
        if not self.reloads:
            log.info("filter worker ready (compiled ext_proc frame)")
        if self.ready_file is not None:
            tmp = self.ready_file.with_name(self.ready_file.name + ".tmp")
            tmp.write_text(f"{os.getpid()} {self.reloads}")
            os.replace(tmp, self.ready_file)

    def reload(self) -> Table | None:
        with turn.held():
            return self._reload()

    def _reload(self) -> Table | None:
        self.reloads += 1
        try:
            engine, tracing = self._load()
        except (PolicyError, OSError, faults.Fault) as exc:
            log.error("policy reload refused, keeping the running policies: %s", exc)
            return None
        # A route this reload drops stays until the next one: the workers reload before Envoy, whose draining
        # listeners may still send it requests for a few seconds (gateway/control/envoy_delivery.py). Envoy alone names
        # the route of an exchange, and no longer names this one once it has drained.
        routes = set(engine.pipelines)
        for name in self.routes - routes:
            engine.pipelines[name] = self.engine.pipelines[name]
        self.engine, self.routes = engine, routes
        if tracing != self.tracer.policy:
            self.tracer.shutdown()
            self.tracer = Tracer(tracing)
        log.info("policies reloaded from %s", self.policies_dir)
        return self.table()

    def _label(self, route_name: str) -> tuple[str, str]:
        pipeline = self.engine.pipelines.get(route_name)
        return (pipeline.route.name, pipeline.route.profile) if pipeline else ("?", "?")

    def refused(self, route_name: str, phase: str, kind: str, reason: str) -> None:
        self._count(replace(REFUSALS[kind], reason=reason), self._label(route_name), phase, route_name)

    def _count(self, fault: faults.Fault, label: tuple[str, str], phase: str, route_name: str) -> None:
        reason = faults.metric_reason(fault)
        metrics.series(metrics.REQUESTS, *label, phase, "fault").inc()
        metrics.series(metrics.FAULTS, *label, reason).inc()
        if fault.reason.startswith("replay"):
            metrics.series(metrics.REPLAYS, *label).inc()
        log.warning("refused route=%s phase=%s code=%s reason=%s", route_name, phase, reason, fault.reason)

    def handle(
        self,
        route_name: str,
        phase: str,
        body: Body | bytes,
        headers: dict[str, str],
        in_flight: InFlight | None,
        may_wait: bool = True,
    ) -> Answer:
        """The one call from the frame into the engine, with the phase's headers (the request's, or the
        response's). Never raises: a fault is an answer, and so is a bug (a generic fault: fail closed, the
        traceback only in the log). On the frame's gRPC thread (`may_wait` False) a call about to wait on the
        network answers `elsewhere` instead, before the wait, and the frame makes it again on an engine thread
        (filters/engine/turn.py); nothing of the first run is kept (a request's in-flight record is made anew)."""
        with turn.held(may_wait):
            try:
                return self._phase(route_name, phase, body, headers, in_flight)
            except turn.WouldWait:
                return Answer.elsewhere(in_flight)

    def _phase(
        self, route_name: str, phase: str, body: Body | bytes, headers: dict[str, str], in_flight: InFlight | None
    ) -> Answer:
        p = in_flight or InFlight(headers)
        if phase == "response" and in_flight is None:
            # No request of this exchange went through a worker: the reply is Envoy's own, made before ext_proc
            # (a client-address quota's 429, already a SOAP fault), not a backend's. Envoy passes local replies
            # through every filter's response side, this one's too.
            return Answer.forward(None, [], p, None)
        label = self._label(route_name) if p.pipeline is None else p.label
        spans = metrics.stages.hook = self.tracer.start(p.headers, *label, phase)
        fault_reason: str | None = None
        try:
            return self._handle(route_name, phase, body, headers, p)
        except _Refused as refused:
            fault_reason = refused.reason
            return refused.answer
        finally:
            metrics.stages.hook = None
            if spans is not None:
                spans.finish(fault_reason)

    def _handle(
        self, route_name: str, phase: str, received: Body | bytes, headers: dict[str, str], p: InFlight
    ) -> Answer:
        archive = self.archives.get(route_name)
        body: bytes | memoryview = b""
        try:
            if p.pipeline is None:
                p.pipeline = self.engine.pipeline(route_name)
                p.exchange = Exchange(route=p.pipeline.route)
                p.label = (p.pipeline.route.name, p.pipeline.route.profile)
            assert p.exchange is not None
            # A package a route takes is read where the frame holds it (its attachments never copied:
            # docs/attachments.md); any other body as bytes, as lxml parses them.
            multipart = p.pipeline.route.attachments.accept and is_multipart(headers.get("content-type"))
            body = memoryview(received) if multipart else bytes(received)
            if phase == "request":
                if archive is not None:
                    archive.admit()
                out = p.pipeline.request(body, p.headers, p.exchange)
                if archive is not None and out.verified is not None and archive.keeps("signed_requests"):
                    archive.keep("request", "accepted", bytes(body), p.headers, out)
            else:
                p.exchange.response_type = headers.get("content-type")
                out = p.pipeline.response(body, p.exchange)
                if archive is not None and out.body is not None and archive.keeps("signed_replies"):
                    if isinstance(p.pipeline, SecuredPipeline):
                        archive.keep("reply", "signed", _joined(out.body), p.headers, out)
            check = None
            if out.replay:
                p.replay = out.replay
                keys = [(k.name, k.px) for k in out.replay]
                check = ReplayCheck(_replay_url(p.pipeline), keys, EPOCH_KEY, out.replay_since_ms)
            metrics.series(metrics.REQUESTS, *p.label, phase, "ok").inc()
        except faults.Fault as fault:
            self._count(fault, p.label, phase, route_name)
            if archive is not None and archive.keeps("refusals") and not fault.reason.startswith("archive "):
                archive.keep("refusal", "refused", bytes(received), p.headers, reason=fault.reason)
            raise _Refused(faults.metric_reason(fault), self._fault(fault, p)) from None
        except Exception:
            log.exception("internal error on route %s", route_name)
            metrics.series(metrics.REQUESTS, *p.label, phase, "error").inc()
            raise _Refused("internal", self._fault(REFUSALS["internal"], p)) from None
        if out.answer:
            assert out.body is not None
            content_type = faults.content_type(fault_soap_version(p.exchange, {}))
            return Answer.reply(200, out.body, [("content-type", content_type)], p, check)
        return Answer.forward(out.body, list(out.set_headers.items()), p, check)

    def replay_refused(self, route_name: str, in_flight: InFlight, outcome: ReplayOutcome) -> Answer:
        """The frame found one of `in_flight.replay` already set (a replay), the message not newer than the store's
        epoch, or could not ask Redis (fail closed): the refusal, counted and logged as the engine's own."""
        with turn.held():
            return self._replay_refused(route_name, in_flight, outcome)

    def _replay_refused(self, route_name: str, in_flight: InFlight, outcome: ReplayOutcome) -> Answer:
        match outcome:
            case ReplayOutcome.Replayed(index=index) if 0 <= index < len(in_flight.replay):
                fault = in_flight.replay[index].fault
            case ReplayOutcome.BeforeEpoch(epoch_ms=epoch_ms, since_ms=since_ms):
                fault = before_epoch(since_ms, epoch_ms)
            case ReplayOutcome.Unavailable(reason=reason):
                fault = faults.server(f"replay store unavailable: {reason}")
            case _:  # no key of this message, or no refusal at all: a bug, and still a refusal
                fault = faults.server(f"replay check: unexpected outcome {outcome!r}")
        in_flight.replay = []
        self._count(fault, in_flight.label, "request", route_name)
        archive = self.archives.get(route_name)
        if archive is not None and archive.keeps("refusals"):  # the body went with the accepted record: this names it
            archive.keep("refusal", "refused", b"", in_flight.headers, reason=fault.reason)
        return self._fault(fault, in_flight)

    @staticmethod
    def _fault(fault: faults.Fault, p: InFlight) -> Answer:
        version = fault_soap_version(p.exchange, p.headers)
        headers = [("content-type", faults.content_type(version))]
        return Answer.reply(fault.http_status, faults.render(fault, version), headers, p)


def waits_on_network(route: RoutePolicy) -> bool:
    """Whether the engine's calls on this route may wait on the network after a step a second run could not redo:
    an OCSP lookup comes in the middle of a Security header, after its replay keys may have been claimed (a CBC
    EncryptedKey, a nonce in a memory store). The frame makes these calls on its engine threads at once. Every
    other call is made on its gRPC thread, and moved only if it is about to wait (an outbound secureconversation
    route's Issue, before anything of the message is claimed: filters/engine/turn.py)."""
    return route.rsa.revocation.mode in ("ocsp", "both")


def _joined(body: bytes | Segments) -> bytes:
    return body if isinstance(body, bytes) else b"".join(body)


def _replay_url(pipeline: RoutePipeline) -> str:
    """Only a deferred store's keys come out of the engine: any other pipeline here is a bug (an internal fault)."""
    assert isinstance(pipeline, SecuredPipeline) and isinstance(pipeline.credentials.replay, DeferredRedisReplay)
    return pipeline.credentials.replay.url


class FrameCollector:
    """The frame's own counters and the body budget, on the worker's /metrics beside the engine's metrics."""

    def collect(self):  # type: ignore[no-untyped-def]
        c = wsgate_frame.counters()
        yield GaugeMetricFamily("wsgate_body_bytes_in_flight", "Body bytes reserved by the exchanges in flight",
                                value=c["body_bytes_in_flight"])  # fmt: skip
        yield GaugeMetricFamily("wsgate_body_budget_bytes", "The worker's budget of body bytes in flight",
                                value=c["body_budget_bytes"])  # fmt: skip
        yield CounterMetricFamily(
            "wsgate_frame_streams", "ext_proc streams (HTTP exchanges) opened", value=c["streams"]
        )
        yield GaugeMetricFamily("wsgate_frame_streams_active", "ext_proc streams open now", value=c["streams_active"])
        phases = CounterMetricFamily(
            "wsgate_frame_phases",
            "ext_proc phases by outcome: passed or refused by the frame, handed to the engine, or the call failed",
            labels=["phase", "outcome"],
        )
        for phase, outcome, n in c["phases"]:
            phases.add_metric([phase, outcome], n)
        yield phases
        refusals = CounterMetricFamily("wsgate_frame_refusals", "Exchanges the frame refused itself", labels=["reason"])
        for reason, n in c["refusals"]:
            refusals.add_metric([reason], n)
        yield refusals
        checks = CounterMetricFamily(
            "wsgate_frame_replay_checks",
            "Replay checks the frame made for the engine (Redis stores): every key new, one seen before, no answer",
            labels=["outcome"],
        )
        for outcome, n in c["replay_checks"]:
            checks.add_metric([outcome], n)
        yield checks


def serve(
    policies_dir: Path, listen: str, metrics_port: int | None, ready_file: Path | None = None,
    body_budget_bytes: int = DEFAULT_BODY_BUDGET_MB * 1024 * 1024,
) -> None:  # fmt: skip
    worker = Worker(policies_dir, body_budget_bytes, ready_file)
    if metrics_port:
        from prometheus_client import start_http_server

        REGISTRY.register(FrameCollector())
        start_http_server(metrics_port, addr="127.0.0.1" if listen.startswith("127.") else "0.0.0.0")
    log.info("filter worker listening on %s", listen)
    try:
        wsgate_frame.serve(worker, listen, worker.table(), body_budget_bytes, MAX_MESSAGE_BYTES, GRACE_SECONDS)
    except OSError as exc:
        raise SystemExit(str(exc)) from None
    finally:
        worker.archives.close(GRACE_SECONDS)  # what is queued is written before the worker goes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="wsgate filter", description="Run one ext_proc filter worker.")
    parser.add_argument("--policies", type=Path, default=Path("policies"))
    parser.add_argument("--listen", default="127.0.0.1:9100")
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--ready-file", type=Path, help="written once the worker accepts exchanges")
    parser.add_argument("--body-budget-mb", type=int, default=DEFAULT_BODY_BUDGET_MB,
                        help="body bytes in flight this worker admits; beyond: 503 (filters/frame)")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    check_libxml2()
    serve(args.policies, args.listen, args.metrics_port, args.ready_file, args.body_budget_mb * 1024 * 1024)


if __name__ == "__main__":
    main()
