"""The requester's side of a route's WS-Security: secure a plain request as the route's policy asks, and open
(verify, decrypt) the secured reply. The mirror image of the gateway's inbound pipeline, on the same engine
(filters/engine/wss/wssecurity_sending.py, filters/engine/wss/wssecurity.py).

Two callers: `wsgate client` and the load test (gateway/tools/client.py, keys from files), and the gateway's
outbound routes (filters/engine/outbound.py, keys from the route's policy)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa
from lxml import etree

from filters.engine import faults, ns
from filters.engine.conversation import ws_trust
from filters.engine.faults import content_type
from filters.engine.mime import package as mime
from filters.engine.mime import xop
from filters.engine.profiles import Post, context_security
from filters.engine.wss import attachments, encryption, keys, saml, signing, wssecurity
from filters.engine.wss import secure_conversation as sc
from filters.engine.wss import wssecurity_sending as sending
from filters.engine.wss.optimizations import Optimizations
from filters.engine.wss.replay import DeferredReplay, ReplayCache
from filters.engine.xml import xmlsupport
from filters.engine.xml.soap import Envelope
from filters.engine.xml.threat_protection import parse_envelope
from gateway.policy import Route, UsernameTokenPolicy


class RequesterError(Exception):
    """The reply was a SOAP fault, or did not verify (or the request could not be secured)."""


class ReplyRefused(RequesterError):
    """The other side's reply, not ours: not SOAP, a SOAP fault, did not verify, or an RSTR that issues nothing."""


@dataclass
class RequesterSettings:
    """How the requester secures, beyond the route: its credentials other than keys."""

    key_name: str | None = None  # hmac: a pre-shared key's name; None: a fresh key in an EncryptedKey
    user: str | None = None
    password: str | None = None
    password_digest: bool = True
    encrypt: bool | None = None  # None: as the route requires
    timestamp_ttl_s: int = 300
    sc_version: str = "1.3"  # WS-SecureConversation version to ask for: "1.3" or "2005/02"
    assertion: Path | None = None  # saml: a signed SAML assertion (a file) to send, as its confirmation says
    # saml: the symmetric key a holder-of-key assertion confirms (its EncryptedKey is to the gateway, not to us):
    # the proof key its issuer gave with it. The message is HMAC-signed with it.
    proof_key: bytes | None = None


@dataclass
class RequesterKeys:
    """The requester's keys: its own (signs, decrypts replies), the recipient's certificate (encrypted to), the
    anchors a reply's signer must chain to, pre-shared keys by name."""

    private_key: rsa.RSAPrivateKey
    certificate: x509.Certificate
    recipient: x509.Certificate | None
    trust: keys.TrustStore
    psk: Mapping[str, bytes]
    replay: ReplayCache | DeferredReplay | None = None  # replies' signatures and nonces: none is taken twice
    decryption_key: rsa.RSAPrivateKey | None = None  # opens replies encrypted to us; None: private_key
    # Its certificate, where it is not `certificate`'s key: replies encrypted to either certificate are opened (an
    # STS encrypts its answer to the Issue's signer).
    decryption_certificate: x509.Certificate | None = None


@dataclass
class Pending:
    """What the requester must remember between a request and its reply."""

    secret: bytes | None = None
    encrypted_key_sha1: str | None = None
    soap_version: str = "1.1"

    @property
    def content_type(self) -> str:
        return content_type(self.soap_version)


class Requester:
    """Secures requests for one route and opens its replies. On a `secureconversation` route, `establish` first
    (an Issue RST signed like an `rsa` request); messages then use keys derived from the context."""

    def __init__(
        self, route: Route, cfg: RequesterSettings, keys_: RequesterKeys, optimizations: Optimizations | None = None
    ) -> None:
        """`optimizations`: the route's (the outbound gateway's: digests computed directly, xmlsec signing only the
        canonical SignedInfo, as on inbound routes); None, as for the client tool: xmlsec's reference processing."""
        if route.profile not in ("rsa", "hmac", "secureconversation", "saml"):
            raise ValueError(f"route {route.name}: the requester secures rsa, hmac, secureconversation and saml routes")
        if (route.profile == "saml") != (cfg.assertion is not None):
            raise ValueError(f"route {route.name}: an assertion is sent to saml routes, and only there")
        self.route = route
        self.cfg = cfg
        self.optimizations = optimizations
        self.private_key = keys_.private_key
        self.certificate = keys_.certificate
        self.gateway_cert = keys_.recipient
        self.psk = keys_.psk
        self.trust = keys_.trust
        self.replay = keys_.replay
        self.decryption_key = keys_.decryption_key or keys_.private_key
        self.decryption_keys: list[tuple[x509.Certificate, rsa.RSAPrivateKey]] = []
        if keys_.decryption_key is not None and keys_.decryption_certificate is not None:
            self.decryption_keys = [(keys_.decryption_certificate, keys_.decryption_key),
                                    (keys_.certificate, keys_.private_key)]  # fmt: skip
        sig = route.signature
        self.digest = sig.digests[0]
        x509_signer = route.profile != "hmac"
        if x509_signer:
            algorithm = next(a for a in [*sig.algorithms, "rsa-sha256"] if a.startswith("rsa"))
            self.signer = signing.Signer(self.private_key, algorithm, self.digest)
        self.hmac_algorithm = next(a for a in [*sig.algorithms, "hmac-sha256"] if a.startswith("hmac"))
        signer_kind = "x509" if x509_signer else "symmetric"
        sign_response = route.rsa.sign_response if x509_signer else route.hmac.sign_response
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
        # The partner's reply may use the context's keys derived or not, whatever our route sends.
        self.in_context = replace(self.reply_requirements, signer="context", context_key_direct=True)

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
        raise RequesterError(f"route {self.route.name}: no data algorithm for a {len(secret)}-byte key")

    def secure(self, plain: bytes, parts: Sequence[mime.Part] = ()) -> tuple[bytes, Pending]:
        """The request, secured; and what is needed to open its reply. `parts`: the attachments it will travel
        with; an MTOM request is signed over its infoset (xop:Include expanded), as the gateway verifies it."""
        env = parse_envelope(plain, self.route.limits)
        expanded = attachments.expand_xop(xop.includes(env.root), parts) if parts else []
        secured, pending = self.secure_envelope(env)
        if expanded:
            attachments.restore_xop(expanded, env.root)
            secured = env.serialize()
        return secured, pending

    def secure_envelope(self, env: Envelope) -> tuple[bytes, Pending]:
        now = datetime.now(UTC)
        if self.route.profile == "secureconversation":
            if self.context is None:
                raise RequesterError("no security context: establish one first")
            return self._secure_in_context(env, now), Pending(soap_version=env.version)
        return self._secure(env, now)

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
            sign = sending.SignWith(self.signer, lambda: keys.str_reference(bst_id, ns.X509V3), self.certificate,
                                    self.optimizations)  # fmt: skip
            tokens: tuple[etree._Element, ...] = ()
            if cfg.assertion is not None:
                assertion, sign = self._assertion(sign)
                tokens = (assertion,)
                if assertion.tag != saml.ENCRYPTED_ASSERTION:  # whose ID we cannot read: carried, not named
                    tokens += (saml_reference(assertion, sending.new_id("STR")),)
            encrypt = None
            if self.encrypts or self.encrypts_user:
                encrypt = sending.EncryptFor(algorithm, certificate=self._recipient(), transport=transport)
            sending.secure(env, now, timestamp_ttl_s=cfg.timestamp_ttl_s, sign=sign, sign_parts=parts,
                              encrypt=encrypt if self.encrypts else None, user=user, unique_ids=True,
                              encrypt_user=encrypt if self.encrypts_user else None,
                              encrypt_signature=self.encrypts_signature, tokens=tokens[:1],
                              signed_tokens=tokens[1:])  # fmt: skip
            return env.serialize(), pending
        if cfg.key_name:
            secret = self.psk.get(cfg.key_name)
            if secret is None:
                raise RequesterError(f"no pre-shared key named {cfg.key_name!r} in {route.hmac.keys_file}")
            name = cfg.key_name
            sign = sending.SignWith(signing.Signer(secret, self.hmac_algorithm, self.digest),
                                    lambda: keys.str_pre_shared_key(name), optimizations=self.optimizations)  # fmt: skip
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
        # The symmetric binding: a fresh key, sent encrypted to the recipient, signs and encrypts.
        secret = encryption.new_key(algorithm) if self.encrypts or self.encrypts_user else os.urandom(32)
        sign = sending.SignWith(signing.Signer(secret, self.hmac_algorithm, self.digest), None,
                                optimizations=self.optimizations)  # fmt: skip
        encrypt = sending.EncryptFor(algorithm, secret=secret)
        got = sending.secure(env, now, timestamp_ttl_s=cfg.timestamp_ttl_s, sign=sign, sign_parts=parts,
                                encrypt=encrypt if self.encrypts else None, user=user,
                                symmetric_binding=(secret, self._recipient(), transport), unique_ids=True,
                                encrypt_user=encrypt if self.encrypts_user else None,
                              encrypt_signature=self.encrypts_signature)  # fmt: skip
        pending.secret, pending.encrypted_key_sha1 = secret, got.encrypted_key_sha1
        return env.serialize(), pending

    def _assertion(self, sign: sending.SignWith) -> tuple[etree._Element, sending.SignWith]:
        """The configured assertion (read afresh: it moves into each message) and how to sign beside it: with
        the key it confirms (holder-of-key: KeyInfo names the assertion; a symmetric key: the proof key), else
        with our certificate (the sender vouching, or a bearer message's signer)."""
        assert self.cfg.assertion is not None
        assertion = etree.fromstring(self.cfg.assertion.read_bytes(), _ASSERTION_PARSER)
        if assertion.tag not in (saml.ASSERTION2, saml.ASSERTION1, saml.ENCRYPTED_ASSERTION):
            raise RequesterError(f"{self.cfg.assertion}: not a SAML 2.0 or 1.1 assertion (or an EncryptedAssertion)")
        methods = [saml.METHODS.get(m) for m in _CONFIRMATION_METHODS(assertion)]
        if not methods or any(m != "holder-of-key" for m in methods):
            return assertion, sign
        if next(assertion.iter(saml.ENCRYPTED_KEY), None) is not None:  # a symmetric key (SAML Token Profile 3.5)
            if self.cfg.proof_key is None:
                raise RequesterError(f"{self.cfg.assertion}: it confirms a symmetric key: give its proof key")
            sign = replace(sign, signer=signing.Signer(self.cfg.proof_key, self.hmac_algorithm, self.digest))
        return assertion, replace(sign, key_info=lambda: saml_reference(assertion, None), certificate=None)

    def _secure_in_context(self, env: Envelope, now: datetime) -> bytes:
        assert self.context is not None
        sign, encrypt, tokens = context_security(self.context, self.route, encrypt=self.encrypts,
                                                 optimizations=self.optimizations,
                                                 derived=self.route.secureconversation.derived_keys)  # fmt: skip
        sending.secure(env, now, timestamp_ttl_s=self.cfg.timestamp_ttl_s, sign=sign,
                          sign_parts=tuple(p for p in self.route.signature.parts if p != "username_token"),
                          encrypt=encrypt, tokens=tokens, unique_ids=True,
                          encrypt_signature=self.encrypts_signature)  # fmt: skip
        return env.serialize()

    # -- WS-SecureConversation ---------------------------------------------------------------------------
    def establish(self, post: Post, soap_version: str = "1.1") -> sc.Context:
        """Ask the issuer for a security context (Issue RST, signed and its Body encrypted: the entropy is secret)."""
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
        try:
            issued = ws_trust.read_rstr(reply.body[0], entropy=entropy, private_key=self.private_key)
        except faults.Fault as f:
            raise ReplyRefused(f"RSTR refused: {f.reason}") from None
        self.context = issued.context
        return issued.context

    def request_saml(
        self, post: Post, *, bearer: bool = False, applies_to: str | None = None, soap_version: str = "1.1"
    ) -> etree._Element:
        """Ask the gateway's STS (a secureconversation route with saml_token_service) for a SAML 2.0 assertion:
        holder-of-key for our certificate, or bearer. The request is signed like an `rsa` request."""
        rst = ws_trust.build_saml_issue_rst(bearer=bearer, applies_to=applies_to)
        env = ws_trust.envelope(soap_version, rst, action=ws_trust.SAML_ISSUE_ACTION)
        secured, pending = self._secure(env, datetime.now(UTC))
        return ws_trust.read_saml_rstr(self.open(post(secured, content_type(soap_version)), pending).body[0])

    def cancel(self, post: Post, soap_version: str = "1.1") -> None:
        """End the context (Cancel RST signed with its keys)."""
        if self.context is None:
            raise RequesterError("no security context to cancel")
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

    def _recipient(self) -> x509.Certificate:
        if self.gateway_cert is None:
            raise RequesterError(f"route {self.route.name}: no recipient certificate to encrypt to")
        return self.gateway_cert

    def verify(
        self, body: bytes, pending: Pending, parts: Sequence[mime.Part] = ()
    ) -> tuple[Envelope, wssecurity.Verified]:
        """Verify and decrypt a reply: what it established, its Security header gone. A reply that does not verify
        (an unsecured SOAP fault included) raises RequesterError with the precise reason; a verified fault is
        returned as any verified reply."""
        try:
            env = parse_envelope(body, self.route.response_limits)
        except faults.Fault as f:
            raise ReplyRefused(f"reply is not SOAP: {f.reason}") from None
        security = wssecurity.find_security(env)
        if env.is_fault() and security is None:
            raise ReplyRefused(f"SOAP fault: {fault_text(env)}")
        creds = wssecurity.Credentials(
            trust=self.trust,
            decryption_key=self.decryption_key,
            decryption_keys=self.decryption_keys,
            psk={self.cfg.key_name: pending.secret} if self.cfg.key_name and pending.secret else {},
            encrypted_keys={pending.encrypted_key_sha1: pending.secret}
            if pending.encrypted_key_sha1 and pending.secret
            else {},
            replay=self.replay,
            optimizations=self.optimizations,
        )
        requirements = self.reply_requirements
        if self.context is not None and security is not None and sc.in_context(security, direct=True):
            requirements = self.in_context
            creds.contexts = self._context_resolver
        try:
            # The reply's attachments (its signature may cover them; MTOM content is read expanded, as signed).
            attachments.expand_xop(xop.includes(env.root), parts)
            verified = wssecurity.process(
                env, requirements, creds, datetime.now(UTC), attachments.from_parts(parts), security
            )
            if isinstance(self.replay, DeferredReplay):  # replies are rare enough to settle here, synchronously
                self.replay.settle(verified.replay_keys, verified.replay_since_ms)
        except faults.Fault as f:
            raise ReplyRefused(f"reply refused ({f.code or 'Client'}): {f.reason}") from None
        return env, verified

    def open(self, body: bytes, pending: Pending, parts: Sequence[mime.Part] = ()) -> Envelope:
        """Verify and decrypt a reply (see `verify`); a verified SOAP fault raises RequesterError too."""
        env = self.verify(body, pending, parts)[0]
        if env.is_fault():
            raise ReplyRefused(f"SOAP fault: {fault_text(env)}")
        return env


# The user's own assertion file: no DTD, no entities, no network.
_ASSERTION_PARSER = xmlsupport.parser()
_CONFIRMATION_METHODS = etree.XPath(
    "//*[local-name()='SubjectConfirmation']/@Method | //*[local-name()='ConfirmationMethod']/text()"
)


def saml_reference(assertion: etree._Element, str_id: str | None) -> etree._Element:
    """A wsse:SecurityTokenReference naming `assertion` by its ID (SAML Token Profile 1.1, 3.4.2)."""
    v2 = assertion.tag == saml.ASSERTION2
    ref = etree.Element(ns.q(ns.WSSE, "SecurityTokenReference"), nsmap={"wsse": ns.WSSE, "wsse11": ns.WSSE11})
    if str_id is not None:
        ref.set(ns.q(ns.WSU, "Id"), str_id)
    ref.set(ns.q(ns.WSSE11, "TokenType"), ns.SAML_V2_TOKEN if v2 else ns.SAML_V11_TOKEN)
    ki = etree.SubElement(ref, ns.q(ns.WSSE, "KeyIdentifier"))
    ki.set("ValueType", ns.SAML_ID if v2 else ns.SAML_ASSERTION_ID)
    ki.text = assertion.get("ID" if v2 else "AssertionID")
    return ref


def fault_text(env: Envelope) -> str:
    fault = env.body[0]
    code = fault.findtext("faultcode") or fault.findtext(f".//{{{ns.SOAP12}}}Value") or ""
    text = fault.findtext("faultstring") or fault.findtext(f".//{{{ns.SOAP12}}}Text") or ""
    return f"{code} {text}".strip()
