"""Outbound `secureconversation` (docs/outbound.md): the gateway obtains a context from the partner's STS (a WS-Trust
Issue signed with its certificate), shares it among its workers through Redis, derives keys per message, issues a
new one before the old expires (one Issue per context lifetime, counted in wsgate_outbound_context_issues) and
cancels it when it stops. The partner is a second WSGate with an inbound secureconversation route on its HTTPS
listener (its own STS); with Apache WSS4J as the STS and the service: tests/interop/test_outbound_wss4j.py."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import redis
import requests

from filters.stores.partner_contexts import decode_context
from gateway.control.ports import free_ports
from gateway.policy import REDIS_URL_ENV
from gateway.tools.client import ClientError, http_post
from tests.support.harness import GatewayFactory, LiveGateway
from tests.support.partner import post
from tests.support.wss_helpers import echo, route_doc

GATEWAY_SUBJECT = "CN=WSGate Gateway Signing,O=WSGate Demo"
ENCRYPTED = {"require_request": True, "encrypt_response": True}
LIFETIME_S = 20
RENEW_BEFORE_S = 14  # a new context once the current one is 6 s old


@pytest.fixture(scope="module")
def partner(module_gateway: GatewayFactory, pki: Path) -> LiveGateway:
    sc = {"store": "memory", "lifetime_s": LIFETIME_S, "master_keys_file": str(pki / "sct-master-keys.yaml")}
    direct = {**sc, "derived_keys": False}  # takes the context's own key (no sp:RequireDerivedKeys), answers with it
    return module_gateway([
        route_doc(pki, "secureconversation", name="sc", secureconversation=sc, encryption=ENCRYPTED),
        route_doc(pki, "secureconversation", name="sc-direct", secureconversation=direct, encryption=ENCRYPTED),
    ])  # fmt: skip


def outbound_sc(pki: Path, partner: LiveGateway, listen: str, name: str = "sc", derived_keys: bool = True) -> dict:
    doc = route_doc(pki, "secureconversation", name=name, encryption=ENCRYPTED, replay={"store": "auto"},
                    secureconversation={"derived_keys": derived_keys})  # fmt: skip
    doc["direction"] = "outbound"
    doc["upstream"] = {"address": f"127.0.0.1:{partner.opts.https_port}", "tls": True, "ca": str(pki / "ca.pem")}
    doc["rsa"] = {**doc["rsa"], "allowed_subjects": [GATEWAY_SUBJECT]}
    doc["outbound"] = {"listen": listen, "partner_certificate": str(pki / "gateway-enc.pem"),
                       "renew_before_s": RENEW_BEFORE_S}  # fmt: skip
    return doc


def issues(gw: LiveGateway) -> float:
    text = "".join(requests.get(u, timeout=5).text for u in gw.metrics_urls())
    found = re.findall(r'^wsgate_outbound_context_issues_total\{route="sc"\} (\S+)$', text, re.M)
    return sum(float(v) for v in found)


def moved(gw: LiveGateway) -> dict[str, float]:
    """Calls the frame made again on an engine thread (about to wait on the STS), per phase that had any, all
    workers."""
    text = "".join(requests.get(u, timeout=5).text for u in gw.metrics_urls())
    found = re.findall(r'^wsgate_frame_phases_total\{outcome="moved",phase="(\w+)"\} (\S+)$', text, re.M)
    totals: dict[str, float] = {}
    for phase, value in found:
        totals[phase] = totals.get(phase, 0.0) + float(value)
    return {phase: n for phase, n in totals.items() if n}


def shared_context(gw: LiveGateway):  # type: ignore[no-untyped-def]
    data = redis.Redis.from_url(gw.env[REDIS_URL_ENV]).get("wsgate:outbound-sct:sc")
    assert data is not None
    return decode_context(data)


def test_outbound_context_issued_once_shared_by_workers_and_renewed_before_expiry(
    gateway: GatewayFactory, pki: Path, partner: LiveGateway
) -> None:
    listen = f"127.0.0.1:{free_ports(1)[0]}"
    gw = gateway([outbound_sc(pki, partner, listen)], workers=2, metrics=True)
    partner.clear()
    for i in range(8):
        version = "1.2" if i % 2 else "1.1"
        resp = post(listen, "/sc/echo", echo(f"call-{i}", version), version)
        assert resp.status_code == 200, resp.text
        assert f"call-{i}".encode() in resp.content and b"Security" not in resp.content
    got = partner.received()
    assert len(got) == 8  # the partner's backend: plain SOAP, the context's subject vouched for
    assert {r["headers"]["x-wsgate-subject"] for r in got} == {GATEWAY_SUBJECT}
    assert issues(gw) == 1  # two workers, eight calls: one Issue
    # Only the call that issued waited on the network, so only it left the gRPC thread (docs/frame-contract.md)
    assert moved(gw) == {"request_body": 1.0}
    first = shared_context(gw)
    time.sleep(LIFETIME_S - RENEW_BEFORE_S + 0.5)
    resp = post(listen, "/sc/echo", echo("after renewal"))
    assert resp.status_code == 200, resp.text
    assert issues(gw) == 2
    assert moved(gw) == {"request_body": 2.0}  # and the renewing call
    assert shared_context(gw).identifier != first.identifier


def test_outbound_context_cancelled_with_the_partner_when_the_gateway_stops(
    gateway: GatewayFactory, pki: Path, partner: LiveGateway
) -> None:
    listen = f"127.0.0.1:{free_ports(1)[0]}"
    gw = gateway([outbound_sc(pki, partner, listen)], metrics=True)
    assert post(listen, "/sc/echo", echo("before stop")).status_code == 200
    ctx = shared_context(gw)
    # What the gateway holds works with the partner until the gateway stops...
    client = partner.client("sc", key="gateway-sign.key", certificate="gateway-sign.pem")
    client.context = ctx
    secured, pending = client.secure(echo("with the shared context"))
    client.open(http_post(partner.url("sc", "echo"))(secured, pending.content_type), pending)
    gw.stop()
    # ...and is cancelled then: the partner no longer knows it.
    secured, pending = client.secure(echo("after stop"))
    with pytest.raises(ClientError, match=r"^SOAP fault: \S*BadContextToken"):
        client.open(http_post(partner.url("sc", "echo"))(secured, pending.content_type), pending)


@pytest.mark.parametrize("derived_keys", [False, True])
def test_outbound_context_key_used_directly_where_the_partner_does_not_require_derived_keys(
    gateway: GatewayFactory, pki: Path, partner: LiveGateway, derived_keys: bool
) -> None:
    """The partner's sc-direct route takes the context's own key and answers with it: the outbound route sends
    so (derived_keys false) or derives anyway, and verifies the reply either way. The partner's sc route, which
    requires derived keys, refuses the same requests: they are not derived."""
    listen = f"127.0.0.1:{free_ports(1)[0]}"
    routes = [outbound_sc(pki, partner, listen, "sc-direct", derived_keys), outbound_sc(pki, partner, listen)]
    routes[1]["secureconversation"] = {"derived_keys": derived_keys}
    gateway(routes)
    partner.clear()
    resp = post(listen, "/sc-direct/echo", echo("direct"))
    assert resp.status_code == 200, resp.text
    assert b"direct" in resp.content and b"Security" not in resp.content
    assert [r["headers"]["x-wsgate-subject"] for r in partner.received()] == [GATEWAY_SUBJECT]
    resp = post(listen, "/sc/echo", echo("to a route that derives"))
    assert resp.status_code == (200 if derived_keys else 502), resp.text  # 502: the partner refused (its fault)
