"""Outbound routes (`direction: outbound`, docs/outbound.md): an internal application's plain SOAP request is
secured for the partner as the route's profile says, and the partner's reply is handed back as plain SOAP only
once it verified (signature from the route's trust anchors, timestamp, replay, decryption). The requester's side
of the engine does both (filters/engine/requester.py); this is the pipeline the filter worker runs for it.

A reply that does not verify never reaches the application: it gets a SOAP fault saying the partner's reply
could not be verified (502), and the log gets the reason."""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from filters.engine import faults, metrics
from filters.engine.pipeline import Exchange, Outcome, RoutePipeline, forward
from filters.engine.profiles import Stores, trust_store
from filters.engine.requester import Pending, Requester, RequesterError, RequesterKeys, RequesterSettings
from filters.engine.wss import keys
from filters.engine.xml.threat_protection import parse_envelope
from gateway.policy import Route

PARTNER_REPLY_UNVERIFIED = "The partner's reply could not be verified"


def partner_refused(reason: str) -> faults.Fault:
    return faults.server(f"partner reply refused: {reason}", message=PARTNER_REPLY_UNVERIFIED, status=502)


def _credentials(path: str) -> tuple[str, str]:
    """The UsernameToken the route sends: a YAML file {username: ..., password: ...}."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
        return str(doc["username"]), str(doc["password"])
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        raise faults.server(f"outbound credentials file {path} unreadable: {type(exc).__name__}") from None


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
        )
        self.requester = Requester(route, settings, loaded)

    def request(self, body: bytes, headers: dict[str, str], ex: Exchange) -> Outcome:
        route = self.route
        with metrics.stage(route, "parse"):
            env = parse_envelope(body, route.limits)
        ex.soap_version = env.version
        self.validate(env, request=True)
        try:
            with metrics.stage(route, "secure"):
                secured, pending = self.requester.secure_envelope(env)
        except RequesterError as exc:
            raise faults.server(f"outbound request not secured: {exc}") from None
        ex.security = (pending, time.monotonic())
        return forward(env, headers.get("content-type"), secured)

    def response(self, body: bytes, ex: Exchange) -> Outcome:
        route = self.route
        assert isinstance(ex.security, tuple)
        pending, sent = ex.security
        assert isinstance(pending, Pending)
        metrics.series(metrics.PARTNER_SECONDS, route.name).observe(time.monotonic() - sent)
        try:
            with metrics.stage(route, "security_header"):
                env, _ = self.requester.verify(body, pending)
        except RequesterError as exc:
            metrics.series(metrics.PARTNER_REPLIES, route.name, "refused").inc()
            raise partner_refused(str(exc)) from None
        metrics.series(metrics.PARTNER_REPLIES, route.name, "verified").inc()
        self.validate(env, request=False)
        with metrics.stage(route, "serialize"):
            return forward(env, None, env.serialize())
