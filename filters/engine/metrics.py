"""Prometheus metrics of a filter worker's engine: requests, fault reasons, replays, optimizations, per-stage
timings. The frame's own counters and the body budget join them on the same endpoint (filters/worker.py)."""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import ParamSpec, Protocol, TypeVar

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from gateway.policy import Route

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M", Counter, Histogram)

REQUESTS = Counter("wsgate_requests", "Exchanges processed by the filter", ["route", "profile", "phase", "outcome"])
FAULTS = Counter("wsgate_faults", "Refusals by precise reason code", ["route", "profile", "reason"])
REPLAYS = Counter("wsgate_replays", "Replayed messages refused", ["route", "profile"])
OPTIMIZATIONS = Counter(
    "wsgate_optimizations",
    "What the signature optimizations did (gateway.policy.Optimizations): hits, misses, fallbacks to xmlsec",
    ["route", "profile", "optimization", "outcome"],
)
CERTIFICATE_NOT_AFTER = Gauge(
    "wsgate_certificate_not_after_seconds",
    "When a route's certificates of a use expire (Unix time; the soonest of that use): signing, decryption, "
    "trust_anchor, intermediate, known_signer (filters/engine/wss/inventory.py)",
    ["route", "use"],
)
# Outbound routes (filters/engine/outbound.py), labelled by route: the policy names the partners.
PARTNER_SECONDS = Histogram(
    "wsgate_outbound_partner_seconds",
    "From the secured request handed to Envoy to the partner's reply reaching the filter (outbound routes)",
    ["route"],
    buckets=(1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
PARTNER_REPLIES = Counter(
    "wsgate_outbound_replies", "Partner replies by outcome: verified (handed on) or refused", ["route", "outcome"]
)
PARTNER_CONTEXT_ISSUES = Counter(
    "wsgate_outbound_context_issues",
    "Security contexts issued by partners' STS (outbound secureconversation)",
    ["route"],
)


class StageHistogram:
    """`wsgate_stage_seconds`, a histogram kept in plain lists by the engine's one thread and read by the scrape
    (prometheus_client's custom collector API). A prometheus_client Histogram takes two locks and a Python bucket
    loop per observation: a dozen observations per hmac exchange cost about 4% of its CPU. One thread writes; the
    scrape copies each series in one slice, so its counts and sum are always of the same observations."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, list(labelnames)
        self.bounds = (*buckets, math.inf)
        self._series: dict[tuple[str, ...], list[float]] = {}  # labels -> count per bucket (not cumulative), sum
        REGISTRY.register(self)

    def observe(self, labels: tuple[str, ...], seconds: float) -> None:
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = [0] * (len(self.bounds) + 1)
        series[bisect.bisect_left(self.bounds, seconds)] += 1  # the first bucket whose bound is >= seconds
        series[-1] += seconds

    def collect(self) -> list[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, series in list(self._series.items()):
            snapshot = series[:]
            cumulative = itertools.accumulate(snapshot[:-1])
            buckets = [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative, strict=True)]
            family.add_metric(list(labels), buckets, snapshot[-1])
        return [family]


STAGE = StageHistogram(
    "wsgate_stage_seconds",
    "Time per processing stage",
    ["route", "profile", "stage"],
    buckets=(5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5),
)


class stage:
    """Times a stage of the filter's work as `wsgate_stage_seconds`, exclusive of the stages inside it: the
    pipeline opens parse, security_header, secure and serialize for its route; the engine's modules open the
    finer ones (decrypt, c14n, digest, signature_check, signature_creation, encryption) inside those, with no
    route (they inherit the enclosing stage's). Outside any pipeline stage (the client, tests) nothing is
    recorded. One clock per call (per engine thread): each entry or exit charges the time since the
    last one to the innermost open stage, and when the pipeline stage closes each stage kind it saw is observed
    once with its sum (six C14N runs in one response: one c14n observation)."""

    __slots__ = ("name", "route")

    def __init__(self, route: Route | None, name: str) -> None:
        self.route = route
        self.name = name

    def __enter__(self) -> None:
        _enter(self.name, self.route, stages.call)

    def __exit__(self, *exc: object) -> None:
        _exit(stages.call)


class StageHook(Protocol):
    """Told of every stage as it opens and closes, innermost last: the worker's spans (filters/tracing.py). The
    engine imports no tracer; without a hook a stage costs what it did."""

    def enter(self, name: str) -> None: ...

    def exit(self) -> None: ...


class _Call:
    """One call's open stages (`_Stages.call`): plain slots, read without the thread-local lookup that each attribute
    of a `threading.local` costs (~750 instructions; an entry and exit read ~17 of them)."""

    __slots__ = ("clock", "hook", "open", "route", "spent")

    def __init__(self) -> None:
        self.hook: StageHook | None = None  # set by the worker per exchange phase, None otherwise
        self.open: list[str] = []  # the open stages' names, innermost last
        self.spent: dict[str, float] = {}  # seconds per stage name since the pipeline stage opened
        self.clock = 0.0  # the last entry or exit
        self.route: Route | None = None  # the pipeline stage's route


class _Stages(threading.local):
    """A call's open stages: per thread, as a call runs on one engine thread from start to end and another may
    run while it waits on the network (filters/engine/turn.py)."""

    def __init__(self) -> None:
        self.call = _Call()

    @property
    def hook(self) -> StageHook | None:
        return self.call.hook

    @hook.setter
    def hook(self, hook: StageHook | None) -> None:
        self.call.hook = hook


stages = _Stages()


def _enter(name: str, route: Route | None, st: _Call) -> None:
    now = time.perf_counter()
    if st.open:
        top = st.open[-1]
        st.spent[top] = st.spent.get(top, 0.0) + now - st.clock
    else:
        st.route = route
        st.spent.clear()
    st.open.append(name)
    st.clock = now
    if st.hook is not None:
        st.hook.enter(name)


def _exit(st: _Call) -> None:
    now = time.perf_counter()
    name = st.open.pop()
    st.spent[name] = st.spent.get(name, 0.0) + now - st.clock
    st.clock = now
    if st.hook is not None:
        st.hook.exit()
    route = st.route
    if not st.open and route is not None:
        for kind, spent in st.spent.items():
            STAGE.observe((route.name, route.profile, kind), spent)


def then(name: str) -> None:
    """The innermost open stage goes on as `name`: what it did so far stays charged to its own name. One tick where
    an inner stage would take an entry and an exit (c14n.digest: its C14N, then its hash)."""
    st = stages.call
    if not st.open:  # outside any pipeline stage: nothing to record
        return
    now = time.perf_counter()
    top = st.open[-1]
    st.spent[top] = st.spent.get(top, 0.0) + now - st.clock
    st.open[-1] = name
    st.clock = now
    if st.hook is not None:
        st.hook.exit()
        st.hook.enter(name)


@functools.cache
def series(metric: M, *labels: str) -> M:
    """One labelled child of `metric`, looked up once: prometheus_client's labels() costs more than an observe,
    and the label values (routes, profiles, stages, outcomes) are few."""
    return metric.labels(*labels)


def timed(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A function of the engine timed as the (inner) stage `name`."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def timed_fn(*args: P.args, **kwargs: P.kwargs) -> R:
            st = stages.call
            if not st.open:  # outside any pipeline stage (the client, tests): nothing to record
                return fn(*args, **kwargs)
            _enter(name, None, st)
            try:
                return fn(*args, **kwargs)
            finally:
                _exit(st)

        return timed_fn

    return wrap
