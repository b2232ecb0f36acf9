"""The security context an outbound `secureconversation` route holds with its partner (the engine's
`PartnerContexts`, filters/engine/conversation/contexts.py), and the route's line to the partner's STS.

In Redis (where the route's replay store is, normally the gateway's own) the context is one key per route,
`wsgate:outbound-sct:<route>`, the packed context with EXPIRE at its end, and the issuer's lock a second key with
a short TTL: every worker and replica uses the one context, and one Issue is made per context lifetime. Without
Redis each worker keeps its own.

Each call reads the context, and a cancel or a renewal by another replica must be seen at the next call, but a
GET per call is a round trip and most of a SecureConversation call's cost over hmac's (docs/outbound.md). So
the context is read through a connection Redis keeps informed (`TrackedKey`: CLIENT TRACKING, RESP3, Redis >=
6): the worker keeps what it read, and Redis pushes an invalidation on that same connection when any client
writes, deletes or expires the key; each read first takes in what was pushed. redis-py's own client-side cache
does this but insists on Redis 7.4, and CI's Debian has 7.0."""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Generic, TypeVar

import redis
import requests
from redis.backoff import NoBackoff
from redis.retry import Retry

from filters.engine import turn
from filters.engine.profiles import Post
from filters.engine.wss.secure_conversation import Context
from filters.stores.contexts import _pack, _redis_client, _redis_errors, _ttl_ms, _unpack
from gateway.policy import Route

STS_TIMEOUT_S = 2.0
# A value read through a tracked connection is read again after this long whatever was pushed: the bound on
# what a connection that died without a word (no FIN, no RST; its invalidations lost) could keep using.
TRACKED_MAX_AGE_S = 1.0
T = TypeVar("T")


class MemoryPartnerContexts:
    def __init__(self) -> None:
        self._ctx: Context | None = None
        self._issuing = False  # another exchange of this worker waits on the STS (it gave up the engine's turn)

    def get(self) -> Context | None:
        return self._ctx

    def put(self, ctx: Context) -> None:
        self._ctx = ctx

    def lock(self, ttl_s: float) -> bool:
        if self._issuing:
            return False
        self._issuing = True
        return True

    def unlock(self) -> None:
        self._issuing = False

    def take(self) -> Context | None:
        ctx, self._ctx = self._ctx, None
        return ctx


class TrackedKey(Generic[T]):
    """One key's value, read through a RESP3 connection with CLIENT TRACKING on: kept until Redis pushes that
    the key changed (any client's write, delete, expiry, or a flush), the connection drops, or `max_age_s`
    passed. Reading it once more then is a GET. `decode` turns the bytes (or None) into what is kept."""

    _value: T  # what was read last; used while _until is ahead

    def __init__(self, url: str, key: str, decode: Callable[[bytes | None], T], timeout_s: float,
                 max_age_s: float = TRACKED_MAX_AGE_S) -> None:  # fmt: skip
        pool = redis.ConnectionPool.from_url(url, protocol=3, socket_timeout=timeout_s,
                                             socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))  # fmt: skip
        self.key, self._decode, self._max_age_s = key, decode, max_age_s
        self._conn = pool.make_connection()
        self._conn.register_connect_callback(self._on_connect)
        self._lock = threading.Lock()  # one command at a time on the connection
        self._until = 0.0  # monotonic time the kept value may be used until; 0: nothing kept
        self._arrived = select.poll()  # the connection's socket: readable when something was pushed (or it ended)

    def _on_connect(self, conn: redis.connection.AbstractConnection) -> None:
        # A new connection: whatever was pushed to the old one is lost, so nothing kept is trusted.
        self._until = 0.0
        conn.send_command("CLIENT", "TRACKING", "ON")
        if conn.read_response() != b"OK":
            raise redis.ConnectionError("CLIENT TRACKING refused")
        conn._parser.set_invalidation_push_handler(self._invalidated)  # as redis-py's own cache does
        self._arrived = select.poll()
        self._arrived.register(conn._sock, select.POLLIN)

    def _invalidated(self, _push: object) -> None:
        self._until = 0.0  # one key is tracked on this connection: any push is about it (or a flush)

    def get(self) -> T:
        with self._lock:
            # One poll(2) while nothing arrived: the parser's buffer is empty after every read (_take_pushes).
            if self._until and self._arrived.poll(0):
                self._take_pushes()
            if self._until > time.monotonic():
                return self._value
            conn = self._conn
            try:
                conn.send_command("GET", self.key)
                data = conn.read_response()
            except redis.RedisError:
                conn.disconnect()
                self._until = 0.0
                raise
            self._value = self._decode(data)
            self._until = time.monotonic() + self._max_age_s
            self._take_pushes()  # any that came with the reply: about a change after it
            return self._value

    def _take_pushes(self) -> None:
        """Read what was pushed (the handler forgets the value) up to the last byte received."""
        conn = self._conn
        try:
            while conn.can_read(0):
                conn.read_response(push_request=True)
        except (redis.ConnectionError, redis.TimeoutError):  # closed (a restart?): pushes lost, read afresh
            conn.disconnect()
            self._until = 0.0

    def forget(self) -> None:
        """Read the key again next time (this process changed it)."""
        self._until = 0.0


class RedisPartnerContexts:
    """The identifier is stored beside the packed context (`_pack` leaves it out: the inbound store keys by it)."""

    def __init__(self, url: str, route: str, timeout_s: float = 1.0) -> None:
        self.key = f"wsgate:outbound-sct:{route}"
        self.lock_key = f"wsgate:outbound-sct-issuing:{route}"
        self.token = f"{os.getpid()}".encode()
        self._client = _redis_client(url, timeout_s)
        self._current = TrackedKey(url, self.key, lambda data: decode_context(data) if data else None, timeout_s)

    def get(self) -> Context | None:
        with _redis_errors():
            return self._current.get()

    def put(self, ctx: Context) -> None:
        with _redis_errors():
            self._client.set(self.key, encode_context(ctx), px=_ttl_ms(ctx.expires, datetime.now(UTC)))
        self._current.forget()

    def lock(self, ttl_s: float) -> bool:
        with _redis_errors():
            return bool(self._client.set(self.lock_key, self.token, nx=True, px=int(ttl_s * 1000)))

    def unlock(self) -> None:
        with _redis_errors():
            if self._client.get(self.lock_key) == self.token:
                self._client.delete(self.lock_key)

    def take(self) -> Context | None:
        with _redis_errors():
            data = self._client.getdel(self.key)
        self._current.forget()
        return decode_context(data) if data else None


def encode_context(ctx: Context) -> bytes:
    identifier = ctx.identifier.encode()
    return len(identifier).to_bytes(2, "big") + identifier + _pack(ctx)


def decode_context(data: bytes) -> Context | None:
    size = int.from_bytes(data[:2], "big")
    return _unpack(data[2 : 2 + size].decode(errors="replace"), data[2 + size :])


def sts_post(route: Route) -> Post:
    """HTTPS to the partner's STS with the route's CA and client certificate, keep-alive, the route's timeout."""
    out, upstream = route.outbound, route.upstream
    assert out is not None
    url = f"https://{upstream.address}{out.sts_path or route.match.path_prefix}"
    session = requests.Session()
    cert = (out.client_certificate, out.client_key) if out.client_certificate and out.client_key else None
    verify: str | bool = upstream.ca or True
    # The Issue is made inside a filter's answer to Envoy (3 s), and under the issuer's lock (outbound.ISSUE_LOCK_S).
    timeout = min(upstream.timeout_s, STS_TIMEOUT_S)

    def post(body: bytes, content_type: str) -> bytes:
        try:
            with turn.released():  # the worker's other exchanges go on while the partner answers
                reply = session.post(url, data=body, headers={"content-type": content_type}, timeout=timeout,
                                     verify=verify, cert=cert)  # fmt: skip
        except requests.RequestException as exc:
            raise OSError(f"partner STS {url} unreachable: {type(exc).__name__}") from None
        return reply.content

    return post


def make(route: Route, url: str | None) -> MemoryPartnerContexts | RedisPartnerContexts:
    return RedisPartnerContexts(url, route.name) if url else MemoryPartnerContexts()
