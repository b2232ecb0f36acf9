"""Prometheus metrics of a filter worker: requests, fault reasons, replays, optimizations, per-stage timings,
body bytes in flight."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Counter, Gauge, Histogram

from gateway.policy import Route

REQUESTS = Counter("wsgate_requests", "Exchanges processed by the filter", ["route", "profile", "phase", "outcome"])
FAULTS = Counter("wsgate_faults", "Refusals by precise reason code", ["route", "profile", "reason"])
REPLAYS = Counter("wsgate_replays", "Replayed messages refused", ["route", "profile"])
BODY_BYTES = Gauge("wsgate_body_bytes_in_flight", "Body bytes reserved by the exchanges in flight (filters/budget.py)")
BODY_BUDGET = Gauge("wsgate_body_budget_bytes", "The worker's budget of body bytes in flight")
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


@contextmanager
def stage(route: Route, name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        STAGE.labels(route.name, route.profile, name).observe(time.perf_counter() - start)
