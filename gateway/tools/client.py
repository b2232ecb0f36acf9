"""The WS-Security client: secures a plain SOAP request as a route's policy asks, and opens the secured reply.

`wsgate client` uses it for people; the load test uses it to pre-generate traffic and to check every response.
It is the sending and receiving side of the same engine the gateway runs (filters/engine/wss/wssecurity_sending.py,
filters/engine/wss/wssecurity.py)."""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import requests
from cryptography import x509

from certs import pki
from filters.engine import faults, ns
from filters.engine.conversation import ws_trust
from filters.engine.faults import content_type
from filters.engine.mime import package as mime
from filters.engine.mime import xop
from filters.engine.mime.xop import XOP as XOP_NS
from filters.engine.profiles import context_security
from filters.engine.wss import attachments, encryption, keys, signature, wssecurity
from filters.engine.wss import secure_conversation as sc
from filters.engine.wss import wssecurity_sending as sending
from filters.engine.xml.soap import Envelope
from filters.engine.xml.threat_protection import parse_envelope
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
    sc_version: str = "1.3"  # WS-SecureConversation version to ask for: "1.3" or "2005/02"

    def path(self, name: str) -> Path:
        p = Path(name)
        return p if p.is_absolute() else self.certs / p


@dataclass
class Pending:
    """What the client must remember between a request and its reply."""

    secret: bytes | None = None
    encrypted_key_sha1: str | None = None
    soap_version: str = "1.1"

    @property
    def content_type(self) -> str:
        return content_type(self.soap_version)


Post = Callable[[bytes, str], bytes]  # (body, content type) -> reply body
Exchange = Callable[[bytes, str], tuple[str, bytes]]  # (body, content type) -> (reply content type, reply body)


def http_exchange(url: str, verify: str | bool = True, timeout: float = 30, soap_action: str | None = None) -> Exchange:
    """An Exchange over HTTP(S) with keep-alive."""
    session = requests.Session()
    extra = {"soapaction": f'"{soap_action}"'} if soap_action else {}

    def exchange(body: bytes, ctype: str) -> tuple[str, bytes]:
        headers = {"content-type": ctype, **extra}
        r = session.post(url, data=body, headers=headers, timeout=timeout, verify=verify)
        return r.headers.get("content-type", ""), r.content

    return exchange


def http_post(url: str, verify: str | bool = True, timeout: float = 30, soap_action: str | None = None) -> Post:
    """A Post over HTTP(S) with keep-alive: the reply's body only."""
    exchange = http_exchange(url, verify, timeout, soap_action)
    return lambda body, ctype: exchange(body, ctype)[1]


# ---- attachments: MTOM (the envelope holds xop:Include) or SOAP with Attachments (docs/attachments.md)

ROOT_ID = "root@wsgate-client"


def attachment(spec: str) -> mime.Part:
    """`FILE[:content-type]` (default application/octet-stream) as a part; its Content-ID is the file's name
    (characters a Content-ID cannot hold replaced by `_`): the request names it `cid:<name>`."""
    path, _, ctype = spec.partition(":")
    content_id = re.sub(r"[^A-Za-z0-9!#$&'*+\-./=?@^_`{|}~]", "_", Path(path).name)
    ctype = ctype or "application/octet-stream"
    headers = (("Content-Type", ctype), ("Content-Transfer-Encoding", "binary"), ("Content-ID", f"<{content_id}>"))
    return mime.Part(headers, content_id, ctype, Path(path).read_bytes())


def package(envelope: bytes, soap_version: str, attachments: list[mime.Part]) -> tuple[str, bytes]:
    """(Content-Type, body) of the envelope with its attachments: MTOM where it holds xop:Include, else SwA."""
    soap = content_type(soap_version).split(";")[0]
    is_xop = XOP_NS.encode() in envelope
    root_type = f'application/xop+xml; charset=utf-8; type="{soap}"' if is_xop else f"{soap}; charset=utf-8"
    headers = (("Content-Type", root_type), ("Content-Transfer-Encoding", "binary"), ("Content-ID", f"<{ROOT_ID}>"))
    boundary = f"uuid:{uuid.uuid4()}"
    outer = (
        f'multipart/related; type="{"application/xop+xml" if is_xop else soap}"; boundary="{boundary}"; '
        f'start="<{ROOT_ID}>"' + (f'; start-info="{soap}"' if is_xop else "")
    )
    root = mime.Part(headers, ROOT_ID, root_type, envelope)
    return outer, mime.serialize(mime.Package(root, tuple(attachments), ROOT_ID, boundary, outer))


def unpack(reply_type: str, reply: bytes, route: Route) -> tuple[bytes, tuple[mime.Part, ...]]:
    """A reply's envelope and attachments (none for a plain SOAP reply), checked as the gateway checks them."""
    if not mime.is_multipart(reply_type):
        return reply, ()
    try:
        pkg = mime.parse(reply_type, reply, route.attachments)
    except faults.Fault as f:
        raise ClientError(f"reply is not a valid package: {f.reason}") from None
    return bytes(pkg.root.body), pkg.attachments


class Client:
    """Secures requests for one route and opens its replies. On a `secureconversation` route, `establish` first
    (an Issue RST signed like an `rsa` request); messages then use keys derived from the context."""

    def __init__(self, route: Route, cfg: ClientConfig | None = None) -> None:
        if route.profile not in ("rsa", "hmac", "secureconversation"):
            raise ValueError(f"route {route.name}: the client secures rsa, hmac and secureconversation routes")
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
        x509 = route.profile != "hmac"
        if x509:
            algorithm = next(a for a in [*sig.algorithms, "rsa-sha256"] if a.startswith("rsa"))
            self.signer = signature.Signer(self.private_key, algorithm, self.digest)
        self.hmac_algorithm = next(a for a in [*sig.algorithms, "hmac-sha256"] if a.startswith("hmac"))
        signer_kind = "x509" if x509 else "symmetric"
        sign_response = route.rsa.sign_response if x509 else route.hmac.sign_response
        self.context: sc.Context | None = None
        self.reply_requirements = wssecurity.Requirements(
            timestamp=route.timestamp,
            signature=sig.model_copy(update={"parts": [p for p in sig.parts if p in ("body", "timestamp")]}),
            encryption=route.encryption,
            username_token=UsernameTokenPolicy(),
            signer=signer_kind if sign_response else None,
            body_encrypted=route.encryption.encrypt_response,
            limits=route.response_limits,
        )
        self.in_context = replace(self.reply_requirements, signer="context")
        self.trust = keys.TrustStore([keys.load_certificate(cfg.path(cfg.ca))])

    @property
    def encrypts(self) -> bool:
        return self.route.encryption.require_request if self.cfg.encrypt is None else self.cfg.encrypt

    @property
    def encrypts_signature(self) -> bool:
        """The Signature goes encrypted with the Body, as the route sends its own (encryption.encrypt_signature)."""
        return self.encrypts and self.route.encryption.encrypt_signature

    @property
    def encrypts_user(self) -> bool:
        """The route wants the UsernameToken encrypted (EncryptedSupportingTokens), and we send one."""
        return bool(self.cfg.user) and self.route.username_token.protection == "encrypted"

    def _algorithm_for(self, secret: bytes) -> str:
        """The route's first data algorithm that takes a key of this length."""
        for algorithm in self.route.encryption.data_algorithms:
            if encryption.key_size(algorithm) == len(secret):
                return algorithm
        raise ClientError(f"route {self.route.name}: no data algorithm for a {len(secret)}-byte key")

    def secure(self, plain: bytes, parts: Sequence[mime.Part] = ()) -> tuple[bytes, Pending]:
        """The request, secured; and what is needed to open its reply. `parts`: the attachments it will travel
        with; an MTOM request is signed over its infoset (xop:Include expanded), as the gateway verifies it."""
        env = parse_envelope(plain, self.route.limits)
        now = datetime.now(UTC)
        expanded = attachments.expand_xop(xop.includes(env.root), parts) if parts else []
        if self.route.profile == "secureconversation":
            if self.context is None:
                raise ClientError("no security context: establish one first")
            secured, pending = self._secure_in_context(env, now), Pending(soap_version=env.version)
        else:
            secured, pending = self._secure(env, now)
        if expanded:
            attachments.restore_xop(expanded, env.root)
            secured = env.serialize()
        return secured, pending

    def _secure(self, env: Envelope, now: datetime) -> tuple[bytes, Pending]:
        route, cfg = self.route, self.cfg
        user = (cfg.user, cfg.password or "", cfg.password_digest) if cfg.user else None
        parts = tuple(route.signature.parts)
        if self.encrypts_user and "username_token" not in parts:
            parts += ("username_token",)  # decrypted content must be signed (SignedEncryptedSupportingTokens)
        algorithm = route.encryption.data_algorithms[0]
        transport = route.encryption.key_transport[0]
        pending = Pending(soap_version=env.version)
        if route.profile != "hmac":
            bst_id = sending.new_id("X509")
            sign = sending.SignWith(self.signer, lambda: keys.str_reference(bst_id, ns.X509V3), self.certificate)
            encrypt = None
            if self.encrypts or self.encrypts_user:
                encrypt = sending.EncryptFor(algorithm, certificate=self._gateway_cert(), transport=transport)
            sending.secure(env, now, timestamp_ttl_s=cfg.timestamp_ttl_s, sign=sign, sign_parts=parts,
                              encrypt=encrypt if self.encrypts else None, user=user, unique_ids=True,
                              encrypt_user=encrypt if self.encrypts_user else None,
                              encrypt_signature=self.encrypts_signature)  # fmt: skip
            return env.serialize(), pending
        if cfg.key_name:
            secret = self.psk.get(cfg.key_name)
            if secret is None:
                raise ClientError(f"no pre-shared key named {cfg.key_name!r} in {route.hmac.keys_file}")
            name = cfg.key_name
            sign = sending.SignWith(
                signature.Signer(secret, self.hmac_algorithm, self.digest), lambda: keys.str_pre_shared_key(name)
            )
            encrypt = None
            if self.encrypts or self.encrypts_user:
                encrypt = sending.EncryptFor(self._algorithm_for(secret), secret=secret,
                                                secret_key_info=lambda: keys.str_pre_shared_key(name))  # fmt: skip
            sending.secure(env, now, timestamp_ttl_s=cfg.timestamp_ttl_s, sign=sign, sign_parts=parts,
                              encrypt=encrypt if self.encrypts else None, user=user, unique_ids=True,
                              encrypt_user=encrypt if self.encrypts_user else None,
                              encrypt_signature=self.encrypts_signature)  # fmt: skip
            pending.secret = secret
            return env.serialize(), pending
        # The symmetric binding: a fresh key, sent encrypted to the gateway, signs and encrypts.
        secret = encryption.new_key(algorithm) if self.encrypts or self.encrypts_user else os.urandom(32)
        sign = sending.SignWith(signature.Signer(secret, self.hmac_algorithm, self.digest), None)
        encrypt = sending.EncryptFor(algorithm, secret=secret)
        got = sending.secure(env, now, timestamp_ttl_s=cfg.timestamp_ttl_s, sign=sign, sign_parts=parts,
                                encrypt=encrypt if self.encrypts else None, user=user,
                                symmetric_binding=(secret, self._gateway_cert(), transport), unique_ids=True,
                                encrypt_user=encrypt if self.encrypts_user else None,
                              encrypt_signature=self.encrypts_signature)  # fmt: skip
        pending.secret, pending.encrypted_key_sha1 = secret, got.encrypted_key_sha1
        return env.serialize(), pending

    def _secure_in_context(self, env: Envelope, now: datetime) -> bytes:
        assert self.context is not None
        sign, encrypt, tokens = context_security(self.context, self.route, encrypt=self.encrypts)
        sending.secure(env, now, timestamp_ttl_s=self.cfg.timestamp_ttl_s, sign=sign,
                          sign_parts=tuple(p for p in self.route.signature.parts if p != "username_token"),
                          encrypt=encrypt, tokens=tokens, unique_ids=True,
                          encrypt_signature=self.encrypts_signature)  # fmt: skip
        return env.serialize()

    # -- WS-SecureConversation ---------------------------------------------------------------------------
    def establish(self, post: Post, soap_version: str = "1.1") -> sc.Context:
        """Ask the gateway for a security context (Issue RST, signed and its Body encrypted: the entropy is secret)."""
        version = next(v for v in sc.VERSIONS if v.name == self.cfg.sc_version)
        entropy = os.urandom(32)
        env = ws_trust.envelope(
            soap_version, ws_trust.build_issue_rst(version, entropy=entropy), action=version.issue_action
        )
        saved, self.cfg.encrypt = self.cfg.encrypt, True
        try:
            secured, pending = self._secure(env, datetime.now(UTC))
        finally:
            self.cfg.encrypt = saved
        reply = self.open(post(secured, content_type(soap_version)), pending)
        issued = ws_trust.read_rstr(reply.body[0], entropy=entropy, private_key=self.private_key)
        self.context = issued.context
        return issued.context

    def cancel(self, post: Post, soap_version: str = "1.1") -> None:
        """End the context (Cancel RST signed with its keys)."""
        if self.context is None:
            raise ClientError("no security context to cancel")
        env = ws_trust.envelope(
            soap_version, ws_trust.build_cancel_rst(self.context), action=self.context.version.cancel_action
        )
        secured = self._secure_in_context(env, datetime.now(UTC))
        reply = self.open(post(secured, content_type(soap_version)), Pending(soap_version=soap_version))
        ws_trust.read_cancel_rstr(reply.body[0])
        self.context = None

    def _context_resolver(self, now: datetime, local: Mapping[str, sc.Sct]) -> sc.SctResolver:
        ctx = self.context

        def resolve(ref: sc.SctRef) -> sc.Context:
            if ctx is None or sc.identifier_of(ref, local) != ctx.identifier:
                raise sc.wsc_fault(ref.version, "UnknownDerivationSource", "reply names a context we do not hold")
            return ctx

        return resolve

    def _gateway_cert(self) -> x509.Certificate:
        if self.gateway_cert is None:
            raise ClientError(
                f"no gateway encryption certificate at {self.cfg.path(self.cfg.gateway_encryption_certificate)}"
            )
        return self.gateway_cert

    def open(self, body: bytes, pending: Pending, parts: Sequence[mime.Part] = ()) -> Envelope:
        """Verify and decrypt a reply; a SOAP fault (secured or not) raises ClientError with its text. `parts`: the
        reply's attachments (its signature may cover them; MTOM content is read expanded, as it was signed)."""
        try:
            env = parse_envelope(body, self.route.response_limits)
        except faults.Fault as f:
            raise ClientError(f"reply is not SOAP: {f.reason}") from None
        security = wssecurity.find_security(env)
        if env.is_fault() and security is None:
            raise ClientError(f"SOAP fault: {fault_text(env)}")
        creds = wssecurity.Credentials(
            trust=self.trust,
            decryption_key=self.private_key,
            psk={self.cfg.key_name: pending.secret} if self.cfg.key_name and pending.secret else {},
            encrypted_keys={pending.encrypted_key_sha1: pending.secret}
            if pending.encrypted_key_sha1 and pending.secret
            else {},
        )
        requirements = self.reply_requirements
        if self.context is not None and security is not None and any(sc.is_dkt(c) for c in security.iterchildren()):
            requirements = self.in_context
            creds.contexts = self._context_resolver
        try:
            attachments.expand_xop(xop.includes(env.root), parts)
            wssecurity.process(env, requirements, creds, datetime.now(UTC), attachments.from_parts(parts))
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
