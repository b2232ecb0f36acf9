"""The archive's record: what one exchange leaves as evidence, how it is sealed (body envelope-encrypted, record
chained to the previous one of its stream) and how a stream's chain and its signed checkpoints are checked.

A record is stored as three parts: `meta`, its canonical JSON text (searchable: nothing in it is the body);
`body`, the AES-256-GCM ciphertext of the bytes as received or sent (under its batch's data key, which the meta
holds wrapped by RSA-OAEP to the policy's body key certificate; a nonce of its own, the record id as associated
data); `hash` = SHA-256(meta text, body). The meta
holds the stream, the sequence number and the previous record's hash: changing, removing, inserting or
reordering a record breaks the links after it, and a checkpoint (a stream position and its hash, signed by the
gateway's key) pins the chain so that its tail cannot be rewritten wholesale either."""

from __future__ import annotations

import base64
import functools
import hashlib
import itertools
import json
import operator
import os
import struct
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

GENESIS = "0" * 64  # the `prev` of a stream's first record
_OAEP = padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None)
# The metadata columns a database keeps beside the meta text for search; verify-chain checks they agree with it.
SEARCH_FIELDS = ("at", "route", "kind", "verdict", "identity", "message_id", "request_id")


class _Ids:
    """Record ids as unique as uuid4's, 32 hex digits: a random 64-bit prefix per process and a counter, so the
    request's path makes one without a getrandom() and a UUID object per record. A forked child draws its own
    prefix (a takeover tells records apart by id: two processes must never share one)."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.prefix, self.count = os.urandom(8).hex(), itertools.count()

    def new(self) -> str:
        return f"{self.prefix}{next(self.count):016x}"


_ids = _Ids()


@dataclass(slots=True)
class Pending:
    """One exchange's evidence as the worker hands it over (cheap to build: the thread does the rest)."""

    kind: str  # "request", "reply" or "refusal"
    verdict: str  # "accepted", "signed" (a reply the gateway secured) or "refused"
    route: str
    profile: str
    policy_hash: str
    body: bytes | None  # None: not kept (oversize with metadata_only, or no body to keep)
    body_key: bytes  # the public key the body is encrypted to (SubjectPublicKeyInfo DER)
    at: float  # when the gateway had it (Unix seconds)
    reason: str | None = None  # a refusal's precise reason
    identity: str | None = None
    username: str | None = None
    key_name: str | None = None
    chain: tuple[bytes, ...] = ()  # the signer's validated chain, leaf first (DER)
    replay_keys: tuple[bytes, ...] = ()
    message_id: str | None = None
    request_id: str | None = None
    size: int = 0  # the message's size in bytes, kept or not
    body_omitted: str | None = None  # why the body is not kept
    id: str = field(default_factory=_ids.new)


@dataclass(frozen=True, slots=True)
class Stored:
    """A record as the store keeps it."""

    meta: str
    body: bytes
    hash: str

    @property
    def fields(self) -> dict:
        return json.loads(self.meta)


# json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True), its encoder made once, not per record
canonical = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode


def record_hash(meta: str, body: bytes) -> str:
    h = hashlib.sha256(meta.encode())
    h.update(b"\n")
    h.update(body)
    return h.hexdigest()


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="microseconds")


class BatchKeys:
    """The data keys of one batch (one append to a store): a fresh AES-256 key per body key, wrapped by RSA-OAEP
    once for the whole batch (a public-key operation per record was most of a record's sealing cost). Every
    record still carries the wrapped key, so it opens alone; `batch` names the batch, and `verify_chain` checks
    that a batch's records are consecutive, share its key and never share a nonce."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex
        self.archived_at = iso(datetime.now(UTC).timestamp())  # the batch's records are archived together
        self._keys: dict[bytes, tuple[AESGCM, dict[str, str]]] = {}
        self._nonces = b""

    def key(self, body_key: bytes) -> tuple[AESGCM, dict[str, str]]:
        """The AEAD and the envelope's shared fields for bodies encrypted to `body_key`."""
        got = self._keys.get(body_key)
        if got is None:
            data_key = AESGCM.generate_key(256)
            wrapped = _public_key(body_key).encrypt(data_key, _OAEP)
            envelope = {"alg": "A256GCM+RSA-OAEP-256", "key": base64.b64encode(wrapped).decode(),
                        "key_id": hashlib.sha256(body_key).hexdigest()[:16], "batch": self.id}  # fmt: skip
            got = self._keys[body_key] = (AESGCM(data_key), envelope)
        return got

    def nonce(self) -> bytes:
        """A random 96-bit nonce; drawn 64 at a time (a getrandom() per record was a syscall per record)."""
        if not self._nonces:
            self._nonces = os.urandom(12 * 64)
        nonce, self._nonces = self._nonces[:12], self._nonces[12:]
        return nonce


def seal(p: Pending, stream: str, seq: int, prev: str, keys: BatchKeys | None = None) -> Stored:
    """Encrypt the body under the batch's data key (`keys`; None: a batch of this record alone) and chain the
    record after `prev` (the stream's record `seq - 1`)."""
    ciphertext, envelope = b"", None
    keys = keys or BatchKeys()
    if p.body is not None:
        aead, shared = keys.key(p.body_key)
        nonce = keys.nonce()  # 96 random bits per record: at most a batch's records share a key
        ciphertext = aead.encrypt(nonce, p.body, p.id.encode())
        envelope = {**shared, "nonce": base64.b64encode(nonce).decode()}
    meta = {
        "id": p.id,
        "stream": stream,
        "seq": seq,
        "prev": prev,
        "at": iso(p.at),
        "archived_at": keys.archived_at,
        "kind": p.kind,
        "verdict": p.verdict,
        "reason": p.reason,
        "route": p.route,
        "profile": p.profile,
        "policy_hash": p.policy_hash,
        "identity": p.identity,
        "username": p.username,
        "key_name": p.key_name,
        "chain": [_b64(c) for c in p.chain],
        "replay_keys": [k.hex() for k in p.replay_keys],
        "message_id": p.message_id,
        "request_id": p.request_id,
        "size": p.size,
        "body": envelope,
        "body_omitted": p.body_omitted,
    }
    text = canonical(meta)
    return Stored(text, ciphertext, record_hash(text, ciphertext))


@functools.lru_cache(maxsize=64)
def _b64(der: bytes) -> str:
    """A certificate's base64: the same few signers' chains come record after record."""
    return base64.b64encode(der).decode()


def public_key_der(key: rsa.RSAPublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


@functools.lru_cache(maxsize=16)
def _public_key(der: bytes) -> rsa.RSAPublicKey:
    key = serialization.load_der_public_key(der)
    assert isinstance(key, rsa.RSAPublicKey)
    return key


def _key_id(key: rsa.RSAPublicKey) -> str:
    return hashlib.sha256(public_key_der(key)).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------
# A pending record as the spool keeps it (filters/stores/archive/spool.py): a JSON header (a list: the scalar
# fields in _SCALARS' order, the replay keys, the lengths of the binary fields, whether it has a body), then the
# binary fields as they are: no base64, no dict on the request's path.

_FRAME = struct.Struct(">II")
_HEADER = json.JSONEncoder(separators=(",", ":")).encode


def to_spool(p: Pending) -> list[bytes]:
    """The frame, as the buffers a writev() appends (the body is not copied)."""
    blobs = (p.body_key, *p.chain, p.body or b"")
    lengths = [len(b) for b in blobs]
    text = _HEADER([*_scalars(p), [k.hex() for k in p.replay_keys], lengths, p.body is not None]).encode()
    return [_FRAME.pack(len(text), sum(lengths)), text, *blobs]


def from_spool(data: bytes, offset: int) -> tuple[Pending, int] | None:
    """The pending record at `offset` and the offset after it; None at the end or at a torn last frame."""
    if offset + _FRAME.size > len(data):
        return None
    n_head, n_body = _FRAME.unpack_from(data, offset)
    start = offset + _FRAME.size
    end = start + n_head + n_body
    if end > len(data):
        return None
    head = json.loads(data[start : start + n_head])
    if isinstance(head, list):
        *scalars, replay_keys, blobs, has_body = head
        head = {**dict(zip(_SCALARS, scalars, strict=True)), "replay_keys": replay_keys, "blobs": blobs,
                "has_body": has_body}  # fmt: skip
    if "blobs" in head:  # this version's, or the one before (the same fields in a JSON object)
        at, blobs = start + n_head, []
        for n in head["blobs"]:
            blobs.append(data[at : at + n])
            at += n
        body_key, *chain, body = blobs
    else:  # a frame spooled by an earlier version (base64 in the header), left by a killed worker
        body_key, body = base64.b64decode(head["body_key"]), data[start + n_head : end]
        chain = [base64.b64decode(c) for c in head["chain"]]
    p = Pending(
        **{f: head[f] for f in _SCALARS},
        body=body if head["has_body"] else None,
        body_key=body_key,
        chain=tuple(chain),
        replay_keys=tuple(bytes.fromhex(k) for k in head["replay_keys"]),
    )
    return p, end


_SCALARS = ("kind", "verdict", "route", "profile", "policy_hash", "at", "reason", "identity", "username", "key_name",
            "message_id", "request_id", "size", "body_omitted", "id")  # fmt: skip
_scalars = operator.attrgetter(*_SCALARS)  # a record's scalar fields in that order, read in C


class BodyKeyError(ValueError):
    """The key given does not open this record's body."""


def open_body(rec: Stored, key: rsa.RSAPrivateKey) -> bytes | None:
    """The original bytes (None when the record kept none). Only with the body key's private key."""
    meta = rec.fields
    env = meta["body"]
    if env is None:
        return None
    if env["key_id"] != _key_id(key.public_key()):
        raise BodyKeyError(f"the body is encrypted to key {env['key_id']}, not to the key given")
    try:
        data_key = key.decrypt(base64.b64decode(env["key"]), _OAEP)
        return AESGCM(data_key).decrypt(base64.b64decode(env["nonce"]), rec.body, meta["id"].encode())
    except (ValueError, InvalidTag):
        raise BodyKeyError("the body does not decrypt: altered, or another key") from None


def chain_certificates(meta: dict) -> list[x509.Certificate]:
    return [x509.load_der_x509_certificate(base64.b64decode(c)) for c in meta["chain"]]


# ---------------------------------------------------------------------------------------------------------
# Checkpoints


def checkpoint(stream: str, seq: int, hash_: str, key: rsa.RSAPrivateKey) -> str:
    """A signed statement that record `seq` of `stream` has `hash_` (its canonical JSON text)."""
    doc = {"stream": stream, "seq": seq, "hash": hash_, "at": iso(datetime.now(UTC).timestamp())}
    signature = key.sign(canonical(doc).encode(), padding.PKCS1v15(), hashes.SHA256())
    return canonical({**doc, "signature": base64.b64encode(signature).decode()})


def checkpoint_valid(text: str, certificate: x509.Certificate) -> dict | None:
    """The checkpoint's fields when `certificate` signed it, else None."""
    doc = json.loads(text)
    signature = base64.b64decode(doc.pop("signature", ""))
    public = certificate.public_key()
    assert isinstance(public, rsa.RSAPublicKey)
    try:
        public.verify(signature, canonical(doc).encode(), padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        return None
    return doc


# ---------------------------------------------------------------------------------------------------------
# Verification of a stream


@dataclass
class ChainReport:
    records: int = 0
    checkpoints: int = 0  # checkpoints whose position was checked
    first_seq: int | None = None
    last_seq: int | None = None
    last_hash: str | None = None
    break_at: str | None = None  # the first break, in words (None: intact)

    @property
    def intact(self) -> bool:
        return self.break_at is None


def verify_chain(
    records: Iterable[Stored],
    checkpoints: Iterable[str],
    certificate: x509.Certificate,
    *,
    start: tuple[int, str] | None = None,
    head: tuple[int, str] | None = None,
    head_after: Callable[[], tuple[int, str] | None] | None = None,
    columns: Iterable[dict] | None = None,
) -> ChainReport:
    """Walk `records` in stored order: each one's hash, its link to the one before, its sequence number; then
    every checkpoint's signature and whether the walked chain has its hash at its position. `start`: the (seq,
    prev hash) the walk must begin with (a stream's first record: (1, GENESIS); after retention: the last retired
    record's); None for a time range, which trusts its first record's link. `head`: the stream's head as the
    store recorded it, read before the records and the checkpoints before it (a live writer appends meanwhile),
    which the walk must reach (a removed tail); `head_after` reads it again after the walk, which no record may
    be beyond (one added past it). `columns`: a database's search columns
    per record, which must agree with the meta."""
    report = ChainReport()
    batches = _Batches()
    seen: dict[int, str] = {}
    cols: Iterator[dict] | None = iter(columns) if columns is not None else None
    expect = start
    for rec in records:
        meta = rec.fields
        seq = meta["seq"]
        where = f"record seq {seq} (id {meta['id']})"
        if record_hash(rec.meta, rec.body) != rec.hash:
            return _broken(report, f"{where}: content does not match its hash (altered)")
        if expect is not None and (seq, meta["prev"]) != expect:
            if seq != expect[0]:
                return _broken(report, f"{where}: expected seq {expect[0]} (a record removed, inserted or moved)")
            return _broken(report, f"{where}: does not link to the record before it (altered or replaced)")
        if (why := batches.check(meta["body"])) is not None:
            return _broken(report, f"{where}: {why}")
        if cols is not None:
            row = next(cols)
            if any(row[k] != meta[k] for k in (*SEARCH_FIELDS, "seq", "stream")):
                return _broken(report, f"{where}: search columns differ from the record (altered)")
        seen[seq] = rec.hash
        report.records += 1
        report.first_seq = seq if report.first_seq is None else report.first_seq
        report.last_seq, report.last_hash = seq, rec.hash
        expect = (seq + 1, rec.hash)
    # Read before the records (a live writer may append meanwhile): the walk must reach it and agree with it.
    if head is not None and seen.get(head[0]) != head[1]:
        return _broken(report, f"the stream's head is seq {head[0]}, the last record found is {report.last_seq}")
    after = head_after() if head_after is not None else None
    if after is not None and (report.last_seq or 0) > after[0]:
        return _broken(report, f"records beyond the stream's head (seq {after[0]}): added past it")
    for text in checkpoints:
        doc = checkpoint_valid(text, certificate)
        if doc is None:
            return _broken(report, "a checkpoint's signature does not verify with the certificate given")
        got = seen.get(doc["seq"])
        in_range = report.first_seq is not None and report.first_seq <= doc["seq"] <= (report.last_seq or 0)
        if got is None and in_range:
            return _broken(report, f"checkpoint at seq {doc['seq']}: no such record (removed)")
        if got is not None and got != doc["hash"]:
            return _broken(report, f"checkpoint at seq {doc['seq']}: the record there is not the one signed")
        report.checkpoints += got is not None
        if head is not None and doc["seq"] > (report.last_seq or 0):
            return _broken(report, f"checkpoint at seq {doc['seq']} is beyond the last record (tail removed)")
    return report


class _Batches:
    """The walk's view of the batches (BatchKeys): a batch's records are consecutive (no body: no batch), each
    body key has one wrapped data key in a batch, and no nonce comes twice in one."""

    def __init__(self) -> None:
        self.current: str | None = None
        self.keys: dict[str, str] = {}  # key_id: the wrapped data key, in the current batch
        self.nonces: set[str] = set()
        self.ended: set[str] = set()

    def check(self, envelope: dict | None) -> str | None:
        if envelope is None or "batch" not in envelope:
            return None  # no body, or sealed before batches (a data key of its own)
        batch = envelope["batch"]
        if batch != self.current:
            if batch in self.ended:
                return "sealed in a batch that ended before it (a record moved between batches)"
            if self.current is not None:
                self.ended.add(self.current)
            self.current, self.keys, self.nonces = batch, {}, set()
        if self.keys.setdefault(envelope["key_id"], envelope["key"]) != envelope["key"]:
            return "its data key is not its batch's (a batch key swapped)"
        if envelope["nonce"] in self.nonces:
            return "a nonce its batch used before (nonce reuse)"
        self.nonces.add(envelope["nonce"])
        return None


def _broken(report: ChainReport, why: str) -> ChainReport:
    report.break_at = why
    return report
