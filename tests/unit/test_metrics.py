"""Stage timing: exclusive of the stages inside, inherited route, nothing recorded outside a pipeline."""

from __future__ import annotations

import random
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from filters.engine import faults, metrics
from gateway.policy import Route


def _sums(route: str) -> dict[str, float]:
    return {
        s.labels["stage"]: s.value
        for s in metrics.STAGE.collect()[0].samples
        if s.name.endswith("_sum") and s.labels["route"] == route
    }


def test_nested_stages_are_exclusive_and_inherit_the_route() -> None:
    route = Route.model_validate(
        {"name": "metrics-test", "match": {"path_prefix": "/m/"}, "upstream": {"address": "127.0.0.1:1"},
         "profile": "xml"}
    )  # fmt: skip
    with metrics.stage(route, "security_header"):
        time.sleep(0.02)
        with metrics.stage(None, "signature_check"):
            time.sleep(0.05)
            with metrics.stage(None, "c14n"):
                time.sleep(0.03)
    got = _sums("metrics-test")
    assert 0.02 <= got["security_header"] < 0.045  # its own 20 ms, not its children's 80
    assert 0.05 <= got["signature_check"] < 0.075
    assert 0.03 <= got["c14n"] < 0.055


def test_a_stage_going_on_under_another_name_charges_each_name_its_own_time_and_tells_the_hook() -> None:
    route = Route.model_validate(
        {"name": "metrics-then", "match": {"path_prefix": "/t/"}, "upstream": {"address": "127.0.0.1:1"},
         "profile": "xml"}
    )  # fmt: skip
    seen: list[str] = []

    class Hook:
        def enter(self, name: str) -> None:
            seen.append(f"+{name}")

        def exit(self) -> None:
            seen.append("-")

    metrics.stages.hook = Hook()
    start = time.perf_counter()
    try:
        with metrics.stage(route, "signature_check"), metrics.stage(None, "c14n"):
            time.sleep(0.03)
            metrics.then("digest")
            time.sleep(0.02)
    finally:
        metrics.stages.hook = None
    elapsed = time.perf_counter() - start
    got = _sums("metrics-then")
    # Each name holds its own sleep and nothing is charged twice (no upper bound of its own: a busy machine
    # oversleeps), so c14n cannot hold digest's time.
    assert got["c14n"] >= 0.03 and got["digest"] >= 0.02
    assert got["c14n"] + got["digest"] + got["signature_check"] <= elapsed
    assert got["signature_check"] < got["digest"]
    assert seen == ["+signature_check", "+c14n", "-", "+digest", "-", "-"]  # a span per name, nested as before
    metrics.then("digest")  # outside any stage: nothing to charge, nothing recorded
    assert _sums("metrics-then") == got


def test_inner_stages_outside_a_pipeline_record_nothing() -> None:
    before = metrics.STAGE.collect()[0].samples

    @metrics.timed("digest")
    def work() -> int:
        return 42

    assert work() == 42  # the client and tests call the engine without a pipeline stage around it
    assert metrics.STAGE.collect()[0].samples == before


def test_stage_histogram_exposes_exactly_what_a_prometheus_histogram_would() -> None:
    """The stage histogram keeps its own buckets (no locks per observation): scraped, it must read as
    prometheus_client's Histogram of the same observations, bounds included (a value on a bound is in it)."""
    reference = CollectorRegistry()
    bounds = metrics.STAGE.bounds[:-1]
    hist = Histogram("wsgate_stage_seconds", "Time per processing stage", ["route", "profile", "stage"],
                     buckets=bounds, registry=reference)  # fmt: skip
    values = [*bounds, 0.0, 1e-7, 0.75, 3.0, *(random.uniform(0, 0.6) for _ in range(300))]
    for stage in ("parse", "c14n"):
        for v in values:
            hist.labels("stage-histogram-test", "hmac", stage).observe(v)
            metrics.STAGE.observe(("stage-histogram-test", "hmac", stage), v)

    def exposed(text: bytes) -> list[str]:
        return [line for line in text.decode().splitlines() if "stage-histogram-test" in line or "# " in line]

    mine = [line for line in exposed(generate_latest()) if "wsgate_stage_seconds" in line]
    assert mine == [line for line in exposed(generate_latest(reference)) if "_created" not in line]
    assert any(line.endswith(f" {float(len(values))}") for line in mine)  # the +Inf bucket and the count


@pytest.mark.parametrize(
    "fault",
    [
        faults.client("envelope has 7 Body elements"),
        faults.client("malformed XML: Opening and ending tag mismatch: x123 line 1 and Body, line 1, column 99"),
        faults.client("document element is not a SOAP Envelope: {urn:attacker-chosen}Whatever"),
        faults.server("no XML policy for route 'made-up'"),
        faults.client("method PATCH on an XML route"),
        faults.server("busy: 900 body bytes wanted, 10 of 1000 free", status=503),
        faults.security("FailedCheck", "digest mismatch for #id-attacker"),
    ],
)
def test_fault_labels_come_from_a_fixed_set_whatever_the_reason(fault: faults.Fault) -> None:
    label = faults.metric_reason(fault)
    assert label in faults.LABELS
    assert not any(ch.isdigit() for ch in label) and "attacker" not in label and "made-up" not in label
