"""The archive's stores filled with real records (real keys of the session's PKI), and the edits an attacker with
write access to the files or the tables would make: for tests/unit/test_archive.py and
tests/threats/test_archive_tampering.py."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from filters.engine.wss import keys
from filters.stores.archive.postgres import PostgresStore
from filters.stores.archive.record import SEARCH_FIELDS, Pending, Stored, checkpoint, public_key_der
from filters.stores.archive.segments import SegmentStore
from tests.support.harness import LiveGateway
from tests.support.postgres import Postgres
from tests.support.wss_helpers import route_doc


def pending(pki: Path, n: int, route: str = "signed", identity: str = "CN=client") -> Pending:
    public = keys.load_certificate(pki / "gateway-enc.pem").public_key()
    assert isinstance(public, rsa.RSAPublicKey)
    body = f"<Envelope>order {n}</Envelope>".encode()
    return Pending(kind="request", verdict="accepted", route=route, profile="rsa", policy_hash="00" * 32,
                   body=body, body_key=public_key_der(public), at=time.time(), identity=identity, message_id=f"urn:uuid:m{n}",
                   request_id=f"req-{n}", size=len(body),
                   chain=tuple(der(pki / name) for name in ("client.pem", "ca.pem")))  # fmt: skip


def der(path: Path) -> bytes:
    return keys.load_certificate(path).public_bytes(serialization.Encoding.DER)


def new_stream() -> str:
    return "s" + uuid.uuid4().hex[:12]


def open_backend(kind: str, tmp: Path, pg: Postgres | None) -> SegmentStore | PostgresStore:
    if kind == "postgres":
        assert pg is not None
        return PostgresStore(pg.dsn, new_stream())
    return SegmentStore(tmp / "archive", new_stream())


def fill(store: SegmentStore | PostgresStore, pki: Path, n: int = 10, every: int = 5) -> None:
    """`n` records in batches of `every`, a signed checkpoint after each batch."""
    signer = keys.load_private_key(pki / "gateway-sign.key")
    for start in range(0, n, every):
        head = store.append([pending(pki, i) for i in range(start, min(n, start + every))])
        store.add_checkpoint(checkpoint(store.stream, *head, signer))


class Tamper:
    """An attacker's edits: the records as a list, written back as they are given (files rewritten, rows
    replaced; the database's columns follow the meta, as a careful forger's would)."""

    def __init__(self, store: SegmentStore | PostgresStore, pg: Postgres | None) -> None:
        self.store, self.pg = store, pg

    def records(self) -> list[Stored]:
        return list(self.store.records())

    def write(self, records: list[Stored]) -> None:
        if isinstance(self.store, SegmentStore):
            for path in self.store.dir.glob("seg-*.jsonl"):
                path.unlink()
            lines = [
                json.dumps({"meta": r.meta, "body": base64.b64encode(r.body).decode(), "hash": r.hash}) for r in records
            ]
            (self.store.dir / "seg-000000000001.jsonl").write_text("".join(line + "\n" for line in lines))
            return
        assert self.pg is not None
        self.pg.query("DELETE FROM audit_records WHERE stream = %s RETURNING 1", self.store.stream)
        for r in records:
            m = r.fields
            self.pg.query(
                "INSERT INTO audit_records (stream, seq, id, hash, meta, body, at, route, kind, verdict, identity,"
                " message_id, request_id) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING 1",
                self.store.stream, m["seq"], m["id"], r.hash, r.meta, r.body, *(m[k] for k in SEARCH_FIELDS),
            )  # fmt: skip

    def set_head(self, rec: Stored) -> None:
        """The store's own head moved to `rec`, as a forger who rewrote the tail would."""
        seq = rec.fields["seq"]
        if isinstance(self.store, SegmentStore):
            path = self.store.dir / "head.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), "seq": seq, "hash": rec.hash}))
            return
        assert self.pg is not None
        self.pg.query("UPDATE audit_streams SET seq = %s, hash = %s WHERE name = %s RETURNING 1", seq, rec.hash,
                      self.store.stream)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Through a running gateway

WSGATE = Path(sys.executable).parent / "wsgate"
DEMO = "urn:wsgate:demo"


def archived_route(pki: Path, name: str, archive: dict) -> dict:
    keys = {"body_key_certificate": str(pki / "gateway-enc.pem"), "signing_key": str(pki / "gateway-sign.key"),
            "signing_certificate": str(pki / "gateway-sign.pem"), "checkpoint_interval_s": 0.2}  # fmt: skip
    return route_doc(pki, "rsa", name=name, archive={**keys, **archive})


def with_message_id(message_id: str, text: str = "order 42") -> bytes:
    return (
        '<soap:Envelope xmlns:soap="http://schemas.xmlsoap.org/soap/envelope/"'
        ' xmlns:wsa="http://www.w3.org/2005/08/addressing"><soap:Header>'
        f"<wsa:MessageID>{message_id}</wsa:MessageID></soap:Header><soap:Body>"
        f'<d:echo xmlns:d="{DEMO}"><d:text>{text}</d:text></d:echo></soap:Body></soap:Envelope>'
    ).encode()


def audit(gw: LiveGateway, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    got = subprocess.run([str(WSGATE), "audit", args[0], "--policies", str(gw.opts.policies), *args[1:]],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert not check or got.returncode == 0, got.stdout + got.stderr
    return got


def search(gw: LiveGateway, *args: str) -> list[dict]:
    return [json.loads(line) for line in audit(gw, "search", *args).stdout.splitlines()]


def wait_for(gw: LiveGateway, count: int, *args: str, timeout: float = 20) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = search(gw, *args)
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def metric(gw: LiveGateway, name: str, **labels: str) -> float:
    total = 0.0
    for url in gw.metrics_urls():
        for line in requests.get(url, timeout=5).text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total
