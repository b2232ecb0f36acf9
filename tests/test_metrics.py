"""Stage timing: exclusive of the stages inside, inherited route, nothing recorded outside a pipeline."""

from __future__ import annotations

import time

from filters import metrics
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
