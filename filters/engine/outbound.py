"""Outbound routes (`direction: outbound`, docs/outbound.md): an internal application's plain SOAP request is
secured for the partner as the route's profile says, and the partner's reply is handed back as plain SOAP only
once it verified (signature from the route's trust anchors, timestamp, replay, decryption). The requester's side
of the engine does both (filters/engine/requester.py); this is the pipeline the filter worker runs for it.

On a `secureconversation` route the context comes from the partner's STS (WS-Trust Issue signed with the
gateway's certificate) and is shared by every worker (PartnerContexts): one Issue per context lifetime, a new one
before it expires, derived keys per message, the context cancelled when the gateway stops
(gateway/control/supervisor.py).

A reply that does not verify never reaches the application: it gets a SOAP fault saying the partner's reply
could not be verified (502), and the log gets the reason."""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

import yaml
from cryptography import x509

from filters.engine import faults, metrics, turn
from filters.engine.pipeline import Exchange, Outcome, RoutePipeline, forward
from filters.engine.profiles import Stores, trust_store
from filters.engine.requester import Pending, ReplyRefused, Requester, RequesterError, RequesterKeys, RequesterSettings
from filters.engine.wss import keys, token
from filters.engine.wss import secure_conversation as sc
from filters.engine.wss.optimizations import Optimizations
from filters.engine.xml.threat_protection import parse_envelope
from gateway.policy import Route

PARTNER_REPLY_UNVERIFIED = "The partner's reply could not be verified"
# secureconversation: how long one worker may take to issue the shared context, and another waits for it; both
# within Envoy's time for a filter's answer (gateway/control/envoy_config.py Topology.filter_timeout_ms).
ISSUE_LOCK_S = 2.5
ISSUE_WAIT_S = 2.0


def partner_refused(reason: str) -> faults.Fault:
    return faults.server(f"partner reply refused: {reason}", message=PARTNER_REPLY_UNVERIFIED, status=502)


def _credentials(path: str) -> tuple[str, str]:
    """The UsernameToken the route sends: a YAML file {username: ..., password: ...}."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
        return str(doc["username"]), str(doc["password"])
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        raise faults.server(f"outbound credentials file {path} unreadable: {type(exc).__name__}") from None


def _decryption_certificate(path: str | None, key: str) -> x509.Certificate | None:
    """The decryption key's certificate: as named, else the .pem beside a key file (None when there is none)."""
    if path is None and not token.is_uri(key):
        beside = Path(key).with_suffix(".pem")
        path = str(beside) if beside.exists() else None
    return keys.load_certificate(path) if path else None


class OutboundPipeline(RoutePipeline):
    """Request: threat protection, then secured for the partner. Response: verified and decrypted, then plain."""

    def __init__(self, route: Route, stores: Stores) -> None:
        super().__init__(route)
        out = route.outbound
        assert out is not None
        user = password = None
        if out.credentials_file:
            user, password = _credentials(out.credentials_file)
        settings = RequesterSettings(
            key_name=out.key_name, user=user, password=password, password_digest=out.password_type == "digest"
        )
        x509_signer = route.profile != "hmac"
        opts = route.rsa if x509_signer else route.hmac
        loaded = RequesterKeys(
            private_key=keys.load_private_key(route.rsa.key),
            certificate=keys.load_certificate(route.rsa.certificate),
            recipient=keys.load_certificate(out.partner_certificate) if out.partner_certificate else None,
            trust=trust_store(route, stores),
            psk=keys.load_hmac_keys(route.hmac.keys_file) if out.key_name and route.hmac.keys_file else {},
            replay=stores.replay(route),
            decryption_key=keys.load_private_key(opts.decryption_key)
            if keys.private_key_available(opts.decryption_key)
            else None,
            decryption_certificate=_decryption_certificate(opts.decryption_certificate, opts.decryption_key),
        )
        self.requester = Requester(route, settings, loaded, Optimizations.for_route(route))
        if route.profile == "secureconversation":
            self.contexts = stores.partner_contexts(route)
            self.sts = stores.partner_sts(route)

    def context(self, version: str) -> sc.Context:
        """The route's context with the partner: the shared one while it has more than renew_before_s to live;
        else a new one from the partner's STS, issued by one worker (the others use the current one meanwhile,
        or wait for the new one)."""
        out = self.route.outbound
        assert out is not None
        now = datetime.now(UTC)
        ctx = self.contexts.get()
        if ctx is not None and (ctx.expires - now).total_seconds() > out.renew_before_s:
            return ctx
        live = ctx if ctx is not None and ctx.expires > now else None
        if self.contexts.lock(ISSUE_LOCK_S):
            try:
                with metrics.stage(self.route, "issue"):
                    new = self.requester.establish(self.sts, version)
                self.contexts.put(new)  # before the lock goes: the next lock holder finds it and issues none
            except (RequesterError, faults.Fault, OSError) as exc:
                if live is not None:  # renewal failed: the current one still serves, the next call tries again
                    return live
                if isinstance(exc, ReplyRefused):  # the STS answered, and its answer did not verify: the partner's
                    metrics.series(metrics.PARTNER_REPLIES, self.route.name, "refused").inc()
                    raise partner_refused(f"partner STS answer: {exc}") from None
                raise faults.server(f"partner context not issued: {exc}") from None
            finally:
                self.contexts.unlock()
            metrics.series(metrics.PARTNER_CONTEXT_ISSUES, self.route.name).inc()
            return new
        if live is not None:
            return live
        deadline = time.monotonic() + ISSUE_WAIT_S
        while time.monotonic() < deadline:
            with turn.released():  # the Issue may be this worker's, waiting on the STS without the turn
                time.sleep(0.02)
            ctx = self.contexts.get()
            if ctx is not None and ctx.expires > datetime.now(UTC):
                return ctx
        raise faults.server("partner context not issued: another worker's Issue did not finish in time")

    def cancel_context(self) -> bool:
        """Cancel the shared context with the partner (on shutdown): True if there was one to cancel."""
        ctx = self.contexts.take()
        if ctx is None or ctx.expires <= datetime.now(UTC):
            return False
        self.requester.context = ctx
        self.requester.cancel(self.sts)
        return True

    def request(self, body: bytes | memoryview, headers: Mapping[str, str], ex: Exchange) -> Outcome:
        route = self.route
        with metrics.stage(route, "parse"):
            # A memoryview is a multipart body on a route that takes attachments (filters/worker.py): read as the
            # bytes it is, not SOAP, refused as any other, as where the route takes none.
            env = parse_envelope(bytes(body), route.limits)
        ex.soap_version = env.version
        self.validate(env, request=True)
        ctx = self.context(env.version) if route.profile == "secureconversation" else None
        self.requester.context = ctx
        try:
            with metrics.stage(route, "secure"):
                secured, pending = self.requester.secure_envelope(env)
        except RequesterError as exc:
            raise faults.server(f"outbound request not secured: {exc}") from None
        ex.security = (pending, ctx, time.monotonic())
        return forward(env, headers.get("content-type"), secured)

    def response(self, body: bytes | memoryview, ex: Exchange) -> Outcome:
        route = self.route
        assert isinstance(ex.security, tuple)
        pending, ctx, sent = ex.security
        assert isinstance(pending, Pending)
        self.requester.context = ctx  # the one the request used (another exchange may have renewed it since)
        metrics.series(metrics.PARTNER_SECONDS, route.name).observe(time.monotonic() - sent)
        try:
            with metrics.stage(route, "security_header"):
                env, _ = self.requester.verify(bytes(body), pending)  # a multipart reply: not SOAP (request)
        except RequesterError as exc:
            metrics.series(metrics.PARTNER_REPLIES, route.name, "refused").inc()
            raise partner_refused(str(exc)) from None
        metrics.series(metrics.PARTNER_REPLIES, route.name, "verified").inc()
        self.validate(env, request=False)
        with metrics.stage(route, "serialize"):
            return forward(env, None, env.serialize())
