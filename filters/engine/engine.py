"""The filter runtime: one pipeline per route, built once from the validated policy.

The ext_proc frame hands bodies and a few headers in and gets bodies and headers out (filters/worker.py);
everything XML and crypto lives below this module, pure and synchronous, so the CLI client and the load test use
the same code."""

from __future__ import annotations

from collections.abc import Mapping

from filters.engine import faults, metrics
from filters.engine.outbound import OutboundPipeline
from filters.engine.pipeline import Exchange, Outcome, RoutePipeline
from filters.engine.profiles import SamlPipeline, SecureConversationPipeline, SecuredPipeline, Stores
from filters.engine.wss import inventory
from filters.engine.xml.soap import version_from_content_type
from gateway.policy import PolicySet, Route

__all__ = ["Engine", "Exchange", "Outcome", "RoutePipeline", "Stores", "build_pipeline", "fault_soap_version"]


def build_pipeline(route: Route, stores: Stores) -> RoutePipeline:
    """`stores`: what the secured profiles keep outside the engine (filters/stores/factory.py builds them; a
    deferred replay store is not called: the keys go out with the verdict, Outcome.replay)."""
    if route.is_outbound:
        return OutboundPipeline(route, stores)
    if route.profile == "xml":
        return RoutePipeline(route)
    if route.profile == "secureconversation":
        return SecureConversationPipeline(route, stores)
    if route.profile == "saml":
        return SamlPipeline(route, stores)
    return SecuredPipeline(route, stores)


class Engine:
    """All routes' pipelines; rebuilt as a whole when policies change (old exchanges keep the old one)."""

    def __init__(self, policies: PolicySet, stores: Stores) -> None:
        self.pipelines = {r.name: build_pipeline(r, stores) for r in policies.routes if r.touches_xml}
        # The keys are loaded (and cached) by now: the inventory reads no token that is up (one that is down is
        # tried at most once a second, token.RETRY_S).
        expiry = {
            (r.name, item.use): item.certificate.not_valid_after_utc.timestamp()
            for r in policies.routes
            if r.touches_xml
            for item in sorted(inventory.route_items(r), key=_latest_first)
            if item.certificate is not None
        }
        metrics.CERTIFICATE_NOT_AFTER.clear()
        for (route, use), seconds in expiry.items():
            metrics.CERTIFICATE_NOT_AFTER.labels(route=route, use=use).set(seconds)

    def pipeline(self, route_name: str) -> RoutePipeline:
        try:
            return self.pipelines[route_name]
        except KeyError:
            raise faults.server(f"no XML policy for route {route_name!r}") from None


def _latest_first(item: inventory.Item) -> float:
    # Per (route, use) the last one written wins: the soonest expiry.
    return -item.certificate.not_valid_after_utc.timestamp() if item.certificate else 0.0


def fault_soap_version(ex: Exchange | None, headers: Mapping[str, str]) -> str:
    if ex is not None and ex.soap_version:
        return ex.soap_version
    return version_from_content_type(headers.get("content-type"))
