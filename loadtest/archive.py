"""Archiving on for the load tests (docs/audit.md): `make bench BENCH_ARGS=--archive` (its rows beside a run
without: the gateway's CPU per request with the archive on and off) and the soak (`--archive`), which counts
every secured request the gateway accepted and the archive does not hold: in the segment store, or in a
PostgreSQL server the soak may restart (`ArchiveDb`)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

import yaml

from filters.engine.wss import keys
from filters.stores.archive.postgres import PostgresStore
from filters.stores.archive.record import open_body
from filters.stores.archive.segments import SegmentStore

SECURED = ("hmac", "rsa", "secureconversation", "saml")
CERTS = "${WSGATE_BENCH_CERTS:-certs/out}"
DSN_ENV = "WSGATE_LOAD_ARCHIVE_DSN"  # the gateway's workers read the DSN from here: never in a policy file


class ArchiveDb(Protocol):
    """A PostgreSQL server the soak archives to and restarts (tests/support/postgres.py's)."""

    dsn: str

    def stop(self) -> None: ...

    def start(self) -> None: ...


def with_archive(policies: Path, out: Path, archive: Path, db: bool = False) -> Path:
    """`policies` copied into `out`, every secured route archiving its signed requests and replies to the
    segment store in `archive`, or with `db` to PostgreSQL (the DSN from DSN_ENV; `archive` holds the spools);
    the bench policies' keys: the body encrypted to gateway-enc, checkpoints signed by gateway-sign."""
    out.mkdir(parents=True, exist_ok=True)
    section = {
        "keep": ["signed_requests", "signed_replies"],
        **({"store": "postgres", "dsn": f"${{{DSN_ENV}}}"} if db else {}),
        "directory": str(archive.resolve()),
        "body_key_certificate": f"{CERTS}/gateway-enc.pem",
        "signing_key": f"{CERTS}/gateway-sign.key",
        "signing_certificate": f"{CERTS}/gateway-sign.pem",
    }
    for src in policies.glob("*.y*ml"):
        doc = yaml.safe_load(src.read_text())
        for route in doc.get("routes", []):
            if route.get("profile") in SECURED:
                route["archive"] = section
        (out / src.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def missing(archive: Path, certs: Path, accepted: set[str], dsn: str | None = None) -> tuple[int, int]:
    """(requests archived, accepted requests not among them): `accepted` holds the SHA-256 of each accepted
    request's bytes, which the archived originals (opened with the body key) must include."""
    key = keys.load_private_key(certs / "gateway-enc.key")
    store = PostgresStore(dsn, "default") if dsn else SegmentStore(archive, "default")
    archived = set()
    for rec in store.records():
        if rec.fields["kind"] == "request":
            archived.add(hashlib.sha256(open_body(rec, key) or b"").hexdigest())
    store.close()
    return len(archived), len(accepted - archived)
