"""The embedded archive store: append-only segment files on local disk, one directory per stream; needs nothing.

<directory>/<stream>/
  seg-<first seq>.jsonl   records, one JSON line each ({"meta": text, "body": base64, "hash": hex}), appended
  checkpoints.jsonl       the signed checkpoints, appended
  head.json               the stream's head (seq, hash), the current segment, what retention has retired
  lock                    flock'd while a writer appends: the workers of one host share the stream

A segment is rotated at `segment_max_mb` or when the UTC day changes; segments whose newest record is older
than the retention are removed whole (head.json keeps the last removed record's seq and hash, so the chain
still starts where it must). fsync: a batch's segment lines, then head.json, are on disk before the batch
counts as archived (one fsync pair per batch of up to 256 records, not per record)."""

from __future__ import annotations

import base64
import collections
import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from filters.stores.archive.record import GENESIS, BatchKeys, Pending, Stored, seal


class SegmentStore:
    def __init__(self, directory: str | Path, stream: str, segment_max_bytes: int = 64 << 20) -> None:
        self.stream = stream
        self.dir = Path(directory) / stream
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = segment_max_bytes

    @property
    def where(self) -> str:
        return str(self.dir)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.dir / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _state(self) -> dict:
        try:
            return json.loads((self.dir / "head.json").read_text())
        except FileNotFoundError:
            return {"seq": 0, "hash": GENESIS, "segment": None, "day": None, "retired_seq": 0, "retired_hash": GENESIS}

    def _write_state(self, state: dict) -> None:
        tmp = self.dir / "head.json.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps(state))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / "head.json")

    def append(self, batch: list[Pending]) -> tuple[int, str]:
        with self._locked():
            state = self._recovered(self._state())
            seq, prev = state["seq"], state["hash"]
            day = datetime.now(UTC).strftime("%Y-%m-%d")
            segment = state["segment"]
            if segment is None or state["day"] != day or (self.dir / segment).stat().st_size >= self.max_bytes:
                segment = f"seg-{seq + 1:012d}.jsonl"
            lines, keys = [], BatchKeys()
            for p in batch:
                seq += 1
                rec = seal(p, self.stream, seq, prev, keys)
                prev = rec.hash
                lines.append(_line(rec))
            with open(self.dir / segment, "a") as f:
                f.write("".join(lines))
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            self._write_state({**state, "seq": seq, "hash": prev, "segment": segment, "day": day, "size": size})
            return seq, prev

    def _recovered(self, state: dict) -> dict:
        """The head as the current segment says, after a writer died between its lines and head.json (their
        records are on disk: the head moves to them) or in the middle of a line (a torn line is cut off)."""
        segment = state["segment"]
        if segment is None or (self.dir / segment).stat().st_size == state.get("size"):
            return state
        path = self.dir / segment
        data = path.read_bytes()
        good = data.rfind(b"\n") + 1  # a last line without its newline was torn
        last = None
        for line in data[:good].splitlines():
            if line.strip():
                last = json.loads(line)
        if good < len(data):
            with open(path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        if last is not None:
            state = {**state, "seq": json.loads(last["meta"])["seq"], "hash": last["hash"]}
        state = {**state, "size": good}
        self._write_state(state)
        return state

    def add_checkpoint(self, text: str) -> None:
        with self._locked(), open(self.dir / "checkpoints.jsonl", "a") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())

    def retire(self, older_than: float) -> int:
        """Remove the segments whose newest record is older than `older_than` (Unix seconds), never the current."""
        removed = 0
        with self._locked():
            state = self._state()
            for path in self._segments():
                if path.name == state["segment"] or path.stat().st_mtime >= older_than:
                    break
                for last in collections.deque(self._read(path), maxlen=1):
                    state = {**state, "retired_seq": last.fields["seq"], "retired_hash": last.hash}
                    self._write_state(state)
                path.unlink()
                removed += 1
        return removed

    def _segments(self) -> list[Path]:
        return sorted(self.dir.glob("seg-*.jsonl"))

    @staticmethod
    def _read(path: Path) -> Iterator[Stored]:
        with open(path) as f:
            for line in f:
                if line.strip():
                    doc = json.loads(line)
                    yield Stored(doc["meta"], base64.b64decode(doc["body"]), doc["hash"])

    def records(self) -> Iterator[Stored]:
        for path in self._segments():
            yield from self._read(path)

    def columns(self) -> None:
        return None  # the meta is all there is: nothing beside it to disagree

    def checkpoints(self) -> list[str]:
        try:
            return [line for line in (self.dir / "checkpoints.jsonl").read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []

    def start(self) -> tuple[int, str]:
        state = self._state()
        return state["retired_seq"] + 1, state["retired_hash"]

    def head(self) -> tuple[int, str] | None:
        with self._locked():  # not between a batch's lines and its head.json
            state = self._state()
        return (state["seq"], state["hash"]) if state["seq"] else None

    def get(self, record_id: str) -> Stored | None:
        return next((r for r in self.records() if r.fields["id"] == record_id), None)

    def present(self, ids: list[str]) -> set[str]:
        wanted = set(ids)
        return {r.fields["id"] for r in self.records()} & wanted

    def search(self, **where: str | None) -> Iterator[dict]:
        since, until = where.pop("since", None), where.pop("until", None)
        for rec in self.records():
            meta = rec.fields
            if (since and meta["at"] < since) or (until and meta["at"] > until):
                continue
            if all(meta.get(k) == v for k, v in where.items() if v is not None):
                yield meta

    def close(self) -> None:
        pass


def _line(rec: Stored) -> str:
    """The record's segment line, as json.dumps({"meta", "body", "hash"}) writes it, without a dict's encoding:
    the meta text is the only part that needs escaping (hex and base64 never do), and being canonical JSON (ASCII,
    control characters escaped already) only its backslashes and quotes do: two str.replace, not json.dumps'
    loop over every character."""
    body = base64.b64encode(rec.body).decode()
    meta = rec.meta.replace("\\", "\\\\").replace('"', '\\"')
    return f'{{"meta": "{meta}", "body": "{body}", "hash": "{rec.hash}"}}\n'
