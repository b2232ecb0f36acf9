"""Loopback ports for the servers that tests, benchmarks and side-by-side gateways start, chosen before the server
binds them. Two things could take such a port in between, and neither can here:
- an outgoing connection: the kernel gives it a local port from its ephemeral range (ip_local_port_range, which
  is also where binding port 0 draws from), so ports are chosen outside that range;
- another process of the same run (a second pytest, a benchmark): each process reserves blocks of ports by
  holding an flock on a file per block under a directory shared by the user's processes, and hands out only
  ports of its own blocks, each to one caller until it is released. The kernel drops a dead process's locks.
A port is handed out only if it can be bound right now (no listener, no connection left in TIME_WAIT). Should a
server still find its port taken (by a process outside this scheme), it says so (PortInUse) and the caller may
start it once more on other ports (`retried_if_taken`)."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, TypeVar

log = logging.getLogger("wsgate.ports")
T = TypeVar("T")

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Wider than Linux's default (32768-60999) and macOS's (49152-65535): used where the range cannot be read.
FALLBACK_EPHEMERAL = (32768, 65535)
# Below: fixed ports of the machine's services, `wsgate up`'s defaults among them (8080, 8443, 9100, 9901...).
LOWEST = 10000
BLOCK = 256  # ports per reservation: a gateway takes 5 + 4 x workers
DIR_ENV = "WSGATE_PORTS_DIR"  # where the block locks are; default: wsgate-ports-<uid> under the temp directory


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (and port 0), inclusive."""
    try:
        low, high = (int(v) for v in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return FALLBACK_EPHEMERAL
    return low, high


def blocks() -> list[int]:
    """The first port of every block wholly outside the ephemeral range: below its start, then above its end."""
    low, high = ephemeral_range()
    below = range(LOWEST, low - BLOCK + 1, BLOCK)
    above = range(max(LOWEST, high + 1), 65536 - BLOCK + 1, BLOCK)
    return [*below, *above]


def lock_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or Path(tempfile.gettempdir()) / f"wsgate-ports-{os.getuid()}")


def _bindable(port: int) -> bool:
    # No SO_REUSEADDR: a port with a connection left in TIME_WAIT is skipped too, for servers that bind without it.
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class _Pool:
    """This process's blocks and the ports of them handed out and not yet released."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.locks: dict[int, IO[bytes]] = {}  # by a block's first port; open while reserved, not inherited by children
        self.order: list[int] = []  # every port of the blocks held, in the order they are handed out
        self.next = 0  # round robin: a released port comes back last
        self.leased: set[int] = set()

    def take(self, count: int, consecutive: bool) -> list[int]:
        if not 0 < count <= BLOCK:
            raise ValueError(f"between 1 and {BLOCK} ports at once, not {count}")
        with self.mutex:
            while (found := self._scan(count, consecutive)) is None:
                self._reserve_block()
            self.leased.update(found)
            return found

    def release(self, ports: Iterable[int]) -> None:
        with self.mutex:
            self.leased.difference_update(ports)

    def _free(self, port: int) -> bool:
        return port not in self.leased and _bindable(port)

    def _scan(self, count: int, consecutive: bool) -> list[int] | None:
        picked: list[int] = []
        n = len(self.order)
        for step in range(n):
            i = (self.next + step) % n
            if consecutive:
                run = self.order[i : i + count]
                if len(run) == count and run[-1] - run[0] == count - 1 and all(map(self._free, run)):
                    self.next = (i + count) % n
                    return run
            elif self._free(self.order[i]):
                picked.append(self.order[i])
                if len(picked) == count:
                    self.next = (i + 1) % n
                    return picked
        return None

    def _reserve_block(self) -> None:
        directory = lock_dir()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        firsts = blocks()
        if not firsts:
            raise RuntimeError(
                f"no loopback port block outside the ephemeral range {ephemeral_range()} ({EPHEMERAL_RANGE})"
            )
        for first in firsts:  # in order: the lowest block no other process holds
            if first in self.locks:
                continue
            f = open(directory / f"block-{first}.lock", "ab")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            self.locks[first] = f
            self.order.extend(range(first, first + BLOCK))
            return
        raise RuntimeError(
            f"every loopback port block outside the ephemeral range is reserved by other processes (locks in {directory})"
        )


_pool = _Pool()


def _after_fork() -> None:
    # A forked child shares its parent's locks and tables: it must not hand out the parent's ports.
    global _pool
    _pool = _Pool()


os.register_at_fork(after_in_child=_after_fork)


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports, outside the ephemeral range, free now and reserved for this process's caller
    until released (`release`) or the process ends."""
    return _pool.take(n, consecutive=False)


def free_consecutive_ports(count: int) -> int:
    """The first of `count` consecutive ports, reserved as free_ports reserves (filter workers listen on
    consecutive ports)."""
    return _pool.take(count, consecutive=True)[0]


def release(ports: Iterable[int]) -> None:
    """Hand ports back once the servers bound to them have stopped; ports this process never reserved are ignored."""
    _pool.release(ports)


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` itself listens on TCP `port` (any address), from Linux's /proc: a connection that
    succeeds may have reached another process that took the port."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


class PortInUse(RuntimeError):
    """A server could not bind its port: another process has it. On ports chosen here, that process is outside
    this scheme (a fixed port, another user's run) and took the port since it was chosen."""


# How Envoy, Python, Rust (tonic), Go, redis-server and PostgreSQL all word EADDRINUSE in their logs.
_BIND_FAILED = re.compile(rb"address already in use", re.IGNORECASE)


def bind_failed(log_text: bytes) -> bool:
    """Whether a server's log says it could not bind its port."""
    return _BIND_FAILED.search(log_text) is not None


def retried_if_taken(start: Callable[[], T], what: str) -> T:
    """`start()` (which chooses its ports here), and once more, on the ports it chooses then, if it raised
    PortInUse; any other failure, or a second lost port, is raised."""
    try:
        return start()
    except PortInUse as exc:
        log.warning("%s: %s; starting it again on other ports", what, exc)
    return start()
