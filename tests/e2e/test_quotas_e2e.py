"""Quotas through the running gateway, on the real Envoy rate-limit service and Redis (docs/quotas.md): a
caller's quota counts only verified requests, a client-address limit shapes a flood before any XML work,
per-operation limits, the 429 SOAP fault with Retry-After, and one limit shared by two gateway instances."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
import requests
from lxml import etree

from gateway.policy import REDIS_URL_ENV
from tests.support.harness import GatewayFactory, LiveGateway, envelope
from tests.support.wss_helpers import echo, route_doc

SOAP11 = "http://schemas.xmlsoap.org/soap/envelope/"
SOAP12 = "http://www.w3.org/2003/05/soap-envelope"


def quota_route(pki: Path, name: str, **quotas: object) -> dict:
    return route_doc(pki, "rsa", name=name, replay={"store": "auto"}, quotas=quotas)


def assert_quota_fault(resp: requests.Response, version: str = "1.1") -> None:
    assert resp.status_code == 429
    assert int(resp.headers["retry-after"]) >= 0
    assert not any(h.lower().startswith("x-envoy-") for h in resp.headers)
    root = etree.fromstring(resp.content)
    assert root.tag == f"{{{SOAP12 if version == '1.2' else SOAP11}}}Envelope"
    assert b"Too many requests" in resp.content


def envoy_stats(g: LiveGateway) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{g.opts.admin_port}/stats", timeout=5) as r:
        return r.read().decode()


def test_forged_and_replayed_messages_do_not_burn_a_callers_quota(gateway: GatewayFactory, pki: Path) -> None:
    with gateway([quota_route(pki, "rsa", caller={"per_day": 3})], workers=2) as g:
        alice = g.client("rsa")
        bob = g.client("rsa", key="client2.key", certificate="client2.pem")
        genuine, _ = alice.secure(echo("pay 10"))
        assert g.post("rsa", genuine).status_code == 200  # 1 of alice's 3
        alice_subject = g.received()[-1]["headers"]["x-wsgate-subject"]
        forged = genuine.replace(b"pay 10", b"pay 99")  # alice's signature, another body: refused by the worker
        for _ in range(6):
            assert g.post("rsa", forged).status_code == 500
            assert g.post("rsa", genuine).status_code == 500  # a replay of her message
        # Claiming to be alice in the header the quota reads: stripped on arrival, the request counts for bob.
        spoof = {"x-wsgate-subject": alice_subject}
        for _ in range(3):
            assert g.post("rsa", bob.secure(echo("bob"))[0], headers=spoof).status_code == 200
        assert g.post("rsa", alice.secure(echo("pay 20"))[0]).status_code == 200
        assert g.post("rsa", alice.secure(echo("pay 30"))[0]).status_code == 200
        over = g.post("rsa", alice.secure(echo("pay 40"))[0])
        assert_quota_fault(over)
        assert int(over.headers["retry-after"]) > 1  # the day's window, not the next second
        assert_quota_fault(g.post("rsa", bob.secure(echo("bob again"))[0]))  # his 3 are spent too
        assert [r["body"].count("pay") for r in g.received()].count(1) == 3  # alice's three, nothing more
        stats = envoy_stats(g)  # counted by route and stage: the 12 refused messages were never asked about
        assert "cluster.upstream_rsa.ratelimit.quota_caller.ok: 6\n" in stats
        assert "cluster.upstream_rsa.ratelimit.quota_caller.over_limit: 2\n" in stats


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_a_flood_from_one_address_is_shaped_before_any_xml_work(
    gateway: GatewayFactory, pki: Path, version: str
) -> None:
    with gateway([quota_route(pki, "rsa", client_address={"per_day": 2})], metrics=True) as g:
        garbage = envelope("<unsigned/>", version)
        # Within the limit the worker answers (an unsigned message: its 500 fault); beyond it Envoy refuses
        # before the worker is asked: 429 instead of the worker's fault.
        assert [g.post("rsa", garbage, version).status_code for _ in range(2)] == [500, 500]
        for _ in range(5):
            assert_quota_fault(g.post("rsa", garbage, version), version)
        assert "cluster.upstream_rsa.ratelimit.quota_address.over_limit: 5\n" in envoy_stats(g)
        metrics = requests.get(g.metrics_urls()[0], timeout=5).text
        parsed = re.search(r'wsgate_requests_total\{[^}]*phase="request"[^}]*\} (\S+)', metrics)
        assert parsed and float(parsed.group(1)) == 2  # the worker parsed the first two only


def test_a_per_second_limit_refuses_a_burst(gateway: GatewayFactory, pki: Path) -> None:
    with gateway([quota_route(pki, "rsa", client_address={"per_second": 1})]) as g:
        garbage = envelope("<unsigned/>")
        codes = [g.post("rsa", garbage).status_code for _ in range(8)]
        assert set(codes) == {500, 429} and codes.count(429) >= 4  # 8 requests span at most a few seconds


def test_an_operation_limit_counts_each_operation_apart(gateway: GatewayFactory, pki: Path) -> None:
    route = quota_route(pki, "rsa", operations={"urn:demo:pay": {"per_day": 2}})
    with gateway([route]) as g:
        alice = g.client("rsa")

        def call(action: str) -> int:
            return g.post("rsa", alice.secure(echo(action))[0], headers={"soapaction": f'"{action}"'}).status_code

        assert [call("urn:demo:pay") for _ in range(2)] == [200, 200]
        assert call("urn:demo:pay") == 429
        assert [call("urn:demo:balance") for _ in range(3)] == [200, 200, 200]  # not limited
        assert all("x-wsgate-operation" not in r["headers"] for r in g.received())  # for Envoy only


def test_two_gateway_instances_share_one_callers_quota(
    gateway: GatewayFactory, pki: Path, redis_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(REDIS_URL_ENV, redis_server)  # both count in the same Redis
    routes = [quota_route(pki, "shared", caller={"per_day": 4})]
    with gateway(routes) as first, gateway(routes) as second:
        alice = first.client("shared")
        both = [first, second, first, second]
        assert [g.post("shared", alice.secure(echo("hi"))[0]).status_code for g in both] == [200] * 4
        for g in (first, second):
            assert_quota_fault(g.post("shared", alice.secure(echo("over"))[0]))


def test_without_the_rate_limit_service_quota_checked_requests_are_refused(gateway: GatewayFactory, pki: Path) -> None:
    with gateway([quota_route(pki, "rsa", caller={"per_second": 100})]) as g:
        alice = g.client("rsa")
        assert g.post("rsa", alice.secure(echo("before"))[0]).status_code == 200
        g.ratelimit.kill()
        g.ratelimit.wait()
        g.clear()
        down = g.post("rsa", alice.secure(echo("unmetered?"))[0])
        assert down.status_code == 503 and b"Service unavailable" in down.content  # fail closed, a SOAP fault
        assert g.received() == []
        g.supervise_once()  # the supervisor starts it again
        assert g.post("rsa", alice.secure(echo("after"))[0]).status_code == 200
