"""Private keys in a PKCS#11 token (an HSM; SoftHSM2 in the tests and the demo), named by an RFC 7512 URI:

    pkcs11:token=wsgate;object=gateway-sign?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=env:WSGATE_PIN

Path attributes: `token` (label) or `serial`, `object` (key label) and/or `id` (CKA_ID, percent-encoded). Query
attributes: `module-path` (required) and `pin-source`: `env:NAME` or `file:/path` (RFC 7512's pin-source is a
URI); the PIN itself (`pin-value`) is refused: it would sit in the policy.

A `TokenKey` is a cryptography RSAPrivateKey whose `sign` and `decrypt` run in the token, so the engine's code
that takes an RSA key (key transport, the Signer) takes it unchanged; it refuses to export itself. Sessions come
from a pool per token, sized to the worker (it runs one exchange at a time: one session). A token failure (module
error, session closed or logged out, token gone) fails closed: a 503 fault, the sessions dropped; the next call
after `RETRY_S` reinitializes the module and logs in again, so the worker recovers when the token is back."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

import pkcs11
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa, utils
from pkcs11 import Attribute, KeyType, Mechanism, ObjectClass
from pkcs11 import exceptions as p11

from filters.engine import faults

if TYPE_CHECKING:
    from pkcs11._pkcs11 import lib as Library  # what `pkcs11.lib` (a function) returns

log = logging.getLogger("wsgate.token")

_T = TypeVar("_T")
SCHEME = "pkcs11:"
RETRY_S = 1.0  # while a token is down, how often a request may try to reopen it (the others get 503 at once)

# The token's answer about the data (a bad block, a wrong key): a ValueError as cryptography raises, so the
# callers' handling (FailedCheck, rsa-1_5's implicit rejection) is the same as with a key in a file.
_DATA_ERRORS = (p11.EncryptedDataInvalid, p11.EncryptedDataLenRange, p11.DataInvalid, p11.DataLenRange)
# The token cannot do what was asked (SoftHSM 2.6 unwraps OAEP with SHA-1 only): refused, the session is fine.
_UNSUPPORTED = (p11.MechanismInvalid, p11.MechanismParamInvalid, p11.ArgumentsBad, p11.FunctionNotSupported)
# Failures of the token or the session themselves: no probe asked.
_DOWN = (p11.DeviceRemoved, p11.DeviceError, p11.TokenNotPresent, p11.SessionClosed, p11.SessionHandleInvalid,
         p11.UserNotLoggedIn, p11.TokenNotRecognised, p11.DeviceMemory, p11.ObjectHandleInvalid,
         p11.KeyHandleInvalid)  # fmt: skip
_HASH_MECHS = {"sha1": Mechanism.SHA_1, "sha224": Mechanism.SHA224, "sha256": Mechanism.SHA256,
               "sha384": Mechanism.SHA384, "sha512": Mechanism.SHA512}  # fmt: skip
_MGFS = {"sha1": pkcs11.MGF.SHA1, "sha224": pkcs11.MGF.SHA224, "sha256": pkcs11.MGF.SHA256,
         "sha384": pkcs11.MGF.SHA384, "sha512": pkcs11.MGF.SHA512}  # fmt: skip
_SIGN_MECHS = {"sha1": Mechanism.SHA1_RSA_PKCS, "sha256": Mechanism.SHA256_RSA_PKCS,
               "sha384": Mechanism.SHA384_RSA_PKCS, "sha512": Mechanism.SHA512_RSA_PKCS}  # fmt: skip
# DER DigestInfo prefixes (RFC 8017 9.2 note 1): a prehashed digest is signed with raw CKM_RSA_PKCS.
_DIGEST_INFO = {
    "sha1": bytes.fromhex("3021300906052b0e03021a05000414"),
    "sha256": bytes.fromhex("3031300d060960864801650304020105000420"),
    "sha384": bytes.fromhex("3041300d060960864801650304020205000430"),
    "sha512": bytes.fromhex("3051300d060960864801650304020305000440"),
}


_PERCENT = re.compile(rb"%([0-9A-Fa-f]{2})")


def _unquote(text: str) -> bytes:
    """RFC 3986 percent-decoding (the engine does not import urllib: no network code in it)."""
    return _PERCENT.sub(lambda m: bytes([int(m.group(1), 16)]), text.encode())


def _pairs(text: str, sep: str, what: str) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for part in filter(None, text.split(sep)):
        name, eq, value = part.partition("=")
        if not eq or name in out:
            raise ValueError(f"pkcs11 URI: bad or repeated {what} attribute {name[:40]!r}")
        out[name] = _unquote(value)
    return out


def is_uri(text: str) -> bool:
    return text.startswith(SCHEME)


@dataclass(frozen=True)
class TokenRef:
    module: str
    token: str | None
    serial: str | None
    label: str | None
    id: bytes | None
    pin_source: str

    @property
    def token_name(self) -> str:
        return f"token {self.token!r}" if self.token else f"token serial {self.serial}"

    @property
    def key_name(self) -> str:
        return f"key {self.label!r}" if self.label else f"key id {self.id.hex() if self.id else ''}"


def parse_uri(uri: str) -> TokenRef:
    """A pkcs11: URI as a TokenRef; ValueError naming what is wrong (never echoing a PIN)."""
    if not is_uri(uri):
        raise ValueError("not a pkcs11: URI")
    path, _, query = uri[len(SCHEME) :].partition("?")
    attrs = _pairs(path, ";", "path")
    params = {k: v.decode() for k, v in _pairs(query, "&", "query").items()}
    if "pin-value" in params:
        raise ValueError("pkcs11 URI: pin-value puts the PIN in the policy; use pin-source=env:NAME or file:/path")
    unknown = (set(attrs) - {"token", "serial", "object", "id", "type"}) | (set(params) - {"module-path", "pin-source"})
    if unknown:
        raise ValueError(f"pkcs11 URI: unsupported attributes {sorted(unknown)}")
    if attrs.get("type", b"private") != b"private":
        raise ValueError("pkcs11 URI: type must be private (the key the gateway uses)")
    module, pin_source = params.get("module-path"), params.get("pin-source", "")
    if not module:
        raise ValueError("pkcs11 URI: module-path is required")
    if not pin_source.startswith(("env:", "file:")):
        raise ValueError("pkcs11 URI: pin-source must be env:NAME or file:/path")
    if "token" not in attrs and "serial" not in attrs:
        raise ValueError("pkcs11 URI: name the token (token=label or serial=...)")
    if "object" not in attrs and "id" not in attrs:
        raise ValueError("pkcs11 URI: name the key (object=label or id=...)")
    text = {k: v.decode() for k, v in attrs.items() if k != "id"}
    return TokenRef(module, text.get("token"), text.get("serial"), text.get("object"), attrs.get("id"), pin_source)


def read_pin(source: str) -> str:
    """The PIN from `env:NAME` or `file:/path` (one line; a trailing newline is not part of it)."""
    kind, _, where = source.partition(":")
    if kind == "env":
        pin = os.environ.get(where)
        if pin is None:
            raise ValueError(f"PIN environment variable {where} is not set")
        return pin
    return Path(where.removeprefix("//")).read_text().rstrip("\r\n")


def _alive(entry: _Session) -> bool:
    try:
        entry.session.generate_random(64)
    except p11.PKCS11Error:
        return False
    return True


class Refused(ValueError):
    """The token refused the data (a block that does not decrypt), the session being fine."""


class TokenUnavailable(Exception):
    """The token cannot be used now (its sessions were dropped; a later call retries)."""


class _Module:
    """One loaded PKCS#11 library. `generation` counts reinitializations: sessions of an older one are dead."""

    _all: dict[str, _Module] = {}
    _lock = threading.Lock()

    def __init__(self, path: str) -> None:
        self.path = path
        self._lib: Library | None = None  # loaded when first used: C_Initialize fails while a token is down
        self.generation = 0

    @property
    def lib(self) -> Library:
        if self._lib is None:
            self._lib = pkcs11.lib(self.path)
        return self._lib

    @classmethod
    def get(cls, path: str) -> _Module:
        with cls._lock:
            if path not in cls._all:
                cls._all[path] = _Module(path)
            return cls._all[path]

    def reinitialize(self) -> None:
        # C_Finalize + C_Initialize: the module forgets its sessions and rescans its slots (a token put back).
        if self._lib is None:
            self._lib = pkcs11.lib(self.path)  # the first C_Initialize failed: this is the first to succeed
        else:
            self._lib.reinitialize()
        self.generation += 1


@dataclass
class _Session:
    session: pkcs11.Session
    generation: int
    keys: dict[TokenRef, pkcs11.Key]


class Pool:
    """Logged-in sessions on one token, at most `size` open; a failure drops them all."""

    _all: dict[tuple[str, str | None, str | None], Pool] = {}
    _lock = threading.Lock()

    def __init__(self, ref: TokenRef, size: int) -> None:
        self.ref, self.size = ref, size
        self.module = _Module.get(ref.module)
        self._idle: list[_Session] = []
        self._open = 0
        self._cond = threading.Condition()
        self._down_since: float | None = None
        self._next_try = 0.0

    @classmethod
    def for_ref(cls, ref: TokenRef, size: int = 1) -> Pool:
        key = (ref.module, ref.token, ref.serial)
        with cls._lock:
            if key not in cls._all:
                cls._all[key] = Pool(ref, size)
            return cls._all[key]

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def _open_session(self) -> _Session:
        if self._down_since is not None:
            now = time.monotonic()
            if now < self._next_try:
                raise TokenUnavailable("token down, retry pending")
            self._next_try = now + RETRY_S
            self.module.reinitialize()
        ref = self.ref
        token = self.module.lib.get_token(
            **({"token_label": ref.token} if ref.token else {}),
            **({"token_serial": ref.serial.encode()} if ref.serial else {}),
        )
        try:
            session = token.open(user_pin=read_pin(ref.pin_source))
        except p11.UserAlreadyLoggedIn:
            session = token.open()  # a login is the application's, for all its sessions: this pool's others
        if self._down_since is not None:
            log.warning("%s is back after %.1f s", ref.token_name, time.monotonic() - self._down_since)
            self._down_since = None
        return _Session(session, self.module.generation, {})

    @contextmanager
    def session(self) -> Iterator[_Session]:
        with self._cond:
            while not self._idle and self._open >= self.size:
                self._cond.wait()
            entry = self._idle.pop() if self._idle else None
            if entry is not None and entry.generation != self.module.generation:
                entry, self._open = None, self._open - 1  # the module was reinitialized under it: gone with it
            if entry is None:
                try:
                    entry = self._open_session()
                except TokenUnavailable:
                    raise
                except (p11.PKCS11Error, OSError, ValueError) as exc:
                    self._failed(exc)
                    raise TokenUnavailable(f"{type(exc).__name__}: {exc}") from None
                self._open += 1
        try:
            yield entry
        except (*_DATA_ERRORS, *_UNSUPPORTED, p11.NoSuchKey):
            self._release(entry)  # an answer about the data or the URI, not a failure of the session
            raise
        except p11.PKCS11Error as exc:
            # Tokens say GeneralError for a block that does not decrypt too (SoftHSM does): a session that
            # still answers means the data was refused, not that the token went away.
            if not isinstance(exc, _DOWN) and _alive(entry):
                self._release(entry)
                raise Refused(type(exc).__name__) from None
            with self._cond:
                self._idle.append(entry)  # closed with the others
                self._failed(exc)
                self._cond.notify()
            raise
        except BaseException:
            self._release(entry)
            raise
        else:
            self._release(entry)

    def _release(self, entry: _Session) -> None:
        with self._cond:
            self._idle.append(entry)
            self._cond.notify()

    def _failed(self, exc: BaseException) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            self._next_try = 0.0
            log.error("%s unavailable (%s: %s): requests needing it get 503 until it is back",
                      self.ref.token_name, type(exc).__name__, exc)  # fmt: skip
        for entry in self._idle:
            try:
                entry.session.close()
            except p11.PKCS11Error:
                pass  # already gone with the token
        self._open -= len(self._idle)
        self._idle.clear()


def _find_key(entry: _Session, ref: TokenRef) -> pkcs11.Key:
    key = entry.keys.get(ref)
    if key is None:
        # a label or id of None is no condition, as one left out
        key = entry.session.get_key(
            object_class=ObjectClass.PRIVATE_KEY, key_type=KeyType.RSA, label=ref.label or None, id=ref.id or None
        )
        entry.keys[ref] = key
    return key


_Capability = TypeVar("_Capability", pkcs11.SignMixin, pkcs11.DecryptMixin)
# pkcs11 mixes these into the class of a key whose attribute is true.
_ATTRIBUTES = {pkcs11.SignMixin: "CKA_SIGN", pkcs11.DecryptMixin: "CKA_DECRYPT"}


def _able(key: pkcs11.Key, capability: type[_Capability], ref: TokenRef) -> _Capability:
    """The key as one that signs or decrypts; one whose attribute says it may not is a policy error (500)."""
    if not isinstance(key, capability):
        raise faults.server(f"key token: {ref.token_name} {ref.key_name}: {_ATTRIBUTES[capability]} is false")
    return key


def _unavailable(ref: TokenRef, what: str) -> faults.Fault:
    return faults.server(f"key token unavailable: {ref.token_name} {ref.key_name}: {what}", status=503)


class TokenKey(rsa.RSAPrivateKey):
    """An RSA private key that stays in its token: `sign` (PKCS#1 v1.5) and `decrypt` (OAEP, PKCS#1 v1.5) run
    there; the public half is read once, when the key is loaded, or, if the token is down then, when it is back:
    a worker starts without its token and answers 503 until then."""

    def __init__(self, uri: str, pool_size: int = 1) -> None:
        self.ref = parse_uri(uri)
        self.pool = Pool.for_ref(self.ref, pool_size)
        self._public: rsa.RSAPublicKey | None = None
        self._expected: tuple[rsa.RSAPublicNumbers, str] | None = None
        try:
            self.public_key()
        except faults.Fault:
            if not self.pool.down:
                raise  # the token answered: no such key (a policy error, refused at load)
            # The pool logged the token unavailable; requests needing the key get its 503.

    def expect(self, public: rsa.RSAPublicKey, mismatch: str) -> None:
        """The key must be `public`'s (its certificate's): checked now, or once the token is back (a 500 fault
        `mismatch` for every use until the policy is mended)."""
        self._expected = (public.public_numbers(), mismatch)
        if self._public is not None:
            self._check()

    def _check(self) -> None:
        if self._expected and self._public and self._public.public_numbers() != self._expected[0]:
            raise faults.server(self._expected[1])

    def _run(self, what: str, op: Callable[[pkcs11.Key], _T]) -> _T:
        if what != "load":
            self.public_key()  # read once (the token may have been down at load) and checked against expect()
        try:
            with self.pool.session() as entry:
                return op(_find_key(entry, self.ref))
        except _DATA_ERRORS:
            raise ValueError("the token refused the data") from None
        except _UNSUPPORTED as exc:
            raise faults.security(
                "UnsupportedAlgorithm", f"{what}: the key's token refused: {type(exc).__name__}"
            ) from None
        except p11.NoSuchKey:
            raise _unavailable(self.ref, f"{what}: no such key on the token") from None
        except (TokenUnavailable, p11.PKCS11Error) as exc:
            raise _unavailable(self.ref, f"{what}: {type(exc).__name__}: {exc}") from None

    @property
    def key_size(self) -> int:
        return self.public_key().key_size

    def public_key(self) -> rsa.RSAPublicKey:
        if self._public is None:
            public = self._run("load", lambda key: (key[Attribute.MODULUS], key[Attribute.PUBLIC_EXPONENT]))
            n, e = (int.from_bytes(v, "big") for v in public)
            self._public = rsa.RSAPublicNumbers(e, n).public_key()
        self._check()
        return self._public

    def sign(
        self,
        data: bytes,
        pad: padding.AsymmetricPadding,
        algorithm: hashes.HashAlgorithm | utils.Prehashed | utils.NoDigestInfo,
    ) -> bytes:
        if not isinstance(pad, padding.PKCS1v15):
            raise ValueError("the token signs with PKCS#1 v1.5 only")
        if isinstance(algorithm, utils.NoDigestInfo):
            raise ValueError("the token signs a DigestInfo (hashed or prehashed) only")
        if isinstance(algorithm, utils.Prehashed):
            prefix = _DIGEST_INFO.get(algorithm._algorithm.name)
            if prefix is None or len(data) != algorithm.digest_size:
                raise ValueError(f"unsupported prehashed digest {algorithm._algorithm.name}")
            return self._sign(prefix + data, Mechanism.RSA_PKCS)
        mech = _SIGN_MECHS.get(algorithm.name)
        if mech is None:
            raise ValueError(f"unsupported digest {algorithm.name}")
        return self._sign(data, mech)

    def _sign(self, data: bytes, mechanism: Mechanism) -> bytes:
        return self._run("sign", lambda key: _able(key, pkcs11.SignMixin, self.ref).sign(data, mechanism=mechanism))

    def decrypt(self, ciphertext: bytes, pad: padding.AsymmetricPadding) -> bytes:
        if isinstance(pad, padding.OAEP):
            mgf_hash = pad.mgf._algorithm.name
            digest = pad.algorithm.name
            if digest not in _HASH_MECHS or mgf_hash not in _MGFS:
                raise ValueError(f"unsupported OAEP digest {digest}/{mgf_hash}")
            param = (_HASH_MECHS[digest], _MGFS[mgf_hash], pad._label or None)

            def unwrap(key: pkcs11.Key) -> bytes:
                plain = _able(key, pkcs11.DecryptMixin, self.ref).decrypt(
                    ciphertext, mechanism=Mechanism.RSA_PKCS_OAEP, mechanism_param=param
                )
                return cast(bytes, plain)  # bytes in, bytes out (the stub's union: an iterator in, one out)

            return self._run("unwrap", unwrap)
        if isinstance(pad, padding.PKCS1v15):
            # Whether a PKCS#1 v1.5 block decrypts shows in a token's answer and its timing (Bleichenbacher); with
            # no implicit rejection in the token, rsa-1_5 is refused whatever the block.
            raise faults.security("UnsupportedAlgorithm", "rsa-1_5 key transport is not done with a token key")
        raise ValueError("unsupported padding")

    def private_numbers(self) -> rsa.RSAPrivateNumbers:
        raise TypeError("a token key does not leave its token")

    def private_bytes(self, *args: object, **kwargs: object) -> bytes:
        raise TypeError("a token key does not leave its token")

    def __copy__(self) -> TokenKey:
        return self

    def __deepcopy__(self, memo: dict) -> TokenKey:
        return self
