"""Replay stores (the rule and its Protocols: filters/engine/wss/replay.py): in memory, in Redis, or in Redis
checked after the verdict (deferred).

Keys are stored as 16-byte SHA-256 prefixes, so an entry's size does not depend on what the client sent. The memory
store serves one process; the Redis store lets several gateway instances share one view. A Redis that cannot answer
is a server fault. Each store's epoch (filters/engine/wss/replay.py): Redis keeps it in the key EPOCH_KEY, set with
SET NX by whoever finds it missing, so every worker agrees on one value; a memory store's is its creation."""

from __future__ import annotations

import hashlib
import heapq
import math
import time
from collections.abc import Callable, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from filters.engine import faults, metrics
from filters.engine.wss.replay import (
    DeferredKey,
    DeferredReplay,
    ReplayCache,
    check_epoch,
    now_ms,
)

DIGEST_BYTES = 16  # 128 bits: collisions are out of reach at any size the store can hold
# The replay epoch's key (no TTL; never a digest's name: those are hex). The frame gets the name from here.
EPOCH_KEY = b"wsgate:epoch"


def epoch_of(value: bytes | None, mine: int) -> int:
    """The epoch a `SET EPOCH_KEY mine NX GET` reply names: ours when the key was missing (nil), else the
    value there. A value that is not a number is a store we cannot trust: the epoch is now (fail closed)."""
    if value is None:
        return mine
    try:
        return int(value)
    except ValueError:
        return mine


def set_epoch(client: redis.Redis, at_ms: int | None = None) -> int:
    """Start the epoch of a Redis that was just (re)started or found empty; the epoch it has."""
    mine = now_ms() if at_ms is None else at_ms
    return epoch_of(client.set(EPOCH_KEY, str(mine), nx=True, get=True), mine)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()[:DIGEST_BYTES]


def _check_ttl(ttl_s: float) -> None:
    if not ttl_s > 0:  # also refuses NaN
        raise ValueError(f"replay TTL must be positive, got {ttl_s}")


def _redis_entry(prefix: bytes, key: bytes, ttl_s: float) -> tuple[bytes, int]:
    """The Redis key name and its TTL in milliseconds, as every store that shares Redis spells them."""
    _check_ttl(ttl_s)
    return prefix + _digest(key).hex().encode(), max(1, math.ceil(ttl_s * 1000))


def _redis_client(url: str, timeout_s: float) -> redis.Redis:
    # Short timeouts and no retries: a hung Redis turns into a prompt refusal instead of stalled requests,
    # and a SET NX retried after a lost reply would report its own first attempt as a replay.
    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )


def _unavailable(exc: redis.RedisError) -> faults.Fault:
    return faults.server(f"replay store unavailable: {type(exc).__name__}: {exc}")


class MemoryReplayCache:
    """A bounded in-process store: O(log n) per call, never more than `max_entries` entries.

    Expired entries go first; when the store is still full, the entry that would expire soonest makes room
    (`evicted` counts those, a sign the store is too small for the traffic)."""

    def __init__(
        self, max_entries: int = 1_000_000, clock: Callable[[], float] = time.monotonic, epoch_ms: int | None = None
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self.evicted = 0
        # A new store (a worker started or restarted) remembers nothing older; `epoch_ms`: a tool's own store in a
        # process that accepted nothing before it (measurements replaying pre-made messages).
        self._epoch_ms = now_ms() if epoch_ms is None else epoch_ms
        self._clock = clock
        self._expiry: dict[bytes, float] = {}
        # The same entries ordered by expiry. Entries leave both structures together, so the heap holds
        # no stale items and its size is the dict's.
        self._heap: list[tuple[float, bytes]] = []

    def __len__(self) -> int:
        return len(self._expiry)

    def epoch_ms(self) -> int:
        return self._epoch_ms

    @metrics.timed("replay")
    def seen(self, key: bytes, ttl_s: float) -> bool:
        _check_ttl(ttl_s)
        now = self._clock()
        while self._heap and self._heap[0][0] <= now:
            _, old = heapq.heappop(self._heap)
            del self._expiry[old]
        digest = _digest(key)
        if digest in self._expiry:
            return True
        if len(self._expiry) >= self.max_entries:
            _, old = heapq.heappop(self._heap)
            del self._expiry[old]
            self.evicted += 1
        expiry = now + ttl_s
        self._expiry[digest] = expiry
        heapq.heappush(self._heap, (expiry, digest))
        return False


class RedisReplayCache:
    """A store shared through Redis: one `SET key NX PX ttl` per call, atomic on the server."""

    def __init__(self, url: str, prefix: str = "wsgate:replay:", timeout_s: float = 1.0) -> None:
        self.prefix = prefix.encode()
        self._client = _redis_client(url, timeout_s)

    @metrics.timed("replay")
    def seen(self, key: bytes, ttl_s: float) -> bool:
        name, px = _redis_entry(self.prefix, key, ttl_s)
        try:
            created = self._client.set(name, b"1", nx=True, px=px)
        except redis.RedisError as exc:
            raise _unavailable(exc) from None
        return not created

    def epoch_ms(self) -> int:
        try:
            return set_epoch(self._client)
        except redis.RedisError as exc:
            raise _unavailable(exc) from None

    def close(self) -> None:
        self._client.close()


class DeferredRedisReplay(DeferredReplay):
    """The Redis store, checked after the engine's verdict instead of during it (DeferredReplay). The filter
    worker's frame does it in one pipelined round trip off the Python thread (filters/frame/src/replay.rs),
    so no other exchange waits on Redis; `settle` is the same check done here. Same key names and TTLs as
    RedisReplayCache: every worker shares one view."""

    def __init__(self, url: str, prefix: str = "wsgate:replay:", timeout_s: float = 1.0) -> None:
        self.url = url
        self.prefix = prefix.encode()
        self._timeout_s = timeout_s
        self._client: redis.Redis | None = None  # for `settle` and `claim` only, opened on first use

    def key(self, key: bytes, ttl_s: float, fault: faults.Fault) -> DeferredKey:
        return DeferredKey(*_redis_entry(self.prefix, key, ttl_s), fault)

    @metrics.timed("replay")
    def claim(self, key: DeferredKey) -> None:
        if self._client is None:
            self._client = _redis_client(self.url, self._timeout_s)
        try:
            created = self._client.set(key.name, b"1", nx=True, px=key.px)
        except redis.RedisError as exc:
            raise _unavailable(exc) from None
        if not created:
            raise key.fault

    @metrics.timed("replay")
    def settle(self, keys: Sequence[DeferredKey], since_ms: int) -> None:
        """Set every key (SET NX PX) and read the epoch, one round trip; raise the fault of the first key that was
        already set, or `before_epoch` when the message is not newer than the epoch."""
        if not keys:
            return
        if self._client is None:
            self._client = _redis_client(self.url, self._timeout_s)
        mine = now_ms()
        pipe = self._client.pipeline(transaction=False)
        pipe.set(EPOCH_KEY, str(mine), nx=True, get=True)
        for k in keys:
            pipe.set(k.name, b"1", nx=True, px=k.px)
        try:
            epoch, *created = pipe.execute()
        except redis.RedisError as exc:
            raise _unavailable(exc) from None
        for k, ok in zip(keys, created, strict=True):
            if not ok:
                raise k.fault
        check_epoch(since_ms, epoch_of(epoch, mine))


def from_url(url: str | None, max_entries: int) -> ReplayCache:
    """The store a URL names: None or "memory" in process; redis://, rediss:// or unix:// in Redis."""
    if url is None or url == "memory":
        return MemoryReplayCache(max_entries)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisReplayCache(url)
    raise ValueError(f"unknown replay store URL scheme: {url.split(':', 1)[0]!r}")
