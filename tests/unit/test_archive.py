"""The archive in process (docs/audit.md): bodies open only with the body key, an archived original that is not
the one its signer signed fails re-verification, retention keeps the chain verifiable, the writer drains and
checkpoints on stop, and the policy's rules."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from filters.engine import faults
from filters.engine.wss import keys
from filters.stores.archive.record import GENESIS, BodyKeyError, open_body, seal, verify_chain
from filters.stores.archive.segments import SegmentStore
from filters.stores.archive.writer import Writer
from gateway.control.audit import reverify
from gateway.policy import ArchivePolicy, Route
from tests.support.archive import fill, pending, with_message_id
from tests.support.wss_helpers import client_for, make_route, route_doc


def test_body_opens_only_with_the_body_key(pki: Path) -> None:
    rec = seal(pending(pki, 1), "s", 1, GENESIS)
    assert b"order 1" not in rec.body
    assert open_body(rec, keys.load_private_key(pki / "gateway-enc.key")) == b"<Envelope>order 1</Envelope>"
    with pytest.raises(BodyKeyError):
        open_body(rec, keys.load_private_key(pki / "gateway-sign.key"))


def test_archived_original_not_the_signed_one_fails_reverification(pki: Path) -> None:
    # Whoever holds the body key could seal another original into a record and rebuild the chain around it:
    # what the original itself proves is its signature, checked again by `wsgate audit verify`.
    route = make_route(pki, "rsa")
    secured, _ = client_for(route, pki).secure(with_message_id("urn:uuid:x"))
    signer = keys.load_certificate(pki / "client.pem").subject.rfc4514_string()
    p = pending(pki, 1, identity=signer)
    p.body, p.at = secured, time.time()
    assert reverify(seal(p, "s", 1, GENESIS), secured, None) == signer
    forged = secured.replace(b"order 42", b"order 43")
    with pytest.raises(faults.Fault):
        reverify(seal(p, "s", 1, GENESIS), forged, None)


def test_retention_keeps_the_rest_of_the_chain_verifiable(pki: Path, tmp_path: Path) -> None:
    store = SegmentStore(tmp_path, "s", segment_max_bytes=1)  # a segment per batch
    fill(store, pki, n=15, every=5)
    old = sorted(store.dir.glob("seg-*.jsonl"))[0]
    os.utime(old, (time.time() - 86400 * 400,) * 2)
    assert store.retire(time.time() - 86400 * 365) == 1
    cert = keys.load_certificate(pki / "gateway-sign.pem")
    report = verify_chain(store.records(), store.checkpoints(), cert, start=store.start(), head=store.head())
    assert report.intact and (report.first_seq, report.records) == (6, 10)
    # Retention's removal is recorded: removing the next segment by hand is not retention.
    sorted(store.dir.glob("seg-*.jsonl"))[0].unlink()
    report = verify_chain(store.records(), store.checkpoints(), cert, start=store.start(), head=store.head())
    assert not report.intact


def test_writer_drains_its_queue_and_checkpoints_on_stop(pki: Path, tmp_path: Path) -> None:
    policy = ArchivePolicy(directory=str(tmp_path), signing_key=str(pki / "gateway-sign.key"),
                           checkpoint_interval_s=3600)  # fmt: skip
    writer = Writer(policy)
    for i in range(300):
        assert writer.submit(pending(pki, i))
    writer.close(10)
    store = SegmentStore(tmp_path, "default")
    cert = keys.load_certificate(pki / "gateway-sign.pem")
    report = verify_chain(store.records(), store.checkpoints(), cert, start=store.start(), head=store.head())
    assert report.intact and report.records == 300 and report.checkpoints == 1


def test_archive_policy_rules(pki: Path) -> None:
    with pytest.raises(ValidationError, match="dsn is needed"):
        ArchivePolicy(store="postgres")
    secret = ArchivePolicy(store="postgres", dsn="host=db password=hunter2")
    assert "hunter2" not in repr(secret) and "hunter2" not in secret.model_dump_json()
    with pytest.raises(ValidationError, match="nothing to archive"):
        Route.model_validate({**route_doc(pki, "tls"), "upstream": {"address": "127.0.0.1:1"}, "archive": {}})


def intact(store: SegmentStore, pki: Path) -> bool:
    cert = keys.load_certificate(pki / "gateway-sign.pem")
    report = verify_chain(store.records(), store.checkpoints(), cert, start=store.start(), head=store.head(),
                          head_after=store.head)  # fmt: skip
    return report.intact


def test_writer_dead_between_its_lines_and_its_head_leaves_a_chain_that_goes_on(pki: Path, tmp_path: Path) -> None:
    store = SegmentStore(tmp_path, "s")
    fill(store, pki, n=5, every=5)
    head = (store.dir / "head.json").read_bytes()
    fill(store, pki, n=5, every=5)  # its lines on disk...
    (store.dir / "head.json").write_bytes(head)  # ...its head.json never written
    with open(next(store.dir.glob("seg-*.jsonl")), "a") as f:
        f.write('{"meta": "torn')  # and a third one died mid-line
    fill(store, pki, n=5, every=5)
    assert [r.fields["seq"] for r in store.records()] == list(range(1, 16))
    assert intact(store, pki)


def test_verify_chain_while_a_writer_appends_sees_no_break(pki: Path, tmp_path: Path) -> None:
    policy = ArchivePolicy(directory=str(tmp_path), signing_key=str(pki / "gateway-sign.key"), checkpoint_records=20)
    writer = Writer(policy)
    stop = threading.Event()

    def feed() -> None:
        i = 0
        while not stop.is_set():
            writer.submit(pending(pki, i))
            i += 1
            time.sleep(0.001)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        store = SegmentStore(tmp_path, "default")
        for _ in range(15):
            time.sleep(0.05)
            assert intact(store, pki)
    finally:
        stop.set()
        feeder.join()
        writer.close(10)
    assert intact(store, pki) and len(list(store.records())) > 50
