"""The non-repudiation archive's tamper evidence (docs/audit.md): whoever can write the segment files or the
database tables alters, removes, inserts or reorders records, with or without recomputing hashes; verify-chain
finds the first break, in both stores (a real PostgreSQL server, never a mock)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from filters.engine.wss import keys
from filters.stores.archive.record import (
    GENESIS,
    ChainReport,
    Stored,
    canonical,
    checkpoint,
    record_hash,
    seal,
    verify_chain,
)
from tests.support.archive import Tamper, fill, open_backend, pending
from tests.support.postgres import Postgres


@pytest.fixture(params=["segments", "postgres"])
def archive(request: pytest.FixtureRequest, tmp_path: Path, pki: Path) -> Iterator[Tamper]:
    pg: Postgres | None = request.getfixturevalue("postgres") if request.param == "postgres" else None
    store = open_backend(request.param, tmp_path, pg)
    fill(store, pki)
    yield Tamper(store, pg)
    store.close()


def check(t: Tamper, pki: Path) -> ChainReport:
    s = t.store
    cert = keys.load_certificate(pki / "gateway-sign.pem")
    return verify_chain(s.records(), s.checkpoints(), cert, start=s.start(), head=s.head(), head_after=s.head,
                        columns=s.columns())  # fmt: skip


def reseal(rec: Stored, **changes: object) -> Stored:
    """The record with changed fields and its own hash recomputed (the link to it from the next one is not)."""
    meta = {**rec.fields, **changes}
    text = canonical(meta)
    return Stored(text, rec.body, record_hash(text, rec.body))


def rewritten(t: Tamper, pki: Path, records: list[Stored]) -> ChainReport:
    """`records` renumbered and re-linked from the first on, written with the head moved to the last: a chain
    consistent in itself, as a forger who recomputes every hash leaves it; verify-chain's report."""
    prev, out = GENESIS, []
    for seq, rec in enumerate(records, 1):
        out.append(reseal(rec, seq=seq, prev=prev))
        prev = out[-1].hash
    t.write(out)
    t.set_head(out[-1])
    return check(t, pki)


def test_untouched_archive_is_intact(archive: Tamper, pki: Path) -> None:
    report = check(archive, pki)
    assert report.intact, report.break_at
    assert (report.records, report.checkpoints, report.first_seq, report.last_seq) == (10, 2, 1, 10)


def test_altered_record_found(archive: Tamper, pki: Path) -> None:
    recs = archive.records()
    recs[3] = replace(recs[3], meta=recs[3].meta.replace('"accepted"', '"refused"'))
    archive.write(recs)
    report = check(archive, pki)
    assert not report.intact and "seq 4" in report.break_at and "altered" in report.break_at


def test_altered_record_with_recomputed_hash_found(archive: Tamper, pki: Path) -> None:
    recs = archive.records()
    recs[3] = reseal(recs[3], identity="CN=someone else")
    archive.write(recs)
    report = check(archive, pki)
    assert not report.intact and "seq 5" in report.break_at and "link" in report.break_at


def test_altered_body_found(archive: Tamper, pki: Path) -> None:
    recs = archive.records()
    recs[6] = replace(recs[6], body=bytes([recs[6].body[0] ^ 1]) + recs[6].body[1:])
    archive.write(recs)
    assert "seq 7" in (check(archive, pki).break_at or "")


def test_deleted_record_found(archive: Tamper, pki: Path) -> None:
    recs = archive.records()
    del recs[4]
    archive.write(recs)
    report = check(archive, pki)
    assert not report.intact and "expected seq 5" in report.break_at


def test_deleted_tail_found(archive: Tamper, pki: Path) -> None:
    archive.write(archive.records()[:-2])
    report = check(archive, pki)
    assert not report.intact and "head" in report.break_at


def test_inserted_record_found(archive: Tamper, pki: Path) -> None:
    recs = archive.records()
    # A forged record sealed properly after seq 5 (between two batches: inside one, the batch shows it), and
    # everything after it renumbered and re-linked: the chain itself is consistent again, the signed checkpoints
    # are not.
    forged = seal(pending(pki, 99, identity="CN=forged"), archive.store.stream, 6, recs[4].hash)
    report = rewritten(archive, pki, [*recs[:5], forged, *recs[5:]])
    assert not report.intact and "checkpoint at seq 10" in report.break_at


def test_record_inserted_into_a_batch_found(archive: Tamper, pki: Path) -> None:
    recs = archive.records()
    forged = seal(pending(pki, 99, identity="CN=forged"), archive.store.stream, 4, recs[2].hash)
    report = rewritten(archive, pki, [*recs[:3], forged, *recs[3:]])
    assert not report.intact and "record seq 5" in report.break_at and "moved between batches" in report.break_at


def test_record_moved_between_batches_found(archive: Tamper, pki: Path) -> None:
    recs = archive.records()  # two batches: seq 1-5 and 6-10
    report = rewritten(archive, pki, [*recs[:1], *recs[2:7], recs[1], *recs[7:]])
    assert not report.intact and "record seq 7" in report.break_at and "moved between batches" in report.break_at


def test_batch_key_swapped_found(archive: Tamper, pki: Path) -> None:
    # Anyone can wrap a data key to the body key's certificate: the forger encrypts another original under a key
    # of their own and puts it into a batch as if sealed with it.
    recs = archive.records()
    forged = seal(pending(pki, 99, identity="CN=forged"), archive.store.stream, 3, recs[1].hash)
    forged = reseal(forged, body={**forged.fields["body"], "batch": recs[2].fields["body"]["batch"]})
    report = rewritten(archive, pki, [*recs[:2], forged, *recs[3:]])
    assert not report.intact and "record seq 3" in report.break_at and "batch key swapped" in report.break_at


def test_nonce_reuse_in_a_batch_found(archive: Tamper, pki: Path) -> None:
    recs = archive.records()
    recs[3] = reseal(recs[3], body={**recs[3].fields["body"], "nonce": recs[2].fields["body"]["nonce"]})
    report = rewritten(archive, pki, recs)
    assert not report.intact and "record seq 4" in report.break_at and "nonce reuse" in report.break_at


def test_inserted_record_without_relinking_found(archive: Tamper, pki: Path) -> None:
    recs = archive.records()
    extra = seal(pending(pki, 98), archive.store.stream, 11, recs[-1].hash)
    archive.write([*recs, extra])  # appended past the head the store recorded
    report = check(archive, pki)
    assert not report.intact and "beyond the stream's head" in report.break_at


def test_reordered_records_found(archive: Tamper, pki: Path) -> None:
    recs = archive.records()
    recs[2], recs[3] = recs[3], recs[2]
    if archive.pg is not None:  # a table has no order but its seq column: swap those
        for old, new in ((3, -1), (4, 3), (-1, 4)):
            archive.pg.query(
                "UPDATE audit_records SET seq = %s WHERE stream = %s AND seq = %s RETURNING 1",
                new, archive.store.stream, old,
            )  # fmt: skip
    else:
        archive.write(recs)
    report = check(archive, pki)
    assert not report.intact and "seq" in report.break_at


def test_forged_checkpoint_found(archive: Tamper, pki: Path) -> None:
    # The attacker rewrites the whole chain and signs new checkpoints with a key that is not the gateway's.
    rogue = keys.load_private_key(pki / "rogue.key")
    text = checkpoint(archive.store.stream, 10, archive.records()[-1].hash, rogue)
    archive.store.add_checkpoint(text)
    report = check(archive, pki)
    assert not report.intact and "signature" in report.break_at


def test_search_column_altered_in_database_found(tmp_path: Path, pki: Path, postgres: Postgres) -> None:
    # Only the indexed copy changed: a search by identity would now point the auditor elsewhere.
    store = open_backend("postgres", tmp_path, postgres)
    fill(store, pki)
    postgres.query(
        "UPDATE audit_records SET identity = 'CN=innocent' WHERE stream = %s AND seq = 2 RETURNING 1", store.stream
    )
    report = check(Tamper(store, postgres), pki)
    assert not report.intact and "search columns" in report.break_at
