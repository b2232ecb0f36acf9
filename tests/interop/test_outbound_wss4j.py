"""Outbound routes (docs/outbound.md) with a partner we did not write: Apache WSS4J 4.0.1 as the partner service
(tests/support/partner.py: WSS4J's WSSecurityEngine processes each request, BSP enforcement on; WSS4J's builders
secure the reply), behind HTTPS on loopback. The internal application (plain requests, and zeep from the demo
WSDL) sends plain SOAP to the outbound listener; the gateway secures it for the partner and hands back the
partner's reply as plain SOAP once verified. Every outbound profile, SOAP 1.1 and 1.2; for secureconversation
WSS4J is the partner's STS too (the context's secret computed by WSS4J's P_SHA1)."""

from __future__ import annotations

import base64
import hashlib
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import yaml
from cryptography import x509
from lxml import etree

from filters.stores.partner_contexts import decode_context
from gateway.control.ports import free_ports
from gateway.policy import REDIS_URL_ENV
from gateway.tools.wsdl_import import import_wsdl
from tests.support.harness import GatewayFactory, LiveGateway
from tests.support.partner import ENCRYPTED, SC_SERVICES, Service, Wss4jPartner, outbound_route, post, sc_outbound_route
from tests.support.wss4j import WSSE, Wss4j, Wss4jError, soap_ns
from tests.support.wss_helpers import DEMO, echo

VERSIONS = ["1.1", "1.2"]
ACTION = "urn:wsgate:demo#echo"
SERVICES = {
    "/rsa/": Service(),
    "/rsa-encrypted/": Service(encrypt_reply=True),
    "/psk/": Service(sign="psk"),
    "/encrypted-key/": Service(sign="received"),
    "/username/": Service(users={"bob": "bob-demo-password"}),
    "/username-text/": Service(users={"bob": "bob-demo-password"}),
    "/demo/": Service(),  # the imported WSDL's address
    **SC_SERVICES,
}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gw(
    module_gateway: GatewayFactory, pki: Path, partner: Wss4jPartner, listen: str, tmp_path_factory: Any
) -> LiveGateway:
    creds = tmp_path_factory.mktemp("outbound") / "partner-credentials.yaml"
    creds.write_text(yaml.safe_dump({"username": "bob", "password": "bob-demo-password"}))
    routes = [
        outbound_route(pki, "rsa", "rsa", partner, listen),
        outbound_route(pki, "rsa", "rsa-encrypted", partner, listen, encryption=ENCRYPTED),
        outbound_route(pki, "hmac", "psk", partner, listen, outbound={"key_name": "demo-client"}),
        outbound_route(pki, "hmac", "encrypted-key", partner, listen, encryption={"require_request": True}),
        outbound_route(
            pki,
            "rsa",
            "username",
            partner,
            listen,
            outbound={"credentials_file": str(creds)},
            signature={"parts": ["body", "timestamp", "username_token"]},
        ),
        outbound_route(
            pki,
            "rsa",
            "username-text",
            partner,
            listen,
            outbound={"credentials_file": str(creds), "password_type": "text"},
            username_token={"protection": "encrypted"},
        ),
        sc_outbound_route(pki, partner, listen),
        sc_outbound_route(pki, partner, listen, name="sc-signed"),
        sc_outbound_route(pki, partner, listen, name="sc-direct"),
    ]
    return module_gateway(routes, metrics=True)


@pytest.fixture(autouse=True)
def fresh(partner: Wss4jPartner) -> None:
    partner.reset()


def plain_text(resp: Any, version: str) -> str:
    """The reply is plain SOAP of the request's version (no Security header left); its echoResponse text."""
    assert resp.status_code == 200, resp.text
    root = etree.fromstring(resp.content)
    assert etree.QName(root).namespace == soap_ns(version)
    assert root.find(f".//{{{WSSE}}}Security") is None
    return root.findtext(f".//{{{DEMO}}}echoResponse/{{{DEMO}}}text") or ""


def subject(pem: Path) -> str:
    return x509.load_pem_x509_certificate(pem.read_bytes()).subject.rfc4514_string()


@pytest.mark.parametrize("version", VERSIONS)
def test_outbound_rsa_request_signed_for_wss4j_and_its_reply_handed_back_plain(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, pki: Path, version: str
) -> None:
    text = f"rsa-{version}"
    resp = post(listen, "/rsa/echo", echo(text, version), version, soapaction=ACTION)
    assert plain_text(resp, version) == text
    assert partner.refused == []
    got = partner.verified[-1]
    assert "Signature" in got["actions"] and "Timestamp" in got["actions"]
    assert f"{{{soap_ns(version)}}}Body" in got["signed"]
    assert x509.load_der_x509_certificate(base64.b64decode(got["signer_der"])).subject.rfc4514_string() == subject(
        pki / "gateway-sign.pem"
    )
    assert partner.headers[-1].get("soapaction") == ACTION
    # The partner learns nothing of the internal network.
    assert "x-forwarded-for" not in partner.headers[-1]


@pytest.mark.parametrize("version", VERSIONS)
def test_outbound_rsa_request_encrypted_to_wss4j_and_its_encrypted_reply_decrypted(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str
) -> None:
    text = f"secret-{version}"
    resp = post(listen, "/rsa-encrypted/echo", echo(text, version), version)
    assert plain_text(resp, version) == text
    got = partner.verified[-1]
    assert f"{{{soap_ns(version)}}}Body" in got["decrypted"]
    assert "Encrypt" in got["actions"]


@pytest.mark.parametrize("version", VERSIONS)
def test_outbound_hmac_pre_shared_key_request_verified_by_wss4j(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str
) -> None:
    text = f"psk-{version}"
    resp = post(listen, "/psk/echo", echo(text, version), version)
    assert plain_text(resp, version) == text
    got = partner.verified[-1]
    assert got["signature_key_sha256"] == hashlib.sha256(base64.b64decode(partner.psk)).hexdigest()


@pytest.mark.parametrize("version", VERSIONS)
def test_outbound_hmac_symmetric_binding_key_sent_to_wss4j_and_its_reply_signed_with_it(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str
) -> None:
    """hmac without a pre-shared key: a fresh key in an EncryptedKey to the partner's certificate signs and
    encrypts the request; WSS4J's reply is signed with that key, named by its EncryptedKeySHA1."""
    text = f"ek-{version}"
    resp = post(listen, "/encrypted-key/echo", echo(text, version), version)
    assert plain_text(resp, version) == text, partner.refused
    got = partner.verified[-1]
    assert got["encrypted_key_sha1"] and f"{{{soap_ns(version)}}}Body" in got["decrypted"]


@pytest.mark.parametrize("route", ["username", "username-text"])
@pytest.mark.parametrize("version", VERSIONS)
def test_outbound_username_token_from_the_credentials_file_accepted_by_wss4j(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str, route: str
) -> None:
    """The UsernameToken comes from the route's credentials file, signed (digest) or encrypted to the partner
    (text); WSS4J checks the password."""
    text = f"{route}-{version}"
    resp = post(listen, f"/{route}/echo", echo(text, version), version)
    assert plain_text(resp, version) == text, partner.refused
    assert "UsernameToken" in partner.verified[-1]["actions"]


def test_outbound_app_with_zeep_calls_the_partner_through_the_gateway_with_no_ws_security(
    gw: LiveGateway, partner: Wss4jPartner, listen: str
) -> None:
    """zeep, generated from the demo WSDL, bound to the outbound listener: no WS-Security of its own."""
    import zeep

    client = zeep.Client(str(Path(__file__).parent / "demo.wsdl"))
    service = client.create_service(f"{{{DEMO}}}DemoBinding", f"http://{listen}/rsa/echo")
    assert service.echo(text="from zeep") == "from zeep"
    assert "Signature" in partner.verified[-1]["actions"]


def test_outbound_listener_is_not_on_the_public_listener(gw: LiveGateway) -> None:
    """The outbound route is served on its own listener only: on the public one its path is no route (404)."""
    resp = gw.post("/rsa/echo", echo("public"))
    assert resp.status_code == 404


def test_outbound_import_serves_the_partners_wsdl_without_its_policy_and_zeep_calls_through_it(
    gateway: GatewayFactory, pki: Path, partner: Wss4jPartner, tmp_path: Path
) -> None:
    """`wsgate import --outbound`: the partner's WS-SecurityPolicy (an X.509 AsymmetricBinding) becomes an outbound
    rsa route; its WSDL is served on the outbound listener, the address rewritten to it and the policy removed, so
    zeep, built from that URL, calls with no WS-Security and the partner (WSS4J) gets a signed request."""
    wsdl = tmp_path / "partner.wsdl"
    wsdl.write_text(
        (REPO / "tests" / "wsdl" / "demo-asymmetric.wsdl")
        .read_text()
        .replace("http://demo.internal:8080", "https://partner.example")
    )
    listen = f"127.0.0.1:{free_ports(1)[0]}"
    imported = import_wsdl(wsdl.read_bytes(), wsdl, str(wsdl), upstream=partner.address, outbound=listen)
    assert imported.unmapped == []
    [route] = [r.route for r in imported.routes]
    assert route["direction"] == "outbound" and route["profile"] == "rsa"
    # The partner's files, here from the test PKI (the import names placeholders for the operator to provide).
    route["upstream"]["ca"] = str(pki / "ca.pem")  # type: ignore[index]
    route["rsa"] = {"trust_anchors": [str(pki / "ca.pem")], "key": str(pki / "gateway-sign.key"),
                    "certificate": str(pki / "gateway-sign.pem"), "decryption_key": str(pki / "gateway-enc.key"),
                    "allowed_subjects": ["CN=Demo Client,O=WSGate Demo"]}  # fmt: skip
    route["outbound"]["partner_certificate"] = str(pki / "client.pem")  # type: ignore[index]
    route["replay"] = {"store": "memory"}
    gateway([route])
    published = requests.get(f"http://{listen}/demo/echo?wsdl", timeout=10)
    assert published.status_code == 200
    root = etree.fromstring(published.content)
    assert not [el for el in root.iter() if isinstance(el.tag, str) and "policy" in etree.QName(el).namespace.lower()]
    assert [a.get("location") for a in root.iter("{*}address")] == [f"http://{listen}/demo/echo"]
    import zeep

    client = zeep.Client(f"http://{listen}/demo/echo?wsdl")
    assert client.service.echo(text="imported") == "imported"
    got = partner.verified[-1]
    assert "Signature" in got["actions"] and "Timestamp" in got["actions"]


def sts_calls(partner: Wss4jPartner) -> int:
    return sum(p.startswith("/sc-sts/") for p in partner.paths)


@pytest.mark.parametrize("route", ["sc", "sc-signed"])
@pytest.mark.parametrize("version", VERSIONS)
def test_outbound_secure_conversation_context_issued_by_wss4j_secures_both_ways_with_derived_keys(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str, route: str
) -> None:
    """The gateway's signed Issue is verified by WSS4J, whose P_SHA1 computes the context's secret from both
    entropies: the gateway computed the same one. The request is signed (sc: and encrypted) with keys derived
    from it, WSS4J's reply too."""
    text = f"{route}-{version}"
    resp = post(listen, f"/{route}/echo", echo(text, version), version)
    assert plain_text(resp, version) == text, partner.refused
    assert partner.refused == []
    got = partner.verified[-1]
    assert "DerivedKeyToken" in got["actions"] and f"{{{soap_ns(version)}}}Body" in got["signed"]
    assert (f"{{{soap_ns(version)}}}Body" in got["decrypted"]) == (route == "sc")
    data = redis.Redis.from_url(gw.env[REDIS_URL_ENV]).get(f"wsgate:outbound-sct:{route}")
    ctx = decode_context(data) if data else None
    assert ctx is not None and set(got["derived_from"]) == {ctx.identifier}
    assert partner.issued[ctx.identifier] == hashlib.sha256(ctx.secret).hexdigest()


@pytest.mark.parametrize("version", VERSIONS)
def test_outbound_secure_conversation_with_the_context_key_itself_where_wss4j_does_not_require_derived_keys(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str
) -> None:
    """derived_keys false: the request is signed with the context's own key (no DerivedKeyToken), which WSS4J
    resolves by the SCT's Identifier; WSS4J's reply, signed with that key too, is verified and handed back plain."""
    text = f"sc-direct-{version}"
    resp = post(listen, "/sc-direct/echo", echo(text, version), version)
    assert plain_text(resp, version) == text, partner.refused
    assert partner.refused == []
    got = partner.verified[-1]
    assert "DerivedKeyToken" not in got["actions"] and f"{{{soap_ns(version)}}}Body" in got["signed"]
    data = redis.Redis.from_url(gw.env[REDIS_URL_ENV]).get("wsgate:outbound-sct:sc-direct")
    ctx = decode_context(data) if data else None
    assert ctx is not None and got["signature_key_sha256"] == hashlib.sha256(ctx.secret).hexdigest()
    assert partner.issued[ctx.identifier] == got["signature_key_sha256"]


@pytest.mark.parametrize("version", VERSIONS)
def test_outbound_secure_conversation_one_issue_to_wss4j_for_many_calls(
    gw: LiveGateway, partner: Wss4jPartner, listen: str, version: str
) -> None:
    """One context for many calls: the partner's STS sees no Issue after the first call, every call uses the one
    context (and the metric counts one Issue)."""
    assert plain_text(post(listen, "/sc/echo", echo("first", version), version), version) == "first"
    partner.reset()
    for i in range(4):
        assert plain_text(post(listen, "/sc/echo", echo(f"call-{i}", version), version), version) == f"call-{i}"
    assert sts_calls(partner) == 0 and len(partner.paths) == 4
    assert len({c for got in partner.verified for c in got["derived_from"]}) == 1
    metrics = "".join(requests.get(u, timeout=5).text for u in gw.metrics_urls())
    issued = re.findall(r'^wsgate_outbound_context_issues_total\{route="sc"\} (\S+)$', metrics, re.M)
    assert sum(float(v) for v in issued) == 1


@pytest.mark.parametrize("version", VERSIONS)
def test_outbound_secure_conversation_context_cancelled_with_wss4j_when_the_gateway_stops(
    gateway: GatewayFactory,
    pki: Path,
    partner: Wss4jPartner,
    wss4j: Wss4j,
    caplog: pytest.LogCaptureFixture,
    version: str,
) -> None:
    """A fresh gateway's first call issues the context in the call's SOAP version. On shutdown the gateway sends
    a Cancel signed with the context's derived keys; WSS4J verifies it, the partner forgets the context (its
    secret is gone from WSS4J's keys: nothing derived from it verifies any more) and answers with the context's
    keys, which the gateway verifies."""
    listen = f"127.0.0.1:{free_ports(1)[0]}"
    gw = gateway([sc_outbound_route(pki, partner, listen)])
    assert plain_text(post(listen, "/sc/echo", echo("before stop", version), version), version) == "before stop"
    assert partner.paths[0] == "/sc-sts/" and ("soap+xml" in partner.headers[0]["content-type"]) == (version == "1.2")
    [context] = set(partner.verified[-1]["derived_from"])  # two derived keys (sign, encrypt), one context
    with caplog.at_level(logging.INFO, logger="wsgate.up"):
        gw.stop()
    assert partner.cancelled[-1:] == [context] and sts_calls(partner) == 2  # the Issue, then the Cancel
    assert "route sc: the context with the partner is cancelled" in caplog.text
    step = [{"do": "sct", "identifier": context, "in_header": False}, {"do": "sign", "with": "sct", "parts": []}]
    with pytest.raises(Wss4jError, match="no secret"):
        wss4j.secure(echo("after stop"), step)
