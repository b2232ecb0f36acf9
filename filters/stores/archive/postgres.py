"""The archive in PostgreSQL (psycopg 3), for a cluster: every gateway replica appends to the same streams.

Tables (created when missing):
  audit_streams      one row per stream: its head (seq, hash) and what retention retired; a batch takes the row
                     FOR UPDATE, so replicas append one after another and the chain stays one line
  audit_records      the record: its meta text (what the hash covers), the body ciphertext, the hash, and copies of
                     the searchable fields in indexed columns (verify-chain checks they agree with the meta)
  audit_checkpoints  the signed checkpoints

Bodies live in the table (bytea), not in files beside it: a record and its body commit in one transaction, so no
body is ever without its record (or the reverse) after a crash, one backup (pg_dump, base backup) holds the
whole evidence, and the bodies are bounded by the route's `max_record_bytes` (TOAST stores large values out of
line anyway). The DSN is never logged: errors are reported by their class and SQLSTATE only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime

import psycopg

from filters.stores.archive.record import GENESIS, SEARCH_FIELDS, BatchKeys, Pending, Stored, seal

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS audit_streams (
    name text PRIMARY KEY, seq bigint NOT NULL, hash text NOT NULL,
    retired_seq bigint NOT NULL DEFAULT 0, retired_hash text NOT NULL DEFAULT '{GENESIS}');
CREATE TABLE IF NOT EXISTS audit_records (
    stream text NOT NULL, seq bigint NOT NULL, id text NOT NULL UNIQUE, hash text NOT NULL,
    meta text NOT NULL, body bytea NOT NULL,
    at text NOT NULL, route text NOT NULL, kind text NOT NULL, verdict text NOT NULL,
    identity text, message_id text, request_id text,
    PRIMARY KEY (stream, seq));
CREATE INDEX IF NOT EXISTS audit_records_at ON audit_records (at);
CREATE INDEX IF NOT EXISTS audit_records_identity ON audit_records (identity);
CREATE INDEX IF NOT EXISTS audit_records_message_id ON audit_records (message_id);
CREATE INDEX IF NOT EXISTS audit_records_request_id ON audit_records (request_id);
CREATE TABLE IF NOT EXISTS audit_checkpoints (stream text NOT NULL, seq bigint NOT NULL, doc text NOT NULL);
"""


class DatabaseError(Exception):
    """The database failed; the message names no DSN, password or value."""


def describe(exc: psycopg.Error) -> str:
    return f"{type(exc).__name__} (SQLSTATE {exc.sqlstate or '-'})"


class PostgresStore:
    def __init__(self, dsn: str, stream: str) -> None:
        self.stream = stream
        self._dsn = dsn
        self._conn: psycopg.Connection | None = None

    @property
    def where(self) -> str:
        return "postgresql"

    def __repr__(self) -> str:  # never the DSN
        return f"PostgresStore(stream={self.stream!r})"

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            try:
                self._conn = psycopg.connect(self._dsn, connect_timeout=5)
                with self._conn.transaction():
                    self._conn.execute(SCHEMA)
            except psycopg.Error as exc:
                self._conn = None
                raise DatabaseError(f"cannot reach the archive database: {describe(exc)}") from None
        return self._conn

    def _run(self, fn):  # type: ignore[no-untyped-def]
        conn = self._connection()
        try:
            with conn.transaction():
                return fn(conn)
        except psycopg.Error as exc:
            raise DatabaseError(f"archive database error: {describe(exc)}") from None

    def append(self, batch: list[Pending]) -> tuple[int, str]:
        def write(conn: psycopg.Connection) -> tuple[int, str]:
            conn.execute(
                "INSERT INTO audit_streams (name, seq, hash) VALUES (%s, 0, %s) ON CONFLICT DO NOTHING",
                (self.stream, GENESIS),
            )
            row = conn.execute(
                "SELECT seq, hash FROM audit_streams WHERE name = %s FOR UPDATE", (self.stream,)
            ).fetchone()
            assert row is not None
            seq, prev = row
            rows, keys = [], BatchKeys()
            for p in batch:
                seq += 1
                rec = seal(p, self.stream, seq, prev, keys)
                prev = rec.hash
                meta = rec.fields
                rows.append(
                    (self.stream, seq, meta["id"], rec.hash, rec.meta, rec.body, *(meta[k] for k in SEARCH_FIELDS))
                )
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO audit_records (stream, seq, id, hash, meta, body, at, route, kind, verdict, identity,"
                    " message_id, request_id) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                    rows,
                )
            conn.execute("UPDATE audit_streams SET seq = %s, hash = %s WHERE name = %s", (seq, prev, self.stream))
            return seq, prev

        return self._run(write)

    def add_checkpoint(self, text: str) -> None:
        seq = json.loads(text)["seq"]
        self._run(lambda c: c.execute("INSERT INTO audit_checkpoints VALUES (%s, %s, %s)", (self.stream, seq, text)))

    def retire(self, older_than: float) -> int:
        cutoff = datetime.fromtimestamp(older_than, UTC).isoformat(timespec="microseconds")

        def delete(conn: psycopg.Connection) -> int:
            row = conn.execute("SELECT seq FROM audit_streams WHERE name = %s FOR UPDATE", (self.stream,)).fetchone()
            if row is None:
                return 0
            # Whole prefixes only, never the head: the chain keeps one unbroken line from the last retired record.
            last = conn.execute(
                "SELECT max(seq) FROM audit_records WHERE stream = %s AND seq < %s AND seq < COALESCE("
                "(SELECT min(seq) FROM audit_records WHERE stream = %s AND at >= %s), %s)",
                (self.stream, row[0], self.stream, cutoff, row[0]),
            ).fetchone()
            if last is None or last[0] is None:
                return 0
            retired = conn.execute(
                "SELECT hash FROM audit_records WHERE stream = %s AND seq = %s", (self.stream, last[0])
            ).fetchone()
            assert retired is not None
            conn.execute(
                "UPDATE audit_streams SET retired_seq = %s, retired_hash = %s WHERE name = %s",
                (last[0], retired[0], self.stream),
            )
            cur = conn.execute("DELETE FROM audit_records WHERE stream = %s AND seq <= %s", (self.stream, last[0]))
            return cur.rowcount

        return self._run(delete)

    def _rows(self) -> list[tuple]:
        fields = ", ".join(SEARCH_FIELDS)
        # Ordered as stored in the chain's own terms would hide a swap: the meta's seq is checked against the column.
        return self._run(
            lambda c: c.execute(
                f"SELECT meta, body, hash, seq, stream, {fields} FROM audit_records WHERE stream = %s ORDER BY seq",
                (self.stream,),
            ).fetchall()
        )

    def records(self) -> Iterator[Stored]:
        for row in self._rows():
            yield Stored(row[0], bytes(row[1]), row[2])

    def columns(self) -> Iterator[dict]:
        for row in self._rows():
            yield {"seq": row[3], "stream": row[4], **dict(zip(SEARCH_FIELDS, row[5:], strict=True))}

    def checkpoints(self) -> list[str]:
        rows = self._run(
            lambda c: c.execute("SELECT doc FROM audit_checkpoints WHERE stream = %s", (self.stream,)).fetchall()
        )
        return [r[0] for r in rows]

    def _stream_row(self) -> tuple | None:
        return self._run(
            lambda c: c.execute(
                "SELECT seq, hash, retired_seq, retired_hash FROM audit_streams WHERE name = %s", (self.stream,)
            ).fetchone()
        )

    def start(self) -> tuple[int, str]:
        row = self._stream_row()
        return (row[2] + 1, row[3]) if row else (1, GENESIS)

    def head(self) -> tuple[int, str] | None:
        row = self._stream_row()
        return (row[0], row[1]) if row and row[0] else None

    def get(self, record_id: str) -> Stored | None:
        row = self._run(
            lambda c: c.execute("SELECT meta, body, hash FROM audit_records WHERE id = %s", (record_id,)).fetchone()
        )
        return Stored(row[0], bytes(row[1]), row[2]) if row else None

    def present(self, ids: list[str]) -> set[str]:
        rows = self._run(lambda c: c.execute("SELECT id FROM audit_records WHERE id = ANY(%s)", (ids,)).fetchall())
        return {r[0] for r in rows}

    def search(self, **where: str | None) -> Iterator[dict]:
        clauses, args = ["stream = %s"], [self.stream]
        since, until = where.pop("since", None), where.pop("until", None)
        if since:
            clauses.append("at >= %s")
            args.append(since)
        if until:
            clauses.append("at <= %s")
            args.append(until)
        for k, v in where.items():
            if v is not None:
                assert k in SEARCH_FIELDS  # column names from the fixed set only
                clauses.append(f"{k} = %s")
                args.append(v)
        sql = f"SELECT meta FROM audit_records WHERE {' AND '.join(clauses)} ORDER BY seq"
        for row in self._run(lambda c: c.execute(sql, args).fetchall()):
            yield json.loads(row[0])

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
