"""The soak's short variant (loadtest/soak.py): load across every profile while a filter worker is killed, Redis is
killed (the supervisor restarts both) and accepted messages are sent again. Nothing may be lost outside the
documented refusals, nothing corrupted, no replay let through: across the Redis kill too (the replay epoch). And the
keys rotated under that load: nothing refused at all.
Counts only, never timings: the machine is shared."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.control.tracing import ENVOY_SERVICE
from loadtest import soak
from loadtest.faults import ARCHIVE_DB_RESTART
from tests.support.collector import Collector, jaeger
from tests.support.postgres import remove, start_postgres

pytestmark = pytest.mark.slow  # 20 s of load


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collector]:
    with jaeger(tmp_path_factory.mktemp("jaeger")) as c:
        yield c


def test_under_load_a_worker_kill_and_a_redis_kill_lose_nothing_and_reopen_no_replay(
    tmp_path: Path, pki: Path, collector: Collector
) -> None:
    """As production runs (#27): every route's quotas on (counted by the rate-limit service in the Redis that is
    killed, never reached by the load: a 429 would count as lost) and tracing to a real collector. The hostile
    burst floods a route with a per-second quota from one address: refused (429, SOAP fault, Retry-After) beyond
    the limit, never more admitted than the limit per second."""
    log = io.StringIO()
    result = soak.run_soak(duration=20, share=0.5, seed=14, kinds=["worker_kill", "redis_kill", "hostile"],
                           threads=4, probe_s=2, out=tmp_path, certs=pki, log=log, chart=False, quotas=True,
                           tracing=collector.otlp, sampling_percent=10)  # fmt: skip
    t = result.totals
    assert t["ok"] > 0 and t["replays sent"] > 0, log.getvalue()
    assert (t["lost"], t["corrupted"], t["replays accepted"], t["hostile accepted"]) == (0, 0, 0, 0), log.getvalue()
    assert t["flood sent"] == soak.FLOOD_REQUESTS and t["flood refused"] > 0, log.getvalue()
    assert t["flood over limit"] == 0 and t["flood admitted"] > 0, log.getvalue()
    assert collector.wait_for(ENVOY_SERVICE, 1) and collector.wait_for("wsgate-filter", 1)
    kinds = [kind for _, kind in result.schedule]
    assert sorted(kinds) == ["hostile", "redis_kill", "worker_kill"]
    assert (tmp_path / "soak.csv").read_text().startswith("second,sent,ok,")


def test_keys_rotated_under_load_refuse_nothing_that_should_pass(tmp_path: Path, pki: Path) -> None:
    """docs/keys.md "Rotation" done twice while every profile's traffic runs (loadtest/faults.py `rotation`: the
    next signing certificate published, the new decryption key beside the old, then signing switched and a new
    master key; there and back), beside the soak's plain policy reload: not one request refused, lost or
    corrupted, every reply verified by the client."""
    log = io.StringIO()
    result = soak.run_soak(duration=20, share=0.5, seed=23, kinds=["rotation", "rotation", "reload"], threads=4,
                           probe_s=2, out=tmp_path, certs=pki, log=log, chart=False)  # fmt: skip
    t = result.totals
    assert t["ok"] > 0, log.getvalue()
    assert (t["refused"], t["lost"], t["corrupted"]) == (0, 0, 0), log.getvalue()
    events = [what for _, what in result.tally.events]
    assert any("to the rotated keys" in e for e in events) and any("to the PKI keys" in e for e in events), events


def test_under_load_and_worker_kills_no_accepted_request_is_missing_from_the_archive(tmp_path: Path, pki: Path) -> None:
    log = io.StringIO()
    result = soak.run_soak(duration=15, share=0.5, seed=7, kinds=["worker_kill", "worker_kill"], threads=4,
                           probe_s=2, out=tmp_path, certs=pki, log=log, chart=False, archive=True)  # fmt: skip
    t = result.totals
    assert t["ok"] > 0 and (t["lost"], t["corrupted"]) == (0, 0), log.getvalue()
    assert t["archived"] > 0 and t["archive missing"] == 0, log.getvalue()
    assert "accepted and not archived: 0" in log.getvalue()


def test_under_load_a_worker_kill_and_an_archive_database_restart_lose_no_archived_request(
    tmp_path: Path, pki: Path
) -> None:
    db = start_postgres()
    try:
        log = io.StringIO()
        result = soak.run_soak(duration=20, share=0.5, seed=11, kinds=["worker_kill", ARCHIVE_DB_RESTART], threads=4,
                               probe_s=2, out=tmp_path, certs=pki, log=log, chart=False, archive=True,
                               archive_db=db)  # fmt: skip
    finally:
        remove(db)
    t = result.totals
    assert sorted(kind for _, kind in result.schedule) == [ARCHIVE_DB_RESTART, "worker_kill"]
    assert t["ok"] > 0 and (t["lost"], t["corrupted"]) == (0, 0), log.getvalue()
    assert t["archived"] > 0 and t["archive missing"] == 0, log.getvalue()
