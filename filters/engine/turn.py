"""The engine's turn: one call into the engine at a time, as the engine is written (synchronous, its caches and
stage clocks shared without locks), whichever of the frame's engine threads makes it.

The worker holds the turn for each call from the frame (`held`). A call that waits on the network (a partner's
STS, an OCSP responder, another worker's Issue) gives the turn up for the wait (`released`): the worker's other
exchanges go on meanwhile, on the frame's other engine threads, and the waiting call takes the turn back before
it goes on. Nothing the engine computes is ever interleaved, only waits. Outside a turn (unit tests, the client
tool, a background refresh thread) `released` has nothing to give up and only waits."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_TURN = threading.Lock()


class _Holder(threading.local):
    holds = False  # this thread holds the turn


_holder = _Holder()


@contextmanager
def held() -> Iterator[None]:
    """Wait for the turn, hold it for the block."""
    with _TURN:
        _holder.holds = True
        try:
            yield
        finally:
            _holder.holds = False


@contextmanager
def released() -> Iterator[None]:
    """Give the turn up for a wait on the network (a no-op for a thread that does not hold it)."""
    if not _holder.holds:
        yield
        return
    _holder.holds = False
    _TURN.release()
    try:
        yield
    finally:
        _TURN.acquire()
        _holder.holds = True
