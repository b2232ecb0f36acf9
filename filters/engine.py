"""The filter runtime: one pipeline per route, built once from the validated policy.

The ext_proc layer hands bodies and a few headers in and gets bodies and headers out; everything XML and crypto
lives below this module, pure and synchronous, so the CLI client and the load test use the same code."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from filters import charset, faults, metrics
from filters.soap import Envelope, version_from_content_type
from filters.threat_protection import parse_envelope
from gateway.policy import PolicySet, Route


@dataclass
class Exchange:
    """What one HTTP exchange carries from the request to the response side."""

    route: Route
    soap_version: str | None = None  # known once the request envelope parsed
    security: object | None = None  # the security context the response is secured for (hmac key, requester cert)


@dataclass
class Outcome:
    body: bytes | None  # None: pass the body on unchanged
    set_headers: dict[str, str] = field(default_factory=dict)
    answer: bool = False  # the gateway answers this request itself with `body` (e.g. WS-Trust); no backend


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

    def request(self, body: bytes, headers: Mapping[str, str], ex: Exchange) -> Outcome:
        with metrics.stage(self.route, "parse"):
            env = parse_envelope(body, self.route.limits)
        ex.soap_version = env.version
        return forward(env, headers.get("content-type"))

    def response(self, body: bytes, ex: Exchange) -> Outcome:
        return forward(self.parse_response(body), None)

    def parse_response(self, body: bytes) -> Envelope:
        try:
            with metrics.stage(self.route, "parse"):
                return parse_envelope(body, self.route.response_limits)
        except faults.Fault as fault:
            # A backend that answers something other than SOAP is the backend's fault, not the client's.
            raise faults.server(f"backend response refused: {fault.reason}", status=502) from None


def build_pipeline(route: Route) -> RoutePipeline:
    if route.profile == "xml":
        return RoutePipeline(route)
    from filters.profiles import SecureConversationPipeline, SecuredPipeline  # profiles builds on this module

    if route.profile == "secureconversation":
        return SecureConversationPipeline(route)
    return SecuredPipeline(route)


class Engine:
    """All routes' pipelines; rebuilt as a whole when policies change (old exchanges keep the old one)."""

    def __init__(self, policies: PolicySet) -> None:
        self.pipelines = {r.name: build_pipeline(r) for r in policies.routes if r.touches_xml}

    def pipeline(self, route_name: str) -> RoutePipeline:
        try:
            return self.pipelines[route_name]
        except KeyError:
            raise faults.server(f"no XML policy for route {route_name!r}") from None


def fault_soap_version(ex: Exchange | None, headers: Mapping[str, str]) -> str:
    if ex is not None and ex.soap_version:
        return ex.soap_version
    return version_from_content_type(headers.get("content-type"))
