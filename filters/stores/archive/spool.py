"""The writer's spool: every queued record is first appended to a local file, so that a worker killed with records
still in its queue (SIGKILL, a crash) loses none of them: a living writer of the same stream takes the dead
worker's spool over and archives what it holds.

One file per writer, `<directory>/<stream>.<pid>.spool`, flock'd while its writer lives; `<...>.done` holds how
far the writer has archived (8 bytes). Appending is a write() into the page cache, no fsync: the request never
waits on the disk, and what a killed process wrote is still there (a machine crash is the segment store's and the
database's fsync's concern: the spool guards the queue, not the disk). The writer empties the file whenever all
of it is archived. A spool taken over may hold records archived just before the kill, between the store's commit
and the done mark: those are recognized by their ids and not archived twice."""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
from pathlib import Path

from filters.stores.archive.record import Pending, from_spool, to_spool

log = logging.getLogger("wsgate.archive")
_DONE = struct.Struct(">Q")


class Spool:
    def __init__(self, directory: str | Path, stream: str) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stream = stream
        self.path = self.dir / f"{stream}.{os.getpid()}.spool"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.done_fd = os.open(self.path.with_suffix(".done"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.size = 0
        self._held: dict[Path, int] = {}  # orphan spools taken over, locked until released
        self.lock = threading.Lock()  # the worker's thread appends, the writer's thread marks and empties

    def append(self, p: Pending) -> int:
        """Spool `p`; the offset after it (the writer marks it done once archived)."""
        frame = to_spool(p)
        with self.lock:
            self.size += os.writev(self.fd, frame)
            return self.size

    def done(self, offset: int) -> None:
        """Everything up to `offset` is archived; an empty spool is truncated."""
        with self.lock:
            if offset >= self.size:
                os.ftruncate(self.fd, 0)
                self.size = 0
                offset = 0
            os.pwrite(self.done_fd, _DONE.pack(offset), 0)

    def close(self) -> None:
        os.close(self.done_fd)
        os.close(self.fd)
        if self.size == 0:
            self.path.unlink(missing_ok=True)
            self.path.with_suffix(".done").unlink(missing_ok=True)

    def orphans(self) -> list[tuple[Path, list[Pending]]]:
        """The spools of this stream whose writer is gone (no flock on them), with what they hold beyond their done
        mark. The caller archives those records, then `release`s the file (still locked by us until then)."""
        found = []
        for path in sorted(self.dir.glob(f"{self.stream}.*.spool")):
            if path == self.path:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # its writer lives (or another writer is taking it over)
                continue
            if not path.exists():  # taken over and removed between the glob and the lock
                os.close(fd)
                continue
            found.append((path, _read(path, fd)))
            self._held[path] = fd
        return found

    def release(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        path.with_suffix(".done").unlink(missing_ok=True)
        os.close(self._held.pop(path))


def _read(path: Path, fd: int) -> list[Pending]:
    data = os.pread(fd, os.fstat(fd).st_size, 0)
    try:
        mark = path.with_suffix(".done").read_bytes()
        offset = _DONE.unpack(mark)[0] if len(mark) == _DONE.size else 0
    except FileNotFoundError:
        offset = 0
    out = []
    while (got := from_spool(data, offset)) is not None:
        p, offset = got
        out.append(p)
    if offset < len(data):
        log.warning("archive spool %s: a torn last record (%d bytes) left out", path.name, len(data) - offset)
    return out
