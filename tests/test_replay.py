"""Replay stores: the bounded memory store and the Redis store against a real redis-server."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import redis

from filters.engine import faults
from filters.engine.wss.replay import DeferredKey, first_sight
from filters.stores import replay
from filters.stores.replay import DeferredRedisReplay, MemoryReplayCache, RedisReplayCache, from_url
from tests.harness import free_ports, start_redis, stop

FRESH = 2**62  # a message newer than any epoch: these tests are about its keys


class Clock:
    """A hand-driven monotonic clock, so expiry is tested without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def redis_url(redis_server: str) -> str:
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    client.close()
    return redis_server


# --- memory store


def test_memory_first_sight_then_replay() -> None:
    cache = MemoryReplayCache(max_entries=10)
    assert cache.seen(b"nonce-1", 60) is False
    assert cache.seen(b"nonce-1", 60) is True
    assert cache.seen(b"nonce-2", 60) is False
    assert len(cache) == 2


def test_memory_expiry() -> None:
    clock = Clock()
    cache = MemoryReplayCache(max_entries=10, clock=clock)
    assert not cache.seen(b"a", 10)
    assert not cache.seen(b"b", 20)
    clock.now += 9
    assert cache.seen(b"a", 10)
    clock.now += 1
    assert not cache.seen(b"a", 10)  # expired after 10s, recorded afresh until 1020
    assert cache.seen(b"b", 20)
    clock.now += 9
    assert cache.seen(b"a", 10)
    clock.now += 100
    assert len(cache) == 2  # expired entries are dropped by the next call
    assert not cache.seen(b"c", 1)
    assert len(cache) == 1


def test_memory_replay_does_not_extend_ttl() -> None:
    clock = Clock()
    cache = MemoryReplayCache(max_entries=10, clock=clock)
    assert not cache.seen(b"a", 10)
    clock.now += 5
    assert cache.seen(b"a", 100)
    clock.now += 5
    assert not cache.seen(b"a", 10)


def test_memory_never_grows_past_max_entries() -> None:
    cache = MemoryReplayCache(max_entries=1000)
    for i in range(2000):
        assert not cache.seen(i.to_bytes(4, "big"), 3600)
        assert len(cache) <= 1000
    assert len(cache) == 1000
    assert cache.evicted == 1000
    assert len(cache._heap) == 1000


def test_memory_evicts_soonest_to_expire_first() -> None:
    clock = Clock()
    cache = MemoryReplayCache(max_entries=3, clock=clock)
    assert not cache.seen(b"long", 300)
    assert not cache.seen(b"short", 10)
    assert not cache.seen(b"mid", 100)
    assert not cache.seen(b"new", 200)  # full: "short" makes room
    assert cache.evicted == 1
    assert cache.seen(b"long", 300)
    assert cache.seen(b"mid", 100)
    assert cache.seen(b"new", 200)
    assert not cache.seen(b"short", 10)  # forgotten: the price of a store that is too small
    assert cache.evicted == 2  # ... and recording it again pushed out "mid", now the soonest to expire
    assert len(cache) == 3


def test_memory_prefers_expired_entries_to_eviction() -> None:
    clock = Clock()
    cache = MemoryReplayCache(max_entries=2, clock=clock)
    assert not cache.seen(b"a", 1)
    assert not cache.seen(b"b", 100)
    clock.now += 2
    assert not cache.seen(b"c", 100)
    assert cache.evicted == 0
    assert cache.seen(b"b", 100)


def test_memory_stores_fixed_size_digests() -> None:
    cache = MemoryReplayCache(max_entries=10)
    cache.seen(b"x" * 100_000, 60)
    cache.seen(b"", 60)
    assert cache.seen(b"x" * 100_000, 60)
    assert cache.seen(b"", 60)
    assert {len(k) for k in cache._expiry} == {16}


@pytest.mark.parametrize("ttl", [0, -1, float("nan")])
def test_non_positive_ttl_refused(ttl: float) -> None:
    with pytest.raises(ValueError):
        MemoryReplayCache(max_entries=10).seen(b"a", ttl)


def test_memory_needs_room_for_one() -> None:
    with pytest.raises(ValueError):
        MemoryReplayCache(max_entries=0)


# --- Redis store


def test_redis_first_sight_then_replay(redis_url: str) -> None:
    cache = RedisReplayCache(redis_url)
    try:
        assert cache.seen(b"nonce-1", 60) is False
        assert cache.seen(b"nonce-1", 60) is True
        assert cache.seen(b"nonce-2", 60) is False
    finally:
        cache.close()


def test_redis_key_shape_and_ttl(redis_url: str) -> None:
    cache = RedisReplayCache(redis_url, prefix="t:")
    client = redis.Redis.from_url(redis_url)
    try:
        assert not cache.seen(b"x" * 10_000, 30.5)
        (key,) = client.keys("*")
        assert key.startswith(b"t:") and len(key) == 2 + 32  # 16-byte digest in hex
        assert 29_000 < client.pttl(key) <= 30_500
    finally:
        cache.close()
        client.close()


def test_redis_expiry(redis_url: str) -> None:
    cache = RedisReplayCache(redis_url)
    try:
        assert not cache.seen(b"short", 0.1)
        assert cache.seen(b"short", 0.1)
        time.sleep(0.25)
        assert not cache.seen(b"short", 0.1)
        # A TTL under a millisecond is rounded up to one: recorded, and gone soon after (never "no expiry").
        assert not cache.seen(b"tiny", 0.0001)
        time.sleep(0.05)
        assert not cache.seen(b"tiny", 60)
    finally:
        cache.close()


def test_redis_instances_share_the_server(redis_url: str) -> None:
    one, two = RedisReplayCache(redis_url), RedisReplayCache(redis_url)
    try:
        assert not one.seen(b"shared", 60)
        assert two.seen(b"shared", 60)
        assert not two.seen(b"other", 60)
        assert one.seen(b"other", 60)
    finally:
        one.close()
        two.close()


def test_redis_prefixes_separate_stores(redis_url: str) -> None:
    one, two = RedisReplayCache(redis_url, prefix="a:"), RedisReplayCache(redis_url, prefix="b:")
    try:
        assert not one.seen(b"k", 60)
        assert not two.seen(b"k", 60)
    finally:
        one.close()
        two.close()


def test_redis_only_one_of_many_racers_wins(redis_url: str) -> None:
    caches = [RedisReplayCache(redis_url) for _ in range(8)]
    try:
        assert [c.seen(b"race", 60) for c in caches].count(False) == 1
    finally:
        for c in caches:
            c.close()


def test_redis_unreachable_is_a_server_fault() -> None:
    cache = RedisReplayCache(f"redis://127.0.0.1:{free_ports(1)[0]}/0", timeout_s=0.5)
    with pytest.raises(faults.Fault) as info:
        cache.seen(b"a", 60)
    assert info.value.sender is False
    assert info.value.http_status == 500
    assert "replay store unavailable" in info.value.reason
    cache.close()


def test_redis_dying_mid_use_is_a_server_fault(tmp_path: Path) -> None:
    proc, url = start_redis(tmp_path)
    cache = RedisReplayCache(url, timeout_s=0.5)
    try:
        assert not cache.seen(b"a", 60)
        stop(proc)
        with pytest.raises(faults.Fault) as info:
            cache.seen(b"a", 60)
        assert info.value.sender is False
    finally:
        stop(proc)
        cache.close()


def test_redis_auth_failure_is_a_server_fault_without_the_password(redis_url: str) -> None:
    cache = RedisReplayCache(redis_url.replace("redis://", "redis://user:s3cret-pw@"))
    with pytest.raises(faults.Fault) as info:
        cache.seen(b"a", 60)
    assert info.value.sender is False
    assert "s3cret-pw" not in info.value.reason
    cache.close()


# --- from_url


def test_from_url_memory() -> None:
    for url in (None, "memory"):
        cache = from_url(url, max_entries=7)
        assert isinstance(cache, MemoryReplayCache)
        assert cache.max_entries == 7


def test_from_url_redis(redis_url: str) -> None:
    cache, other = from_url(redis_url, max_entries=7), RedisReplayCache(redis_url)
    try:
        assert isinstance(cache, RedisReplayCache)
        assert not cache.seen(b"via-url", 60)
        assert other.seen(b"via-url", 60)
    finally:
        other.close()


def test_from_url_unknown_scheme_names_only_the_scheme() -> None:
    with pytest.raises(ValueError, match="'memcached'") as info:
        from_url("memcached://user:pw@host", max_entries=7)
    assert "pw" not in str(info.value)


# --- the deferred Redis store (the frame sets the keys: filters/frame/src/replay.rs)


def test_deferred_keys_are_the_keys_the_engines_own_redis_store_sets(redis_url: str) -> None:
    # Workers of either kind (and the SC Issue path, which settles here) must refuse each other's replays.
    deferred, direct = DeferredRedisReplay(redis_url), RedisReplayCache(redis_url)
    replayed = faults.security("InvalidSecurity", "replay: signature value seen before")
    try:
        k = deferred.key(b"sig:shared-view", 60, replayed)
        assert k.px == 60_000 and k.fault is replayed
        deferred.settle([k], FRESH)
        assert direct.seen(b"sig:shared-view", 60)
        assert not direct.seen(b"sig:set-directly-first", 60)
        with pytest.raises(faults.Fault) as info:
            deferred.settle([deferred.key(b"sig:set-directly-first", 60, replayed)], FRESH)
        assert info.value is replayed
    finally:
        direct.close()


def test_deferred_settle_needs_every_key_new_and_names_the_replayed_one(redis_url: str) -> None:
    store = DeferredRedisReplay(redis_url)
    sig = faults.security("InvalidSecurity", "replay: signature value seen before")
    nonce = faults.security("FailedAuthentication", "replay: UsernameToken nonce seen before")
    store.settle([store.key(b"ut:alice:n1", 60, nonce)], FRESH)
    with pytest.raises(faults.Fault) as info:
        store.settle([store.key(b"sig:fresh", 60, sig), store.key(b"ut:alice:n1", 60, nonce)], FRESH)
    assert info.value is nonce
    with pytest.raises(faults.Fault) as info:  # the same key twice in one message: the second sight is a replay
        store.settle([store.key(b"sig:twice", 60, sig), store.key(b"sig:twice", 60, sig)], FRESH)
    assert info.value is sig


def test_deferred_settle_with_redis_unreachable_is_a_server_fault() -> None:
    store = DeferredRedisReplay(f"redis://127.0.0.1:{free_ports(1)[0]}/0", timeout_s=0.5)
    with pytest.raises(faults.Fault) as info:
        store.settle([store.key(b"a", 60, faults.security("InvalidSecurity", "replay"))], FRESH)
    assert info.value.sender is False and info.value.http_status == 500
    assert "replay store unavailable" in info.value.reason


def test_first_sight_defers_to_the_deferred_store_and_checks_the_others_now(redis_url: str) -> None:
    replayed = faults.security("InvalidSecurity", "replay: signature value seen before")
    deferred: list[DeferredKey] = []
    store = DeferredRedisReplay(redis_url)
    first_sight(store, b"sig:x", 60, replayed, deferred)
    first_sight(store, b"sig:x", 60, replayed, deferred)  # not checked here: the frame's pipeline refuses it
    assert [k.name for k in deferred] == [store.key(b"sig:x", 60, replayed).name] * 2
    memory = MemoryReplayCache(10)
    first_sight(memory, b"sig:x", 60, replayed, deferred)
    with pytest.raises(faults.Fault):
        first_sight(memory, b"sig:x", 60, replayed, deferred)
    assert len(deferred) == 2


# --- the replay epoch: a store that lost its memory does not reopen the replay window


def test_a_replay_store_that_lost_its_memory_refuses_what_it_may_have_accepted_before(tmp_path: Path) -> None:
    proc, url = start_redis(tmp_path)  # started with its epoch, as the supervisor starts its own
    store, deferred = RedisReplayCache(url), DeferredRedisReplay(url)
    nonce = faults.security("InvalidSecurity", "replay")
    try:
        time.sleep(0.01)
        created = replay.now_ms()  # a message signed after the epoch began, accepted once
        assert not store.seen(b"sig:m", 60)
        replay.check_epoch(created, store.epoch_ms())
        stop(proc)
        port = url.rsplit(":", 1)[1].split("/")[0]
        proc = subprocess.Popen(["redis-server", "--port", port, "--bind", "127.0.0.1", "--save", ""],
                                stdout=subprocess.DEVNULL)  # fmt: skip
        for _ in range(100):  # restarted empty, as after a crash: nobody has set its epoch yet
            try:
                assert not store.seen(b"sig:m", 60)  # forgotten...
                break
            except faults.Fault:
                time.sleep(0.05)
        with pytest.raises(faults.Fault) as info:  # ...but older than the epoch the check starts: refused
            replay.check_epoch(created, store.epoch_ms())
        assert info.value.code == "MessageExpired"
        with pytest.raises(faults.Fault) as info:  # the deferred store (SC Issue/Cancel) sees the same epoch
            deferred.settle([deferred.key(b"sig:n", 60, nonce)], created)
        assert info.value.code == "MessageExpired"
        deferred.settle([deferred.key(b"sig:o", 60, nonce)], replay.now_ms() + 1)  # a new message passes
    finally:
        store.close()
        stop(proc)


def test_a_memory_store_remembers_nothing_from_before_it_started() -> None:
    before = replay.now_ms() - 1
    store = MemoryReplayCache(10)
    with pytest.raises(faults.Fault, match="epoch"):
        replay.check_epoch(before, store.epoch_ms())
    replay.check_epoch(store.epoch_ms() + 1, store.epoch_ms())


def test_the_epoch_is_set_once_and_a_value_that_is_no_number_fails_closed(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        first = replay.set_epoch(client, 1000)
        assert first == 1000 and replay.set_epoch(client, 2000) == 1000  # every worker agrees on the first
        client.set(replay.EPOCH_KEY, b"garbage")
        mine = replay.now_ms()
        assert replay.set_epoch(client, mine) == mine  # nothing older than now passes
    finally:
        client.close()
