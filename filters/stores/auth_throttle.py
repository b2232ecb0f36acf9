"""Repeated authentication failures per user are slowed down (online password guessing).

After `max_failures` failed checks for a username within `window_s` seconds (a fixed window that opens at the
first failure), that username is refused without checking until the window closes. Known and unknown usernames
are counted alike, so the throttle tells nobody which users exist.

Memory is bounded whatever names clients send: usernames are hashed (HMAC-SHA256 under a random key) into a
fixed number of buckets, and a bucket holds only a count and the window's start. Names sharing a bucket share
the count; with a secret key nobody can aim a name at someone else's bucket. The trade-off, documented: an
attacker can keep a real user refused, but only for short windows at a time and only by failing on that very
name (or by failing on very many names, which costs him `max_failures` refused requests per bucket per window).

The memory throttle serves one worker; when the route's replay store is Redis, `RedisFailureThrottle` counts
for every worker and replica (the bucket key is kept in Redis too, so they all bucket alike). A Redis that
cannot answer is a server fault: fail closed. Both implement username_token.FailureThrottle (the engine's side)."""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from array import array
from collections.abc import Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from filters.engine import faults

BUCKETS = 65536  # 12 bytes each in memory; at most this many keys per route in Redis


def _bucket(key: bytes, username: str, buckets: int) -> int:
    return int.from_bytes(hmac.digest(key, username.encode("utf-8", "surrogatepass"), hashlib.sha256)[:8]) % buckets


class MemoryFailureThrottle:
    def __init__(
        self, max_failures: int, window_s: float, buckets: int = BUCKETS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_failures < 1 or window_s <= 0 or buckets < 1:
            raise ValueError("max_failures, window_s and buckets must be positive")
        self.max_failures, self.window_s, self.buckets = max_failures, window_s, buckets
        self._clock = clock
        self._key = os.urandom(32)
        self._count = array("I", bytes(4 * buckets))
        self._start = array("d", [float("-inf")]) * buckets

    def blocked(self, username: str) -> bool:
        b = _bucket(self._key, username, self.buckets)
        return self._clock() - self._start[b] < self.window_s and self._count[b] >= self.max_failures

    def failed(self, username: str) -> None:
        b = _bucket(self._key, username, self.buckets)
        now = self._clock()
        if now - self._start[b] >= self.window_s:
            self._start[b], self._count[b] = now, 0
        self._count[b] = min(self._count[b] + 1, self.max_failures)


class RedisFailureThrottle:
    """The same windows in Redis: `SET bucket 0 NX PX window` then `INCR` (one transaction), so a bucket always
    carries its expiry and no failure can lock a name for longer than a window."""

    def __init__(
        self, url: str, scope: str, max_failures: int, window_s: float, buckets: int = BUCKETS, timeout_s: float = 1.0
    ) -> None:
        if max_failures < 1 or window_s <= 0 or buckets < 1:
            raise ValueError("max_failures, window_s and buckets must be positive")
        self.max_failures, self.window_ms, self.buckets = max_failures, max(1, int(window_s * 1000)), buckets
        self.prefix = f"wsgate:utfail:{scope}:"
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        self._key: bytes | None = None

    def _name(self, username: str) -> str:
        if self._key is None:
            # The first worker's random key wins; every worker then buckets names alike.
            self._client.set("wsgate:utfail:key", os.urandom(32), nx=True)
            got = self._client.get("wsgate:utfail:key")
            if not isinstance(got, bytes) or len(got) != 32:
                raise faults.server("failure throttle: no bucket key in Redis")
            self._key = got
        return self.prefix + str(_bucket(self._key, username, self.buckets))

    def blocked(self, username: str) -> bool:
        try:
            got = self._client.get(self._name(username))
        except redis.RedisError as exc:
            raise faults.server(f"failure throttle unavailable: {type(exc).__name__}: {exc}") from None
        return got is not None and int(got) >= self.max_failures

    def failed(self, username: str) -> None:
        try:
            pipe = self._client.pipeline(transaction=True)
            name = self._name(username)
            pipe.set(name, 0, nx=True, px=self.window_ms)
            pipe.incr(name)
            pipe.execute()
        except redis.RedisError as exc:
            raise faults.server(f"failure throttle unavailable: {type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        self._client.close()
