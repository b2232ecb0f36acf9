"""Replay defence: remember what we have seen (nonces, signature values) for as long as it could be replayed.

`seen(key, ttl_s)` records a key and tells whether it was already there. Keys are stored as 16-byte SHA-256
prefixes, so an entry's size does not depend on what the client sent. The memory store serves one process;
the Redis store lets several gateway instances share one view. A Redis that cannot answer is a server fault:
the gateway refuses rather than accept a message it could not check.

A store that lost its memory (a Redis restarted without persistence or flushed, a worker's memory store after a
restart) must not reopen the replay window. Each store has an epoch: the moment from which it remembers every
message it let through (Redis: the key EPOCH_KEY, set with SET NX by whoever finds it missing, so every worker
agrees on one value; memory: the store's creation). A message passes only if its freshness evidence is newer
than the epoch (`since_ms`, from wssecurity: the signed Timestamp's Created; else the UsernameToken's Created;
else "now minus the key's lifetime": a copy accepted before the loss would have been forgotten by now anyway).
Anything older could have been accepted before the loss: refused (MessageExpired), the client signs afresh."""

from __future__ import annotations

import hashlib
import heapq
import math
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from filters import faults, metrics

DIGEST_BYTES = 16  # 128 bits: collisions are out of reach at any size the store can hold
# The replay epoch's key (no TTL; never a digest's name: those are hex). The frame gets the name from here.
EPOCH_KEY = b"wsgate:epoch"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# This process accepted nothing before it started: the epoch of its in-process stores (one per worker).
PROCESS_STARTED_MS = now_ms()


def before_epoch(since_ms: int, epoch_ms: int) -> faults.Fault:
    """The refusal of a message that may have been accepted before the store lost its memory."""
    return faults.security(
        "MessageExpired",
        f"freshness evidence ({since_ms} ms) not newer than the replay store's epoch ({epoch_ms} ms): "
        "it may have been accepted before the store lost its memory",
    )


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


class ReplayCache(Protocol):
    def seen(self, key: bytes, ttl_s: float) -> bool:
        """Record `key` for `ttl_s` seconds; True when it was already recorded (a replay)."""
        ...

    def epoch_ms(self) -> int:
        """From when (ms since the Unix epoch) the store remembers every key it recorded."""
        ...


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


class DeferredKey(NamedTuple):
    """A key a message must be the first to set, and the refusal if it is not."""

    name: bytes  # the Redis key
    px: int  # its TTL in milliseconds
    fault: faults.Fault


class DeferredRedisReplay:
    """The Redis store, checked after the engine's verdict instead of during it: the engine only collects the keys
    of a verified message (`key`); whoever answers the request sets them all before it passes the message on. The
    filter worker's frame does it in one pipelined round trip off the Python thread (filters/frame/src/replay.rs),
    so no other exchange waits on Redis; `settle` is the same check done here. Same key names and TTLs as
    RedisReplayCache: every worker shares one view."""

    def __init__(self, url: str, prefix: str = "wsgate:replay:", timeout_s: float = 1.0) -> None:
        self.url = url
        self.prefix = prefix.encode()
        self._timeout_s = timeout_s
        self._client: redis.Redis | None = None  # for `settle` only, opened on first use

    def key(self, key: bytes, ttl_s: float, fault: faults.Fault) -> DeferredKey:
        return DeferredKey(*_redis_entry(self.prefix, key, ttl_s), fault)

    @metrics.timed("replay")
    def claim(self, key: DeferredKey) -> None:
        """Set one key now, before the engine goes on (what must not happen twice even once: a CBC key's use,
        filters/wssecurity._check_cbc); raise its fault if it was set. No epoch: it says nothing of freshness."""
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


def first_sight(
    store: ReplayCache | DeferredRedisReplay | None,
    key: bytes,
    ttl_s: float,
    replayed: faults.Fault,
    deferred: list[DeferredKey],
) -> None:
    """Refuse a message whose verified key was seen before: now, or for a deferred store once the verdict is in
    (the key joins `deferred`, which goes out with the verdict; a refused message sets none of its keys)."""
    if isinstance(store, DeferredRedisReplay):
        deferred.append(store.key(key, ttl_s, replayed))
    elif store is not None and store.seen(key, ttl_s):
        raise replayed


def check_epoch(since_ms: int, epoch_ms: int) -> None:
    if since_ms <= epoch_ms:
        raise before_epoch(since_ms, epoch_ms)


def from_url(url: str | None, max_entries: int) -> ReplayCache:
    """The store a URL names: None or "memory" in process; redis://, rediss:// or unix:// in Redis."""
    if url is None or url == "memory":
        return MemoryReplayCache(max_entries)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisReplayCache(url)
    raise ValueError(f"unknown replay store URL scheme: {url.split(':', 1)[0]!r}")
