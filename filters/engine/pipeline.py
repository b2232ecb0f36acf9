"""What one route does to an exchange: the `xml` profile's pipeline, which the secured profiles extend
(filters/engine/profiles.py), and what an exchange carries from its request to its response."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from filters.engine import faults, metrics
from filters.engine.mime import related
from filters.engine.mime.package import Segments
from filters.engine.wss.replay import DeferredKey
from filters.engine.wss.wssecurity import Verified
from filters.engine.xml import charset, schema_validation, wsdl
from filters.engine.xml.soap import Envelope
from filters.engine.xml.threat_protection import parse_envelope
from gateway.policy import Route


@dataclass
class Exchange:
    """The engine's record of one exchange (an HTTP request with its response): what it carries from the request
    to the response side. The frame's side of the same exchange is its `Stream`; the worker keeps this in its
    `InFlight` between the two bodies (filters/worker.py)."""

    route: Route
    soap_version: str | None = None  # known once the request envelope parsed
    security: object | None = None  # the security context the response is secured for (hmac key, requester cert)
    # multipart/related messages (filters/engine/mime/related.py): the request's, the response's and its type
    request_mime: related.Message | None = None
    response_mime: related.Message | None = None
    response_type: str | None = None


@dataclass
class Outcome:
    body: bytes | Segments | None  # None: pass the body on unchanged; Segments: a package's pieces, in order
    set_headers: dict[str, str] = field(default_factory=dict)
    answer: bool = False  # the gateway answers this request itself with `body` (e.g. WS-Trust); no backend
    # Replay keys the caller must set before it answers (a deferred replay store): all new, or the key's fault.
    replay: list[DeferredKey] = field(default_factory=list)
    replay_since_ms: int = 0  # the message's freshness evidence, to compare with the store's epoch
    # What a secured request proved (signer, chain, user) and its wsa:MessageID: the archive's evidence.
    verified: Verified | None = None
    message_id: str | None = None


def forward(env: Envelope, received_type: str | None, body: bytes | None = None, **headers: str) -> Outcome:
    """Pass a message on: `body` (the gateway's UTF-8 serialization of `env`), or None for the bytes as they came.
    The Content-Type names the encoding of the bytes the next hop gets, whatever the sender's label said (a
    backend that trusted a stale label would read other characters than the gateway checked). Responses pass
    None for `received_type`: the SOAP version's media type."""
    encoding = env.encoding if body is None else "utf-8"
    content_type = charset.content_type(received_type, encoding, env.version)
    return Outcome(body=body, set_headers={**headers, "content-type": content_type})


class RoutePipeline:
    """The `xml` profile: threat protection both ways, bodies passed on untouched.

    Secured profiles extend the request and response stages."""

    def __init__(self, route: Route) -> None:
        self.route = route
        try:
            self.schema = schema_validation.for_route(route)
        except wsdl.DocumentError as exc:
            raise faults.server(f"route {route.name}: {exc}") from None

    def request(self, body: bytes | memoryview, headers: Mapping[str, str], ex: Exchange) -> Outcome:
        env = self.parse_request(body, headers, ex)
        self.validate(env, request=True)
        return self.send(env, ex, headers.get("content-type"), request=True)

    def response(self, body: bytes | memoryview, ex: Exchange) -> Outcome:
        env = self.parse_response(body, ex)
        self.validate(env, request=False)
        return self.send(env, ex, None, request=False)

    def parse_request(self, body: bytes | memoryview, headers: Mapping[str, str], ex: Exchange) -> Envelope:
        """The request's envelope: the body, or a multipart/related message's root part (its attachments kept in
        `ex` for `send`)."""
        attachments = self.route.attachments
        with metrics.stage(self.route, "parse"):
            msg = related.receive(headers.get("content-type"), body, attachments)
            # Not multipart, the body is bytes (filters/worker.py), which bytes() returns as it is: no copy.
            env = parse_envelope(bytes(body) if msg is None else msg.root_bytes, self.route.limits)
            if msg is not None:
                related.check(msg, env, attachments)
        ex.soap_version, ex.request_mime = env.version, msg
        return env

    def send(self, env: Envelope, ex: Exchange, received_type: str | None, request: bool, reserialized: bool = False,
             **headers: str) -> Outcome:  # fmt: skip
        """Pass the message on (`forward`), a multipart one with its attachments as the route says."""
        msg = ex.request_mime if request else ex.response_mime
        # The exchange keeps no body past its phase: the frame's budget counts one body at a time.
        ex.request_mime = ex.response_mime = None
        if msg is None:
            return forward(env, received_type, env.serialize() if reserialized else None, **headers)
        if request and reserialized and msg.recheck:
            related.resolve(msg, env)  # the root as the profile left it: decrypted content checked too
        if request and self.route.attachments.to_backend == "inline":
            related.inline(msg)
        body, content_type = related.forward(env, msg, reserialized)
        return Outcome(body=body, set_headers={**headers, "content-type": content_type})

    def validate(self, env: Envelope, request: bool) -> None:
        """The payload against the route's schema, where the policy asks (a backend's fault is not validated)."""
        sv = self.route.schema_validation
        if self.schema is None or not (sv.requests if request else sv.responses) or (not request and env.is_fault()):
            return
        with metrics.stage(self.route, "schema"):
            self.schema.check(related.without_includes(env).body, request)

    def parse_response(self, body: bytes | memoryview, ex: Exchange) -> Envelope:
        attachments = self.route.attachments
        try:
            with metrics.stage(self.route, "parse"):
                msg = related.receive(ex.response_type, body, attachments)
                env = parse_envelope(bytes(body) if msg is None else msg.root_bytes, self.route.response_limits)
                if msg is not None:
                    related.check(msg, env, attachments)
                    if attachments.to_client == "inline":
                        related.inline(msg)  # before the profile signs the reply
        except faults.Fault as fault:
            # A backend that answers something other than SOAP is the backend's fault, not the client's.
            raise faults.server(f"backend response refused: {fault.reason}", status=502) from None
        ex.response_mime = msg
        return env
