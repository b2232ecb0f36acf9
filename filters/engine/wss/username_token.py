"""wsse:UsernameToken (UsernameToken Profile 1.0/1.1, Basic Security Profile 1.1 section 12).

`verify` authenticates a request's token against `Users` (the users.yaml of certs/pki.py); `create` makes one
for a client. PasswordText is checked against a salted scrypt hash or a stored password; PasswordDigest,
Base64(SHA-1(nonce + created + password)), needs the stored password. Every authentication failure carries
the same generic client message; the precise reason names the user, never the password."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal, Protocol

import yaml
from lxml import etree

from filters.engine import faults, ns
from filters.engine.wss.timestamp import check_fresh, format_datetime, parse_datetime
from gateway.policy import UsernameTokenPolicy

USERNAME_TOKEN = ns.q(ns.WSSE, "UsernameToken")
USERNAME = ns.q(ns.WSSE, "Username")
PASSWORD = ns.q(ns.WSSE, "Password")
NONCE = ns.q(ns.WSSE, "Nonce")
CREATED = ns.q(ns.WSU, "Created")

PasswordType = Literal["text", "digest"]
_TYPES: dict[str, PasswordType] = {ns.PASSWORD_TEXT: "text", ns.PASSWORD_DIGEST: "digest"}
MIN_NONCE_BYTES = 16
_SCRYPT_MAXMEM = 64 * 1024 * 1024  # refuse hash parameters that would need more memory per check
_DEFAULT_SCRYPT = (2**14, 8, 1, 32)  # certs.pki.hash_password's (n, r, p, length), for files without hashes


class FailureThrottle(Protocol):
    """Failed checks counted per user (filters/stores/auth_throttle.py: in memory or in Redis)."""

    def blocked(self, username: str) -> bool:
        """True while `username` has `max_failures` failures in its current window."""
        ...

    def failed(self, username: str) -> None:
        """Count a failed check for `username`."""
        ...


def _b64(text: str) -> bytes:
    """Strict base64: anything but the alphabet and padding is an error, not silently skipped."""
    return base64.b64decode("".join(text.split()), validate=True)


@dataclass(frozen=True)
class ScryptHash:
    """scrypt$n$r$p$salt$hash, as certs.pki.hash_password writes it."""

    n: int
    r: int
    p: int
    salt: bytes
    digest: bytes = field(repr=False)

    @classmethod
    def parse(cls, text: str) -> ScryptHash:
        parts = text.split("$")
        if len(parts) != 6 or parts[0] != "scrypt":
            raise ValueError("not a scrypt$n$r$p$salt$hash value")
        try:
            n, r, p = int(parts[1]), int(parts[2]), int(parts[3])
            salt, digest = _b64(parts[4]), _b64(parts[5])
        except (ValueError, binascii.Error):
            raise ValueError("scrypt hash has a malformed field") from None
        if n < 2 or n & (n - 1) or r < 1 or p < 1 or not salt or len(digest) < 16:
            raise ValueError("scrypt hash parameters out of range")
        # OpenSSL needs 128 * r * (n + p + 2) bytes; checked here so verification cannot fail on it later.
        if 128 * r * (n + p + 2) > _SCRYPT_MAXMEM:
            raise ValueError("scrypt hash needs more memory than allowed")
        return cls(n, r, p, salt, digest)

    def derive(self, password: bytes, salt: bytes) -> bytes:
        return hashlib.scrypt(
            password, salt=salt, n=self.n, r=self.r, p=self.p, maxmem=_SCRYPT_MAXMEM, dklen=len(self.digest)
        )

    def matches(self, password: bytes) -> bool:
        return hmac.compare_digest(self.derive(password, self.salt), self.digest)

    def with_digest_of(self, password: str) -> ScryptHash:
        """A hash of `password` with these parameters and a fresh salt."""
        salt = os.urandom(16)
        return ScryptHash(self.n, self.r, self.p, salt, self.derive(password.encode(), salt))


@dataclass(frozen=True)
class User:
    """A user with either a salted hash (PasswordText only) or the password (PasswordDigest too)."""

    name: str
    password_hash: ScryptHash | None = None
    password: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class VerifiedUsernameToken:
    """An authenticated token. `nonce` and `created` (when sent) go to the replay store."""

    username: str
    password_type: PasswordType
    nonce: bytes | None
    created: datetime | None


class Users:
    """The users a route accepts, with a bounded cache of recent successful PasswordText checks.

    Equal work (an unknown user must not be told apart by time): every PasswordText check runs one scrypt
    derivation with the file's one parameter set, against the user's hash, a hash of the stored password made at
    load, or a dummy for an unknown user; every PasswordDigest check runs one SHA-1 over the stored password or a
    dummy. `work` counts the primitives run, so tests can assert it. The cache saves the scrypt on a hot path; its
    keys are (username, HMAC-SHA256 of the password under a per-instance random key), and only a right password
    can hit it. `throttle`, when given, refuses a user with too many recent failures without checking."""

    def __init__(
        self, users: Mapping[str, User], cache_size: int = 1024, throttle: FailureThrottle | None = None
    ) -> None:
        if cache_size < 0:
            raise ValueError("cache_size must not be negative")
        self._users = dict(users)
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._cache_key = os.urandom(32)
        self.throttle = throttle
        self.work: Counter[str] = Counter()
        params = {(u.password_hash.n, u.password_hash.r, u.password_hash.p, len(u.password_hash.digest)): u.name
                  for u in self._users.values() if u.password_hash is not None}  # fmt: skip
        if len(params) > 1:
            raise ValueError(
                f"user {list(params.values())[-1]!r}: scrypt parameters differ from other users' (one set per file, "
                "so that every user, known or not, costs the same)"
            )
        n, r, p, dklen = next(iter(params), _DEFAULT_SCRYPT)
        self._dummy = ScryptHash(n, r, p, os.urandom(16), os.urandom(dklen))
        self._dummy_password = base64.b64encode(os.urandom(24)).decode()
        # Stored passwords are checked like hashes, through a derivation made now with a fresh salt.
        self._text_hashes = {
            u.name: u.password_hash or self._dummy.with_digest_of(u.password or "") for u in self._users.values()
        }

    @classmethod
    def load(cls, path: Path | str, cache_size: int = 1024, throttle: FailureThrottle | None = None) -> Users:
        """Read a users.yaml; any malformed entry refuses the whole file (ValueError naming the entry)."""
        try:
            doc = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
        entries = doc.get("users") if isinstance(doc, dict) else None
        if not isinstance(entries, dict):
            raise ValueError(f"{path}: expected a 'users' mapping")
        users: dict[str, User] = {}
        for name, entry in entries.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"{path}: user names must be non-empty strings")
            if not isinstance(entry, dict) or len(entry) != 1 or not entry.keys() <= {"password", "password_hash"}:
                raise ValueError(f"{path}: user {name!r}: needs exactly one of password_hash or password")
            ((kind, value),) = entry.items()
            if not isinstance(value, str) or not value:
                raise ValueError(f"{path}: user {name!r}: {kind} must be a non-empty string")
            if kind == "password":
                users[name] = User(name, password=value)
            else:
                try:
                    users[name] = User(name, password_hash=ScryptHash.parse(value))
                except ValueError as exc:
                    raise ValueError(f"{path}: user {name!r}: {exc}") from None
        try:
            return cls(users, cache_size, throttle)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def get(self, name: str) -> User | None:
        return self._users.get(name)

    def check_text(self, user: User | None, password: str) -> bool:
        """Does `password` (a PasswordText value) match the user's credential? One scrypt, user or not."""
        sent = password.encode()
        key = (user.name, hmac.digest(self._cache_key, sent, "sha256")) if user is not None else None
        if key is not None and key in self._cache:
            self._cache.move_to_end(key)
            return True
        target = self._text_hashes[user.name] if user is not None else self._dummy
        self.work[f"scrypt:{target.n}:{target.r}:{target.p}"] += 1
        if not target.matches(sent) or key is None:
            return False
        if self._cache_size:
            self._cache[key] = None
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return True

    def check_digest(self, user: User | None, digest: bytes, nonce: bytes, created: str) -> bool:
        """Is `digest` Base64-decoded SHA-1(nonce + created + password)? One SHA-1, user or not, password kept or
        not (a hash-only user cannot pass: PasswordDigest needs the password itself)."""
        stored = user.password if user is not None else None
        self.work["sha1"] += 1
        want = hashlib.sha1(nonce + created.encode() + (stored or self._dummy_password).encode()).digest()
        return hmac.compare_digest(digest, want) and stored is not None


def _only(token: etree._Element, tag: str, required: bool) -> etree._Element | None:
    found = [c for c in token if c.tag == tag]
    name = etree.QName(tag).localname
    if len(found) > 1 or (required and not found):
        raise faults.security("InvalidSecurity", f"UsernameToken has {len(found)} {name} elements")
    if found and len(found[0]):
        raise faults.security("InvalidSecurity", f"UsernameToken {name} has child nodes")
    return found[0] if found else None


def verify(
    ut: etree._Element,
    users: Users,
    policy: UsernameTokenPolicy,
    now: datetime,
    max_age_s: int,
    skew_s: int,
) -> VerifiedUsernameToken:
    """Authenticate a wsse:UsernameToken at `now`; Created, when sent, must lie within the window."""
    if ut.tag != USERNAME_TOKEN:
        raise faults.security("InvalidSecurity", f"expected wsse:UsernameToken, got {str(ut.tag)[:120]}")
    # Fail closed on what we do not understand, including UT 1.1 Salt/Iteration (key derivation, no password).
    unknown = {c.tag for c in ut if isinstance(c.tag, str)} - {USERNAME, PASSWORD, NONCE, CREATED}
    if unknown:
        raise faults.security("InvalidSecurity", f"UsernameToken has unexpected elements: {sorted(unknown)[:3]}")
    username_el = _only(ut, USERNAME, required=True)
    password_el = _only(ut, PASSWORD, required=True)
    nonce_el = _only(ut, NONCE, required=False)
    created_el = _only(ut, CREATED, required=False)
    assert username_el is not None and password_el is not None  # required=True raised otherwise
    username = (username_el.text or "").strip()
    if not username:
        raise faults.security("InvalidSecurity", "UsernameToken Username is empty")
    who = f"user {username[:64]!r}"

    # BSP R4201: the Type is explicit; a missing one would otherwise default to PasswordText.
    type_uri = password_el.get("Type")
    if type_uri is None:
        raise faults.security("InvalidSecurity", "UsernameToken Password has no Type attribute")

    nonce: bytes | None = None
    if nonce_el is not None:
        # BSP R4220/R4221 ask for EncodingType; Base64Binary is the only one, and the profile's default.
        if nonce_el.get("EncodingType", ns.BASE64) != ns.BASE64:
            raise faults.security("InvalidSecurity", "UsernameToken Nonce EncodingType is not Base64Binary")
        try:
            nonce = _b64(nonce_el.text or "")
        except binascii.Error:
            raise faults.security("InvalidSecurity", "UsernameToken Nonce is not base64") from None
        if len(nonce) < MIN_NONCE_BYTES:
            raise faults.security(
                "InvalidSecurity", f"UsernameToken Nonce has {len(nonce)} bytes, fewer than {MIN_NONCE_BYTES}"
            )
    created: datetime | None = None
    if created_el is not None:
        try:
            created = parse_datetime(created_el.text or "")
        except ValueError as exc:
            raise faults.security("InvalidSecurity", f"UsernameToken Created: {exc}") from None

    kind = _TYPES.get(type_uri)
    if kind is None or kind not in policy.password_types:
        raise faults.security("FailedAuthentication", f"{who}: password type {type_uri[:120]!r} not allowed")
    if kind == "digest" and (nonce is None or created is None):
        raise faults.security("InvalidSecurity", "UsernameToken PasswordDigest needs a Nonce and a Created")
    if created is not None:
        check_fresh(created, now, max_age_s, skew_s, "UsernameToken Created")

    sent = password_el.text or ""
    digest = b""
    if kind == "digest":
        try:
            digest = _b64(sent)
        except binascii.Error:
            raise faults.security("InvalidSecurity", "UsernameToken PasswordDigest is not base64") from None
    # Known or not: a user with too many recent failures is refused without a check (auth_throttle).
    if users.throttle is not None and users.throttle.blocked(username):
        raise faults.security("FailedAuthentication", f"{who}: too many recent failures, refused unchecked")
    user = users.get(username)
    if kind == "text":
        ok = users.check_text(user, sent)
    else:
        assert nonce is not None and created_el is not None  # checked above for digest
        # The digest covers Created exactly as sent, not as we parsed it.
        ok = users.check_digest(user, digest, nonce, created_el.text or "")
    if not ok:
        if users.throttle is not None:
            users.throttle.failed(username)
        if user is None:
            why = "unknown user"
        elif kind == "digest" and user.password is None:
            why = "only a hash is stored, PasswordDigest impossible"
        else:
            why = "wrong password" if kind == "text" else "wrong password digest"
        raise faults.security("FailedAuthentication", f"{who}: {why}")
    return VerifiedUsernameToken(username=username, password_type=kind, nonce=nonce, created=created)


def create(username: str, password: str, digest: bool, now: datetime, id: str) -> etree._Element:
    """A client's UsernameToken with a fresh 16-byte Nonce and Created, PasswordDigest when `digest`."""
    nonce = os.urandom(MIN_NONCE_BYTES)
    created = format_datetime(now)
    ut = etree.Element(USERNAME_TOKEN, {ns.q(ns.WSU, "Id"): id}, nsmap={"wsse": ns.WSSE, "wsu": ns.WSU})
    etree.SubElement(ut, USERNAME).text = username
    if digest:
        value = base64.b64encode(hashlib.sha1(nonce + created.encode() + password.encode()).digest()).decode()
        etree.SubElement(ut, PASSWORD, Type=ns.PASSWORD_DIGEST).text = value
    else:
        etree.SubElement(ut, PASSWORD, Type=ns.PASSWORD_TEXT).text = password
    etree.SubElement(ut, NONCE, EncodingType=ns.BASE64).text = base64.b64encode(nonce).decode()
    etree.SubElement(ut, CREATED).text = created
    return ut
