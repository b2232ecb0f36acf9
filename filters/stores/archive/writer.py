"""Archiving off the hot path: the worker hands each record to a bounded queue (`RouteArchive.keep`, no disk, no
database, no crypto on the request's thread); one background thread per store and stream seals, chains and
writes them in batches, checkpoints the chain with the gateway's key and applies the retention.

A full queue applies the route's `when_full` (503 or drop and count); a store that fails marks the archive
unavailable until a write succeeds again, and the route's `on_failure` decides (503, or pass and count). The
batch that failed is retried, not lost; a stopping worker drains its queue (SIGTERM, within the grace period)."""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import threading
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from prometheus_client import Counter, Gauge

from filters.engine import faults
from filters.engine.pipeline import Outcome
from filters.engine.wss import keys
from filters.stores.archive.postgres import DatabaseError, PostgresStore
from filters.stores.archive.record import Pending, checkpoint, public_key_der
from filters.stores.archive.segments import SegmentStore
from filters.stores.archive.spool import Spool
from gateway.policy import ArchiveKeep, ArchivePolicy, Route

log = logging.getLogger("wsgate.archive")

# outcome: archived (written), queued, refused_full/refused_unavailable/refused_oversize (the exchange got a
# fault), dropped_full (passed, record lost), passed_unavailable (passed while the store was down: alarm),
# metadata_only (kept without the body: over max_record_bytes).
RECORDS = Counter("wsgate_archive_records", "Archive records by route and outcome", ["route", "outcome"])
AVAILABLE = Gauge("wsgate_archive_available", "1 while the archive store takes writes, 0 while it fails", ["stream"])
DEPTH = Gauge("wsgate_archive_queue_depth", "Records waiting for the archive writer", ["stream"])

BATCH = 256
BATCH_WAIT_S = 0.2  # how long the first record of a batch waits for more (up to BATCH)
RETIRE_EVERY_S = 3600.0
ORPHANS_EVERY_S = 2.0  # how often a writer looks for the spools of killed workers

ArchiveStore = SegmentStore | PostgresStore


def open_store(policy: ArchivePolicy) -> ArchiveStore:
    if policy.store == "postgres":
        assert policy.dsn is not None
        return PostgresStore(policy.dsn.get_secret_value(), policy.stream)
    return SegmentStore(policy.directory, policy.stream, policy.segment_max_mb << 20)


class Writer:
    """One store and stream: the queue and the thread that empties it."""

    def __init__(self, policy: ArchivePolicy) -> None:
        self.policy = policy
        self.store = open_store(policy)
        self.signer = keys.load_private_key(policy.signing_key)
        self.spool = Spool(Path(policy.directory) / "spool", policy.stream)
        # (record, the spool's offset after it): marked done in the spool once archived. A deque, not a
        # queue.Queue: the writer wakes on its batch timer, so an append needs no lock and wakes no thread.
        self.queue: collections.deque[tuple[Pending, int]] = collections.deque()
        self.available = True
        self._last_orphans = 0.0
        self._since_checkpoint, self._last_checkpoint = 0, time.monotonic()
        self._head: tuple[int, str] | None = None
        self._stopping = threading.Event()
        self._last_retire = 0.0
        AVAILABLE.labels(stream=policy.stream).set(1)
        self._thread = threading.Thread(target=self._run, name=f"archive-{policy.stream}", daemon=True)
        self._thread.start()

    def submit(self, p: Pending) -> bool:
        """Spool and queue `p`; False when the queue is full. Called from the worker's one thread only."""
        if len(self.queue) >= self.policy.queue_size:
            return False
        self.queue.append((p, self.spool.append(p)))
        return True

    def close(self, timeout_s: float) -> None:
        """Write what is queued (up to `timeout_s`), checkpoint, stop."""
        self._stopping.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("archive stream %s: %d records not written at stop", self.policy.stream, len(self.queue))
            return  # the spool stays: another writer of the stream takes it over
        self.spool.close()
        self.store.close()

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch:
                self._write([p for p, _ in batch])
                self.spool.done(batch[-1][1])
            elif self._stopping.is_set():
                self._checkpoint()
                return
            self._maybe_checkpoint()
            self._maybe_retire()
            self._take_over_orphans()

    def _take_over_orphans(self) -> None:
        """Archive what killed writers of this stream had spooled and not archived (once: ids already stored
        are left out)."""
        now = time.monotonic()
        if now - self._last_orphans < ORPHANS_EVERY_S:
            return
        self._last_orphans = now
        for path, pending in self.spool.orphans():
            present: set[str] = set()
            while pending:
                try:
                    present = self.store.present([p.id for p in pending])
                    break
                except (OSError, DatabaseError) as exc:
                    self._unavailable(exc)
            rest = [p for p in pending if p.id not in present]
            for start in range(0, len(rest), BATCH):
                self._write(rest[start : start + BATCH])
            log.warning("archive stream %s: took over %s (%d records, %d archived now)", self.policy.stream,
                        path.name, len(pending), len(rest))  # fmt: skip
            self.spool.release(path)

    def _unavailable(self, exc: Exception) -> None:
        if self.available:
            log.error("archive stream %s unavailable (%s): %s", self.policy.stream, self.store.where, exc)
        self._set_available(False)
        time.sleep(0.5)

    def _take(self) -> list[tuple[Pending, int]]:
        if len(self.queue) < BATCH:
            # Group commit: a batch's fixed cost (two fsyncs, the lock, the head) is most of a small batch's; the
            # records wait in the spool meanwhile, the request never does. The writer wakes on this timer, never
            # per record. A stopping writer does not wait.
            self._stopping.wait(BATCH_WAIT_S)
        batch = []
        while self.queue and len(batch) < BATCH:
            batch.append(self.queue.popleft())  # the only taker: what len() saw is there
        DEPTH.labels(stream=self.policy.stream).set(len(self.queue))
        return batch

    def _write(self, batch: list[Pending]) -> None:
        delay = 0.1
        while True:
            try:
                self._head = self.store.append(batch)
            except (OSError, DatabaseError) as exc:
                if self.available:
                    log.error("archive stream %s unavailable (%s): %s", self.policy.stream, self.store.where, exc)
                self._set_available(False)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            except Exception:  # a bug must not end the thread silently: the archive is then down (fail closed)
                log.exception("archive stream %s: write failed", self.policy.stream)
                self._set_available(False)
                time.sleep(2.0)
                continue
            if not self.available:
                log.warning("archive stream %s available again", self.policy.stream)
            self._set_available(True)
            self._since_checkpoint += len(batch)
            for route, n in collections.Counter(p.route for p in batch).items():
                RECORDS.labels(route=route, outcome="archived").inc(n)
            return

    def _set_available(self, up: bool) -> None:
        self.available = up
        AVAILABLE.labels(stream=self.policy.stream).set(1 if up else 0)

    def _maybe_checkpoint(self) -> None:
        due = time.monotonic() - self._last_checkpoint >= self.policy.checkpoint_interval_s
        if self._since_checkpoint >= self.policy.checkpoint_records or (due and self._since_checkpoint):
            self._checkpoint()

    def _checkpoint(self) -> None:
        if self._head is None or not self._since_checkpoint:
            return
        try:
            self.store.add_checkpoint(checkpoint(self.policy.stream, *self._head, self.signer))
        except (OSError, DatabaseError, faults.Fault) as exc:  # the store, or a key token, down: the next try
            log.error("archive stream %s: checkpoint not written: %s", self.policy.stream, exc)
            return
        self._since_checkpoint, self._last_checkpoint = 0, time.monotonic()

    def _maybe_retire(self) -> None:
        now = time.time()
        if now - self._last_retire < RETIRE_EVERY_S:
            return
        self._last_retire = now
        try:
            removed = self.store.retire(now - self.policy.retention_days * 86400)
        except (OSError, DatabaseError) as exc:
            log.error("archive stream %s: retention not applied: %s", self.policy.stream, exc)
            return
        if removed:
            log.info("archive stream %s: retention removed %d segments or records", self.policy.stream, removed)


class RouteArchive:
    """One route's archiving, as the worker calls it on the hot path."""

    def __init__(self, route: Route, writer: Writer) -> None:
        assert route.archive is not None
        self.policy: ArchivePolicy = route.archive
        self.route, self.profile = route.name, route.profile
        self.writer = writer
        self.policy_hash = hashlib.sha256(route.model_dump_json().encode()).hexdigest()
        public = keys.load_certificate(self.policy.body_key_certificate).public_key()
        if not isinstance(public, rsa.RSAPublicKey):
            raise faults.server(f"route {route.name}: archive.body_key_certificate is not an RSA certificate")
        self.body_key = public_key_der(public)
        self._queued = RECORDS.labels(route=self.route, outcome="queued")  # per record: looked up once

    def keeps(self, what: ArchiveKeep) -> bool:
        return what in self.policy.keep

    def admit(self) -> None:
        """Before a request is worked on: an archive that cannot write refuses it (fail_closed) or lets it pass."""
        if self.writer.available:
            return
        if self.policy.on_failure == "fail_closed":
            RECORDS.labels(route=self.route, outcome="refused_unavailable").inc()
            raise faults.server("archive unavailable", message="Service unavailable", status=503)
        RECORDS.labels(route=self.route, outcome="passed_unavailable").inc()

    def keep(
        self,
        kind: str,
        verdict: str,
        body: bytes,
        headers: dict[str, str],
        out: Outcome | None = None,
        reason: str | None = None,
    ) -> None:
        """Queue one record. Raises the route's fault when it cannot be kept and the route refuses then (never for
        a refusal's own record: that exchange is refused already)."""
        p = Pending(kind=kind, verdict=verdict, route=self.route, profile=self.profile, policy_hash=self.policy_hash,
                    body=body, body_key=self.body_key, at=time.time(), reason=reason, size=len(body),
                    request_id=headers.get("x-request-id"))  # fmt: skip
        if out is not None:
            _evidence(p, out)
        refusing = kind != "refusal"
        if len(body) > self.policy.max_record_bytes:
            if refusing and self.policy.oversize == "refuse":
                RECORDS.labels(route=self.route, outcome="refused_oversize").inc()
                raise faults.client(f"archive limit: {len(body)} bytes over max_record_bytes", status=413)
            RECORDS.labels(route=self.route, outcome="metadata_only").inc()
            p.body, p.body_omitted = None, "oversize"
        if self.writer.submit(p):
            self._queued.inc()
            return
        if refusing and self.policy.when_full == "refuse":
            RECORDS.labels(route=self.route, outcome="refused_full").inc()
            raise faults.server("archive queue full", message="Service unavailable", status=503)
        RECORDS.labels(route=self.route, outcome="dropped_full").inc()
        log.warning("archive stream %s: queue full, record of route %s dropped", self.policy.stream, self.route)


def _evidence(p: Pending, out: Outcome) -> None:
    v = out.verified
    p.message_id = out.message_id
    p.replay_keys = tuple(k.name for k in out.replay)
    if v is None:
        return
    p.identity, p.username = v.subject, v.username
    if v.key_reference is not None and v.key_reference.kind == "key_name":
        p.key_name = v.key_reference.value
    chain = v.signer_chain or ((v.signer_certificate,) if v.signer_certificate is not None else ())
    p.chain = tuple(_der(c) for c in chain)


@functools.lru_cache(maxsize=256)
def _der(cert: x509.Certificate) -> bytes:
    """A certificate's DER, kept per certificate: the trust store's validation cache hands the same chains to
    request after request, and serializing them again was a good part of an rsa record's cost on the request's
    path."""
    return cert.public_bytes(serialization.Encoding.DER)


class Archives:
    """Every archiving route's RouteArchive; writers are shared by the routes of one store and stream and kept
    across policy reloads (a reload must not lose what is queued)."""

    def __init__(self) -> None:
        self.writers: dict[tuple[str, str, str], Writer] = {}
        self.routes: dict[str, RouteArchive] = {}

    def configure(self, routes: list[Route]) -> None:
        built: dict[str, RouteArchive] = {}
        for route in routes:
            a = route.archive
            if a is None or not route.touches_xml:
                continue
            where = a.dsn.get_secret_value() if a.dsn is not None else a.directory
            key = (a.store, where, a.stream)
            if key not in self.writers:
                self.writers[key] = Writer(a)
            built[route.name] = RouteArchive(route, self.writers[key])
        self.routes = built

    def get(self, route_name: str) -> RouteArchive | None:
        return self.routes.get(route_name)

    def close(self, timeout_s: float) -> None:
        for writer in self.writers.values():
            writer.close(timeout_s)
