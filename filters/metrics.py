"""Prometheus metrics of a filter worker's engine: requests, fault reasons, replays, optimizations, per-stage
timings. The frame's own counters and the body budget join them on the same endpoint (filters/server.py)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from prometheus_client import Counter, Histogram

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
STAGE = Histogram(
    "wsgate_stage_seconds",
    "Time per processing stage",
    ["route", "profile", "stage"],
    buckets=(5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5),
)


class stage:
    """Times a stage of the filter's work as `wsgate_stage_seconds`, exclusive of the stages inside it: the
    pipeline opens parse, security_header, secure and serialize for its route; the engine's modules open the
    finer ones (decrypt, c14n, digest, signature_check, signature_creation, encryption) inside those, with no
    route (they inherit the enclosing stage's). A finer stage's time is summed per pipeline stage and observed
    once when that closes (six C14N runs in one response: one c14n observation), so an observation costs per
    stage kind, not per call. Outside any pipeline stage (the client, tests) nothing is recorded. One stack per
    worker: the engine is synchronous."""

    __slots__ = ("children", "inner", "name", "route", "start")
    _open: list[stage] = []

    def __init__(self, route: Route | None, name: str) -> None:
        self.route = route
        self.name = name

    def __enter__(self) -> None:
        self.children = 0.0
        self.inner: dict[str, float] = {}
        self._open.append(self)
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self.start
        own = elapsed - self.children
        opened = self._open
        opened.pop()
        if opened:
            opened[-1].children += elapsed
            outer = opened[0].inner
            outer[self.name] = outer.get(self.name, 0.0) + own
            return
        route = self.route
        if route is not None:
            series(STAGE, route.name, route.profile, self.name).observe(own)
            for name, spent in self.inner.items():
                series(STAGE, route.name, route.profile, name).observe(spent)


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
            if not stage._open:  # outside any pipeline stage (the client, tests): nothing to record
                return fn(*args, **kwargs)
            with stage(None, name):
                return fn(*args, **kwargs)

        return timed_fn

    return wrap
