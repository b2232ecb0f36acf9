"""Where security contexts live (`make_store`): `sealed` keeps nothing per context (the state travels
AES-256-GCM-sealed in the wsc:Identifier, so any replica with the master keys serves any context; only cancelled
contexts are remembered, until they expire), `memory` a bounded dict, `redis` a Redis shared by replicas."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hashlib
import heapq
import os
import re
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import Protocol

import redis
import yaml
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from redis.backoff import NoBackoff
from redis.retry import Retry

from filters.engine import faults
from filters.engine.conversation.contexts import ContextStore, live, random_identifier, unknown_context
from filters.engine.wss.replay import PROCESS_STARTED_MS, now_ms
from filters.engine.wss.secure_conversation import (
    EXPIRED_GRACE_S,
    MAX_IDENTIFIER,
    VERSIONS,
    Context,
    Version,
    store_full,
    wsc_fault,
    wst_fault,
)
from filters.stores.replay import EPOCH_KEY, epoch_of
from filters.stores.tracked import TrackedKeys
from gateway.policy import SecureConversationOptions

# ---------------------------------------------------------------------------------------------------------
# Contexts and their stores


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


def _ms(when: datetime) -> int:
    if when.tzinfo is None:
        raise ValueError("`now` must be an aware datetime")
    return (when - _EPOCH) // _MS


def _new_context(
    identifier: str, secret: bytes, subject: str, version: Version, now: datetime, lifetime_s: int
) -> Context:
    if not 16 <= len(secret) <= 255:
        raise ValueError(f"a context secret has 16 to 255 bytes, got {len(secret)}")
    created = _EPOCH + _ms(now) * _MS
    return Context(identifier, secret, subject, version, created, created + timedelta(seconds=lifetime_s))


# format, spec version code, created ms, expires ms, secret length; then the secret and the UTF-8 subject.
_PACK = struct.Struct(">BBqqB")
_PACK_FORMAT = 1


def _pack(ctx: Context) -> bytes:
    head = _PACK.pack(_PACK_FORMAT, VERSIONS.index(ctx.version), _ms(ctx.created), _ms(ctx.expires), len(ctx.secret))
    return head + ctx.secret + ctx.subject.encode()


def _unpack(identifier: str, data: bytes) -> Context | None:
    """The context `_pack` made, or None for anything else."""
    if len(data) < _PACK.size:
        return None
    fmt, code, created, expires, size = _PACK.unpack_from(data)
    secret = data[_PACK.size : _PACK.size + size]
    if fmt != _PACK_FORMAT or code >= len(VERSIONS) or len(secret) != size:
        return None
    try:
        subject = data[_PACK.size + size :].decode()
    except UnicodeDecodeError:
        return None
    return Context(identifier, secret, subject, VERSIONS[code], _EPOCH + created * _MS, _EPOCH + expires * _MS)


class MemoryContextStore:
    """Contexts in this process: at most `max_contexts`. When full, expired contexts make room (earliest
    expiry first); a store full of live contexts refuses new ones (RequestFailed, a Receiver fault) rather than grow or
    evict a context someone is using."""

    def __init__(self, lifetime_s: int, max_contexts: int) -> None:
        if lifetime_s < 1 or max_contexts < 1:
            raise ValueError("lifetime_s and max_contexts must be at least 1")
        self.lifetime_s = lifetime_s
        self.max_contexts = max_contexts
        self._contexts: dict[str, Context] = {}
        # (expires, identifier) of every context, plus those of cancelled ones until they come up (skipped then).
        self._expiry: list[tuple[datetime, str]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._contexts)

    def _drop_expired(self, before: datetime) -> None:
        while self._expiry and self._expiry[0][0] <= before:
            self._contexts.pop(heapq.heappop(self._expiry)[1], None)

    def issue(self, secret: bytes, subject: str, version: Version, now: datetime) -> Context:
        ctx = _new_context(random_identifier(), secret, subject, version, now, self.lifetime_s)
        with self._lock:
            self._drop_expired(now - timedelta(seconds=EXPIRED_GRACE_S))
            if len(self._contexts) >= self.max_contexts:
                self._drop_expired(now)
            if len(self._contexts) >= self.max_contexts:
                raise store_full(version, f"memory context store full: {len(self._contexts)} live contexts")
            self._contexts[ctx.identifier] = ctx
            heapq.heappush(self._expiry, (ctx.expires, ctx.identifier))
        return ctx

    def lookup(self, identifier: str, version: Version, now: datetime) -> Context:
        ctx = self._contexts.get(identifier)
        if ctx is None:
            raise unknown_context(version, identifier)
        return live(ctx, version, now)

    def cancel(self, identifier: str, version: Version, now: datetime) -> Context:
        ctx = self.lookup(identifier, version, now)
        with self._lock:
            self._contexts.pop(identifier, None)
            # Cancelled contexts leave stale heap entries; rebuild before they outnumber the live ones.
            if len(self._expiry) > 2 * self.max_contexts:
                self._expiry = [(c.expires, c.identifier) for c in self._contexts.values()]
                heapq.heapify(self._expiry)
        return ctx


class _RedisErrors:
    """A store that cannot answer is a server fault: refuse rather than guess (as the replay store does). A class,
    not a @contextmanager: every message enters it, and a generator per use cost 7,500 instructions."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, redis.RedisError):
            raise faults.server(f"security context store unavailable: {type(exc).__name__}: {exc}") from None


_REDIS_ERRORS = _RedisErrors()


def _redis_errors() -> _RedisErrors:
    return _REDIS_ERRORS


def _redis_client(url: str, timeout_s: float) -> redis.Redis:
    # Short timeouts and no retries: a hung Redis turns into a prompt refusal instead of stalled requests.
    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )


def _ttl_ms(until: datetime, now: datetime) -> int:
    return max(1, _ms(until) - _ms(now))


class RedisContextStore:
    """Contexts in Redis, shared by every gateway that uses the same server.

    Each context is one key, `<prefix>ctx:<digest of the identifier>`, holding the packed context with EXPIRE =
    its lifetime, so Redis forgets the secret when the context ends. A secret-free marker key lives
    EXPIRED_GRACE_S longer, so an expired context is reported as RenewNeeded rather than unknown."""

    def __init__(self, url: str, lifetime_s: int, prefix: str = "wsgate:sct:", timeout_s: float = 1.0) -> None:
        if lifetime_s < 1:
            raise ValueError("lifetime_s must be at least 1")
        self.lifetime_s = lifetime_s
        self.prefix = prefix
        self._client = _redis_client(url, timeout_s)

    def _names(self, identifier: str) -> tuple[str, str]:
        # Fixed-size keys whatever identifier a client sends.
        digest = hashlib.sha256(identifier.encode()).hexdigest()[:32]
        return f"{self.prefix}ctx:{digest}", f"{self.prefix}expired:{digest}"

    def issue(self, secret: bytes, subject: str, version: Version, now: datetime) -> Context:
        ctx = _new_context(random_identifier(), secret, subject, version, now, self.lifetime_s)
        name, marker = self._names(ctx.identifier)
        ttl = self.lifetime_s * 1000
        with _redis_errors():
            pipe = self._client.pipeline(transaction=True)
            pipe.set(name, _pack(ctx), px=ttl)
            pipe.set(marker, b"", px=ttl + EXPIRED_GRACE_S * 1000)
            pipe.execute()
        return ctx

    def lookup(self, identifier: str, version: Version, now: datetime) -> Context:
        name, marker = self._names(identifier)
        with _redis_errors():
            pipe = self._client.pipeline(transaction=False)
            pipe.get(name)
            pipe.exists(marker)
            data, expired = pipe.execute()
        if data is None:
            if expired:
                raise wsc_fault(version, "RenewNeeded", f"security context expired: {identifier[:80]!r}")
            raise unknown_context(version, identifier)
        ctx = _unpack(identifier, data)
        if ctx is None:
            raise unknown_context(version, identifier, "unreadable context record")
        return live(ctx, version, now)

    def cancel(self, identifier: str, version: Version, now: datetime) -> Context:
        ctx = self.lookup(identifier, version, now)
        with _redis_errors():
            self._client.delete(*self._names(identifier))
        return ctx

    def close(self) -> None:
        self._client.close()


class Revocations(Protocol):
    """Cancelled sealed contexts, remembered until they would have expired anyway.

    (filters.engine.wss.replay.ReplayCache cannot serve here: its only operation, `seen`, records what it is asked about,
    so asking whether an identifier was cancelled would cancel it.)"""

    def __len__(self) -> int:
        """Entries held in this process."""
        ...

    def revoke(self, key: bytes, until: datetime, now: datetime) -> bool:
        """Remember `key` (ASCII) until `until`; False when there is no room (nothing is forgotten to make some)."""
        ...

    def revoked(self, key: bytes, issued_ms: int, now: datetime) -> bool:
        """Whether `key` was cancelled, or may have been: a context issued (`issued_ms`, ms since the epoch) at or
        before the list's epoch (the moment it started remembering, filters/engine/wss/replay.py) could have been
        cancelled in what it forgot."""
        ...


class MemoryRevocations:
    """Revocations in this process, at most `max_entries`; expired entries make room."""

    def __init__(self, max_entries: int, epoch: datetime | None = None) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        # A new list (a worker started) knows no cancellation made before it: contexts issued until then are out.
        self._epoch_ms = now_ms() if epoch is None else _ms(epoch)
        self._until: dict[bytes, datetime] = {}
        self._heap: list[tuple[datetime, bytes]] = []  # the same entries by expiry; they leave both together
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._until)

    def revoke(self, key: bytes, until: datetime, now: datetime) -> bool:
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                del self._until[heapq.heappop(self._heap)[1]]
            if key in self._until:
                return True
            if len(self._until) >= self.max_entries:
                return False
            self._until[key] = until
            heapq.heappush(self._heap, (until, key))
            return True

    def revoked(self, key: bytes, issued_ms: int, now: datetime) -> bool:
        until = self._until.get(key)
        return (until is not None and now < until) or issued_ms <= self._epoch_ms


OPENED_CONTEXTS = 1024  # sealed identifiers remembered opened, per store (each at most MAX_IDENTIFIER characters)


class RedisRevocations:
    """Revocations in Redis, so a context cancelled through one replica is refused by all.

    Every message of every context asks, so the epoch and each context's cancellation key are read through a
    tracked connection (filters/stores/tracked.py): kept, at most `max_keys` of them, until Redis pushes that one
    changed (a cancellation through any replica, an expiry, a flush) or the connection drops; a known context's
    check is a poll(2), not a round trip. A Redis that cannot answer still refuses (a server fault)."""

    def __init__(self, url: str, prefix: str = "wsgate:sct-cancelled:", timeout_s: float = 1.0,
                 max_keys: int = OPENED_CONTEXTS + 1) -> None:  # fmt: skip
        self.prefix = prefix.encode()
        self._client = _redis_client(url, timeout_s)
        self._tracked = TrackedKeys(url, (EPOCH_KEY, self.prefix), _raw, timeout_s, max_keys)

    def __len__(self) -> int:
        return 0

    def revoke(self, key: bytes, until: datetime, now: datetime) -> bool:
        name = self.prefix + key
        with _redis_errors():
            self._client.set(name, b"", px=_ttl_ms(until, now))
        self._tracked.forget(name)  # this worker refuses it at once, whatever the push does
        return True

    def revoked(self, key: bytes, issued_ms: int, now: datetime) -> bool:
        # Only a Redis found without its epoch (restarted empty) is written: whoever comes first starts the epoch
        # (SET NX GET), and the push that write makes has every worker read the epoch again.
        mine = now_ms()
        with _redis_errors():
            epoch, cancelled = self._tracked.get((EPOCH_KEY, self.prefix + key))
            if epoch is None:
                epoch = self._client.set(EPOCH_KEY, str(mine), nx=True, get=True)
                self._tracked.forget(EPOCH_KEY)
        return cancelled is not None or issued_ms <= epoch_of(epoch, mine)

    def close(self) -> None:
        self._client.close()
        self._tracked.close()


def _raw(data: bytes | None) -> bytes | None:
    return data


@dataclass(frozen=True)
class MasterKey:
    id: str
    key: bytes = field(repr=False)


_KEY_ID = re.compile(r"[A-Za-z0-9_\-]{1,32}")


def load_master_keys(path: str | Path) -> list[MasterKey]:
    """The sealing keys from YAML `keys: [{id: k1, key: base64}]` (32-byte AES-256 keys, distinct ids).

    The first key seals; every key opens, so a new key goes first and the old one stays until the contexts
    it sealed have expired (lifetime_s)."""
    doc = yaml.safe_load(Path(path).read_text())
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a non-empty list `keys: [{{id: ..., key: base64}}]`")
    out: list[MasterKey] = []
    for entry in entries:
        key_id = entry.get("id") if isinstance(entry, dict) else None
        value = entry.get("key") if isinstance(entry, dict) else None
        if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id) or not isinstance(value, str):
            raise ValueError(f"{path}: each key needs an id of 1-32 letters, digits, '_' or '-' and a base64 key")
        if any(k.id == key_id for k in out):
            raise ValueError(f"{path}: key id {key_id} appears twice")
        try:
            secret = base64.b64decode(value, validate=True)
        except binascii.Error:
            raise ValueError(f"{path}: key {key_id}: not base64") from None
        if len(secret) != 32:
            raise ValueError(f"{path}: key {key_id}: {len(secret)} bytes, AES-256 needs 32")
        out.append(MasterKey(key_id, secret))
    return out


SEALED_PREFIX = "urn:wsgate:sct:"
_GCM_NONCE = 12
_GCM_TAG = 16
_B64URL = re.compile(r"[A-Za-z0-9_\-]+")


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


class _Unopened(Exception):
    """A sealed identifier that does not open; the reason (SealedContextStore._open raises it, _lookup turns it
    into the message's version's fault: the cache of opened identifiers is not keyed by version)."""


class SealedContextStore:
    """Contexts sealed into their own identifiers: `urn:wsgate:sct:<key id>:<base64url(nonce || AES-256-GCM
    ciphertext)>` of the secret, times, subject and version, with the prefix up to the key id as associated
    data. Nothing is kept per context except cancellations, in `revocations` (bounded)."""

    def __init__(self, master_keys: Sequence[MasterKey], lifetime_s: int, revocations: Revocations) -> None:
        if not master_keys or lifetime_s < 1:
            raise ValueError("a sealed store needs a master key and a lifetime of at least 1 s")
        self.lifetime_s = lifetime_s
        self.revocations = revocations
        self._seal_with = master_keys[0].id
        self._keys = {k.id: AESGCM(k.key) for k in master_keys}
        # Every message of a context presents the same identifier: opened (base64, AES-GCM, unpacked) once while
        # it is among the last OPENED_CONTEXTS; only identifiers that opened are remembered (exceptions are not
        # cached). Keyed by the identifier alone (live() checks the message's version), with what each message's
        # checks need made once: the cancellation key, the creation in ms. Cancellation and expiry are still
        # checked per message (_lookup).
        self._opened = functools.lru_cache(maxsize=OPENED_CONTEXTS)(self._open)

    def __len__(self) -> int:
        """Per-context entries held in this process: the cancellations."""
        return len(self.revocations)

    def issue(self, secret: bytes, subject: str, version: Version, now: datetime) -> Context:
        ctx = _new_context("", secret, subject, version, now, self.lifetime_s)
        head = f"{SEALED_PREFIX}{self._seal_with}:"
        nonce = os.urandom(_GCM_NONCE)
        sealed = nonce + self._keys[self._seal_with].encrypt(nonce, _pack(ctx), head.encode())
        identifier = head + _b64url(sealed)
        if len(identifier) > MAX_IDENTIFIER:
            raise wst_fault(version, "RequestFailed", f"subject of {len(subject)} characters too long to seal")
        return dataclasses.replace(ctx, identifier=identifier)

    def _open(self, identifier: str) -> tuple[Context, bytes, int]:
        """The sealed context, the key its cancellation is recorded under (hex of the key id, ':' and the GCM
        nonce) and its creation in ms; _Unopened (the reason) for anything else."""
        if len(identifier) > MAX_IDENTIFIER or not identifier.startswith(SEALED_PREFIX):
            raise _Unopened("not a sealed context identifier")
        key_id, sep, payload = identifier[len(SEALED_PREFIX) :].partition(":")
        aead = self._keys.get(key_id)
        if not sep or aead is None:
            raise _Unopened(f"sealed under unknown master key {key_id[:32]!r}")
        try:
            raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        except binascii.Error:
            raw = b""
        # One spelling per context (base64 leaves spare bits in the last character): whatever is keyed by the
        # identifier string sees one context as one. Cancellations are keyed by key id and GCM nonce anyway.
        if not _B64URL.fullmatch(payload) or _b64url(raw) != payload or len(raw) < _GCM_NONCE + _GCM_TAG:
            raise _Unopened("malformed sealed identifier")
        head = identifier[: len(SEALED_PREFIX) + len(key_id) + 1]
        try:
            plain = aead.decrypt(raw[:_GCM_NONCE], raw[_GCM_NONCE:], head.encode())
        except InvalidTag:
            raise _Unopened("sealed identifier does not open (tampered)") from None
        ctx = _unpack(identifier, plain)
        if ctx is None:
            raise _Unopened("unreadable sealed context")
        return ctx, (f"{key_id}:".encode() + raw[:_GCM_NONCE]).hex().encode(), _ms(ctx.created)

    def _lookup(self, identifier: str, version: Version, now: datetime) -> tuple[Context, bytes]:
        try:
            ctx, revocation, created_ms = self._opened(identifier)
        except _Unopened as e:
            raise unknown_context(version, identifier, str(e)) from None
        if self.revocations.revoked(revocation, created_ms, now):
            raise unknown_context(
                version, identifier, "cancelled security context, or issued before the cancellations' epoch"
            )
        return live(ctx, version, now), revocation

    def lookup(self, identifier: str, version: Version, now: datetime) -> Context:
        return self._lookup(identifier, version, now)[0]

    def cancel(self, identifier: str, version: Version, now: datetime) -> Context:
        ctx, revocation = self._lookup(identifier, version, now)
        if not self.revocations.revoke(revocation, ctx.expires, now):
            raise store_full(version, "cancellation list full")
        return ctx


@functools.cache
def _memory_revocations(max_entries: int) -> MemoryRevocations:
    # One per worker, kept across policy reloads: a new list would start a new epoch and refuse every context.
    return MemoryRevocations(max_entries, epoch=_EPOCH + PROCESS_STARTED_MS * _MS)


def make_store(options: SecureConversationOptions, redis_url: str | None = None) -> ContextStore:
    """The store a route's options choose. Build it once per route (it loads keys and opens connections).

    Redis URL: the policy's own `redis_url` when it sets one, else `redis_url` (e.g. WSGATE_REDIS_URL), else
    the policy default. A sealed store keeps its cancellations in that Redis when one of the first two is given
    (so all replicas refuse a cancelled context), else in process (bounded by max_contexts)."""
    explicit = options.redis_url if "redis_url" in options.model_fields_set else None
    if options.store == "memory":
        return MemoryContextStore(options.lifetime_s, options.max_contexts)
    if options.store == "redis":
        return RedisContextStore(explicit or redis_url or options.redis_url, options.lifetime_s)
    shared = explicit or redis_url
    revocations: Revocations = RedisRevocations(shared) if shared else _memory_revocations(options.max_contexts)
    return SealedContextStore(load_master_keys(options.master_keys_file), options.lifetime_s, revocations)
