"""An outbound route's shared partner context in a real Redis: each worker keeps the context it read, and sees
another replica's renewal or cancel at its next call (CLIENT TRACKING invalidations), not a call later."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import redis

from filters.engine.wss.secure_conversation import WSC_1_3, Context
from filters.stores.partner_contexts import RedisPartnerContexts
from filters.stores.tracked import TrackedKeys
from tests.support.harness import redis_again, start_redis, stop

# A push travels from Redis to the reader as the writer's reply travels to the writer: on a loaded machine the
# reader may take it in a moment after the writer returns. Far less than TRACKED_MAX_AGE_S, so only the push
# can make a reader see a change this soon.
PUSH_S = 0.3


def _context(name: str, lifetime_s: int = 600) -> Context:
    now = datetime.now(UTC).replace(microsecond=0)
    return Context(
        f"urn:uuid:{name}", name.encode().ljust(32, b"."), "", WSC_1_3, now, now + timedelta(seconds=lifetime_s)
    )


def _soon(read: Callable[[], object], expected: object) -> object:
    """What `read` gives once it gives `expected`, or after PUSH_S."""
    deadline = time.monotonic() + PUSH_S
    got = read()
    while got != expected and time.monotonic() < deadline:
        time.sleep(0.01)
        got = read()
    return got


def _reads(url: str) -> int:
    """GETs and MGETs Redis has answered."""
    stats = redis.Redis.from_url(url).info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("get", "mget"))


@pytest.fixture
def url(redis_server: str) -> str:
    redis.Redis.from_url(redis_server).flushall()
    return redis_server


def test_stale_partner_context_after_another_replicas_renewal_or_cancel_is_not_used(url: str) -> None:
    a, b = RedisPartnerContexts(url, "partner"), RedisPartnerContexts(url, "partner")  # two replicas' workers
    assert b.get() is None
    first, second = _context("first"), _context("second")
    a.put(first)
    assert _soon(b.get, first) == first
    a.put(second)  # a renewal by the other replica
    assert _soon(b.get, second) == second
    assert a.take() == second  # its cancel (the gateway stopping)
    assert _soon(b.get, None) is None
    a.put(first)
    redis.Redis.from_url(url).delete(a.key)  # any client's delete
    assert _soon(b.get, None) is None


def test_stale_partner_context_after_expiry_or_flush_is_not_used(url: str) -> None:
    a, b = RedisPartnerContexts(url, "partner"), RedisPartnerContexts(url, "partner")
    ctx = _context("short")
    a.put(ctx)
    assert _soon(b.get, ctx) == ctx
    redis.Redis.from_url(url).pexpire(a.key, 50)  # Redis expires it: a push as for a delete
    time.sleep(0.1)
    assert _soon(b.get, None) is None
    a.put(ctx)
    assert _soon(b.get, ctx) == ctx
    redis.Redis.from_url(url).flushall()
    assert _soon(b.get, None) is None


def test_unchanged_partner_context_is_read_from_redis_once(url: str) -> None:
    a, b = RedisPartnerContexts(url, "partner"), RedisPartnerContexts(url, "partner")
    ctx = _context("kept")
    a.put(ctx)
    assert _soon(b.get, ctx) == ctx
    before = _reads(url)
    assert all(b.get() == ctx for _ in range(50))
    assert _reads(url) == before  # kept: no read while nothing changed
    a.put(_context("renewed"))
    assert _soon(b.get, _context("renewed")) == _context("renewed")
    assert _reads(url) > before  # read again once Redis said it changed


def test_stale_partner_context_after_a_redis_restart_is_not_used(tmp_path: Path) -> None:
    """Pushes sent while the connection was down are lost: a reconnected reader reads afresh."""
    (tmp_path / "one").mkdir()
    proc, url = start_redis(tmp_path / "one")
    try:
        reader = TrackedKeys(url, (b"k",), lambda data: data, timeout_s=1.0, max_keys=1, max_age_s=3600)
        writer = redis.Redis.from_url(url)
        writer.set("k", b"old")
        assert reader.get((b"k",)) == [b"old"]
    finally:
        stop(proc)
    proc = redis_again(url, tmp_path / "two")
    try:
        redis.Redis.from_url(url).set("k", b"new")  # written while the reader's connection was gone
        assert reader.get((b"k",)) == [b"new"]
    finally:
        stop(proc)
