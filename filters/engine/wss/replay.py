"""The replay rule: remember what we have seen (nonces, signature values) for as long as it could be replayed.

`seen(key, ttl_s)` records a key and tells whether it was already there (ReplayCache); a deferred store
(DeferredReplay) only collects the keys of a verified message and has them set after the verdict. The stores
themselves (memory, Redis, deferred Redis) live in filters/stores/replay.py; the engine takes them as arguments. A
store that cannot answer is a server fault: the gateway refuses rather than accept a message it could not check.

A store that lost its memory (a Redis restarted without persistence or flushed, a worker's memory store after a
restart) must not reopen the replay window. Each store has an epoch: the moment from which it remembers every
message it let through. A message passes only if its freshness evidence is newer than the epoch (`since_ms`, from
wssecurity: the signed Timestamp's Created; else the UsernameToken's Created; else "now minus the key's lifetime":
a copy accepted before the loss would have been forgotten by now anyway). Anything older could have been accepted
before the loss: refused (MessageExpired), the client signs afresh."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from filters.engine import faults


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


def check_epoch(since_ms: int, epoch_ms: int) -> None:
    if since_ms <= epoch_ms:
        raise before_epoch(since_ms, epoch_ms)


class ReplayCache(Protocol):
    def seen(self, key: bytes, ttl_s: float) -> bool:
        """Record `key` for `ttl_s` seconds; True when it was already recorded (a replay)."""
        ...

    def epoch_ms(self) -> int:
        """From when (ms since the Unix epoch) the store remembers every key it recorded."""
        ...


class DeferredKey(NamedTuple):
    """A key a message must be the first to set, and the refusal if it is not."""

    name: bytes  # the store's key
    px: int  # its TTL in milliseconds
    fault: faults.Fault


class DeferredReplay(ABC):
    """A store checked after the engine's verdict instead of during it: the engine only collects the keys of a
    verified message (`key`); whoever answers the request sets them all before it passes the message on
    (`settle`, or the filter worker's frame off the Python thread)."""

    @abstractmethod
    def key(self, key: bytes, ttl_s: float, fault: faults.Fault) -> DeferredKey: ...

    @abstractmethod
    def claim(self, key: DeferredKey) -> None:
        """Set one key now, before the engine goes on; raise its fault if it was set (no epoch: not a freshness
        check). For what must not happen even once more, as a CBC key's use (wssecurity._check_cbc)."""

    @abstractmethod
    def settle(self, keys: Sequence[DeferredKey], since_ms: int) -> None:
        """Set every key; raise the fault of the first key that was already set, or `before_epoch` when the message
        is not newer than the store's epoch."""


def first_sight(
    store: ReplayCache | DeferredReplay | None,
    key: bytes,
    ttl_s: float,
    replayed: faults.Fault,
    deferred: list[DeferredKey],
) -> None:
    """Refuse a message whose verified key was seen before: now, or for a deferred store once the verdict is in
    (the key joins `deferred`, which goes out with the verdict; a refused message sets none of its keys)."""
    if isinstance(store, DeferredReplay):
        deferred.append(store.key(key, ttl_s, replayed))
    elif store is not None and store.seen(key, ttl_s):
        raise replayed
