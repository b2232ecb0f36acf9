"""Repeated UsernameToken failures per user are slowed down, in bounded memory, per worker or shared in Redis."""

from __future__ import annotations

import pytest
import redis

from filters.engine import faults
from filters.stores.auth_throttle import MemoryFailureThrottle, RedisFailureThrottle


def test_failures_within_the_window_block_then_the_window_closes() -> None:
    clock = [100.0]
    throttle = MemoryFailureThrottle(3, 30, clock=lambda: clock[0])
    for _ in range(2):
        throttle.failed("bob")
    assert not throttle.blocked("bob")
    throttle.failed("bob")
    assert throttle.blocked("bob")
    assert not throttle.blocked("alice")
    clock[0] += 29.9
    assert throttle.blocked("bob")
    clock[0] += 0.1
    assert not throttle.blocked("bob")  # never longer than one window: the real user cannot be locked out for good


def test_unknown_usernames_cannot_fill_memory() -> None:
    """Any number of distinct names lands in the same fixed buckets: no per-name state grows."""
    throttle = MemoryFailureThrottle(5, 60, buckets=1024)
    sizes = (len(throttle._count), len(throttle._start))
    for i in range(20_000):
        throttle.failed(f"guess-{i}")
    assert (len(throttle._count), len(throttle._start)) == sizes == (1024, 1024)
    assert max(throttle._count) <= 5  # counts saturate


def test_redis_throttle_is_shared_by_workers_and_expires(redis_server: str) -> None:
    """Two workers' throttles on one Redis: failures through either count together; each bucket carries the
    window as its expiry, and the keys stay within the bucket count whatever names arrive."""
    a = RedisFailureThrottle(redis_server, "shared-test", 3, 2, buckets=8)
    b = RedisFailureThrottle(redis_server, "shared-test", 3, 2, buckets=8)
    a.failed("bob")
    b.failed("bob")
    assert not a.blocked("bob")
    a.failed("bob")
    assert a.blocked("bob") and b.blocked("bob")
    client = redis.Redis.from_url(redis_server)
    name = a._name("bob")
    assert 0 < client.pttl(name) <= 2000
    for i in range(200):
        b.failed(f"guess-{i}")
    assert len(client.keys("wsgate:utfail:shared-test:*")) <= 8
    client.close()
    a.close()
    b.close()


def test_redis_throttle_fails_closed() -> None:
    throttle = RedisFailureThrottle("redis://127.0.0.1:1/0", "down", 3, 60, timeout_s=0.2)
    with pytest.raises(faults.Fault) as info:
        throttle.blocked("bob")
    assert not info.value.sender  # a server fault: refused, not let through
