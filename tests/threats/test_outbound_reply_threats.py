"""Partner replies on an outbound route that must never reach the internal application: tampered after signing,
replayed, unsigned, signed by an untrusted or a wrong certificate. Each is refused with a SOAP fault of the
request's version saying the partner's reply could not be verified (502), the reason in the worker's log and the
refusal in the per-route metric. The partner is Apache WSS4J 4.0.1 behind HTTPS (tests/support/partner.py), its
STS too for secureconversation: a reply secured with keys derived from another context is refused as well."""

from __future__ import annotations

import base64
import os
import uuid
from pathlib import Path

import pytest
import requests
from lxml import etree

from filters.engine.outbound import PARTNER_REPLY_UNVERIFIED
from gateway.control.ports import free_ports
from tests.support.harness import GatewayFactory, LiveGateway
from tests.support.partner import SC_SERVICES, Service, Wss4jPartner, outbound_route, post, sc_outbound_route
from tests.support.wss4j import WSU, soap_ns
from tests.support.wss_helpers import echo

VERSIONS = ["1.1", "1.2"]
SERVICES = {
    "/rsa/": Service(),
    "/rsa-encrypted/": Service(encrypt_reply=True),
    "/psk/": Service(sign="psk"),
    "/rogue/": Service(stem="rogue"),  # CN=Demo Client, issued by another CA
    "/other/": Service(stem="client2"),  # the demo CA, but not the partner's subject
    "/downgraded/": Service(),  # signs, but does not encrypt
    **SC_SERVICES,
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
        sc_outbound_route(pki, partner, listen),
        sc_outbound_route(pki, partner, listen, name="sc-signed"),
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


@pytest.mark.parametrize("route", ["rsa", "sc-signed"])
@pytest.mark.parametrize("version", VERSIONS)
def test_partner_reply_tampered_after_signing_is_refused(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str, route: str
) -> None:
    """sc-signed: the Body signed with a key derived from the context."""
    text = f"tamper-{version}"
    partner.tamper = lambda xml: xml.replace(f">{text}<".encode(), b">pay the attacker<")
    resp = post(listen, f"/{route}/echo", echo(text, version), version)
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


@pytest.mark.parametrize("route", ["rsa-encrypted", "sc"])
@pytest.mark.parametrize("version", VERSIONS)
def test_partner_reply_encrypted_content_tampered_is_refused(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str, route: str
) -> None:
    """A flipped byte of the encrypted Body (to the gateway's key, or a key derived from the context): GCM
    refuses it, nothing decrypted reaches the application."""

    def flip(xml: bytes) -> bytes:
        root = etree.fromstring(xml)
        value = root.find(".//{http://www.w3.org/2001/04/xmlenc#}EncryptedData//{*}CipherValue")
        assert value is not None and value.text
        value.text = ("B" if value.text[10] != "B" else "C").join((value.text[:10], value.text[11:]))
        return etree.tostring(root)

    partner.tamper = flip
    resp = post(listen, f"/{route}/echo", echo(f"enc-tamper-{version}", version), version)
    assert_refused(gw, resp, version, "reply refused")


@pytest.mark.parametrize("route", ["rsa", "sc"])
@pytest.mark.parametrize("version", VERSIONS)
def test_partner_reply_replayed_is_refused(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str, route: str
) -> None:
    """The same signed reply twice (an attacker on the path answers a new call with an old reply): the second is
    refused, by whichever worker gets it (the replay store is the shared Redis). sc: in the same context."""
    first = post(listen, f"/{route}/echo", echo(f"once-{version}", version), version)
    assert first.status_code == 200, first.text
    partner.replay_next = True
    resp = post(listen, f"/{route}/echo", echo(f"twice-{version}", version), version)
    assert_refused(gw, resp, version, "replay")


@pytest.mark.parametrize("route", ["rsa", "psk", "sc"])
@pytest.mark.parametrize("version", VERSIONS)
def test_partner_reply_unsigned_is_refused(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str, route: str
) -> None:
    partner.unsecured = True
    resp = post(listen, f"/{route}/echo", echo(f"unsigned-{version}", version), version)
    assert_refused(gw, resp, version, "reply refused")


def extend(xml: bytes) -> bytes:
    """The reply's signed Timestamp given a later Expires."""
    root = etree.fromstring(xml)
    expires = root.find(f".//{{{WSU}}}Timestamp/{{{WSU}}}Expires")
    assert expires is not None and expires.text
    expires.text = "2099" + expires.text[4:]
    return etree.tostring(root)


@pytest.mark.parametrize("version", VERSIONS)
def test_partner_sc_reply_tampered_after_signing_is_refused(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str
) -> None:
    """The reply's Timestamp, signed with the context's derived key, given a later Expires: the signature no
    longer verifies."""
    partner.tamper = extend
    resp = post(listen, "/sc/echo", echo(f"sc-tamper-{version}", version), version)
    assert_refused(gw, resp, version, "FailedCheck")


@pytest.mark.parametrize(("how", "reason"), [("identifier", "UnknownDerivationSource"), ("key", "FailedCheck")])
@pytest.mark.parametrize("route", ["sc", "sc-signed"])
@pytest.mark.parametrize("version", VERSIONS)
def test_partner_reply_signed_with_a_key_of_another_context_is_refused(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str, route: str, how: str, reason: str
) -> None:
    """The reply secured with keys derived from another context the partner issued: naming it (identifier: a
    context the gateway does not hold), or naming the gateway's context but derived from the other one's secret
    (key: sc's Body does not decrypt, sc-signed's signature does not verify)."""
    assert post(listen, f"/{route}/echo", echo("the context", version), version).status_code == 200
    other = f"urn:uuid:{uuid.uuid4()}"
    partner.wss4j.sc_issue(other, base64.b64encode(os.urandom(32)).decode(), 256)
    partner.sct_override = {how: other}
    resp = post(listen, f"/{route}/echo", echo(f"other-context-{version}", version), version)
    assert_refused(gw, resp, version, reason)


@pytest.mark.parametrize(("how", "reason"), [("unsigned", "no wsse:Security header"), ("tampered", "FailedCheck")])
def test_partner_sts_answer_that_does_not_verify_establishes_no_context(
    gateway: GatewayFactory, pki: Path, partner: Wss4jPartner, how: str, reason: str
) -> None:
    """The STS's answer to the Issue unsigned, or altered after signing (its Timestamp): no context comes of it,
    no request goes to the service, the application gets the fault of a partner reply that did not verify (the
    STS answered: it is the partner's reply, not the gateway's failure)."""
    listen = f"127.0.0.1:{free_ports(1)[0]}"
    gw = gateway([sc_outbound_route(pki, partner, listen, name="sc-signed")])
    partner.sts_unsecured = how == "unsigned"
    partner.sts_tamper = extend if how == "tampered" else None
    resp = post(listen, "/sc-signed/echo", echo(f"sts-{how}"))
    assert partner.paths == ["/sc-sts/"]  # the Issue, and nothing for the service
    assert_refused(gw, resp, "1.1", reason)


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
