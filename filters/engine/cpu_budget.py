"""Work that may not take more than a CPU budget: `Bounded`, a child process forked from the worker that runs one
function on bytes, and that the kernel kills when one call crosses its budget.

Why a process: libxml2's XML Schema validation has no time limit and cannot be interrupted. Its regular
expression matcher (pattern facets) and its content-model automata backtrack when they are ambiguous, e.g.
`(a|aa)*`, `(\\w{1,10}\\s?)*` or a repeated sequence of a repeated element: each value or element may cost up to
libxml2's own limit (10 million saved states, 0.1 to 0.5 s, more with many counters) and a message holds
thousands. Neither a thread nor a signal handler can stop C code in the middle; the kernel can stop a process.

The child arms ITIMER_PROF (its own user and system CPU) for each call, with the signal's default action
(terminate): a call that crosses its budget ends the child within one scheduler tick (4 ms at HZ=250), whatever
the work was doing. The parent sees the end of the pipe, reaps the child, raises OverBudget, and forks a fresh
child on the next call. A wall-clock cap (a stopped or starved child) ends with SIGKILL the same way."""

from __future__ import annotations

import ctypes
import gc
import os
import select
import signal
import struct
import time
import weakref
from collections.abc import Callable

_HEADER = struct.Struct("!Id")  # payload length, budget in CPU seconds
_REPLY = struct.Struct("!I")
WALL_CAP_S = 30.0  # how long a call may wait for a child that uses no CPU (stopped, starved) before it is killed
_LIBC = ctypes.CDLL(None, use_errno=True)


class OverBudget(Exception):
    """The call used its CPU budget (or the wall-clock cap) and its child was killed."""


class Bounded:
    """`work(data) -> bytes` run in a child process, each call within a CPU budget.

    The child is forked on first use (it inherits `work` and what it holds, e.g. a compiled schema, without
    copying), and again after a call it was killed for. One call at a time: a worker's engine is synchronous.
    Two pipes carry the calls (a pipe, not a socket: the engine opens none)."""

    def __init__(self, work: Callable[[bytes], bytes]) -> None:
        self.work = work
        self._pipes: tuple[int, int] | None = None  # (write to the child, read from it)
        self._pid = 0
        self._finalizer: weakref.finalize | None = None
        self._ended = [0.0]  # the CPU seconds of the children that ended (loadtest/hostile.py counts them)

    def __call__(self, data: bytes, budget_s: float) -> bytes:
        to_child, from_child = self._pipes or self._start()
        deadline = time.monotonic() + max(WALL_CAP_S, 10 * budget_s)
        try:
            _write(to_child, _HEADER.pack(len(data), budget_s) + data)
            (length,) = _REPLY.unpack(_read(from_child, _REPLY.size, deadline))
            return _read(from_child, length, deadline)
        except (OSError, EOFError):  # the child ended (its budget) or timed out: it is replaced
            self.close()
            raise OverBudget(f"over its CPU budget of {budget_s * 1000:.1f} ms") from None

    def _start(self) -> tuple[int, int]:
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child: it never returns
            try:
                _serve(down_r, up_w, self.work)
            finally:
                os._exit(0)
        os.close(down_r)
        os.close(up_w)
        self._pipes, self._pid = (down_w, up_r), pid
        self._finalizer = weakref.finalize(self, _end, self._pipes, pid, self._ended)
        return self._pipes

    def cpu_seconds(self) -> float:
        """The CPU its children used: those that ended, and the one running (its CPU clock, to the ns)."""
        clock = ctypes.c_int()
        if not self._pid or _LIBC.clock_getcpuclockid(self._pid, ctypes.byref(clock)):
            return self._ended[0]
        return self._ended[0] + time.clock_gettime(clock.value)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._pipes = self._finalizer = None
        self._pid = 0


def _end(pipes: tuple[int, int], pid: int, ended: list[float]) -> None:
    """Close the child's pipes (an idle child exits on it), make sure it is gone, reap it and count its CPU."""
    for fd in pipes:
        os.close(fd)
    try:
        os.kill(pid, signal.SIGKILL)
        _, _, usage = os.wait4(pid, 0)
        ended[0] += usage.ru_utime + usage.ru_stime
    except (ChildProcessError, ProcessLookupError):
        pass


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read(fd: int, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; EOFError when the writer is gone, TimeoutError past `deadline` (time.monotonic)."""
    chunks, got = [], 0
    poll = select.poll()
    poll.register(fd, select.POLLIN)
    while got < n:
        if deadline is not None and not poll.poll(max(0.0, deadline - time.monotonic()) * 1000):
            raise TimeoutError
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _serve(down: int, up: int, work: Callable[[bytes], bytes]) -> None:  # pragma: no cover - runs in the child
    # Only its two pipes stay open (the worker's listener, Redis and log files are the worker's), and the signals
    # a process group gets end the child as they would a plain process; SIGPROF ends it at its budget.
    gc.freeze()  # collections leave the worker's objects alone: writing their headers would copy every shared page
    low, high = sorted((down, up))
    os.closerange(3, low)
    os.closerange(low + 1, high)
    os.closerange(high + 1, 1 << 16)
    for sig in (signal.SIGPROF, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    while True:
        try:
            length, budget_s = _HEADER.unpack(_read(down, _HEADER.size))
            data = _read(down, length)
        except (OSError, EOFError):
            return  # the worker closed its end or ended
        signal.setitimer(signal.ITIMER_PROF, budget_s)
        out = work(data)
        signal.setitimer(signal.ITIMER_PROF, 0)
        _write(up, _REPLY.pack(len(out)) + out)
