"""Sealed contexts' cancellations in a real Redis, read through a tracked connection (filters/stores/tracked.py):
a known context's check makes no round trip, yet a cancellation through another replica, a flush, a restart or
the epoch's expiry is refused from the next message on (as soon as Redis's push arrives), memory stays bounded
under many contexts, and a Redis that cannot answer still refuses."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis

from filters.engine import faults
from filters.engine.wss.secure_conversation import WSC_1_3
from filters.stores import contexts as context_store
from filters.stores import replay
from tests.support.harness import redis_again, start_redis, stop
from tests.unit.test_secure_conversation import write_master_keys

V = WSC_1_3
SECRET = b"s" * 32
LIFETIME = 3600
# A push travels from Redis to the reader as the writer's reply travels to the writer: on a loaded machine the
# reader may take it in a moment after the writer returns. Far less than TRACKED_MAX_AGE_S (1 s).
PUSH_S = 0.3


def _now() -> datetime:
    return datetime.now(UTC)


def _store(keys: Path, url: str, max_keys: int = 1025) -> context_store.SealedContextStore:
    revocations = context_store.RedisRevocations(url, max_keys=max_keys)
    return context_store.SealedContextStore(context_store.load_master_keys(keys), LIFETIME, revocations)


def _refused(store: context_store.SealedContextStore, identifier: str) -> bool:
    """Whether `store` refuses the context within PUSH_S."""
    deadline = time.monotonic() + PUSH_S
    while True:
        try:
            store.lookup(identifier, V, _now())
        except faults.Fault as fault:
            assert fault.code == "BadContextToken", fault.reason
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _mgets(url: str) -> int:
    stats = redis.Redis.from_url(url).info("commandstats")
    return int(stats.get("cmdstat_mget", {}).get("calls", 0))


@pytest.fixture
def master_keys(tmp_path: Path) -> Path:
    return write_master_keys(tmp_path / "master-keys.yaml", "k1")


@pytest.fixture
def url(redis_server: str) -> str:
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    replay.set_epoch(client, int((_now() - timedelta(seconds=60)).timestamp() * 1000))
    return redis_server


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[tuple[list[subprocess.Popen[bytes]], str]]:
    """A Redis of this test's own, to stop and start again: ([its process], url)."""
    (tmp_path / "one").mkdir()
    proc, url = start_redis(tmp_path / "one")
    procs = [proc]
    yield procs, url
    for p in procs:
        stop(p)


def test_cancelled_context_through_another_replica_is_refused_at_once(master_keys: Path, url: str) -> None:
    a, b = _store(master_keys, url), _store(master_keys, url)  # two replicas' workers
    ctx = a.issue(SECRET, "CN=client", V, _now())
    assert b.lookup(ctx.identifier, V, _now()) == ctx  # b keeps the epoch and "not cancelled"
    a.cancel(ctx.identifier, V, _now())
    assert _refused(a, ctx.identifier)  # the canceller's own worker: at once, whatever the push does
    assert _refused(b, ctx.identifier)


def test_known_context_check_makes_no_round_trip_until_something_changes(master_keys: Path, url: str) -> None:
    a, b = _store(master_keys, url), _store(master_keys, url)
    ctx, other = (a.issue(SECRET, "CN=client", V, _now()) for _ in range(2))
    assert b.lookup(ctx.identifier, V, _now()) == ctx
    before = _mgets(url)
    assert all(b.lookup(ctx.identifier, V, _now()) == ctx for _ in range(50))
    assert _mgets(url) == before  # kept: no MGET while nothing changed
    a.cancel(other.identifier, V, _now())  # another context's cancellation: pushed, ctx read again at most once
    time.sleep(PUSH_S)
    assert all(b.lookup(ctx.identifier, V, _now()) == ctx for _ in range(10))
    assert _mgets(url) <= before + 1


def test_contexts_before_a_flush_are_refused(master_keys: Path, url: str) -> None:
    """A flush forgets every cancellation: the epoch starts again and no context issued before it opens."""
    store = _store(master_keys, url)
    ctx = store.issue(SECRET, "CN=client", V, _now())
    assert store.lookup(ctx.identifier, V, _now()) == ctx
    redis.Redis.from_url(url).flushall()
    assert _refused(store, ctx.identifier)
    later = store.issue(SECRET, "CN=client", V, _now() + timedelta(milliseconds=10))
    assert store.lookup(later.identifier, V, _now() + timedelta(milliseconds=10)) == later


def test_contexts_after_the_epoch_key_expired_are_refused(master_keys: Path, url: str) -> None:
    store = _store(master_keys, url)
    ctx = store.issue(SECRET, "CN=client", V, _now())
    assert store.lookup(ctx.identifier, V, _now()) == ctx
    redis.Redis.from_url(url).pexpire(replay.EPOCH_KEY, 50)  # Redis expires it: a push as for a delete
    time.sleep(0.1)
    assert _refused(store, ctx.identifier)


def test_contexts_after_a_redis_restart_are_refused(
    master_keys: Path, own_redis: tuple[list[subprocess.Popen[bytes]], str], tmp_path: Path
) -> None:
    """Pushes sent while the connection was down are lost; the restarted Redis has forgotten the cancellations."""
    procs, url = own_redis
    a, b = _store(master_keys, url), _store(master_keys, url)
    ctx = a.issue(SECRET, "CN=client", V, _now())
    assert b.lookup(ctx.identifier, V, _now()) == ctx
    stop(procs.pop())
    procs.append(redis_again(url, tmp_path / "two"))
    assert _refused(b, ctx.identifier)
    assert _refused(a, ctx.identifier)


def test_redis_down_refuses_known_contexts(
    master_keys: Path, own_redis: tuple[list[subprocess.Popen[bytes]], str]
) -> None:
    procs, url = own_redis
    store = _store(master_keys, url)
    ctx = store.issue(SECRET, "CN=client", V, _now())
    assert store.lookup(ctx.identifier, V, _now()) == ctx  # kept
    stop(procs.pop())
    time.sleep(0.05)
    with pytest.raises(faults.Fault) as refused:
        store.lookup(ctx.identifier, V, _now())
    assert not refused.value.sender and "security context store unavailable" in refused.value.reason


def test_many_contexts_keep_bounded_memory_and_cancellations_still_count(master_keys: Path, url: str) -> None:
    a, b = _store(master_keys, url), _store(master_keys, url, max_keys=8)
    contexts = [a.issue(SECRET, "CN=client", V, _now()) for _ in range(40)]
    for ctx in contexts:
        assert b.lookup(ctx.identifier, V, _now()) == ctx
    assert isinstance(b.revocations, context_store.RedisRevocations)
    tracked = b.revocations._tracked
    assert len(tracked) <= 8
    for ctx in contexts[::3]:  # kept and long forgotten alike
        a.cancel(ctx.identifier, V, _now())
    for i, ctx in enumerate(contexts):
        assert _refused(b, ctx.identifier) == (i % 3 == 0)
    assert len(tracked) <= 8
