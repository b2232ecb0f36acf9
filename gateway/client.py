"""The WS-Security client: secures a plain SOAP request as a route's policy asks, and opens the secured reply.

`wsgate client` uses it for people; the load test uses it to pre-generate traffic and to check every response.
It is the sending and receiving side of the same engine the gateway runs (filters/wssecurity.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509

from certs import pki
from filters import encryption, faults, keys, ns, signature, wssecurity
from filters.soap import Envelope
from filters.threat_protection import parse_envelope
from gateway.policy import Route, UsernameTokenPolicy


class ClientError(Exception):
    """The reply was a SOAP fault, or did not verify."""


@dataclass
class ClientConfig:
    """Who the client is. Defaults: the demo PKI's client."""

    certs: Path = pki.DEFAULT_DIR
    key: str = "client.key"
    certificate: str = "client.pem"
    gateway_encryption_certificate: str = "gateway-enc.pem"
    ca: str = "ca.pem"
    key_name: str | None = None  # hmac: a pre-shared key's name; None: a fresh key in an EncryptedKey
    user: str | None = None
    password: str | None = None
    password_digest: bool = True
    encrypt: bool | None = None  # None: as the route requires
    timestamp_ttl_s: int = 300

    def path(self, name: str) -> Path:
        p = Path(name)
        return p if p.is_absolute() else self.certs / p


@dataclass
class Pending:
    """What the client must remember between a request and its reply."""

    secret: bytes | None = None
    encrypted_key_sha1: str | None = None
    soap_version: str = "1.1"
    extra: dict[str, object] = field(default_factory=dict)


class Client:
    def __init__(self, route: Route, cfg: ClientConfig | None = None) -> None:
        if route.profile not in ("rsa", "hmac"):
            raise ValueError(f"route {route.name}: the client secures rsa and hmac routes, not {route.profile}")
        self.route = route
        self.cfg = cfg = cfg or ClientConfig()
        self.private_key = keys.load_private_key(cfg.path(cfg.key))
        self.certificate = keys.load_certificate(cfg.path(cfg.certificate))
        self.gateway_cert: x509.Certificate | None = None
        enc_cert = cfg.path(cfg.gateway_encryption_certificate)
        if enc_cert.exists():
            self.gateway_cert = keys.load_certificate(enc_cert)
        self.psk = keys.load_hmac_keys(route.hmac.keys_file) if cfg.key_name and route.hmac.keys_file else {}
        sig = route.signature
        self.digest = sig.digests[0]
        if route.profile == "rsa":
            algorithm = next(a for a in [*sig.algorithms, "rsa-sha256"] if a.startswith("rsa"))
            self.signer = signature.Signer(self.private_key, algorithm, self.digest)
        self.hmac_algorithm = next(a for a in [*sig.algorithms, "hmac-sha256"] if a.startswith("hmac"))
        signer_kind = "x509" if route.profile == "rsa" else "symmetric"
        sign_response = route.rsa.sign_response if route.profile == "rsa" else route.hmac.sign_response
        self.reply_requirements = wssecurity.Requirements(
            timestamp=route.timestamp,
            signature=sig.model_copy(update={"parts": [p for p in sig.parts if p in ("body", "timestamp")]}),
            encryption=route.encryption,
            username_token=UsernameTokenPolicy(),
            signer=signer_kind if sign_response else None,
            body_encrypted=route.encryption.encrypt_response,
            limits=route.response_limits,
        )
        self.trust = keys.TrustStore([keys.load_certificate(cfg.path(cfg.ca))])

    @property
    def encrypts(self) -> bool:
        return self.route.encryption.require_request if self.cfg.encrypt is None else self.cfg.encrypt

    def secure(self, plain: bytes) -> tuple[bytes, Pending]:
        """The request, secured; and what is needed to open its reply."""
        env = parse_envelope(plain, self.route.limits)
        now = datetime.now(UTC)
        route, cfg = self.route, self.cfg
        user = (cfg.user, cfg.password or "", cfg.password_digest) if cfg.user else None
        parts = tuple(route.signature.parts)
        algorithm = route.encryption.data_algorithms[0]
        transport = route.encryption.key_transport[0]
        pending = Pending(soap_version=env.version)
        if route.profile == "rsa":
            bst_id = wssecurity.new_id("X509")
            sign = wssecurity.SignWith(self.signer, lambda: keys.str_reference(bst_id, ns.X509V3), self.certificate)
            encrypt = None
            if self.encrypts:
                encrypt = wssecurity.EncryptFor(algorithm, certificate=self._gateway_cert(), transport=transport)
            wssecurity.secure(env, now, timestamp_ttl_s=cfg.timestamp_ttl_s, sign=sign, sign_parts=parts,
                              encrypt=encrypt, user=user)  # fmt: skip
            return env.serialize(), pending
        if cfg.key_name:
            secret = self.psk.get(cfg.key_name)
            if secret is None:
                raise ClientError(f"no pre-shared key named {cfg.key_name!r} in {route.hmac.keys_file}")
            name = cfg.key_name
            sign = wssecurity.SignWith(
                signature.Signer(secret, self.hmac_algorithm, self.digest), lambda: keys.key_name(name)
            )
            encrypt = None
            if self.encrypts:
                encrypt = wssecurity.EncryptFor(algorithm, secret=secret, secret_key_info=lambda: keys.key_name(name))
            wssecurity.secure(env, now, timestamp_ttl_s=cfg.timestamp_ttl_s, sign=sign, sign_parts=parts,
                              encrypt=encrypt, user=user)  # fmt: skip
            pending.secret = secret
            return env.serialize(), pending
        # The symmetric binding: a fresh key, sent encrypted to the gateway, signs and encrypts.
        secret = encryption.new_key(algorithm) if self.encrypts else os.urandom(32)
        sign = wssecurity.SignWith(signature.Signer(secret, self.hmac_algorithm, self.digest), None)
        encrypt = wssecurity.EncryptFor(algorithm, secret=secret) if self.encrypts else None
        got = wssecurity.secure(env, now, timestamp_ttl_s=cfg.timestamp_ttl_s, sign=sign, sign_parts=parts,
                                encrypt=encrypt, user=user,
                                symmetric_binding=(secret, self._gateway_cert(), transport))  # fmt: skip
        pending.secret, pending.encrypted_key_sha1 = secret, got.encrypted_key_sha1
        return env.serialize(), pending

    def _gateway_cert(self) -> x509.Certificate:
        if self.gateway_cert is None:
            raise ClientError(
                f"no gateway encryption certificate at {self.cfg.path(self.cfg.gateway_encryption_certificate)}"
            )
        return self.gateway_cert

    def open(self, body: bytes, pending: Pending) -> Envelope:
        """Verify and decrypt a reply; a SOAP fault (secured or not) raises ClientError with its text."""
        try:
            env = parse_envelope(body, self.route.response_limits)
        except faults.Fault as f:
            raise ClientError(f"reply is not SOAP: {f.reason}") from None
        if env.is_fault() and wssecurity.find_security(env) is None:
            raise ClientError(f"SOAP fault: {fault_text(env)}")
        creds = wssecurity.Credentials(
            trust=self.trust,
            decryption_key=self.private_key,
            psk={self.cfg.key_name: pending.secret} if self.cfg.key_name and pending.secret else {},
            encrypted_keys={pending.encrypted_key_sha1: pending.secret}
            if pending.encrypted_key_sha1 and pending.secret
            else {},
        )
        try:
            wssecurity.process(env, self.reply_requirements, creds, datetime.now(UTC))
        except faults.Fault as f:
            raise ClientError(f"reply refused ({f.code or 'Client'}): {f.reason}") from None
        if env.is_fault():
            raise ClientError(f"SOAP fault: {fault_text(env)}")
        return env


def fault_text(env: Envelope) -> str:
    fault = env.body[0]
    code = fault.findtext("faultcode") or fault.findtext(f".//{{{ns.SOAP12}}}Value") or ""
    text = fault.findtext("faultstring") or fault.findtext(f".//{{{ns.SOAP12}}}Text") or ""
    return f"{code} {text}".strip()


def content_type(soap_version: str) -> str:
    return "application/soap+xml; charset=utf-8" if soap_version == "1.2" else "text/xml; charset=utf-8"
