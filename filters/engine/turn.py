"""The engine's turn: one call into the engine at a time, as the engine is written (synchronous, its caches and
stage clocks shared without locks), whichever thread makes it.

The worker holds the turn for each call from the frame (`held`). The frame makes every call first on its gRPC
thread (`may_wait` False): a call there must not wait on the network, as every other exchange of the worker waits
for that thread. A call about to wait (a partner's STS, an OCSP responder, another worker's Issue: `released`)
raises `WouldWait` there instead, before the wait; the worker answers that the call belongs elsewhere, and the
frame makes it again on one of its engine threads (`may_wait` True), where the call gives the turn up for the wait:
the worker's other exchanges go on meanwhile, and the waiting call takes the turn back before it goes on. Nothing
the engine computes is ever interleaved, only waits. So whatever a call does before `released` must be redone
harmlessly by its second run (a read, a lock it lets go on the way out; not a replay key). At steady state (the
context cached, the OCSP answers fresh) no call waits and none is made twice.

Outside a turn (unit tests, the client tool, a background refresh thread) `released` has nothing to give up and
only waits."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_TURN = threading.Lock()


class WouldWait(BaseException):
    """A call that may not wait (on the frame's gRPC thread) is about to: it must be made again where it may. Not
    an error (a BaseException: the engine's `except Exception` handlers let it through to the worker)."""


class _Holder(threading.local):
    holds = False  # this thread holds the turn
    may_wait = True  # ... and may give it up to wait (else `released` raises WouldWait)


_holder = _Holder()


@contextmanager
def held(may_wait: bool = True) -> Iterator[None]:
    """Wait for the turn, hold it for the block; `may_wait` False: a wait in the block raises WouldWait."""
    with _TURN:
        _holder.holds, _holder.may_wait = True, may_wait
        try:
            yield
        finally:
            _holder.holds, _holder.may_wait = False, True


@contextmanager
def released() -> Iterator[None]:
    """Give the turn up for a wait on the network (a no-op for a thread that does not hold it); WouldWait for a call
    that may not wait."""
    if not _holder.holds:
        yield
        return
    if not _holder.may_wait:
        raise WouldWait
    _holder.holds = False
    _TURN.release()
    try:
        yield
    finally:
        _TURN.acquire()
        _holder.holds = True
