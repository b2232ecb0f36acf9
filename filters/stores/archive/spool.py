"""The writer's spool: every queued record is first appended to a local file, so that a worker killed with records
still in its queue (SIGKILL, a crash) loses none of them: a living writer of the same stream takes the dead
worker's spool over and archives what it holds.

A writer's spool is a run of files, `<directory>/<stream>.<pid>.<n>.spool`, each flock'd while its writer lives;
`<...>.done` holds how far the writer has archived in it (8 bytes). Appending is a write() into the page cache, no
fsync: the request never waits on the disk, and what a killed process wrote is still there (a machine crash is
the segment store's and the database's fsync's concern: the spool guards the queue, not the disk). The writer
empties the last file whenever all of it is archived; under steady traffic it never is, so appends go on in a new
file once the last one holds `rotate_bytes`, and a file is removed once all of it is archived: the spool holds
about what is queued, not the traffic since the last quiet moment. A spool taken over may hold records archived
just before the kill, between the store's commit and the done mark: those are recognized by their ids and not
archived twice."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from filters.stores.archive.record import Pending, from_spool, to_spool

log = logging.getLogger("wsgate.archive")
_DONE = struct.Struct(">Q")


ROTATE_BYTES = 8 << 20


@dataclass
class _File:
    path: Path
    fd: int
    done_fd: int
    start: int  # the spool position (bytes appended by this writer, all files) of its first byte
    size: int = 0


class Spool:
    def __init__(self, directory: str | Path, stream: str, rotate_bytes: int = ROTATE_BYTES) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stream = stream
        self.rotate_bytes = rotate_bytes
        self._n = 0
        self.position = 0
        self._files = [self._open()]  # oldest first; the last one takes the appends
        self._held: dict[Path, int] = {}  # orphan spools taken over, locked until released
        self.lock = threading.Lock()  # the worker's thread appends, the writer's thread marks and empties

    def _open(self) -> _File:
        path = self.dir / f"{self.stream}.{os.getpid()}.{self._n}.spool"
        self._n += 1
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        done_fd = os.open(path.with_suffix(".done"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        return _File(path, fd, done_fd, self.position)

    def append(self, p: Pending) -> int:
        """Spool `p`; the spool position after it (the writer marks it done once archived)."""
        frame = to_spool(p)
        with self.lock:
            if self._files[-1].size >= self.rotate_bytes:
                self._files.append(self._open())
            f = self._files[-1]
            written = os.writev(f.fd, frame)
            f.size += written
            self.position += written
            return self.position

    def done(self, position: int) -> None:
        """Everything up to `position` is archived: files wholly before it are removed, an archived last file is
        emptied."""
        with self.lock:
            while len(self._files) > 1 and self._files[0].start + self._files[0].size <= position:
                _remove(self._files.pop(0))
            f = self._files[0]
            offset = position - f.start
            if len(self._files) == 1 and offset >= f.size:
                os.ftruncate(f.fd, 0)
                f.start, f.size, offset = self.position, 0, 0
            os.pwrite(f.done_fd, _DONE.pack(offset), 0)

    def close(self) -> None:
        """Close the files; removed when all is archived, else left for another writer of the stream."""
        archived = len(self._files) == 1 and self._files[0].size == 0
        for f in self._files:
            if archived:
                _remove(f)
            else:
                os.close(f.done_fd)
                os.close(f.fd)

    def orphans(self) -> list[tuple[Path, list[Pending]]]:
        """The spools of this stream whose writer is gone (no flock on them), with what they hold beyond their done
        mark. The caller archives those records, then `release`s the file (still locked by us until then)."""
        found = []
        own = {f.path for f in self._files}
        # This stream's only (not those of a stream "<stream>.x"): <pid>.<n>, or <pid> as an earlier version named them
        mine = re.compile(re.escape(self.stream) + r"\.\d+(\.\d+)?\.spool")
        paths = [p for p in self.dir.glob(f"{self.stream}.*.spool") if mine.fullmatch(p.name) and p not in own]
        for path in sorted(paths, key=_order):
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


def _remove(f: _File) -> None:
    os.close(f.done_fd)
    os.close(f.fd)
    f.path.unlink(missing_ok=True)
    f.path.with_suffix(".done").unlink(missing_ok=True)


def _order(path: Path) -> tuple[str, int]:
    """A killed writer's files in the order it wrote them (`<stream>.<pid>.<n>.spool`)."""
    head, _, n = path.stem.rpartition(".")
    return head, int(n)


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
