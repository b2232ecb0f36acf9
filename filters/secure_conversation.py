"""WS-SecureConversation: security contexts on `secureconversation` routes.

Two spec versions, each with its own WS-Trust: 2005/02 (WS-Trust 2005/02) and 1.3 (WS-Trust 1.3); see VERSIONS.

Gateway side: `find_rst` and `parse_rst` read a RequestSecurityToken, `answer_issue` establishes a context and
builds the RSTR (the backend never sees either), `answer_cancel` ends one. In a context, `header_scts` and
`store_resolver` find the context a wsc:DerivedKeyToken derives from and `derive` computes its key.
Client side: `build_issue_rst`, `read_rstr`, `build_dkt` / `message_keys`, `build_cancel_rst`,
`read_cancel_rstr`.

Context stores (`make_store`): `sealed` keeps nothing per context (the state travels AES-256-GCM-sealed in the
wsc:Identifier, so any replica with the master keys serves any context; only cancelled contexts are remembered,
until they expire), `memory` a bounded dict, `redis` a Redis shared by replicas.

Everything is synchronous and takes `now` (an aware datetime) from the caller. Refusals are faults.Fault: wsc
codes in the namespace of the spec version at hand, wst codes for malformed RSTs, wsse codes for malformed
tokens."""

from __future__ import annotations

import base64
import binascii
import copy
import dataclasses
import functools
import hashlib
import heapq
import hmac
import os
import re
import struct
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal, Protocol

import redis
import yaml
from cryptography import x509
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from lxml import etree
from redis.backoff import NoBackoff
from redis.retry import Retry

from filters import encryption, faults, keys, ns, replay
from filters.soap import Envelope
from filters.timestamp import format_datetime, parse_datetime
from gateway.policy import SecureConversationOptions

# ---------------------------------------------------------------------------------------------------------
# Spec versions


@dataclass(frozen=True)
class Version:
    """The URIs of one WS-SecureConversation version and the WS-Trust version it goes with."""

    name: str
    wsc: str  # WS-SecureConversation namespace
    wst: str  # WS-Trust namespace
    sct_token_type: str
    dk_token_type: str
    p_sha1: str  # DerivedKeyToken Algorithm
    computed_key_psha1: str  # ComputedKeyAlgorithm / ComputedKey
    nonce_type: str  # BinarySecret Type of entropy
    symmetric_key_type: str  # BinarySecret Type and KeyType
    issue: str  # RequestType values
    cancel: str
    renew: str
    issue_action: str  # WS-Addressing actions
    issue_reply_action: str
    cancel_action: str
    cancel_reply_action: str


def _version(name: str, wsc: str, wst: str) -> Version:
    # Both versions build their URIs the same way from their two namespaces (see the notes' table).
    return Version(
        name=name,
        wsc=wsc,
        wst=wst,
        sct_token_type=f"{wsc}/sct",
        dk_token_type=f"{wsc}/dk",
        p_sha1=f"{wsc}/dk/p_sha1",
        computed_key_psha1=f"{wst}/CK/PSHA1",
        nonce_type=f"{wst}/Nonce",
        symmetric_key_type=f"{wst}/SymmetricKey",
        issue=f"{wst}/Issue",
        cancel=f"{wst}/Cancel",
        renew=f"{wst}/Renew",
        issue_action=f"{wst}/RST/SCT",
        issue_reply_action=f"{wst}/RSTR/SCT",
        cancel_action=f"{wst}/RST/SCT/Cancel",
        cancel_reply_action=f"{wst}/RSTR/SCT/Cancel",
    )


WSC_2005_02 = _version(
    "2005/02", "http://schemas.xmlsoap.org/ws/2005/02/sc", "http://schemas.xmlsoap.org/ws/2005/02/trust"
)
WSC_1_3 = _version(
    "1.3",
    "http://docs.oasis-open.org/ws-sx/ws-secureconversation/200512",
    "http://docs.oasis-open.org/ws-sx/ws-trust/200512",
)
VERSIONS: tuple[Version, ...] = (WSC_2005_02, WSC_1_3)  # the index is the version's code in packed contexts
BY_WSC = {v.wsc: v for v in VERSIONS}
BY_WST = {v.wst: v for v in VERSIONS}

DEFAULT_KEY_BITS = 256
MIN_KEY_BITS, MAX_KEY_BITS = 128, 512
MIN_ENTROPY_BYTES, MAX_ENTROPY_BYTES = 16, 512  # WCF and CXF send as many bytes as the key has
DEFAULT_DK_LENGTH = 32  # WSS4J's default
DEFAULT_LABEL = b"WS-SecureConversationWS-SecureConversation"
DK_NONCE_BYTES = 16  # what WSS4J and WCF send
MIN_DK_NONCE_BYTES = 8  # no nonce (or a tiny one) would give every message of a context the same key
MIN_DK_LENGTH, MAX_DK_LENGTH = 16, 64
MAX_DK_OUTPUT = 4096  # offset + length: bounds the P_SHA1 work one token can ask for
MAX_IDENTIFIER = 4096
MAX_CONTEXT_ATTRIBUTE = 1024
# How long an expired context is still recognised (memory, redis), so its client hears RenewNeeded rather than
# BadContextToken; sealed identifiers are recognised for ever.
EXPIRED_GRACE_S = 600

_WSU_ID = ns.q(ns.WSU, "Id")
_STR = ns.q(ns.WSSE, "SecurityTokenReference")
_REFERENCE = ns.q(ns.WSSE, "Reference")
_LOCAL_ID = re.compile(r"[^\W\d][\w.\-]*")  # an NCName, as keys.py accepts in '#id' references
_INTEGER = re.compile(r"[0-9]{1,9}")


# ---------------------------------------------------------------------------------------------------------
# Faults

# WS-Trust fault codes this module uses, with their generic client messages (WS-Trust section 11).
WST_CODES: dict[str, str] = {
    "InvalidRequest": "The request was invalid or malformed",
    "RequestFailed": "The specified request failed",
}


def wsc_fault(version: Version, code: str, reason: str) -> faults.Fault:
    """A WS-SecureConversation fault (wsc:code in `version`'s namespace); `reason` is for the log only."""
    assert code in faults.WSC_CODES, code
    return faults.Fault(code=code, reason=reason, code_ns=version.wsc)


def _wst_fault(
    version: Version, code: str, reason: str, *, message: str = "", status: int = 500, sender: bool = True
) -> faults.Fault:
    return faults.Fault(
        code=code,
        reason=reason,
        message=message or WST_CODES[code],
        code_ns=version.wst,
        http_status=status,
        sender=sender,
    )


def _store_full(version: Version, reason: str) -> faults.Fault:
    # The gateway's limit, not the client's mistake: a Receiver fault it may retry later.
    return _wst_fault(
        version,
        "RequestFailed",
        reason,
        message="The gateway holds as many security contexts as it may; retry later",
        sender=False,  # HTTP 500 as every SOAP fault (503 is Envoy's own "service unavailable")
    )


Fail = Callable[[str], faults.Fault]


def _invalid_security(reason: str) -> faults.Fault:
    return faults.security("InvalidSecurity", reason)


def _invalid_token(reason: str) -> faults.Fault:
    return faults.security("InvalidSecurityToken", reason)


# ---------------------------------------------------------------------------------------------------------
# P_SHA1


def p_sha1(secret: bytes, seed: bytes, length: int) -> bytes:
    """RFC 2246 P_SHA1: HMAC-SHA1(secret, A(i) + seed) for A(0) = seed, A(i) = HMAC-SHA1(secret, A(i-1)).

    Computed keys are p_sha1(requestor entropy, issuer entropy, size); derived keys p_sha1(context secret,
    label + nonce, offset + length)."""
    if length < 0:
        raise ValueError(f"P_SHA1 length must not be negative, got {length}")
    out = bytearray()
    a = seed
    while len(out) < length:
        a = hmac.digest(secret, a, "sha1")
        out += hmac.digest(secret, a + seed, "sha1")
    return bytes(out[:length])


# ---------------------------------------------------------------------------------------------------------
# Contexts and their stores


@dataclass(frozen=True)
class Context:
    """An established security context. `subject` is the requester the bootstrap authenticated (RFC 4514);
    on the client side it is empty. Times are UTC, to the millisecond."""

    identifier: str
    secret: bytes = field(repr=False)
    subject: str
    version: Version
    created: datetime
    expires: datetime


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


def _random_identifier() -> str:
    return f"urn:uuid:{uuid.uuid4()}"


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


def _unknown(version: Version, identifier: str, why: str = "unknown security context") -> faults.Fault:
    return wsc_fault(version, "BadContextToken", f"{why}: {identifier[:80]!r}")


def _live(ctx: Context, version: Version, now: datetime) -> Context:
    """`ctx` if it may be used in a `version` message at `now`."""
    if ctx.version is not version:
        raise _unknown(version, ctx.identifier, f"context of version {ctx.version.name} used with {version.name}")
    if now >= ctx.expires:
        raise wsc_fault(version, "RenewNeeded", f"security context expired at {format_datetime(ctx.expires)}")
    return ctx


class ContextStore(Protocol):
    """Where contexts live. `version` is that of the message at hand: it names the faults' namespace, and a
    context is only found for messages of the version it was established with."""

    lifetime_s: int

    def issue(self, secret: bytes, subject: str, version: Version, now: datetime) -> Context:
        """A new context created at `now`, expiring `lifetime_s` later."""
        ...

    def lookup(self, identifier: str, version: Version, now: datetime) -> Context:
        """The live context `identifier` names; BadContextToken (unknown, cancelled, tampered, other version)
        or RenewNeeded (expired)."""
        ...

    def cancel(self, identifier: str, version: Version, now: datetime) -> Context:
        """End a live context (faults as `lookup`) and return it."""
        ...


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
        ctx = _new_context(_random_identifier(), secret, subject, version, now, self.lifetime_s)
        with self._lock:
            self._drop_expired(now - timedelta(seconds=EXPIRED_GRACE_S))
            if len(self._contexts) >= self.max_contexts:
                self._drop_expired(now)
            if len(self._contexts) >= self.max_contexts:
                raise _store_full(version, f"memory context store full: {len(self._contexts)} live contexts")
            self._contexts[ctx.identifier] = ctx
            heapq.heappush(self._expiry, (ctx.expires, ctx.identifier))
        return ctx

    def lookup(self, identifier: str, version: Version, now: datetime) -> Context:
        ctx = self._contexts.get(identifier)
        if ctx is None:
            raise _unknown(version, identifier)
        return _live(ctx, version, now)

    def cancel(self, identifier: str, version: Version, now: datetime) -> Context:
        ctx = self.lookup(identifier, version, now)
        with self._lock:
            self._contexts.pop(identifier, None)
            # Cancelled contexts leave stale heap entries; rebuild before they outnumber the live ones.
            if len(self._expiry) > 2 * self.max_contexts:
                self._expiry = [(c.expires, c.identifier) for c in self._contexts.values()]
                heapq.heapify(self._expiry)
        return ctx


@contextmanager
def _redis_errors() -> Iterator[None]:
    # A store that cannot answer is a server fault: refuse rather than guess (as the replay store does).
    try:
        yield
    except redis.RedisError as exc:
        raise faults.server(f"security context store unavailable: {type(exc).__name__}: {exc}") from None


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
        ctx = _new_context(_random_identifier(), secret, subject, version, now, self.lifetime_s)
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
            raise _unknown(version, identifier)
        ctx = _unpack(identifier, data)
        if ctx is None:
            raise _unknown(version, identifier, "unreadable context record")
        return _live(ctx, version, now)

    def cancel(self, identifier: str, version: Version, now: datetime) -> Context:
        ctx = self.lookup(identifier, version, now)
        with _redis_errors():
            self._client.delete(*self._names(identifier))
        return ctx

    def close(self) -> None:
        self._client.close()


class Revocations(Protocol):
    """Cancelled sealed contexts, remembered until they would have expired anyway.

    (filters.replay.ReplayCache cannot serve here: its only operation, `seen`, records what it is asked about,
    so asking whether an identifier was cancelled would cancel it.)"""

    def __len__(self) -> int:
        """Entries held in this process."""
        ...

    def revoke(self, key: bytes, until: datetime, now: datetime) -> bool:
        """Remember `key` until `until`; False when there is no room (nothing is forgotten to make some)."""
        ...

    def revoked(self, key: bytes, issued: datetime, now: datetime) -> bool:
        """Whether `key` was cancelled, or may have been: a context issued at or before the list's epoch (the
        moment it started remembering, filters/replay.py) could have been cancelled in what it forgot."""
        ...


class MemoryRevocations:
    """Revocations in this process, at most `max_entries`; expired entries make room."""

    def __init__(self, max_entries: int, epoch: datetime | None = None) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        # A new list (a worker started) knows no cancellation made before it: contexts issued until then are out.
        self._epoch_ms = replay.now_ms() if epoch is None else _ms(epoch)
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

    def revoked(self, key: bytes, issued: datetime, now: datetime) -> bool:
        until = self._until.get(key)
        return (until is not None and now < until) or _ms(issued) <= self._epoch_ms


class RedisRevocations:
    """Revocations in Redis, so a context cancelled through one replica is refused by all."""

    def __init__(self, url: str, prefix: str = "wsgate:sct-cancelled:", timeout_s: float = 1.0) -> None:
        self.prefix = prefix
        self._client = _redis_client(url, timeout_s)

    def __len__(self) -> int:
        return 0

    def revoke(self, key: bytes, until: datetime, now: datetime) -> bool:
        with _redis_errors():
            self._client.set(self.prefix + key.hex(), b"", px=_ttl_ms(until, now))
        return True

    def revoked(self, key: bytes, issued: datetime, now: datetime) -> bool:
        mine = replay.now_ms()
        with _redis_errors():
            pipe = self._client.pipeline(transaction=False)
            pipe.set(replay.EPOCH_KEY, str(mine), nx=True, get=True)
            pipe.exists(self.prefix + key.hex())
            epoch, cancelled = pipe.execute()
        return bool(cancelled) or _ms(issued) <= replay.epoch_of(epoch, mine)

    def close(self) -> None:
        self._client.close()


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
OPENED_CONTEXTS = 1024  # sealed identifiers remembered opened, per store (each at most MAX_IDENTIFIER characters)
_GCM_NONCE = 12
_GCM_TAG = 16
_B64URL = re.compile(r"[A-Za-z0-9_\-]+")


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


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
        # cached). Cancellation and expiry are still checked per message (_lookup).
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
            raise _wst_fault(version, "RequestFailed", f"subject of {len(subject)} characters too long to seal")
        return dataclasses.replace(ctx, identifier=identifier)

    def _open(self, identifier: str, version: Version) -> tuple[Context, bytes]:
        """The sealed context and the key its cancellation is recorded under."""
        if len(identifier) > MAX_IDENTIFIER or not identifier.startswith(SEALED_PREFIX):
            raise _unknown(version, identifier, "not a sealed context identifier")
        key_id, sep, payload = identifier[len(SEALED_PREFIX) :].partition(":")
        aead = self._keys.get(key_id)
        if not sep or aead is None:
            raise _unknown(version, identifier, f"sealed under unknown master key {key_id[:32]!r}")
        try:
            raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        except binascii.Error:
            raw = b""
        # One spelling per context (base64 leaves spare bits in the last character): whatever is keyed by the
        # identifier string sees one context as one. Cancellations are keyed by key id and GCM nonce anyway.
        if not _B64URL.fullmatch(payload) or _b64url(raw) != payload or len(raw) < _GCM_NONCE + _GCM_TAG:
            raise _unknown(version, identifier, "malformed sealed identifier")
        head = identifier[: len(SEALED_PREFIX) + len(key_id) + 1]
        try:
            plain = aead.decrypt(raw[:_GCM_NONCE], raw[_GCM_NONCE:], head.encode())
        except InvalidTag:
            raise _unknown(version, identifier, "sealed identifier does not open (tampered)") from None
        ctx = _unpack(identifier, plain)
        if ctx is None:
            raise _unknown(version, identifier, "unreadable sealed context")
        return ctx, f"{key_id}:".encode() + raw[:_GCM_NONCE]

    def _lookup(self, identifier: str, version: Version, now: datetime) -> tuple[Context, bytes]:
        ctx, revocation = self._opened(identifier, version)
        if self.revocations.revoked(revocation, ctx.created, now):
            raise _unknown(version, identifier, "cancelled security context, or issued before the cancellations' epoch")
        return _live(ctx, version, now), revocation

    def lookup(self, identifier: str, version: Version, now: datetime) -> Context:
        return self._lookup(identifier, version, now)[0]

    def cancel(self, identifier: str, version: Version, now: datetime) -> Context:
        ctx, revocation = self._lookup(identifier, version, now)
        if not self.revocations.revoke(revocation, ctx.expires, now):
            raise _store_full(version, "cancellation list full")
        return ctx


@functools.cache
def _memory_revocations(max_entries: int) -> MemoryRevocations:
    # One per worker, kept across policy reloads: a new list would start a new epoch and refuse every context.
    return MemoryRevocations(max_entries, epoch=_EPOCH + replay.PROCESS_STARTED_MS * _MS)


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


# ---------------------------------------------------------------------------------------------------------
# XML helpers


def _elements(el: etree._Element) -> list[etree._Element]:
    return [c for c in el if isinstance(c.tag, str)]


def _at_most_one(parent: etree._Element, tag: str, fail: Fail) -> etree._Element | None:
    found = parent.findall(tag)
    if len(found) > 1:
        raise fail(f"more than one {etree.QName(tag).localname}")
    return found[0] if found else None


def _one(parent: etree._Element, tag: str, fail: Fail) -> etree._Element:
    found = _at_most_one(parent, tag, fail)
    if found is None:
        raise fail(f"{etree.QName(parent).localname} without {etree.QName(tag).localname}")
    return found


def _text(el: etree._Element, fail: Fail) -> str:
    text = (el.text or "").strip()
    if len(el) or not text:
        raise fail(f"{etree.QName(el).localname}: expected non-empty text")
    return text


def _integer(el: etree._Element, fail: Fail) -> int:
    text = _text(el, fail)
    if not _INTEGER.fullmatch(text):
        raise fail(f"{etree.QName(el).localname} is not a small non-negative integer")
    return int(text)


def _b64(el: etree._Element, fail: Fail) -> bytes:
    try:
        return base64.b64decode("".join(_text(el, fail).split()), validate=True)
    except binascii.Error:
        raise fail(f"{etree.QName(el).localname} is not base64") from None


def _sub(parent: etree._Element, tag: str, text: str | None = None) -> etree._Element:
    el = etree.SubElement(parent, tag)
    el.text = text
    return el


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------------------
# SecurityContextToken and references to it


@dataclass(frozen=True)
class Sct:
    """A wsc:SecurityContextToken as a message carries it."""

    version: Version
    identifier: str
    id: str | None  # its wsu:Id


_SCT_TAGS = {ns.q(v.wsc, "SecurityContextToken") for v in VERSIONS}


def is_sct(el: etree._Element) -> bool:
    """Whether `el` is a wsc:SecurityContextToken of either version (a Security header processor's test)."""
    return isinstance(el.tag, str) and el.tag in _SCT_TAGS


def parse_sct(el: etree._Element) -> Sct:
    """Read a wsc:SecurityContextToken: one non-empty wsc:Identifier; BadContextToken if malformed,
    UnsupportedContextToken for a renewed instance (wsc:Instance: the gateway does not renew)."""
    qn = etree.QName(el)
    version = BY_WSC.get(qn.namespace or "")
    if version is None or qn.localname != "SecurityContextToken":
        raise _invalid_token(f"not a SecurityContextToken: {str(el.tag)[:120]}")

    def bad(reason: str) -> faults.Fault:
        return wsc_fault(version, "BadContextToken", f"SecurityContextToken: {reason}")

    if el.find(ns.q(version.wsc, "Instance")) is not None:
        raise wsc_fault(version, "UnsupportedContextToken", "SecurityContextToken with an Instance (renewed key)")
    identifier = _text(_one(el, ns.q(version.wsc, "Identifier"), bad), bad)
    if len(identifier) > MAX_IDENTIFIER:
        raise bad(f"Identifier of {len(identifier)} characters")
    return Sct(version, identifier, el.get(_WSU_ID))


def header_scts(security: etree._Element) -> dict[str, Sct]:
    """The SCTs a wsse:Security header carries, by wsu:Id: what '#id' references in that message mean.

    An id that names more than one element of the message is refused (InvalidSecurity): which would count?"""
    scts = [parse_sct(c) for c in security if is_sct(c)]
    wanted = {s.id for s in scts if s.id}
    if not wanted:
        return {}
    root = security.getroottree().getroot()
    counts = dict.fromkeys(wanted, 0)
    for el in root.iter():
        for value in {el.get(_WSU_ID), el.get("Id")}:
            if value in counts:
                counts[value] += 1
    twice = sorted(i for i, n in counts.items() if n > 1)
    if twice:
        raise _invalid_security(f"id {twice[0][:80]!r} names more than one element")
    return {s.id: s for s in scts if s.id}


@dataclass(frozen=True)
class SctRef:
    """How a message names an SCT: by the wsu:Id of one in the same Security header, or by its Identifier."""

    version: Version
    local_id: str | None = None
    identifier: str | None = None


def _sct_ref(str_el: etree._Element, version: Version, fail: Fail) -> SctRef:
    """The SCT a wsse:SecurityTokenReference names: Reference URI="#id" (ValueType absent or the SCT token
    type) or Reference URI=<Identifier> with ValueType the SCT token type. Anything else is `fail`."""
    if str_el.tag != _STR:
        raise fail(f"expected a SecurityTokenReference, got {str(str_el.tag)[:120]}")
    forms = _elements(str_el)
    if len(forms) != 1 or forms[0].tag != _REFERENCE:
        raise fail("the reference is not a single wsse:Reference")
    uri = forms[0].get("URI") or ""
    value_type = forms[0].get("ValueType")
    if uri.startswith("#"):
        if not _LOCAL_ID.fullmatch(uri[1:]) or value_type not in (None, version.sct_token_type):
            raise fail(f"reference {uri[:80]!r} (ValueType {str(value_type)[:120]!r}) names no {version.name} SCT")
        return SctRef(version, local_id=uri[1:])
    if value_type != version.sct_token_type or not uri or len(uri) > MAX_IDENTIFIER:
        raise fail(f"reference {uri[:80]!r} (ValueType {str(value_type)[:120]!r}) names no {version.name} SCT")
    return SctRef(version, identifier=uri)


def _identifier(ref: SctRef, local: Mapping[str, Sct] | None, code: str) -> str:
    if ref.identifier is not None:
        return ref.identifier
    sct = (local or {}).get(ref.local_id or "")
    if sct is None or sct.version is not ref.version:
        raise wsc_fault(ref.version, code, f"no {ref.version.name} SCT #{(ref.local_id or '')[:80]} in the header")
    return sct.identifier


def identifier_of(ref: SctRef, local: Mapping[str, Sct] | None) -> str:
    """The Identifier a reference names (through `local`, the header's SCTs, for '#id')."""
    return _identifier(ref, local, "UnknownDerivationSource")


def sct_reference(version: Version, *, identifier: str | None = None, local_id: str | None = None) -> etree._Element:
    """A wsse:SecurityTokenReference to an SCT: by Identifier (ValueType the SCT token type) or by the wsu:Id
    of one in the same header. Exactly one of the two."""
    if (identifier is None) == (local_id is None):
        raise ValueError("name the SCT by identifier or by local_id")
    el = etree.Element(_STR, nsmap={"wsse": ns.WSSE})
    etree.SubElement(
        el, _REFERENCE, URI=identifier if identifier is not None else f"#{local_id}", ValueType=version.sct_token_type
    )
    return el


def _sct_element(version: Version, identifier: str, sct_id: str) -> etree._Element:
    el = etree.Element(
        ns.q(version.wsc, "SecurityContextToken"), {_WSU_ID: sct_id}, nsmap={"wsc": version.wsc, "wsu": ns.WSU}
    )
    _sub(el, ns.q(version.wsc, "Identifier"), identifier)
    return el


SctResolver = Callable[[SctRef], Context]


def store_resolver(store: ContextStore, now: datetime, local: Mapping[str, Sct] | None = None) -> SctResolver:
    """Resolves SCT references of one message: '#id' through `local` (header_scts of its Security header),
    Identifiers directly, then the live context from `store` (its faults). Each context once per message: its
    derived keys (signature, encryption) name the same one, and a lookup may be a Redis round trip."""
    found: dict[tuple[str, str], Context] = {}

    def resolve(ref: SctRef) -> Context:
        identifier = _identifier(ref, local, "UnknownDerivationSource")
        key = (identifier, ref.version.name)
        if key not in found:
            found[key] = store.lookup(identifier, ref.version, now)
        return found[key]

    return resolve


# ---------------------------------------------------------------------------------------------------------
# DerivedKeyToken


@dataclass(frozen=True)
class DerivedKeyToken:
    """A parsed wsc:DerivedKeyToken. `offset` already accounts for a Generation (Generation x Length)."""

    version: Version
    id: str | None  # its wsu:Id
    source: SctRef
    offset: int
    length: int
    label: bytes
    nonce: bytes


_DKT_TAGS = {ns.q(v.wsc, "DerivedKeyToken") for v in VERSIONS}
_DKT_PARAMETERS = ("Generation", "Offset", "Length", "Label", "Nonce")


def is_dkt(el: etree._Element) -> bool:
    """Whether `el` is a wsc:DerivedKeyToken of either version (a Security header processor's test)."""
    return isinstance(el.tag, str) and el.tag in _DKT_TAGS


@functools.cache
def _dkt_children(wsc: str) -> frozenset[str]:
    return frozenset({ns.q(wsc, n) for n in _DKT_PARAMETERS} | {_STR})


def parse_dkt(el: etree._Element) -> DerivedKeyToken:
    """Read a wsc:DerivedKeyToken. InvalidSecurity if malformed, UnsupportedAlgorithm for an Algorithm other
    than the version's P_SHA1, UnknownDerivationSource when it does not reference an SCT."""
    qn = etree.QName(el)
    version = BY_WSC.get(qn.namespace or "")
    if version is None or qn.localname != "DerivedKeyToken":
        raise _invalid_security(f"not a DerivedKeyToken: {str(el.tag)[:120]}")
    algorithm = el.get("Algorithm")
    if algorithm not in (None, version.p_sha1):
        raise faults.security("UnsupportedAlgorithm", f"key derivation algorithm {algorithm[:120]!r}")
    allowed = _dkt_children(version.wsc)
    children: dict[str, etree._Element] = {}  # one walk over the children, each kind at most once
    for child in _elements(el):
        if child.tag not in allowed:
            raise _invalid_security(f"DerivedKeyToken: unsupported child {str(child.tag)[:120]}")
        if children.setdefault(child.tag, child) is not child:
            raise _invalid_security(f"more than one {etree.QName(child).localname}")

    def derived(name: str) -> etree._Element | None:
        return children.get(ns.q(version.wsc, name))

    def unknown_source(reason: str) -> faults.Fault:
        return wsc_fault(version, "UnknownDerivationSource", f"DerivedKeyToken: {reason}")

    if _STR not in children:
        raise _invalid_security("DerivedKeyToken without SecurityTokenReference")
    source = _sct_ref(children[_STR], version, unknown_source)
    generation, offset, length_el, label_el, nonce_el = (derived(n) for n in _DKT_PARAMETERS)
    if generation is not None and offset is not None:
        raise _invalid_security("DerivedKeyToken has both Offset and Generation")
    length = DEFAULT_DK_LENGTH if length_el is None else _integer(length_el, _invalid_security)
    if not MIN_DK_LENGTH <= length <= MAX_DK_LENGTH:
        raise _invalid_security(f"DerivedKeyToken Length {length} outside {MIN_DK_LENGTH}..{MAX_DK_LENGTH}")
    # WSE's rule: without an Offset, the key starts at Generation x Length.
    start = _integer(offset, _invalid_security) if offset is not None else 0
    if generation is not None:
        start = _integer(generation, _invalid_security) * length
    if start + length > MAX_DK_OUTPUT:
        raise _invalid_security(f"DerivedKeyToken asks for {start + length} bytes of P_SHA1 output")
    label = DEFAULT_LABEL if label_el is None else _text(label_el, _invalid_security).encode()
    if nonce_el is None:
        raise _invalid_security("DerivedKeyToken without Nonce")
    nonce = _b64(nonce_el, _invalid_security)
    if len(nonce) < MIN_DK_NONCE_BYTES:
        raise _invalid_security(f"DerivedKeyToken Nonce of {len(nonce)} bytes")
    return DerivedKeyToken(version, el.get(_WSU_ID), source, start, length, label, nonce)


def derive_key(dkt: DerivedKeyToken, secret: bytes) -> bytes:
    """P_SHA1(secret, label + nonce)[offset : offset + length]."""
    return p_sha1(secret, dkt.label + dkt.nonce, dkt.offset + dkt.length)[dkt.offset :]


@dataclass(frozen=True)
class ContextKey:
    """A derived key a message uses, and the context it comes from."""

    id: str | None  # the DerivedKeyToken's wsu:Id: how the message's signature or EncryptedData names it
    key: bytes = field(repr=False)
    context: Context


def derive(el: etree._Element, resolve: SctResolver) -> ContextKey:
    """The key a wsc:DerivedKeyToken of a message in a context stands for (parse_dkt's and `resolve`'s faults)."""
    dkt = parse_dkt(el)
    ctx = resolve(dkt.source)
    return ContextKey(dkt.id, derive_key(dkt, ctx.secret), ctx)


@dataclass(frozen=True)
class DerivedKey:
    """A DerivedKeyToken built for a message we send, and its key."""

    element: etree._Element
    id: str
    key: bytes = field(repr=False)


def build_dkt(
    version: Version,
    source: etree._Element,
    secret: bytes,
    *,
    length: int = DEFAULT_DK_LENGTH,
    offset: int = 0,
    generation: int | None = None,
    label: str | None = None,
    nonce: bytes | None = None,
) -> DerivedKey:
    """A wsc:DerivedKeyToken (wsu:Id, the `source` SecurityTokenReference, Offset or Generation, Length,
    Label when not the default, Nonce: a fresh 16-byte one unless given) and the key it derives from
    `secret`. Reference it with keys.str_reference(result.id, version.dk_token_type)."""
    if generation is not None and offset:
        raise ValueError("Offset and Generation exclude each other")
    nonce = os.urandom(DK_NONCE_BYTES) if nonce is None else nonce
    wsc = version.wsc
    dk_id = _new_id("DK")
    el = etree.Element(ns.q(wsc, "DerivedKeyToken"), {_WSU_ID: dk_id}, nsmap={"wsc": wsc, "wsu": ns.WSU})
    el.append(source)
    if generation is not None:
        _sub(el, ns.q(wsc, "Generation"), str(generation))
    else:
        _sub(el, ns.q(wsc, "Offset"), str(offset))
    _sub(el, ns.q(wsc, "Length"), str(length))
    if label is not None:
        _sub(el, ns.q(wsc, "Label"), label)
    _sub(el, ns.q(wsc, "Nonce"), base64.b64encode(nonce).decode())
    start = offset if generation is None else generation * length
    seed = (DEFAULT_LABEL if label is None else label.encode()) + nonce
    return DerivedKey(el, dk_id, p_sha1(secret, seed, start + length)[start:])


@dataclass(frozen=True)
class MessageKeys:
    signing: DerivedKey
    encryption: DerivedKey


def message_keys(ctx: Context, *, local_id: str | None = None, length: int = DEFAULT_DK_LENGTH) -> MessageKeys:
    """Two DerivedKeyTokens for one message in `ctx`, with distinct nonces: one to sign, one to encrypt.

    They reference the SCT by Identifier, or by `local_id` when the message carries the SCT in its header."""

    def one() -> DerivedKey:
        ref = sct_reference(ctx.version, identifier=None if local_id else ctx.identifier, local_id=local_id)
        return build_dkt(ctx.version, ref, ctx.secret, length=length)

    return MessageKeys(signing=one(), encryption=one())


# ---------------------------------------------------------------------------------------------------------
# RequestSecurityToken (gateway side)


@dataclass(frozen=True)
class Rst:
    """A parsed wst:RequestSecurityToken for an SCT."""

    version: Version
    request_type: Literal["issue", "cancel"]
    context: str | None  # the Context attribute, echoed in the RSTR
    key_size_bits: int  # Issue: the KeySize asked for, DEFAULT_KEY_BITS when absent
    entropy: bytes | None = field(repr=False)  # Issue: the requestor's Entropy/BinarySecret
    cancel_target: SctRef | None  # Cancel


def find_rst(env: Envelope) -> etree._Element | None:
    """The Body's wst:RequestSecurityToken (either version) when it is the Body's one element, else None."""
    children = _elements(env.body)
    if len(children) != 1:
        return None
    qn = etree.QName(children[0])
    return children[0] if qn.localname == "RequestSecurityToken" and qn.namespace in BY_WST else None


def parse_rst(el: etree._Element) -> Rst:
    """Read an RST: the version from its WS-Trust namespace; Issue or Cancel. wst:InvalidRequest when
    malformed, wsc:UnableToRenew for Renew."""
    qn = etree.QName(el)
    version = BY_WST.get(qn.namespace or "")
    if version is None or qn.localname != "RequestSecurityToken":
        raise faults.client(f"not a WS-Trust RequestSecurityToken: {str(el.tag)[:120]}")
    wst = version.wst

    def invalid(reason: str) -> faults.Fault:
        return _wst_fault(version, "InvalidRequest", f"RST: {reason}")

    context = el.get("Context")
    if context is not None and len(context) > MAX_CONTEXT_ATTRIBUTE:
        raise invalid(f"Context attribute of {len(context)} characters")
    request_type = _text(_one(el, ns.q(wst, "RequestType"), invalid), invalid)
    token_type = _at_most_one(el, ns.q(wst, "TokenType"), invalid)
    if token_type is not None and _text(token_type, invalid) != version.sct_token_type:
        raise invalid(f"TokenType {_text(token_type, invalid)[:120]!r} is not the {version.name} SCT")
    if request_type == version.renew:
        raise wsc_fault(version, "UnableToRenew", "RST Renew: the gateway does not renew contexts")
    if request_type == version.cancel:
        target = _one(el, ns.q(wst, "CancelTarget"), invalid)
        inner = _elements(target)
        if len(inner) != 1:
            raise invalid("CancelTarget must hold one token or reference")
        if is_sct(inner[0]):  # CXF puts the token itself there
            sct = parse_sct(inner[0])
            if sct.version is not version:
                raise invalid(f"CancelTarget holds a {sct.version.name} SCT")
            ref = SctRef(version, identifier=sct.identifier)
        else:
            ref = _sct_ref(inner[0], version, invalid)
        return Rst(version, "cancel", context, DEFAULT_KEY_BITS, None, ref)
    if request_type != version.issue:
        raise invalid(f"RequestType {request_type[:120]!r}")
    bits = DEFAULT_KEY_BITS
    key_size = _at_most_one(el, ns.q(wst, "KeySize"), invalid)
    if key_size is not None:
        bits = _integer(key_size, invalid)
        if not MIN_KEY_BITS <= bits <= MAX_KEY_BITS or bits % 8:
            raise invalid(f"KeySize {bits}")
    key_type = _at_most_one(el, ns.q(wst, "KeyType"), invalid)
    if key_type is not None and _text(key_type, invalid) != version.symmetric_key_type:
        raise invalid(f"KeyType {_text(key_type, invalid)[:120]!r}: an SCT has a symmetric key")
    algorithm = _at_most_one(el, ns.q(wst, "ComputedKeyAlgorithm"), invalid)
    if algorithm is not None and _text(algorithm, invalid) != version.computed_key_psha1:
        raise invalid(f"ComputedKeyAlgorithm {_text(algorithm, invalid)[:120]!r}")
    entropy = None
    entropy_el = _at_most_one(el, ns.q(wst, "Entropy"), invalid)
    if entropy_el is not None:
        inner = _elements(entropy_el)
        if len(inner) != 1 or inner[0].tag != ns.q(wst, "BinarySecret"):
            raise invalid("Entropy must be one BinarySecret (encrypted entropy is not supported)")
        if inner[0].get("Type") not in (None, version.nonce_type, version.symmetric_key_type):
            raise invalid(f"Entropy BinarySecret Type {inner[0].get('Type', '')[:120]!r}")
        entropy = _b64(inner[0], invalid)
        if not MIN_ENTROPY_BYTES <= len(entropy) <= MAX_ENTROPY_BYTES:
            raise invalid(f"Entropy of {len(entropy)} bytes")
    return Rst(version, "issue", context, bits, entropy, None)


@dataclass(frozen=True)
class IssueAnswer:
    response: etree._Element  # the RSTR (2005/02) or RSTR collection (1.3), for the reply's Body
    context: Context


def answer_issue(
    rst: Rst,
    store: ContextStore,
    requester: x509.Certificate,
    subject: str,
    now: datetime,
    *,
    entropy_confidential: bool,
    transport: str = "rsa-oaep-mgf1p",
) -> IssueAnswer:
    """Establish a context for an Issue RST whose sender the bootstrap authenticated (`requester`, `subject`).

    With requestor entropy, and `entropy_confidential` (the request Body arrived encrypted, or over TLS), the
    key is computed: P_SHA1(requestor entropy, fresh issuer entropy), the issuer entropy in the RSTR. Otherwise
    the key is fresh and travels in an xenc:EncryptedKey to `requester` (`transport`: policy key transport
    name): requestor entropy sent in the clear would give the computed key to any eavesdropper of both."""
    if rst.request_type != "issue":
        raise ValueError("answer_issue needs an Issue RST")
    version, size = rst.version, rst.key_size_bits // 8
    server_entropy = None
    if rst.entropy is not None and entropy_confidential:
        server_entropy = os.urandom(size)
        secret = p_sha1(rst.entropy, server_entropy, size)
    else:
        secret = os.urandom(size)
    ctx = store.issue(secret, subject, version, now)
    proof = etree.Element(ns.q(version.wst, "RequestedProofToken"))
    if server_entropy is not None:
        _sub(proof, ns.q(version.wst, "ComputedKey"), version.computed_key_psha1)
    else:
        if not isinstance(requester.public_key(), rsa.RSAPublicKey):
            raise _wst_fault(version, "RequestFailed", "the requester's certificate has no RSA key to encrypt to")
        proof.append(
            encryption.encrypt_key(secret, requester, transport, _new_id("EK"), keys.str_issuer_serial(requester), [])
        )
    return IssueAnswer(_rstr(rst, ctx, proof, server_entropy), ctx)


def _rstr(rst: Rst, ctx: Context, proof: etree._Element, server_entropy: bytes | None) -> etree._Element:
    version = rst.version
    wst = version.wst
    nsmap = {"wst": wst, "wsc": version.wsc, "wsu": ns.WSU, "wsse": ns.WSSE}
    rstr_tag = ns.q(wst, "RequestSecurityTokenResponse")
    if version is WSC_1_3:  # WS-Trust 1.3 wraps a final Issue response in a collection (CXF does)
        outer = etree.Element(ns.q(wst, "RequestSecurityTokenResponseCollection"), nsmap=nsmap)
        rstr = etree.SubElement(outer, rstr_tag)
    else:
        outer = rstr = etree.Element(rstr_tag, nsmap=nsmap)
    if rst.context is not None:
        rstr.set("Context", rst.context)
    _sub(rstr, ns.q(wst, "TokenType"), version.sct_token_type)
    sct_id = _new_id("sct")
    _sub(rstr, ns.q(wst, "RequestedSecurityToken")).append(_sct_element(version, ctx.identifier, sct_id))
    _sub(rstr, ns.q(wst, "RequestedAttachedReference")).append(sct_reference(version, local_id=sct_id))
    _sub(rstr, ns.q(wst, "RequestedUnattachedReference")).append(sct_reference(version, identifier=ctx.identifier))
    rstr.append(proof)
    if server_entropy is not None:
        secret = _sub(
            _sub(rstr, ns.q(wst, "Entropy")), ns.q(wst, "BinarySecret"), base64.b64encode(server_entropy).decode()
        )
        secret.set("Type", version.nonce_type)
    lifetime = _sub(rstr, ns.q(wst, "Lifetime"))
    _sub(lifetime, ns.q(ns.WSU, "Created"), format_datetime(ctx.created))
    _sub(lifetime, ns.q(ns.WSU, "Expires"), format_datetime(ctx.expires))
    _sub(rstr, ns.q(wst, "KeySize"), str(rst.key_size_bits))
    return outer


def answer_cancel(
    rst: Rst, store: ContextStore, proven: Context, now: datetime, local: Mapping[str, Sct] | None = None
) -> etree._Element:
    """End the context a Cancel RST names and return the RSTR (RequestedTokenCancelled) for the reply's Body.

    `proven`: the context whose derived key verified this message's signature. Only that context may be
    cancelled (BadContextToken otherwise): an Identifier is no secret. `local`: header_scts of the message,
    for a CancelTarget that references an SCT in the header."""
    if rst.request_type != "cancel" or rst.cancel_target is None:
        raise ValueError("answer_cancel needs a Cancel RST")
    version = rst.version
    identifier = _identifier(rst.cancel_target, local, "BadContextToken")
    if identifier != proven.identifier or proven.version is not version:
        raise _unknown(version, identifier, "cancel of a context the message is not secured with")
    store.cancel(identifier, version, now)
    rstr = etree.Element(ns.q(version.wst, "RequestSecurityTokenResponse"), nsmap={"wst": version.wst})
    if rst.context is not None:
        rstr.set("Context", rst.context)
    _sub(rstr, ns.q(version.wst, "RequestedTokenCancelled"))
    return rstr


# ---------------------------------------------------------------------------------------------------------
# Client side


def build_issue_rst(
    version: Version, *, entropy: bytes | None, key_size_bits: int = DEFAULT_KEY_BITS, context: str | None = None
) -> etree._Element:
    """An Issue RST for an SCT, as WCF and CXF send it. With `entropy` (keep it: read_rstr needs it), the
    gateway may compute the key from both parties' entropy."""
    wst = version.wst
    el = etree.Element(ns.q(wst, "RequestSecurityToken"), nsmap={"wst": wst})
    if context is not None:
        el.set("Context", context)
    _sub(el, ns.q(wst, "TokenType"), version.sct_token_type)
    _sub(el, ns.q(wst, "RequestType"), version.issue)
    if entropy is not None:
        secret = _sub(_sub(el, ns.q(wst, "Entropy")), ns.q(wst, "BinarySecret"), base64.b64encode(entropy).decode())
        secret.set("Type", version.nonce_type)
        _sub(el, ns.q(wst, "ComputedKeyAlgorithm"), version.computed_key_psha1)
    _sub(el, ns.q(wst, "KeySize"), str(key_size_bits))
    return el


@dataclass(frozen=True)
class IssuedContext:
    """What the client learns from an Issue RSTR."""

    context: Context  # subject ""
    token: etree._Element  # the wsc:SecurityContextToken, to put in a Security header when referencing '#id'


def _only_rstr(el: etree._Element) -> tuple[Version, etree._Element]:
    """The RSTR of a response: `el` itself, or the one RSTR of a (1.3) collection."""
    qn = etree.QName(el)
    version = BY_WST.get(qn.namespace or "")
    if version is None:
        raise _invalid_token(f"not a WS-Trust response: {str(el.tag)[:120]}")
    if qn.localname == "RequestSecurityTokenResponseCollection":
        inner = _elements(el)
        if len(inner) != 1:
            raise _invalid_token(f"RSTR collection with {len(inner)} responses")
        el = inner[0]
    if el.tag != ns.q(version.wst, "RequestSecurityTokenResponse"):
        raise _invalid_token(f"not an RSTR: {str(el.tag)[:120]}")
    return version, el


def read_rstr(
    el: etree._Element,
    *,
    entropy: bytes | None,
    private_key: rsa.RSAPrivateKey | None,
    transports: Sequence[str] = ("rsa-oaep-mgf1p", "rsa-oaep"),
    key_size_bits: int = DEFAULT_KEY_BITS,
) -> IssuedContext:
    """The context an Issue RSTR (or RSTR collection) establishes. The key: computed from `entropy` (what
    build_issue_rst sent) and the issuer's Entropy, or decrypted from the EncryptedKey with `private_key`
    (`transports`: policy key transport names allowed). `key_size_bits`: what was asked, when the RSTR has
    no KeySize. InvalidSecurityToken when the RSTR is unusable."""
    version, rstr = _only_rstr(el)
    wst = version.wst
    token_holder = _one(rstr, ns.q(wst, "RequestedSecurityToken"), _invalid_token)
    tokens = _elements(token_holder)
    if len(tokens) != 1 or not is_sct(tokens[0]):
        raise _invalid_token("RequestedSecurityToken does not hold one SecurityContextToken")
    sct = parse_sct(tokens[0])
    if sct.version is not version:
        raise _invalid_token(f"{version.name} RSTR with a {sct.version.name} SCT")
    lifetime = _one(rstr, ns.q(wst, "Lifetime"), _invalid_token)
    try:
        created = parse_datetime(_text(_one(lifetime, ns.q(ns.WSU, "Created"), _invalid_token), _invalid_token))
        expires = parse_datetime(_text(_one(lifetime, ns.q(ns.WSU, "Expires"), _invalid_token), _invalid_token))
    except ValueError as exc:
        raise _invalid_token(f"Lifetime: {exc}") from None
    size_el = _at_most_one(rstr, ns.q(wst, "KeySize"), _invalid_token)
    size = (key_size_bits if size_el is None else _integer(size_el, _invalid_token)) // 8
    proof = _elements(_one(rstr, ns.q(wst, "RequestedProofToken"), _invalid_token))
    if len(proof) != 1:
        raise _invalid_token("RequestedProofToken must hold one proof")
    if proof[0].tag == ns.q(wst, "ComputedKey"):
        if _text(proof[0], _invalid_token) != version.computed_key_psha1:
            raise _invalid_token("ComputedKey is not P_SHA1")
        holder = _one(rstr, ns.q(wst, "Entropy"), _invalid_token)
        if entropy is None:
            raise _invalid_token("ComputedKey, but no entropy was sent")
        server_entropy = _b64(_one(holder, ns.q(wst, "BinarySecret"), _invalid_token), _invalid_token)
        secret = p_sha1(entropy, server_entropy, size)
    elif proof[0].tag == ns.q(ns.XENC, "EncryptedKey"):
        if private_key is None:
            raise _invalid_token("EncryptedKey proof token, but no private key to open it")
        secret = encryption.decrypt_key(proof[0], private_key, transports, size)
    else:
        raise _invalid_token(f"unsupported proof token {str(proof[0].tag)[:120]}")
    ctx = Context(sct.identifier, secret, "", version, created, expires)
    return IssuedContext(ctx, copy.deepcopy(tokens[0]))


def build_cancel_rst(ctx: Context, *, context: str | None = None) -> etree._Element:
    """A Cancel RST for `ctx`, naming it by Identifier. Secure the message with keys derived from `ctx`."""
    wst = ctx.version.wst
    el = etree.Element(ns.q(wst, "RequestSecurityToken"), nsmap={"wst": wst})
    if context is not None:
        el.set("Context", context)
    _sub(el, ns.q(wst, "RequestType"), ctx.version.cancel)
    _sub(el, ns.q(wst, "CancelTarget")).append(sct_reference(ctx.version, identifier=ctx.identifier))
    return el


def read_cancel_rstr(el: etree._Element) -> Version:
    """Check a Cancel response (RSTR or RSTR collection) says RequestedTokenCancelled; its version."""
    version, rstr = _only_rstr(el)
    _one(rstr, ns.q(version.wst, "RequestedTokenCancelled"), _invalid_token)
    return version


# ---------------------------------------------------------------------------------------------------------
# Envelopes for the exchanges the gateway answers itself


def message_id(env: Envelope) -> str | None:
    """The request's wsa:MessageID (WS-Addressing 1.0), for the reply's RelatesTo."""
    header = env.header
    found = header.find(ns.q(ns.WSA, "MessageID")) if header is not None else None
    if found is None:
        return None
    return (found.text or "").strip() or None


def envelope(soap_version: str, body_child: etree._Element, *, action: str, relates_to: str | None = None) -> Envelope:
    """A SOAP `soap_version` ("1.1" or "1.2") envelope around `body_child`, with wsa:Action, a fresh
    wsa:MessageID and, when given, wsa:RelatesTo. Secure it like any other message (wssecurity_sending.secure)."""
    soap = ns.SOAP12 if soap_version == "1.2" else ns.SOAP11
    root = etree.Element(ns.q(soap, "Envelope"), nsmap={"soap": soap, "wsa": ns.WSA})
    header = _sub(root, ns.q(soap, "Header"))
    _sub(header, ns.q(ns.WSA, "Action"), action)
    _sub(header, ns.q(ns.WSA, "MessageID"), _random_identifier())
    if relates_to is not None:
        _sub(header, ns.q(ns.WSA, "RelatesTo"), relates_to)
    _sub(root, ns.q(soap, "Body")).append(body_child)
    return Envelope(root=root, version="1.2" if soap_version == "1.2" else "1.1")
