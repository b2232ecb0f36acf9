"""The secured profiles on the gateway side: `rsa` (X.509), `hmac` (pre-shared or symmetric-binding keys) and
`secureconversation` (contexts issued by the gateway itself, bootstrapped like `rsa`).

Everything a route needs is loaded once, when the policy is: keys, certificates, the trust store, users, the
replay store, the response signer. The hot path only parses, verifies, secures and serializes."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa
from lxml import etree

from filters.engine import faults, metrics, ns
from filters.engine.conversation import ws_trust
from filters.engine.conversation.contexts import ContextStore, PartnerContexts, store_resolver
from filters.engine.mime import related
from filters.engine.pipeline import Exchange, Outcome, RoutePipeline
from filters.engine.wss import attachments, encryption, keys, saml, saml_issuer, token, wssecurity
from filters.engine.wss import secure_conversation as sc
from filters.engine.wss import wssecurity_sending as sending
from filters.engine.wss.keys import RevocationCheck
from filters.engine.wss.optimizations import Optimizations
from filters.engine.wss.replay import DeferredReplay, ReplayCache, check_epoch, first_sight
from filters.engine.wss.signing import Signer
from filters.engine.wss.username_token import FailureThrottle, Users
from filters.engine.xml import header_blocks
from filters.engine.xml.soap import Envelope
from filters.engine.xml.threat_protection import check_structure
from gateway.policy import OPERATION_HEADER, HmacOptions, Route, RsaOptions

RESPONSE_TIMESTAMP_TTL_S = 300


class Stores(Protocol):
    """What a secured route keeps outside the engine, built for it by the caller (filters/stores/factory.py: the
    filter worker's Redis or memory stores, the client's memory ones). Called once per pipeline build."""

    def replay(self, route: Route) -> ReplayCache | DeferredReplay:
        """Where nonces and signature values are remembered."""
        ...

    def failure_throttle(self, route: Route) -> FailureThrottle:
        """Failed UsernameToken checks per user."""
        ...

    def contexts(self, route: Route) -> ContextStore:
        """Where the route's security contexts live (`secureconversation`)."""
        ...

    def revocation(self, route: Route, issuers: Sequence[x509.Certificate]) -> RevocationCheck:
        """The signer's revocation status (route.rsa.revocation, mode not "off")."""
        ...

    def partner_contexts(self, route: Route) -> PartnerContexts:
        """The context an outbound `secureconversation` route holds with its partner."""
        ...

    def partner_sts(self, route: Route) -> Post:
        """Posts to the partner's STS (outbound `secureconversation`): (body, content type) -> reply body."""
        ...


Post = Callable[[bytes, str], bytes]  # (body, content type) -> reply body

# What secures a message: the signature, the encryption, tokens to put first in the header.
ResponseSecurity = tuple[sending.SignWith | None, sending.EncryptFor | None, tuple[etree._Element, ...]]


T = TypeVar("T")


def with_parts(env: Envelope, msg: related.Message | None, work: Callable[[attachments.Attachments | None], T]) -> T:
    """`work` (the Security header's processing or making) over a multipart message's attachments (the SwA profile:
    filters/engine/wss/attachments.py), its XOP content expanded: signatures are over the infoset, as an MTOM sender
    makes them. Then the parts it decrypted or encrypted replace theirs, and the XOP form is restored where its
    content is still there (what was decrypted or encrypted away leaves the package)."""
    if msg is None:
        return work(None)
    expanded = attachments.expand_xop(msg.includes, msg.package.attachments)
    parts = attachments.from_parts(msg.package.attachments)
    result = work(parts)
    if any(p.changed for p in parts):
        msg.package = attachments.to_package(msg.package, parts)
    if expanded:
        msg.includes, gone = attachments.restore_xop(expanded, env.root)
        kept = tuple(p for p in msg.package.attachments if p.content_id not in gone)
        msg.package = msg.package.with_attachments(kept)
    return result


class SecuredPipeline(RoutePipeline):
    """Inbound: threat protection, then the Security header in the sender's order, then plain SOAP out.
    Outbound: the mirror image, the response signed (and encrypted) for the requester."""

    def __init__(self, route: Route, stores: Stores) -> None:
        super().__init__(route)
        self.requirements = wssecurity.Requirements(
            timestamp=route.timestamp,
            signature=route.signature,
            encryption=route.encryption,
            username_token=route.username_token,
            signer="symmetric" if route.profile == "hmac" else "x509",
            body_encrypted=route.encryption.require_request,
            limits=route.limits,
            anonymous=route.profile != "hmac" or route.hmac.allow_anonymous,
            attachments=route.attachment_security,
        )
        self.optimizations = Optimizations.for_route(route)
        self.credentials = wssecurity.Credentials(
            users=Users.load(route.username_token.users_file, throttle=stores.failure_throttle(route))
            if route.username_token.users_file
            else None,
            replay=stores.replay(route),
            optimizations=self.optimizations,
        )
        x509 = route.profile != "hmac"
        opts = route.rsa if x509 else route.hmac
        if keys.private_key_available(opts.decryption_key):
            self.credentials.decryption_key = keys.load_private_key(opts.decryption_key)
            self.credentials.decryption_keys = _rotating_keys(route, opts, self.credentials.decryption_key)
        elif x509 and route.encryption.require_request:
            raise faults.server(f"route {route.name}: decryption key {opts.decryption_key} missing")
        if x509:
            self.credentials.trust = trust_store(route, stores)
            self.credentials.known_certificates = keys.load_certificates(route.rsa.known_certificates)
            self.certificate = keys.load_certificate(route.rsa.certificate)
            self.signer = Signer(keys.load_private_key(route.rsa.key), _rsa_algorithm(route), _digest(route))
        elif route.hmac.keys_file:
            self.credentials.psk = keys.load_hmac_keys(route.hmac.keys_file)
        self.backend_issuer = saml_issuer.Issuer(route.backend_assertion) if route.backend_assertion else None

    def request(self, body: bytes | memoryview, headers: Mapping[str, str], ex: Exchange) -> Outcome:
        route = self.route
        env = self.parse_request(body, headers, ex)
        with metrics.stage(route, "security_header"):
            verified = self.process(env, ex, self.requirements, self.credentials, datetime.now(UTC))
        # Decrypted content is new XML: the envelope must still be one Envelope with one Body.
        check_structure(env.root)
        return self.deliver(env, verified, verified.subject, headers, ex)

    def process(
        self,
        env: Envelope,
        ex: Exchange,
        req: wssecurity.Requirements,
        creds: wssecurity.Credentials,
        now: datetime,
        security: etree._Element | None = None,
    ) -> wssecurity.Verified:
        """The Security header, with a multipart request's attachments (see `with_parts`). Where it decrypted
        nothing into the envelope and no part left with its header (`restore_xop`), the root only lost that header:
        its `cid:` references are those `related.check` read, and `send` does not read them again. `security`:
        the header, where the caller found it already (wssecurity.process)."""
        msg = ex.request_mime
        count = len(msg.package.attachments) if msg is not None else 0
        verified = with_parts(env, msg, lambda parts: wssecurity.process(env, req, creds, now, parts, security))
        if msg is not None:
            msg.recheck = verified.decrypted or len(msg.package.attachments) != count
        return verified

    def deliver(
        self,
        env: Envelope,
        verified: wssecurity.Verified,
        subject: str | None,
        headers: Mapping[str, str],
        ex: Exchange,
    ) -> Outcome:
        """The verified request as the backend gets it: unsigned header blocks handled as the route says, and
        who sent it in the identity header."""
        route = self.route
        self.validate(env, request=True)  # the Security header gone, the Body's wsu:Id stripped
        message_id = ws_trust.message_id(env)  # before unsigned addressing blocks may be stripped
        header_blocks.enforce(env, verified.covers, route.unsigned_headers, headers)
        ex.security = verified
        out_headers = {route.identity_header: subject} if route.identity_header and subject else {}
        if self.backend_issuer is not None and route.backend_assertion is not None:
            with metrics.stage(route, "assertion"):
                attributes = route.saml.attribute_headers if route.saml else {}
                out_headers |= saml_issuer.for_backend(
                    env, self.backend_issuer, route.backend_assertion, verified, datetime.now(UTC), attributes
                )
            if ex.request_mime is not None:
                ex.request_mime.recheck = True  # an assertion in the root is new XML, with the client's values
        if route.quotas.operations and (op := header_blocks.operation(env, verified.covers, headers)):
            out_headers[OPERATION_HEADER] = op  # read by Envoy's rate-limit filter, removed before the backend
        with metrics.stage(route, "serialize"):
            out = self.send(env, ex, headers.get("content-type"), request=True, reserialized=True, **out_headers)
        out.replay = verified.replay_keys
        out.replay_since_ms = verified.replay_since_ms
        out.verified, out.message_id = verified, message_id
        return out

    def response(self, body: bytes | memoryview, ex: Exchange) -> Outcome:
        route = self.route
        env = self.parse_response(body, ex)
        self.validate(env, request=False)
        if env.is_fault() and not route.secure_faults:
            return self.send(env, ex, None, request=False)
        assert isinstance(ex.security, wssecurity.Verified)
        sign, encrypt, tokens = self.response_security(ex.security)
        with metrics.stage(route, "secure"):
            now = datetime.now(UTC)
            with_parts(env, ex.response_mime, lambda parts: self.secure(env, now, sign, encrypt, tokens, parts))
        with metrics.stage(route, "serialize"):
            return self.send(env, ex, None, request=False, reserialized=True)

    def secure(
        self,
        env: Envelope,
        now: datetime,
        sign: sending.SignWith | None,
        encrypt: sending.EncryptFor | None,
        tokens: tuple[etree._Element, ...],
        parts: attachments.Attachments | None = None,
    ) -> None:
        """Secure a reply; its Signature encrypted with its Body where the policy says (encrypt_signature); its
        attachments (`parts`) signed and encrypted where attachment_security says."""
        encrypt_signature = self.route.encryption.encrypt_signature and sign is not None and encrypt is not None
        # The reply's WS-Addressing headers signed where the published policy's SignedParts name them (the route
        # signs addressing; a SecureConversation bootstrap always does): Metro refuses a reply without them.
        route = self.route
        signed_parts: tuple[str, ...] = ("body", "timestamp")
        if "addressing" in route.signature.parts or route.profile == "secureconversation":
            signed_parts += ("addressing",)
        swa = route.attachment_security
        sending.secure(env, now, timestamp_ttl_s=RESPONSE_TIMESTAMP_TTL_S, sign=sign, sign_parts=signed_parts,
                       encrypt=encrypt, tokens=tokens, encrypt_signature=encrypt_signature, parts=parts,
                       sign_parts_attached=swa.sign_response, encrypt_parts=swa.encrypt_response)  # fmt: skip

    def response_security(self, verified: wssecurity.Verified) -> ResponseSecurity:
        """How to secure the response to a request that established `verified`."""
        route = self.route
        algorithm = route.encryption.response_algorithm
        if route.profile != "hmac":
            sign = None
            if route.rsa.sign_response:
                bst_id = sending.new_id("X509")
                sign = sending.SignWith(
                    signer=self.signer,
                    key_info=lambda: keys.str_reference(bst_id, ns.X509V3),
                    certificate=self.certificate,
                    optimizations=self.optimizations,
                )
            encrypt = None
            if route.encryption.encrypt_response:
                if verified.signer_certificate is None:
                    raise faults.server("no requester certificate to encrypt the response for")
                encrypt = sending.EncryptFor(algorithm=algorithm, certificate=verified.signer_certificate)
            return sign, encrypt, ()
        secret, ref = verified.symmetric_key, verified.key_reference
        if secret is None or ref is None:
            raise faults.server("no request key to secure the response with")
        key_info = _key_info_for(ref)
        sign = None
        if route.hmac.sign_response:
            algorithm_used = _hmac_algorithm(route, verified.signature_algorithm)
            sign = sending.SignWith(signer=Signer(secret, algorithm_used, _digest(route)),
                                       key_info=key_info, optimizations=self.optimizations)  # fmt: skip
        encrypt = None
        if route.encryption.encrypt_response:
            encrypt = sending.EncryptFor(
                algorithm=_sized(algorithm, len(secret)), secret=secret, secret_key_info=key_info
            )
        return sign, encrypt, ()


class SecureConversationPipeline(SecuredPipeline):
    """`secureconversation`: the gateway issues and cancels security contexts itself (WS-Trust RST, never seen by
    the backend); ordinary messages must be signed with keys derived from a live context.

    The Issue request is checked like an `rsa` request (X.509 signature from a trusted client). Contexts live
    where the route says: sealed into the token (no gateway memory), in memory (bounded), or in Redis."""

    def __init__(self, route: Route, stores: Stores) -> None:
        super().__init__(route, stores)
        self.store = stores.contexts(route)
        self.direct = not route.secureconversation.derived_keys
        self.in_context = replace(self.requirements, signer="context", context_key_direct=self.direct)
        self.context_credentials = replace(
            self.credentials, contexts=lambda now, local: store_resolver(self.store, now, local)
        )
        sts = route.saml_token_service
        self.saml_issuer = saml_issuer.Issuer(sts) if sts else None

    def request(self, body: bytes | memoryview, headers: Mapping[str, str], ex: Exchange) -> Outcome:
        route = self.route
        env = self.parse_request(body, headers, ex)
        security = wssecurity.find_security(env)
        in_context = security is not None and sc.in_context(security, direct=self.direct)
        now = datetime.now(UTC)
        with metrics.stage(route, "security_header"):
            if in_context:
                verified = self.process(env, ex, self.in_context, self.context_credentials, now, security)
            else:
                verified = self.process(env, ex, self.requirements, self.credentials, now, security)
        check_structure(env.root)
        rst = ws_trust.find_rst(env)
        if rst is not None:
            # Issue and Cancel change the context store: their replay keys are settled first, here (rare messages).
            if isinstance(self.credentials.replay, DeferredReplay):
                self.credentials.replay.settle(verified.replay_keys, verified.replay_since_ms)
            with metrics.stage(route, "secure_conversation"):
                return self._answer(ws_trust.parse_rst(rst), env, verified, headers, now)
        if verified.context is None:
            raise faults.security("InvalidSecurity", "secureconversation route: message outside a security context")
        return self.deliver(env, verified, verified.context.subject, headers, ex)

    def _answer(
        self, rst: ws_trust.Rst, env: Envelope, verified: wssecurity.Verified, headers: Mapping[str, str], now: datetime
    ) -> Outcome:
        route = self.route
        relates_to = ws_trust.message_id(env)
        if rst.request_type == "issue":
            if verified.context is not None or verified.signer_certificate is None or verified.subject is None:
                raise faults.security("InvalidSecurity", "an Issue request must be signed with an X.509 certificate")
            if rst.saml is not None:
                return self._answer_saml(rst, env, verified, headers, now)
            # Client entropy is only secret if nobody could read it on the way: encrypted Body or TLS (Envoy writes
            # x-forwarded-proto itself: the client's is dropped before routing, gateway/control/envoy_config.py).
            confidential = verified.decrypted_body or headers.get("x-forwarded-proto") == "https"
            answer = ws_trust.answer_issue(
                rst, self.store, verified.signer_certificate, verified.subject, now, entropy_confidential=confidential
            )
            reply = ws_trust.envelope(
                env.version, answer.response, action=rst.version.issue_reply_action, relates_to=relates_to
            )
            sign, encrypt, tokens = self.response_security(verified)
            if encrypt is None and (answer.key_in_body or verified.decrypted_body):
                # The key travels in this Body (or the client protected its own entropy: so is the issuer's).
                algorithm = route.encryption.response_algorithm
                encrypt = sending.EncryptFor(algorithm=algorithm, certificate=verified.signer_certificate)
        else:
            if verified.context is None:
                raise faults.security("InvalidSecurity", "a Cancel request must be signed with the context's keys")
            rstr = ws_trust.answer_cancel(rst, self.store, verified.context, now)
            reply = ws_trust.envelope(env.version, rstr, action=rst.version.cancel_reply_action, relates_to=relates_to)
            sign, encrypt, tokens = self.response_security(verified)
        with metrics.stage(route, "secure"):
            self.secure(reply, now, sign, encrypt, tokens)
        return Outcome(body=reply.serialize(), answer=True)

    def _answer_saml(
        self, rst: ws_trust.Rst, env: Envelope, verified: wssecurity.Verified, headers: Mapping[str, str], now: datetime
    ) -> Outcome:
        """Issue a SAML 2.0 assertion (route.saml_token_service) to the X.509 signer of the request."""
        route, policy = self.route, self.route.saml_token_service
        if self.saml_issuer is None or policy is None:
            raise sc.wst_fault(rst.version, "InvalidRequest", "RST: SAML 2.0 assertions are not issued on this route")
        assert verified.signer_certificate is not None and verified.subject is not None
        rstr, bearer = ws_trust.answer_saml_issue(
            rst, self.saml_issuer, policy, verified.signer_certificate, verified.subject, now
        )
        reply = ws_trust.envelope(env.version, rstr, action=ws_trust.SAML_ISSUE_REPLY_ACTION,
                                  relates_to=ws_trust.message_id(env))  # fmt: skip
        sign, encrypt, tokens = self.response_security(verified)
        if encrypt is None and bearer and headers.get("x-forwarded-proto") != "https":
            # Whoever reads a bearer assertion can use it: outside TLS it travels encrypted to the requester.
            algorithm = route.encryption.response_algorithm
            encrypt = sending.EncryptFor(algorithm=algorithm, certificate=verified.signer_certificate)
        with metrics.stage(route, "secure"):
            self.secure(reply, now, sign, encrypt, tokens)
        return Outcome(body=reply.serialize(), answer=True)

    def response_security(self, verified: wssecurity.Verified) -> ResponseSecurity:
        if verified.context is None:  # the reply to an Issue request: as on an `rsa` route
            return super().response_security(verified)
        return context_security(
            verified.context, self.route, encrypt=self.route.encryption.encrypt_response,
            optimizations=self.optimizations, algorithm=verified.signature_algorithm, derived=not self.direct,
        )  # fmt: skip


class SamlPipeline(SecuredPipeline):
    """`saml`: the caller is who a trusted issuer's assertion says (filters/engine/wss/saml.py, docs/saml.md). The
    message's X.509 signature is verified as on an `rsa` route, but its signer is allowed by the assertion's
    subject confirmation (holder-of-key, sender-vouches), not by the route's trust anchors; those vouch only for
    a party that signs a bearer assertion's message. A holder-of-key assertion may confirm a symmetric key
    instead (an EncryptedKey to the route's decryption key): the message is then HMAC-signed with it. Bearer
    assertions and OneTimeUse ones are used once."""

    def __init__(self, route: Route, stores: Stores) -> None:
        super().__init__(route, stores)
        policy = route.saml
        assert policy is not None  # the policy's _saml_options
        if "bearer" in policy.confirmation:  # over TLS a bearer message needs no signature; one sent is checked
            self.requirements = replace(self.requirements, signer=None)

        def issuer_trust(anchors: list[str], intermediates: list[str]) -> keys.TrustStore:
            found = keys.load_certificates(anchors)
            between = keys.load_certificates(intermediates)
            checker = stores.revocation(route, [*found, *between]) if route.rsa.revocation.mode != "off" else None
            return keys.TrustStore(found, None, intermediates=between, revocation=checker)

        self.validator = saml.validator(policy, issuer_trust)
        self.credentials.saml = self.validator

    def request(self, body: bytes | memoryview, headers: Mapping[str, str], ex: Exchange) -> Outcome:
        route = self.route
        env = self.parse_request(body, headers, ex)
        security = wssecurity.find_security(env)
        now = datetime.now(UTC)
        with metrics.stage(route, "security_header"):
            verified = wssecurity.process(env, self.requirements, self.credentials, now, security=security)
            assertion = verified.assertion
            if assertion is None or security is None:
                raise faults.security("InvalidSecurity", "saml route: no SAML assertion")
            # x-forwarded-proto is Envoy's own (the client's is dropped: gateway/control/envoy_config.py).
            tls = headers.get("x-forwarded-proto") == "https"
            method = self.validator.confirm(assertion, verified.signer_certificate, verified.signed, security, tls,
                                            lambda cert: self._trusted(cert, now), verified.proof_key)  # fmt: skip
            if route.encryption.encrypt_response and verified.signer_certificate is None:
                # refused before the backend acts: the reply is encrypted to an X.509 signer (a symmetric holder-of-key
                # or an unsigned bearer message has none)
                raise faults.security("InvalidSecurity", "saml route encrypts replies: no X.509 signer to encrypt to")
            if method == "bearer" or assertion.one_time_use:
                self._use_once(assertion, verified, now)
        check_structure(env.root)
        out = self.deliver(env, verified, assertion.subject, headers, ex)
        out.set_headers.update(assertion.headers)
        return out

    def _trusted(self, cert: x509.Certificate, now: datetime) -> bool:
        trust = self.credentials.trust
        try:
            return trust is not None and bool(trust.validate(cert, [], now))
        except faults.Fault:
            return False

    def _use_once(self, a: saml.Assertion, verified: wssecurity.Verified, now: datetime) -> None:
        """Remember the assertion for as long as it is valid: a copy in any other message is a replay."""
        skew = self.route.saml.clock_skew_s if self.route.saml else 0
        ttl = max((a.not_on_or_after - now).total_seconds() + skew, 1.0)
        replayed = faults.security("FailedAuthentication", "replay: SAML assertion used before")
        store = self.credentials.replay
        first_sight(store, saml.replay_key(a), ttl, replayed, verified.replay_keys)
        if verified.replay_since_ms == 0:  # no signed Timestamp: the issuer's IssueInstant is the evidence
            verified.replay_since_ms = int(a.issue_instant.timestamp() * 1000)
            if store is not None and not isinstance(store, DeferredReplay):
                check_epoch(verified.replay_since_ms, store.epoch_ms())


def context_security(
    ctx: sc.Context,
    route: Route,
    *,
    encrypt: bool,
    optimizations: Optimizations | None = None,
    algorithm: str | None = None,
    derived: bool = True,
) -> ResponseSecurity:
    """Sign (and encrypt) with fresh keys derived from `ctx`, one each; both sides of a context use this.
    `algorithm`: the request's signature algorithm, answered in where the route allows it. `derived` False: with
    the context's own key, named by its Identifier (WS-SecurityPolicy without sp:RequireDerivedKeys)."""
    if not derived:
        sct = functools.partial(sc.sct_reference, ctx.version, identifier=ctx.identifier)
        sign = sending.SignWith(
            signer=Signer(ctx.secret, _hmac_algorithm(route, algorithm), _digest(route)),
            key_info=sct,
            optimizations=optimizations,
        )
        if not encrypt:
            return sign, None, ()
        algorithm = _sized(route.encryption.response_algorithm, len(ctx.secret))
        return sign, sending.EncryptFor(algorithm=algorithm, secret=ctx.secret, secret_key_info=sct), ()
    dk = ctx.version.dk_token_type
    signing = sc.context_key(ctx)
    sign = sending.SignWith(
        signer=Signer(signing.key, _hmac_algorithm(route, algorithm), _digest(route)),
        key_info=lambda: keys.str_reference(signing.id, dk),
        optimizations=optimizations,
    )
    if not encrypt:  # no key derived that nothing uses
        return sign, None, (signing.element,)
    encrypting = sc.context_key(ctx)
    algorithm = _sized(route.encryption.response_algorithm, len(encrypting.key))
    enc = sending.EncryptFor(
        algorithm=algorithm, secret=encrypting.key, secret_key_info=lambda: keys.str_reference(encrypting.id, dk)
    )
    return sign, enc, (signing.element, encrypting.element)


def _rotating_keys(
    route: Route, opts: RsaOptions | HmacOptions, current: rsa.RSAPrivateKey
) -> list[tuple[x509.Certificate, rsa.RSAPrivateKey]]:
    """The current decryption key and the previous ones, each with the certificate that must name it; empty
    without previous keys (the one key opens every EncryptedKey, as before rotation)."""
    if not opts.previous_decryption_keys:
        return []
    cert_path = opts.decryption_certificate
    if cert_path is None:
        if token.is_uri(opts.decryption_key):
            raise faults.server(
                f"route {route.name}: a token decryption key with previous keys needs decryption_certificate"
            )
        cert_path = str(Path(opts.decryption_key).with_suffix(".pem"))
    pairs = [(cert_path, current)]
    pairs += [(p.certificate, keys.load_private_key(p.key)) for p in opts.previous_decryption_keys]
    out = []
    for path, key in pairs:
        cert = keys.load_certificate(path)
        mismatch = f"route {route.name}: certificate {path} is not the decryption key's"
        public = cert.public_key()
        assert isinstance(public, rsa.RSAPublicKey)
        if isinstance(key, token.TokenKey):
            key.expect(public, mismatch)  # now, or when its token is back (it may be down as the worker starts)
        elif public.public_numbers() != key.public_key().public_numbers():
            raise faults.server(mismatch)
        out.append((cert, key))
    return out


def trust_store(route: Route, stores: Stores) -> keys.TrustStore:
    """The X.509 signer's trust (`rsa`, and the `secureconversation` bootstrap): anchors, intermediates,
    allow-list, revocation."""
    opts = route.rsa
    anchors = keys.load_certificates(opts.trust_anchors)
    intermediates = keys.load_certificates(opts.intermediates)
    checker = None
    if opts.revocation.mode != "off":
        checker = stores.revocation(route, [*anchors, *intermediates])
    return keys.TrustStore(anchors, opts.allowed_subjects, intermediates=intermediates, revocation=checker)


def _key_info_for(ref: keys.KeyRef) -> Callable[[], etree._Element]:
    if ref.kind == "key_name":
        return lambda: keys.str_pre_shared_key(ref.value)
    if ref.kind == "encrypted_key_sha1":
        return lambda: keys.str_key_identifier(ns.ENCKEY_SHA1, ref.value)
    raise faults.server(f"cannot name a {ref.kind} key back to the requester")


def _sized(algorithm: str, key_size: int) -> str:
    """The response algorithm's mode at the size of the request's key (Basic128 clients send 16 bytes)."""
    mode = algorithm.split("-", 1)[1]
    sized = f"aes{key_size * 8}-{mode}"
    if sized not in encryption.DATA_ALGORITHMS:
        raise faults.server(f"no {mode} algorithm for a {key_size}-byte request key")
    return sized


def _rsa_algorithm(route: Route) -> str:
    return next((a for a in route.signature.algorithms if a.startswith("rsa")), "rsa-sha256")


def _hmac_algorithm(route: Route, used: str | None = None) -> str:
    """The request's HMAC algorithm where the route allows it (a client that signed HMAC-SHA1, as Metro and every
    SP suite do, may verify nothing else), else the route's first."""
    allowed = [a for a in route.signature.algorithms if a.startswith("hmac")]
    if used in allowed:
        return used
    return allowed[0] if allowed else "hmac-sha256"


def _digest(route: Route) -> str:
    return route.signature.digests[0]
