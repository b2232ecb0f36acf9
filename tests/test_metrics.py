"""Stage timing: exclusive of the stages inside, inherited route, nothing recorded outside a pipeline."""

from __future__ import annotations

import time

import pytest

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


def test_inner_stages_outside_a_pipeline_record_nothing() -> None:
    before = metrics.STAGE.collect()[0].samples

    @metrics.timed("digest")
    def work() -> int:
        return 42

    assert work() == 42  # the client and tests call the engine without a pipeline stage around it
    assert metrics.STAGE.collect()[0].samples == before


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
