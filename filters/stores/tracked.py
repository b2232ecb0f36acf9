"""Redis keys read without a round trip while they do not change: `TrackedKeys`.

A worker that asks Redis the same thing on every message (the outbound route's partner context, a context's
cancellation and the cancellations' epoch) keeps what it read, on a connection Redis keeps informed: RESP3 with
`CLIENT TRACKING ON BCAST PREFIX ...` (Redis >= 6), so Redis pushes an invalidation on that connection when any
client writes, deletes or expires a key under the prefixes, or flushes. Each read first takes in what was pushed
(one poll(2) while nothing was), and reads a key again after a push about it, a reconnection (pushes sent
meanwhile are lost) or `max_age_s` (the bound on a connection that died without a word: no FIN, no RST). BCAST
mode keeps nothing per key in Redis (the default mode remembers every key each client read). redis-py's own
client-side cache does this but insists on Redis 7.4, and CI's Debian has 7.0."""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

# A value read through a tracked connection is read again after this long whatever was pushed.
TRACKED_MAX_AGE_S = 1.0
T = TypeVar("T")


class TrackedKeys(Generic[T]):
    """Values of keys under `prefixes`, each kept (decoded by `decode` from its bytes or None) until Redis pushes
    that it changed, the connection drops, or `max_age_s` passed; at most `max_keys` kept (the oldest read
    goes first: it is read again when next asked for)."""

    def __init__(self, url: str, prefixes: Sequence[bytes], decode: Callable[[bytes | None], T], timeout_s: float,
                 max_keys: int, max_age_s: float = TRACKED_MAX_AGE_S) -> None:  # fmt: skip
        if max_keys < 1 or not prefixes:
            raise ValueError("TrackedKeys needs a prefix and room for a key")
        pool = redis.ConnectionPool.from_url(url, protocol=3, socket_timeout=timeout_s,
                                             socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))  # fmt: skip
        self._prefixes, self._decode, self._max_keys, self._max_age_s = prefixes, decode, max_keys, max_age_s
        self._conn = pool.make_connection()
        self._conn.register_connect_callback(self._on_connect)
        self._lock = threading.Lock()  # one command at a time on the connection
        self._kept: dict[bytes, tuple[T, float]] = {}  # key -> (value, monotonic time it may be used until)
        self._arrived = select.poll()  # the connection's socket: readable when something was pushed (or it ended)

    def __len__(self) -> int:
        return len(self._kept)

    def _on_connect(self, conn: redis.connection.AbstractConnection) -> None:
        # A new connection: whatever was pushed to the old one is lost, so nothing kept is trusted.
        self._kept.clear()
        args: list[bytes | str] = ["CLIENT", "TRACKING", "ON", "BCAST"]
        for prefix in self._prefixes:
            args += ["PREFIX", prefix]
        conn.send_command(*args)
        if conn.read_response() != b"OK":
            raise redis.ConnectionError("CLIENT TRACKING refused")
        conn._parser.set_invalidation_push_handler(self._invalidated)  # as redis-py's own cache does
        self._arrived = select.poll()
        self._arrived.register(conn._sock, select.POLLIN)

    def _invalidated(self, push: list[object]) -> None:
        keys = push[1]
        if not isinstance(keys, list):  # a flush
            self._kept.clear()
            return
        for key in keys:
            self._kept.pop(key, None)  # type: ignore[call-overload]

    def get(self, keys: Sequence[bytes]) -> list[T]:
        """The values of `keys` (each under a prefix), as kept or read now in one command."""
        with self._lock:
            kept = self._kept
            # One poll(2) while nothing arrived: the parser's buffer is empty after every read (_take_pushes).
            if kept and self._arrived.poll(0):
                self._take_pushes()
            now = time.monotonic()
            out: list[T] = []
            for key in keys:
                entry = kept.get(key)
                if entry is None or entry[1] <= now:
                    break
                out.append(entry[0])
            else:
                return out
            conn = self._conn
            try:
                conn.send_command("MGET", *keys)
                values = conn.read_response()
            except redis.RedisError:
                conn.disconnect()
                kept.clear()
                raise
            out = [self._decode(value) for value in values]
            until = now + self._max_age_s
            for key, value in zip(keys, out, strict=True):
                kept.pop(key, None)  # to the end: the oldest read leaves first
                kept[key] = (value, until)
            while len(kept) > self._max_keys:
                del kept[next(iter(kept))]
            self._take_pushes()  # any that came with the reply: about a change after it
            return out

    def _take_pushes(self) -> None:
        """Read what was pushed (the handler forgets those keys) up to the last byte received."""
        conn = self._conn
        try:
            while conn.can_read(0):
                conn.read_response(push_request=True)
        except (redis.ConnectionError, redis.TimeoutError):  # closed (a restart?): pushes lost, read afresh
            conn.disconnect()
            self._kept.clear()

    def forget(self, key: bytes) -> None:
        """Read `key` again next time (this process changed it)."""
        with self._lock:
            self._kept.pop(key, None)

    def close(self) -> None:
        self._conn.disconnect()
