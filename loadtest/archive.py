"""Archiving on for the load tests (docs/audit.md): `make bench BENCH_ARGS=--archive` (its rows beside a run
without: the gateway's CPU per request with the archive on and off) and the soak (`--archive`), which counts
every secured request the gateway accepted and the archive does not hold."""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

from filters.engine.wss import keys
from filters.stores.archive.record import open_body
from filters.stores.archive.segments import SegmentStore

SECURED = ("hmac", "rsa", "secureconversation")
CERTS = "${WSGATE_BENCH_CERTS:-certs/out}"


def with_archive(policies: Path, out: Path, archive: Path) -> Path:
    """`policies` copied into `out`, every secured route archiving its signed requests and replies to the
    segment store in `archive` (the bench policies' keys: the body encrypted to gateway-enc, checkpoints signed
    by gateway-sign)."""
    out.mkdir(parents=True, exist_ok=True)
    section = {
        "keep": ["signed_requests", "signed_replies"],
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


def missing(archive: Path, certs: Path, accepted: set[str]) -> tuple[int, int]:
    """(requests archived, accepted requests not among them): `accepted` holds the SHA-256 of each accepted
    request's bytes, which the archived originals (opened with the body key) must include."""
    key = keys.load_private_key(certs / "gateway-enc.key")
    archived = set()
    for stream in (p for p in archive.iterdir() if p.is_dir() and p.name != "spool"):
        for rec in SegmentStore(archive, stream.name).records():
            if rec.fields["kind"] == "request":
                body = open_body(rec, key)
                archived.add(hashlib.sha256(body or b"").hexdigest())
    return len(archived), len(accepted - archived)
