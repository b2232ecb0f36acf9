"""The security context an outbound `secureconversation` route holds with its partner (the engine's
`PartnerContexts`, filters/engine/conversation/contexts.py), and the route's line to the partner's STS.

In Redis (where the route's replay store is, normally the gateway's own) the context is one key per route,
`wsgate:outbound-sct:<route>`, the packed context with EXPIRE at its end, and the issuer's lock a second key with
a short TTL: every worker and replica uses the one context, and one Issue is made per context lifetime. Without
Redis each worker keeps its own.

Each call reads the context, and a cancel or a renewal by another replica must be seen at the next call, but a
GET per call is a round trip and most of a SecureConversation call's cost over hmac's (docs/outbound.md). So
the context is read through a connection Redis keeps informed (filters/stores/tracked.py): the worker keeps what
it read until Redis pushes that the key changed."""

from __future__ import annotations

import os
from datetime import UTC, datetime

import requests

from filters.engine import turn
from filters.engine.profiles import Post
from filters.engine.wss.secure_conversation import Context
from filters.stores.contexts import _pack, _redis_client, _redis_errors, _ttl_ms, _unpack
from filters.stores.tracked import TrackedKeys
from gateway.policy import Route

STS_TIMEOUT_S = 2.0


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


class RedisPartnerContexts:
    """The identifier is stored beside the packed context (`_pack` leaves it out: the inbound store keys by it)."""

    def __init__(self, url: str, route: str, timeout_s: float = 1.0) -> None:
        self.key = f"wsgate:outbound-sct:{route}"
        self.lock_key = f"wsgate:outbound-sct-issuing:{route}"
        self.token = f"{os.getpid()}".encode()
        self._client = _redis_client(url, timeout_s)
        self._name = self.key.encode()
        self._current = TrackedKeys(url, (self._name,), _decode_kept, timeout_s, max_keys=1)

    def get(self) -> Context | None:
        with _redis_errors():
            return self._current.get((self._name,))[0]

    def put(self, ctx: Context) -> None:
        with _redis_errors():
            self._client.set(self.key, encode_context(ctx), px=_ttl_ms(ctx.expires, datetime.now(UTC)))
        self._current.forget(self._name)

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
        self._current.forget(self._name)
        return decode_context(data) if data else None


def _decode_kept(data: bytes | None) -> Context | None:
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
