"""The stores a route's pipeline is handed (filters/engine/profiles.py `Stores`), built from its policy: the
replay store and the UsernameToken failure throttle in Redis where the route's replay store is (every worker sees
the same), else in this worker's memory; the security-context store; the revocation checker."""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import cache

from cryptography import x509

from filters.engine import faults
from filters.engine.conversation.contexts import ContextStore, PartnerContexts
from filters.engine.profiles import Post
from filters.engine.wss.replay import PROCESS_STARTED_MS, ReplayCache
from filters.stores import auth_throttle, contexts, partner_contexts, replay
from filters.stores.revocation import RevocationChecker
from gateway.policy import REDIS_URL_ENV, Route


class RouteStores:
    """`defer_replay`: a Redis replay store is left to the caller (the filter worker's frame sets the keys that go
    out with the verdict), except rediss:// (the frame speaks no TLS to Redis)."""

    def __init__(self, defer_replay: bool = False, redis_url: str | None = None) -> None:
        """`redis_url`: the shared Redis where a route names none (None: WSGATE_REDIS_URL)."""
        self.defer_replay = defer_replay
        self.redis_url = redis_url

    def replay(self, route: Route) -> ReplayCache | replay.DeferredRedisReplay:
        url = _shared_store_url(route, self.redis_url)
        if url and self.defer_replay and url.startswith(("redis://", "unix://")):
            return _deferred_store(url)
        return _redis_store(url) if url else _memory_store(route.replay.max_entries)

    def failure_throttle(
        self, route: Route
    ) -> auth_throttle.MemoryFailureThrottle | auth_throttle.RedisFailureThrottle:
        """In Redis where the replay store is, else in this worker's memory (counted afresh after a policy reload)."""
        ut = route.username_token
        url = _shared_store_url(route, self.redis_url)
        if url:
            return _redis_throttle(url, route.name, ut.max_failures, ut.failure_window_s)
        return auth_throttle.MemoryFailureThrottle(ut.max_failures, ut.failure_window_s)

    def contexts(self, route: Route) -> ContextStore:
        return contexts.make_store(route.secureconversation, os.environ.get(REDIS_URL_ENV))

    def revocation(self, route: Route, issuers: Sequence[x509.Certificate]) -> RevocationChecker:
        return RevocationChecker(route.rsa.revocation, issuers)

    def partner_contexts(self, route: Route) -> PartnerContexts:
        """Where the route's replay store is: Redis shares one context among all workers."""
        return partner_contexts.make(route, _shared_store_url(route, self.redis_url))

    def partner_sts(self, route: Route) -> Post:
        return partner_contexts.sts_post(route)


def _shared_store_url(route: Route, default: str | None = None) -> str | None:
    """The Redis URL the route's replay store uses, or None when it keeps to the worker's memory."""
    policy = route.replay
    url = policy.redis_url or default or os.environ.get(REDIS_URL_ENV)
    if policy.store == "memory" or (policy.store == "auto" and not url):
        return None
    if not url:
        raise faults.server(f"route {route.name}: replay store redis needs redis_url or {REDIS_URL_ENV}")
    return url


@cache
def _redis_throttle(url: str, scope: str, max_failures: int, window_s: int) -> auth_throttle.RedisFailureThrottle:
    return auth_throttle.RedisFailureThrottle(url, scope, max_failures, window_s)  # one connection pool, not per reload


@cache
def _memory_store(max_entries: int) -> ReplayCache:
    # One per worker, shared by its routes and kept across reloads; it remembers all since the worker started.
    return replay.MemoryReplayCache(max_entries, epoch_ms=PROCESS_STARTED_MS)


@cache
def _redis_store(url: str) -> ReplayCache:
    return replay.RedisReplayCache(url)


@cache
def _deferred_store(url: str) -> replay.DeferredRedisReplay:
    return replay.DeferredRedisReplay(url)
