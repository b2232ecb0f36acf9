"""WS-SecureConversation through the real gateway: issue, use, cancel for every store and both spec versions;
contexts shared between gateway processes; refusals."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import requests
from lxml import etree

from filters.engine.wss import secure_conversation as sc
from filters.engine.xml.threat_protection import parse_envelope
from gateway.tools.client import Client, ClientError, Post, http_post
from tests.support.harness import GatewayFactory, LiveGateway
from tests.support.wss_helpers import DEMO, Keys, echo, route_doc


@pytest.fixture(scope="module")
def redis_url(redis_server: str) -> str:
    return redis_server


def sc_route(pki: Path, name: str, store: str, redis_url: str | None = None, **extra: object) -> dict:
    options = {"store": store, "master_keys_file": str(pki / "sct-master-keys.yaml"), **extra}
    if redis_url:
        options["redis_url"] = redis_url
    return route_doc(pki, "secureconversation", name=name, secureconversation=options,
                     encryption={"encrypt_response": True}, replay={"store": "memory"})  # fmt: skip


def client_of(gw: LiveGateway, name: str, version: str = "1.3") -> tuple[Client, Post]:
    return gw.client(name, sc_version=version), http_post(gw.url(name))


def call(client: Client, post, text: str) -> str:
    secured, pending = client.secure(echo(text))
    return client.open(post(secured, pending.content_type), pending).body.findtext(f".//{{{DEMO}}}text")


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path, redis_url: str, gateway_keys: Keys) -> LiveGateway:
    """The gateway's keys in files, then in the token (each module-scoped gateway_keys param)."""
    routes = [
        sc_route(pki, "sealed", "sealed"),
        sc_route(pki, "memory", "memory", max_contexts=3),
        sc_route(pki, "redis", "redis", redis_url),
        sc_route(pki, "short", "sealed", lifetime_s=1),
    ]
    return module_gateway([gateway_keys(r) for r in routes])


@pytest.mark.parametrize("version", ["1.3", "2005/02"])
@pytest.mark.parametrize("store", ["sealed", "memory", "redis"])
def test_issue_use_cancel(gw, store: str, version: str) -> None:
    client, post = client_of(gw, store, version)
    requests.delete(f"http://{gw.backend_addr}/_received", timeout=5)
    ctx = client.establish(post)
    assert ctx.version.name == version
    assert gw.received() == []  # the gateway answered the Issue request itself
    assert call(client, post, "first") == "first"
    assert call(client, post, "second") == "second"
    got = gw.received()
    assert len(got) == 2 and all("Security" not in r["body"] for r in got)
    assert got[0]["headers"]["x-wsgate-subject"] == "CN=Demo Client,O=WSGate Demo"
    client.cancel(post)
    client.context = ctx  # keep using the cancelled context
    with pytest.raises(ClientError, match="BadContextToken"):
        call(client, post, "after cancel")


def test_tampered_derived_key_signature_refused(gw) -> None:
    client, post = client_of(gw, "sealed")
    client.establish(post)
    secured, pending = client.secure(echo("pay 10"))
    with pytest.raises(ClientError, match="FailedCheck"):
        client.open(post(secured.replace(b"pay 10", b"pay 99"), pending.content_type), pending)


def test_wrong_nonce_refused(gw) -> None:
    client, post = client_of(gw, "sealed")
    client.establish(post)
    secured, pending = client.secure(echo())
    root = etree.fromstring(secured)
    nonce = root.find(".//{*}DerivedKeyToken/{*}Nonce")
    nonce.text = "AAAAAAAAAAAAAAAAAAAAAA=="  # another derived key: the signature no longer verifies
    with pytest.raises(ClientError, match="FailedCheck"):
        client.open(post(etree.tostring(root), pending.content_type), pending)


def test_expired_context_needs_renewal(gw) -> None:
    client, post = client_of(gw, "short")
    client.establish(post)
    time.sleep(1.2)
    with pytest.raises(ClientError, match="RenewNeeded"):
        call(client, post, "too late")


def test_unknown_context_refused(gw) -> None:
    client, post = client_of(gw, "redis")
    client.establish(post)
    assert client.context is not None
    forged = sc.Context(
        identifier="urn:uuid:00000000-0000-0000-0000-000000000000", secret=client.context.secret,
        subject="", version=client.context.version, created=client.context.created, expires=client.context.expires,
    )  # fmt: skip
    client.context = forged
    with pytest.raises(ClientError, match="BadContextToken"):
        call(client, post, "forged")


def test_full_memory_store_refuses_new_contexts(gw) -> None:
    clients = [client_of(gw, "memory") for _ in range(4)]
    established = 0
    with pytest.raises(ClientError, match="RequestFailed"):
        for client, post in clients:
            client.establish(post)
            established += 1
    assert established <= 3
    assert call(*clients[0], "still served") == "still served"  # live contexts keep working


def test_message_outside_a_context_refused(gw) -> None:
    client, post = client_of(gw, "sealed")
    # Signed like the bootstrap (X.509) but not an RST: only context keys may carry messages.
    secured, pending = client._secure(parse_envelope(echo(), client.route.limits), datetime.now(UTC))
    with pytest.raises(ClientError, match="InvalidSecurity"):
        client.open(post(secured, pending.content_type), pending)


@pytest.mark.parametrize("store", ["sealed", "redis"])
def test_context_served_by_a_second_gateway(gateway: GatewayFactory, pki: Path, redis_url: str, store: str) -> None:
    """sealed: the two gateways share only the master keys; redis: they share the Redis server."""
    routes = [sc_route(pki, "shared", store, redis_url if store == "redis" else None)]
    with gateway(routes) as a, gateway(routes) as b:
        client, post_a = client_of(a, "shared")
        _, post_b = client_of(b, "shared")
        client.establish(post_a)
        assert call(client, post_b, "via b") == "via b"
        client.cancel(post_b)
        if store == "redis":  # a sealed store's cancellations stay with the gateway that took them, without Redis
            client.context = None
            with pytest.raises(ClientError):
                call(client, post_a, "after cancel")
