"""The archive in process (docs/audit.md): bodies open only with the body key, an archived original that is not
the one its signer signed fails re-verification, retention keeps the chain verifiable, the writer drains and
checkpoints on stop, and the policy's rules."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import ValidationError

from filters.engine import faults
from filters.engine.wss import keys
from filters.stores.archive.record import (
    _OAEP,
    _SCALARS,
    GENESIS,
    BodyKeyError,
    Stored,
    canonical,
    from_spool,
    open_body,
    public_key_der,
    record_hash,
    seal,
    to_spool,
    verify_chain,
)
from filters.stores.archive.segments import SegmentStore, _line
from filters.stores.archive.writer import BATCH_WAIT_S, Writer, _der
from gateway.control.audit import reverify
from gateway.policy import ArchivePolicy, Route
from tests.support.archive import der, fill, pending, with_message_id
from tests.support.wss_helpers import client_for, make_route, route_doc


def test_body_opens_only_with_the_body_key(pki: Path) -> None:
    rec = seal(pending(pki, 1), "s", 1, GENESIS)
    assert b"order 1" not in rec.body
    assert open_body(rec, keys.load_private_key(pki / "gateway-enc.key")) == b"<Envelope>order 1</Envelope>"
    with pytest.raises(BodyKeyError):
        open_body(rec, keys.load_private_key(pki / "gateway-sign.key"))


def test_records_of_one_batch_share_a_wrapped_key_and_each_opens_alone(pki: Path, tmp_path: Path) -> None:
    store = SegmentStore(tmp_path, "s")
    other = replace(pending(pki, 9), body_key=public_key_der(keys.load_certificate(pki / "client.pem").public_key()))
    store.append([pending(pki, 1), other, pending(pki, 2), pending(pki, 3)])  # two body keys in one batch
    recs = list(store.records())
    envelopes = [r.fields["body"] for r in recs]
    assert len({e["batch"] for e in envelopes}) == 1 and len({e["nonce"] for e in envelopes}) == 4
    assert len({e["key"] for e in envelopes}) == 2  # one wrapped data key per body key, not per record
    enc, client = keys.load_private_key(pki / "gateway-enc.key"), keys.load_private_key(pki / "client.key")
    for rec, key, n in zip(recs, (enc, client, enc, enc), (1, 9, 2, 3), strict=True):
        assert open_body(Stored(rec.meta, rec.body, rec.hash), key) == f"<Envelope>order {n}</Envelope>".encode()
    with pytest.raises(BodyKeyError):  # a batchmate's body is not this record's: the record id is bound to it
        open_body(Stored(recs[0].meta, recs[2].body, recs[0].hash), enc)
    assert intact(store, pki)


def test_records_sealed_with_a_data_key_each_still_open_and_verify(pki: Path, tmp_path: Path) -> None:
    # As the archive sealed before batches: its own data key per record, wrapped alone, no batch named.
    p, public = pending(pki, 1), keys.load_certificate(pki / "gateway-enc.pem").public_key()
    data_key, nonce = AESGCM.generate_key(256), os.urandom(12)
    envelope = {"alg": "A256GCM+RSA-OAEP-256", "key_id": hashlib.sha256(p.body_key).hexdigest()[:16],
                "key": base64.b64encode(public.encrypt(data_key, _OAEP)).decode(),
                "nonce": base64.b64encode(nonce).decode()}  # fmt: skip
    new = seal(p, "s", 1, GENESIS)
    meta = {**new.fields, "body": envelope}
    text, body = canonical(meta), AESGCM(data_key).encrypt(nonce, p.body, p.id.encode())
    old = Stored(text, body, record_hash(text, body))
    then = seal(pending(pki, 2), "s", 2, old.hash)
    cert = keys.load_certificate(pki / "gateway-sign.pem")
    report = verify_chain([old, then], [], cert, start=(1, GENESIS))
    assert report.intact and report.records == 2
    enc = keys.load_private_key(pki / "gateway-enc.key")
    assert open_body(old, enc) == p.body and open_body(then, enc) == b"<Envelope>order 2</Envelope>"


def test_segment_line_is_the_json_of_the_record_whatever_its_fields_hold(pki: Path) -> None:
    # The line escapes the meta text by hand: a reason or an identity with quotes, backslashes, control or
    # non-ASCII characters must neither break the line nor come back other than sealed.
    p = replace(pending(pki, 1), reason='a "quoted" \\ back\\slash\n\t\x00\x7f é \u2028 </x>',
                identity='CN="a\\b",O=Ü')  # fmt: skip
    rec = seal(p, "s", 1, GENESIS)
    line = _line(rec)
    assert line == json.dumps({"meta": rec.meta, "body": base64.b64encode(rec.body).decode(), "hash": rec.hash}) + "\n"
    assert json.loads(line)["meta"] == rec.meta and json.loads(rec.meta)["reason"] == p.reason


def test_forked_workers_never_share_record_ids(pki: Path) -> None:
    # Ids come from a per-process prefix and a counter, not a UUID each: a takeover leaves out the records whose
    # ids the store holds, so a worker forked with its parent's prefix would have records of its own left out.
    ours = [pending(pki, i).id for i in range(3)]
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        os.write(write, pending(pki, 9).id.encode())
        os._exit(0)
    os.close(write)
    theirs = os.read(read, 64).decode()
    os.close(read)
    assert os.waitpid(child, 0)[1] == 0
    assert len(set(ours)) == 3 and all(len(i) == 32 and int(i, 16) >= 0 for i in [*ours, theirs])
    assert theirs[:16] not in {i[:16] for i in ours}


def test_archived_chain_is_never_another_certificates(pki: Path) -> None:
    # The DER of a signer's certificate is kept per certificate object (the trust store's cache hands the same
    # ones out): a certificate freed and another made where it was must not get the first one's DER.
    ders = [der(pki / name) for name in ("client.pem", "client2.pem", "ca.pem")]
    for i in range(600):
        want = ders[i % 3]
        cert = x509.load_der_x509_certificate(want)
        assert _der(cert) == want
        del cert


def test_spool_frames_read_back_as_written_and_as_an_earlier_version_wrote_them(pki: Path) -> None:
    p = replace(pending(pki, 1), replay_keys=(b"k" * 32,))
    frame = b"".join(to_spool(p))
    assert from_spool(frame, 0) == (p, len(frame))
    assert from_spool(frame[:-1], 0) is None  # torn
    # A killed worker of the version before left its spool: base64 in the header, the body after it.
    head = {f: getattr(p, f) for f in _SCALARS}
    head |= {"body_key": base64.b64encode(p.body_key).decode(), "has_body": True,
             "chain": [base64.b64encode(c).decode() for c in p.chain], "replay_keys": [k.hex() for k in p.replay_keys]}  # fmt: skip
    text = json.dumps(head).encode()
    earlier = struct.pack(">II", len(text), len(p.body or b"")) + text + (p.body or b"")
    assert from_spool(earlier + frame, 0) == (p, len(earlier))
    # The version after it: the header a JSON object, the binary fields after it as they are.
    blobs = (p.body_key, *p.chain, p.body or b"")
    head = {f: getattr(p, f) for f in _SCALARS}
    head |= {"replay_keys": [k.hex() for k in p.replay_keys], "blobs": [len(b) for b in blobs], "has_body": True}
    text = json.dumps(head).encode()
    previous = struct.pack(">II", len(text), sum(head["blobs"])) + text + b"".join(blobs)
    assert from_spool(previous + frame, 0) == (p, len(previous))
    assert from_spool(previous + frame, len(previous)) == (p, len(previous + frame))


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


def test_writer_gathers_a_steady_trickle_into_few_batches(pki: Path, tmp_path: Path) -> None:
    # A batch's fixed cost (the lock, two fsyncs, a key wrap) is shared by what arrives within BATCH_WAIT_S.
    writer = Writer(ArchivePolicy(directory=str(tmp_path), signing_key=str(pki / "gateway-sign.key")))
    started = time.monotonic()
    for i in range(200):
        assert writer.submit(pending(pki, i))
        time.sleep(0.005)
    elapsed = time.monotonic() - started
    writer.close(10)
    batches = {r.fields["body"]["batch"] for r in SegmentStore(tmp_path, "default").records()}
    assert len(batches) <= elapsed / BATCH_WAIT_S + 2


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
