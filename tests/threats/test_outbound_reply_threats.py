"""Partner replies on an outbound route that must never reach the internal application: tampered after signing,
replayed, unsigned, signed by an untrusted or a wrong certificate. Each is refused with a SOAP fault of the
request's version saying the partner's reply could not be verified (502), the reason in the worker's log and the
refusal in the per-route metric. The partner is Apache WSS4J 4.0.1 behind HTTPS (tests/support/partner.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
from lxml import etree

from filters.engine.outbound import PARTNER_REPLY_UNVERIFIED
from tests.support.harness import GatewayFactory, LiveGateway
from tests.support.partner import Service, Wss4jPartner, outbound_route, post
from tests.support.wss4j import soap_ns
from tests.support.wss_helpers import echo

VERSIONS = ["1.1", "1.2"]
SERVICES = {
    "/rsa/": Service(),
    "/rsa-encrypted/": Service(encrypt_reply=True),
    "/psk/": Service(sign="psk"),
    "/rogue/": Service(stem="rogue"),  # CN=Demo Client, issued by another CA
    "/other/": Service(stem="client2"),  # the demo CA, but not the partner's subject
    "/downgraded/": Service(),  # signs, but does not encrypt
    "/rsa-cached/": Service(),  # as /rsa/, the route's optimizations all on
}


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path, partner: Wss4jPartner, listen: str) -> LiveGateway:
    shared = {"replay": {"store": "auto"}}  # two workers: the replay store is the gateway's Redis
    encrypted = {"require_request": True, "encrypt_response": True}
    routes = [
        outbound_route(pki, "rsa", "rsa", partner, listen, **shared),
        outbound_route(pki, "rsa", "rsa-encrypted", partner, listen, encryption=encrypted, **shared),
        outbound_route(pki, "hmac", "psk", partner, listen, outbound={"key_name": "demo-client"}, **shared),
        outbound_route(pki, "rsa", "rogue", partner, listen, **shared),
        outbound_route(pki, "rsa", "other", partner, listen, **shared),
        outbound_route(pki, "rsa", "downgraded", partner, listen, encryption=encrypted, **shared),
        outbound_route(pki, "rsa", "rsa-cached", partner, listen, **shared,
                       optimizations={"on_demand_c14n": True, "digest_cache": True, "prehash": True}),
    ]  # fmt: skip
    return module_gateway(routes, workers=2, metrics=True)


LOG_MARK: dict[Path, int] = {}  # each worker log's size when the test began


@pytest.fixture(autouse=True)
def fresh(partner: Wss4jPartner, gw: LiveGateway) -> None:
    partner.reset()
    LOG_MARK.clear()
    LOG_MARK.update({p: p.stat().st_size for p in (gw.opts.run_dir / "logs").glob("filter-*.log")})


def new_log_lines(gw: LiveGateway) -> list[str]:
    lines = []
    for p in (gw.opts.run_dir / "logs").glob("filter-*.log"):
        with p.open("rb") as f:
            f.seek(LOG_MARK.get(p, 0))
            lines += f.read().decode(errors="replace").splitlines()
    return lines


def assert_refused(gw: LiveGateway, resp: requests.Response, version: str, reason: str) -> None:
    """The application gets the generic fault of its SOAP version, nothing of the reply; this test's log line
    says why."""
    assert resp.status_code == 502, resp.text
    root = etree.fromstring(resp.content)
    assert etree.QName(root).namespace == soap_ns(version)
    assert PARTNER_REPLY_UNVERIFIED.encode() in resp.content.replace(b"&apos;", b"'")
    assert b"echoResponse" not in resp.content
    refusals = [line for line in new_log_lines(gw) if "partner reply refused" in line]
    assert len(refusals) == 1 and reason in refusals[0], refusals


@pytest.mark.parametrize("version", VERSIONS)
def test_partner_reply_tampered_after_signing_is_refused(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str
) -> None:
    text = f"tamper-{version}"
    partner.tamper = lambda xml: xml.replace(f">{text}<".encode(), b">pay the attacker<")
    resp = post(listen, "/rsa/echo", echo(text, version), version)
    assert_refused(gw, resp, version, "FailedCheck")


@pytest.mark.parametrize("version", VERSIONS)
def test_partner_reply_tampered_is_refused_with_every_optimization_on(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str
) -> None:
    """An outbound route verifies replies (and signs requests) with its optimizations, as inbound routes do: the
    digests computed directly, here with the received form hashed first and verified digests remembered. A reply
    tampered after signing is still a failed check."""
    text = f"optimized-{version}"
    good = post(listen, "/rsa-cached/echo", echo(text, version), version)
    assert good.status_code == 200 and text.encode() in good.content, good.text
    lines = "".join(requests.get(u, timeout=5).text for u in gw.metrics_urls()).splitlines()
    assert any('optimization="on_demand_c14n"' in m and 'route="rsa-cached"' in m for m in lines)  # the route's path
    partner.tamper = lambda xml: xml.replace(f">{text}<".encode(), b">pay the attacker<")
    resp = post(listen, "/rsa-cached/echo", echo(text, version), version)
    assert_refused(gw, resp, version, "FailedCheck")


@pytest.mark.parametrize("version", VERSIONS)
def test_partner_reply_encrypted_content_tampered_is_refused(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str
) -> None:
    """A flipped byte of the encrypted Body: GCM refuses it, nothing decrypted reaches the application."""

    def flip(xml: bytes) -> bytes:
        root = etree.fromstring(xml)
        value = root.find(".//{http://www.w3.org/2001/04/xmlenc#}EncryptedData//{*}CipherValue")
        assert value is not None and value.text
        value.text = ("B" if value.text[10] != "B" else "C").join((value.text[:10], value.text[11:]))
        return etree.tostring(root)

    partner.tamper = flip
    resp = post(listen, "/rsa-encrypted/echo", echo(f"enc-tamper-{version}", version), version)
    assert_refused(gw, resp, version, "reply refused")


@pytest.mark.parametrize("version", VERSIONS)
def test_partner_reply_replayed_is_refused(gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str) -> None:
    """The same signed reply twice (an attacker on the path answers a new call with an old reply): the second is
    refused, by whichever worker gets it (the replay store is the shared Redis)."""
    first = post(listen, "/rsa/echo", echo(f"once-{version}", version), version)
    assert first.status_code == 200, first.text
    partner.replay_next = True
    resp = post(listen, "/rsa/echo", echo(f"twice-{version}", version), version)
    assert_refused(gw, resp, version, "replay")


@pytest.mark.parametrize("route", ["rsa", "psk"])
@pytest.mark.parametrize("version", VERSIONS)
def test_partner_reply_unsigned_is_refused(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str, route: str
) -> None:
    partner.unsecured = True
    resp = post(listen, f"/{route}/echo", echo(f"unsigned-{version}", version), version)
    assert_refused(gw, resp, version, "reply refused")


@pytest.mark.parametrize("route", ["rogue", "other"])
@pytest.mark.parametrize("version", VERSIONS)
def test_partner_reply_signed_by_a_wrong_certificate_is_refused(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str, route: str
) -> None:
    """rogue: the partner's subject from another CA; other: the demo CA, not the partner's subject."""
    resp = post(listen, f"/{route}/echo", echo(f"wrong-signer-{version}", version), version)
    assert_refused(gw, resp, version, "FailedAuthentication")


@pytest.mark.parametrize("version", VERSIONS)
def test_partner_reply_not_encrypted_where_the_route_requires_it_is_refused(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str
) -> None:
    """A downgrade: a signed but readable reply on a route whose replies must arrive encrypted."""
    resp = post(listen, "/downgraded/echo", echo(f"downgraded-{version}", version), version)
    assert_refused(gw, resp, version, "required to be encrypted")


def test_partner_reply_refusals_counted_per_route(gw: LiveGateway, partner: Wss4jPartner, listen: str) -> None:
    partner.unsecured = True
    post(listen, "/psk/echo", echo("counted"))
    metrics = "".join(requests.get(u, timeout=5).text for u in gw.metrics_urls())
    assert 'wsgate_outbound_replies_total{outcome="refused",route="psk"}' in metrics
    assert 'wsgate_faults_total{profile="hmac",reason="partner reply refused",route="psk"}' in metrics
