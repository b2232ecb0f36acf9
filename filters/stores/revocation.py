"""X.509 revocation: whether a certificate of a validated chain has been revoked by its issuer.

Two sources, as the route's `rsa.revocation` policy says: CRLs from files (RFC 5280; reloaded when a file
changes) and OCSP (RFC 6960; the responder from the certificate's Authority Information Access or the policy).
Every certificate of the chain but the trust anchor is checked against its own issuer. Answers are cached per
(issuer, serial) for their validity (capped by the policy), so a signer costs one OCSP round trip per
nextUpdate, not one per message; a revoked answer is cached too, and a failed lookup for a few seconds (a dead
responder does not make every message wait out the timeout). When no source can tell, the policy decides:
refuse (the default) or accept with a warning in the log.

An OCSP lookup on a cache miss holds its message for at most `timeout_s`, without the engine's turn (the
worker's other exchanges go on: filters/engine/turn.py); answers in use are fetched anew in the background
before they expire."""

from __future__ import annotations

import datetime as dt
import itertools
import logging
import os
import secrets
import threading
import time
import urllib.request
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa
from cryptography.x509 import ocsp
from cryptography.x509.oid import AuthorityInformationAccessOID, ExtendedKeyUsageOID

from filters.engine import faults, turn
from gateway.policy import RevocationPolicy

log = logging.getLogger("wsgate.revocation")

CRL_RECHECK_S = 2.0  # how often a CRL file's mtime and size are looked at (on use)
UNKNOWN_RETRY = dt.timedelta(seconds=10)  # a failed lookup is not repeated sooner
CLOCK_SKEW = dt.timedelta(minutes=5)  # thisUpdate may lie this far in the future
NO_NEXT_UPDATE_AGE = dt.timedelta(minutes=5)  # an OCSP answer without nextUpdate must be this fresh
CACHE_SIZE = 10_000
MAX_OCSP_RESPONSE = 256 * 1024
MAX_REFRESHING = 8  # background OCSP refreshes at once, per route and worker

State = Literal["good", "revoked", "unknown"]


@dataclass(frozen=True)
class Status:
    state: State
    detail: str  # which source said so and why, for the log
    until: dt.datetime  # good for reuse until then


def _key_hash(cert: x509.Certificate) -> bytes:
    """SHA-1 of the public key's bits: OCSP's issuerKeyHash and byKey ResponderID."""
    return x509.SubjectKeyIdentifier.from_public_key(cert.public_key()).digest  # type: ignore[arg-type]


def _verify_signature(cert: x509.Certificate, signature: bytes, data: bytes, hash_alg: hashes.HashAlgorithm | None):
    """InvalidSignature unless `cert`'s key signed `data`."""
    key = cert.public_key()
    if isinstance(key, rsa.RSAPublicKey) and hash_alg is not None:
        key.verify(signature, data, padding.PKCS1v15(), hash_alg)
    elif isinstance(key, ec.EllipticCurvePublicKey) and hash_alg is not None:
        key.verify(signature, data, ec.ECDSA(hash_alg))
    elif isinstance(key, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
        key.verify(signature, data)
    else:
        raise InvalidSignature(f"unsupported signature key {type(key).__name__}")


def _subject(cert: x509.Certificate) -> str:
    return cert.subject.rfc4514_string()


# ---------------------------------------------------------------------------------------------------------
# CRLs


def _parse_crl(data: bytes) -> x509.CertificateRevocationList:
    if data.lstrip().startswith(b"-----BEGIN"):
        return x509.load_pem_x509_crl(data)
    return x509.load_der_x509_crl(data)


@dataclass(frozen=True)
class _LoadedCrl:
    crl: x509.CertificateRevocationList
    revoked: dict[int, x509.RevokedCertificate]
    scope: x509.IssuingDistributionPoint | None


def _load(data: bytes, issuers: Sequence[x509.Certificate]) -> _LoadedCrl:
    """A CRL fit for use, or ValueError: parsed, signed by one of `issuers`, complete for its scope."""
    crl = _parse_crl(data)
    if not any(ca.subject == crl.issuer and crl.is_signature_valid(ca.public_key()) for ca in issuers):  # type: ignore[arg-type]
        raise ValueError(f"not signed by a known CA (issuer {crl.issuer.rfc4514_string()!r})")
    scope = None
    for ext in crl.extensions:
        if isinstance(ext.value, x509.IssuingDistributionPoint):
            scope = ext.value
            if scope.indirect_crl or scope.only_some_reasons or scope.only_contains_attribute_certs:
                raise ValueError("an indirect or partial (some reasons only) CRL is not a complete answer")
        elif isinstance(ext.value, x509.DeltaCRLIndicator):
            raise ValueError("a delta CRL is not a complete answer")
        elif ext.critical and not isinstance(ext.value, x509.CRLNumber | x509.AuthorityKeyIdentifier):
            raise ValueError(f"unknown critical extension {ext.oid.dotted_string}")
    return _LoadedCrl(crl, {r.serial_number: r for r in crl}, scope)


class CrlFile:
    """One CRL file, PEM or DER. Looked at again (mtime, size, inode) at most every CRL_RECHECK_S seconds when
    used; a new file that does not load (unparsable, not signed by a known CA, older than the one in use) is
    logged and the last good CRL stays."""

    def __init__(self, path: str, issuers: Sequence[x509.Certificate]) -> None:
        self.path = path
        self._issuers = list(issuers)
        self._seen: tuple[int, int, int] | None = None
        self._checked = -CRL_RECHECK_S
        self.current: _LoadedCrl | None = None
        self.problem = "not loaded yet"  # why there is no CRL, when there is none

    def refresh(self, monotonic: float) -> bool:
        """Look at the file if it is time; whether the CRL in use changed."""
        if monotonic - self._checked < CRL_RECHECK_S:
            return False
        self._checked = monotonic
        try:
            st = os.stat(self.path)
        except OSError as exc:
            problem = f"CRL file {self.path}: {exc.strerror}"
            if self.current is None and problem != self.problem:
                log.error("%s: its issuers' certificates have no CRL status", problem)
                self.problem = problem
            return False
        seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        if seen == self._seen:
            return False
        self._seen = seen
        try:
            loaded = _load(Path(self.path).read_bytes(), self._issuers)
            old = self.current
            if old is not None and loaded.crl.last_update_utc < old.crl.last_update_utc:
                raise ValueError(f"older (thisUpdate {loaded.crl.last_update_utc}) than the CRL in use")
        except (OSError, ValueError) as exc:
            log.error("CRL file %s not loaded, keeping %s: %s", self.path, "the last good one" if self.current else
                      "none", exc)  # fmt: skip
            if self.current is None:
                self.problem = f"CRL file {self.path}: {exc}"
            return False
        self.current = loaded
        log.info("CRL file %s loaded: %d revoked, next update %s", self.path, len(loaded.revoked),
                 loaded.crl.next_update_utc)  # fmt: skip
        return True


def _covers(loaded: _LoadedCrl, cert: x509.Certificate) -> bool:
    """Whether a CRL with an IssuingDistributionPoint speaks for `cert` (RFC 5280 6.3.3 b)."""
    scope = loaded.scope
    if scope is None:
        return True
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if (scope.only_contains_user_certs and is_ca) or (scope.only_contains_ca_certs and not is_ca):
        return False
    if scope.full_name:
        try:
            points = cert.extensions.get_extension_for_class(x509.CRLDistributionPoints).value
        except x509.ExtensionNotFound:
            return False
        names = {n for p in points for n in (p.full_name or [])}
        return any(n in names for n in scope.full_name)
    return True


def _crl_status(files: Sequence[CrlFile], cert: x509.Certificate, issuer: x509.Certificate, now: dt.datetime) -> Status:
    why: list[str] = []
    for f in files:
        loaded = f.current
        if loaded is None:
            why.append(f.problem)
            continue
        crl = loaded.crl
        if crl.issuer != issuer.subject or not _covers(loaded, cert):
            continue
        if not crl.is_signature_valid(issuer.public_key()):  # type: ignore[arg-type]
            why.append(f"CRL {f.path} is not signed by {_subject(issuer)!r}")
            continue
        if crl.last_update_utc > now + CLOCK_SKEW:
            why.append(f"CRL {f.path} is not valid before {crl.last_update_utc}")
            continue
        next_update = crl.next_update_utc
        if next_update is None or now >= next_update:
            why.append(f"CRL {f.path} expired (nextUpdate {next_update})")
            continue
        entry = loaded.revoked.get(cert.serial_number)
        if entry is not None:
            reason = next((e.value.reason.name for e in entry.extensions if isinstance(e.value, x509.CRLReason)), "")
            return Status(
                "revoked", f"CRL {f.path}: revoked {entry.revocation_date_utc} {reason}".rstrip(), next_update
            )
        return Status("good", f"CRL {f.path}", next_update)
    if not why:
        why.append(f"no CRL from {_subject(issuer)!r}")
    return Status("unknown", "; ".join(why), now + UNKNOWN_RETRY)


# ---------------------------------------------------------------------------------------------------------
# OCSP


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # a responder answers where it is asked: a redirect is an error


_opener = urllib.request.build_opener(_NoRedirect)


def responder_urls(cert: x509.Certificate) -> list[str]:
    """The OCSP responders the certificate's Authority Information Access names (http and https only)."""
    try:
        aia = cert.extensions.get_extension_for_class(x509.AuthorityInformationAccess).value
    except x509.ExtensionNotFound:
        return []
    return [
        d.access_location.value
        for d in aia
        if d.access_method == AuthorityInformationAccessOID.OCSP
        and isinstance(d.access_location, x509.UniformResourceIdentifier)
        and d.access_location.value.lower().startswith(("http://", "https://"))
    ]


def _post(url: str, request: bytes, timeout_s: float) -> bytes:
    req = urllib.request.Request(
        url, data=request, method="POST",
        headers={"Content-Type": "application/ocsp-request", "Accept": "application/ocsp-response"},
    )  # fmt: skip
    with turn.released(), _opener.open(req, timeout=timeout_s) as resp:  # other exchanges go on meanwhile
        body = resp.read(MAX_OCSP_RESPONSE + 1)
    if len(body) > MAX_OCSP_RESPONSE:
        raise ValueError(f"answer over {MAX_OCSP_RESPONSE} bytes")
    return body


def _response_signer(resp: ocsp.OCSPResponse, issuer: x509.Certificate, now: dt.datetime) -> x509.Certificate:
    """The certificate whose key must have signed `resp`: the issuer itself, or a responder the issuer
    delegated OCSP signing to (RFC 6960 4.2.2.2). ValueError otherwise."""

    def named(cert: x509.Certificate) -> bool:
        if resp.responder_key_hash is not None:
            return resp.responder_key_hash == _key_hash(cert)
        return resp.responder_name == cert.subject

    if named(issuer):
        return issuer
    for cert in resp.certificates:
        if not named(cert):
            continue
        try:
            cert.verify_directly_issued_by(issuer)
        except (ValueError, TypeError, InvalidSignature):
            raise ValueError(f"responder {_subject(cert)!r} is not certified by {_subject(issuer)!r}") from None
        try:
            usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except x509.ExtensionNotFound:
            usages = x509.ExtendedKeyUsage([])
        if ExtendedKeyUsageOID.OCSP_SIGNING not in usages:
            raise ValueError(f"responder {_subject(cert)!r} lacks the OCSPSigning extended key usage")
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise ValueError(f"responder certificate {_subject(cert)!r} is outside its validity")
        return cert
    raise ValueError("signed by neither the issuer nor a responder it certified")


def _ocsp_answer(
    der: bytes, request: ocsp.OCSPRequest, nonce: bytes, issuer: x509.Certificate, now: dt.datetime
) -> tuple[State, str, dt.datetime]:
    """(state, detail, nextUpdate or a short freshness) from a responder's answer; ValueError if not believable."""
    resp = ocsp.load_der_ocsp_response(der)
    if resp.response_status != ocsp.OCSPResponseStatus.SUCCESSFUL:
        raise ValueError(f"responder answered {resp.response_status.name}")
    signer = _response_signer(resp, issuer, now)
    try:
        _verify_signature(signer, resp.signature, resp.tbs_response_bytes, resp.signature_hash_algorithm)
    except (InvalidSignature, UnsupportedAlgorithm):
        raise ValueError(f"bad signature (signer {_subject(signer)!r})") from None
    try:
        echoed = resp.extensions.get_extension_for_class(x509.OCSPNonce).value.nonce
    except x509.ExtensionNotFound:
        echoed = None  # many responders pre-sign their answers: thisUpdate/nextUpdate must do
    if echoed is not None and echoed != nonce:
        raise ValueError("nonce does not match the request's")
    single = next(
        (
            r
            for r in resp.responses
            if r.serial_number == request.serial_number
            and isinstance(r.hash_algorithm, hashes.SHA1)
            and r.issuer_key_hash == request.issuer_key_hash
            and r.issuer_name_hash == request.issuer_name_hash
        ),
        None,
    )
    if single is None:
        raise ValueError("no answer about the certificate asked for")
    if single.this_update_utc > now + CLOCK_SKEW:
        raise ValueError(f"thisUpdate {single.this_update_utc} is in the future")
    until = single.next_update_utc
    if until is None:
        if now - single.this_update_utc > NO_NEXT_UPDATE_AGE:
            raise ValueError(f"stale: thisUpdate {single.this_update_utc} and no nextUpdate")
        until = now + UNKNOWN_RETRY
    elif now >= until:
        raise ValueError(f"stale: nextUpdate {until} has passed")
    status = single.certificate_status
    if status == ocsp.OCSPCertStatus.REVOKED:
        reason = single.revocation_reason.name if single.revocation_reason else ""
        return "revoked", f"revoked {single.revocation_time_utc} {reason}".rstrip(), until
    if status == ocsp.OCSPCertStatus.GOOD:
        return "good", "good", until
    raise ValueError("the responder does not know the certificate")


def _ocsp_status(
    urls: Sequence[str], cert: x509.Certificate, issuer: x509.Certificate, now: dt.datetime, timeout_s: float
) -> Status:
    if not urls:
        return Status("unknown", "OCSP: no responder (none in the policy, no AIA in the certificate)",
                      now + UNKNOWN_RETRY)  # fmt: skip
    nonce = secrets.token_bytes(16)
    request = (
        ocsp.OCSPRequestBuilder()
        .add_certificate(cert, issuer, hashes.SHA1())  # the CertID hash every responder knows; not a signature
        .add_extension(x509.OCSPNonce(nonce), critical=False)
        .build()
    )
    der = request.public_bytes(serialization.Encoding.DER)
    why: list[str] = []
    deadline = time.monotonic() + timeout_s  # for all of them: the worker waits
    for url in urls:
        left = deadline - time.monotonic()
        if left <= 0:
            why.append(f"OCSP {url}: not asked, out of time")
            continue
        try:
            state, detail, until = _ocsp_answer(_post(url, der, left), request, nonce, issuer, now)
        except (OSError, ValueError) as exc:  # URLError and timeouts are OSErrors
            why.append(f"OCSP {url}: {getattr(exc, 'reason', None) or exc}")
            continue
        return Status(state, f"OCSP {url}: {detail}", until)
    return Status("unknown", "; ".join(why), now + UNKNOWN_RETRY)


# ---------------------------------------------------------------------------------------------------------
# The checker


@dataclass(frozen=True)
class _Cached:
    status: Status
    crl_generation: int  # CRL answers hold until a CRL file changes
    refresh_at: dt.datetime  # from here on, an OCSP answer is fetched anew in the background


class RevocationChecker:
    """Checks a validated chain (leaf first, anchor last) as `policy` says; raises FailedAuthentication.

    With OCSP, an answer in the last quarter of its life is fetched anew on a background thread when a message
    uses it (the worker's thread goes on with the cached answer), so steady traffic never waits for a responder;
    the new answer replaces the old one unless it is no answer at all."""

    def __init__(self, policy: RevocationPolicy, issuers: Sequence[x509.Certificate], *, cache_size: int = CACHE_SIZE):
        self.policy = policy
        self._crl = policy.mode in ("crl", "both")
        self._ocsp = policy.mode in ("ocsp", "both")
        self._files = [CrlFile(p, issuers) for p in policy.crl_files] if self._crl else []
        self._generation = 0
        self._size = cache_size
        self._cache: OrderedDict[tuple[bytes, int], _Cached] = OrderedDict()
        self._lock = threading.Lock()  # the cache, between the worker's thread and refreshes
        self._refreshing: set[tuple[bytes, int]] = set()
        self._max_age = dt.timedelta(seconds=policy.max_cache_s)
        self.refresh()

    def refresh(self) -> None:
        """Pick up changed CRL files (at most every CRL_RECHECK_S each)."""
        mono = time.monotonic()
        if any([f.refresh(mono) for f in self._files]):
            self._generation += 1

    def check(self, chain: Sequence[x509.Certificate], now: dt.datetime) -> None:
        self.refresh()
        for cert, issuer in itertools.pairwise(chain):
            status = self.status(cert, issuer, now)
            who = f"certificate {_subject(cert)!r} (serial {cert.serial_number:X})"
            if status.state == "revoked":
                raise faults.security("FailedAuthentication", f"{who} is revoked: {status.detail}")
            if status.state == "unknown" and self.policy.on_unknown == "fail":
                raise faults.security("FailedAuthentication", f"no revocation status: {who}: {status.detail}")

    def status(self, cert: x509.Certificate, issuer: x509.Certificate, now: dt.datetime) -> Status:
        """The cached answer while valid, else a fresh one from the policy's sources."""
        key = (_key_hash(issuer), cert.serial_number)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit.crl_generation == self._generation and now < hit.status.until:
                self._cache.move_to_end(key)
                stale = self._ocsp and hit.status.state != "unknown" and now >= hit.refresh_at
                if stale and key not in self._refreshing and len(self._refreshing) < MAX_REFRESHING:
                    self._refreshing.add(key)
                    threading.Thread(target=self._refresh, args=(key, cert, issuer), daemon=True).start()
                return hit.status
        status = self._store(key, self._lookup(cert, issuer, now), self._generation, now)
        if status.state == "unknown" and self.policy.on_unknown == "allow":
            log.warning("accepted without revocation status (on_unknown: allow): certificate %r: %s",
                        _subject(cert), status.detail)  # fmt: skip
        return status

    def _store(self, key: tuple[bytes, int], status: Status, generation: int, now: dt.datetime) -> Status:
        until = min(status.until, now + self._max_age)
        status = Status(status.state, status.detail, until)
        with self._lock:
            self._cache[key] = _Cached(status, generation, now + (until - now) * 3 / 4)
            self._cache.move_to_end(key)
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return status

    def _refresh(self, key: tuple[bytes, int], cert: x509.Certificate, issuer: x509.Certificate) -> None:
        try:
            generation, now = self._generation, dt.datetime.now(dt.UTC)
            status = self._lookup(cert, issuer, now)
            if status.state != "unknown":
                self._store(key, status, generation, now)
            else:
                log.warning("revocation status of %r not refreshed, the cached answer stays: %s", _subject(cert),
                            status.detail)  # fmt: skip
        finally:
            with self._lock:
                self._refreshing.discard(key)

    def _lookup(self, cert: x509.Certificate, issuer: x509.Certificate, now: dt.datetime) -> Status:
        """Either source may revoke; one good answer (and no revocation) is enough."""
        answers: list[Status] = []
        if self._crl:
            answers.append(_crl_status(self._files, cert, issuer, now))
            if answers[-1].state == "revoked":
                return answers[-1]
        if self._ocsp:
            urls = [self.policy.ocsp_responder] if self.policy.ocsp_responder else responder_urls(cert)
            answers.append(_ocsp_status(urls, cert, issuer, now, self.policy.timeout_s))
        until = min(a.until for a in answers)
        for state in ("revoked", "good"):
            found = [a for a in answers if a.state == state]
            if found:
                return Status(state, found[0].detail, until if state == "good" else found[0].until)
        return Status("unknown", "; ".join(a.detail for a in answers), until)
