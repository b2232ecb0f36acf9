"""SecureConversation without derived keys (WS-SecurityPolicy with no sp:RequireDerivedKeys): messages signed and
encrypted with the context's own key, named by a reference to its SCT. A route that requires derived keys refuses
it; a route that does not takes it and derived keys alike, but never a key of another, cancelled or expired
context, nor two contexts in one message, nor an unsigned Body."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from lxml import etree

from filters.engine.profiles import context_security
from filters.engine.wss import secure_conversation as sc
from filters.engine.wss import wssecurity_sending as sending
from filters.engine.xml.threat_protection import parse_envelope
from gateway.tools.client import Client, ClientConfig, ClientError, Post, http_post
from tests.support.harness import GatewayFactory, LiveGateway
from tests.support.wss_helpers import DEMO, Keys, echo, route_doc


def sc_route(pki: Path, name: str, derived_keys: bool, **extra: object) -> dict:
    options = {"master_keys_file": str(pki / "sct-master-keys.yaml"), "derived_keys": derived_keys, **extra}
    return route_doc(pki, "secureconversation", name=name, secureconversation=options,
                     encryption={"encrypt_response": True}, replay={"store": "memory"})  # fmt: skip


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path, gateway_keys: Keys) -> LiveGateway:
    routes = [
        sc_route(pki, "derived", True),
        sc_route(pki, "direct", False),
        sc_route(pki, "short", False, lifetime_s=1),
    ]
    return module_gateway([gateway_keys(r) for r in routes])


def client_of(gw: LiveGateway, name: str, *, derived: bool, version: str = "1.3") -> tuple[Client, Post]:
    """A client of the route that sends keys as `derived` says, whatever the gateway's route requires."""
    route = gw.route(name)
    options = route.secureconversation.model_copy(update={"derived_keys": derived})
    client = Client(
        route.model_copy(update={"secureconversation": options}), ClientConfig(certs=gw.pki, sc_version=version)
    )
    post = http_post(gw.url(name))
    client.establish(post)
    return client, post


def call(client: Client, post: Post, text: str = "hello") -> str:
    secured, pending = client.secure(echo(text))
    return client.open(post(secured, pending.content_type), pending).body.findtext(f".//{{{DEMO}}}text")


def send(client: Client, post: Post, secured: bytes) -> str:
    pending = client.secure(echo())[1]  # only its content type and SOAP version: the message is ours
    return client.open(post(secured, pending.content_type), pending).body.findtext(f".//{{{DEMO}}}text")


def secured_with(client: Client, sign: sending.SignWith, encrypt: sending.EncryptFor | None,
                 tokens: tuple[etree._Element, ...], parts: tuple[str, ...] = ("body", "timestamp")) -> bytes:  # fmt: skip
    env = parse_envelope(echo("pay 10"), client.route.limits)
    sending.secure(env, datetime.now(UTC), timestamp_ttl_s=300, sign=sign, sign_parts=parts, encrypt=encrypt,
                   tokens=tokens, unique_ids=True)  # fmt: skip
    return env.serialize()


@pytest.mark.parametrize("version", ["1.3", "2005/02"])
def test_context_key_used_directly_where_the_route_allows_it(gw, version: str) -> None:
    client, post = client_of(gw, "direct", derived=False, version=version)
    secured, pending = client.secure(echo("direct"))
    assert b"DerivedKeyToken" not in secured
    raw = post(secured, pending.content_type)
    assert b"DerivedKeyToken" not in raw  # the reply is secured as the route says: the context's own key
    assert client.open(raw, pending).body.findtext(f".//{{{DEMO}}}text") == "direct"
    client.cancel(post)


def test_derived_keys_still_taken_where_the_route_does_not_require_them(gw) -> None:
    client, post = client_of(gw, "direct", derived=True)
    assert call(client, post, "derived anyway") == "derived anyway"


def test_context_key_used_directly_where_derived_keys_are_required_refused(gw) -> None:
    client, post = client_of(gw, "derived", derived=False)
    with pytest.raises(ClientError, match="InvalidSecurity"):
        call(client, post)
    assert call(*client_of(gw, "derived", derived=True), "derived") == "derived"


def test_key_of_another_context_refused(gw) -> None:
    """The key of one context named by the SCT of another: refused whether that other context exists or not."""
    client, post = client_of(gw, "direct", derived=False)
    other, _ = client_of(gw, "direct", derived=False)
    assert client.context is not None and other.context is not None
    mine = client.context
    client.context = sc.Context(other.context.identifier, mine.secret, "", mine.version, mine.created, mine.expires)
    with pytest.raises(ClientError, match="FailedCheck"):
        call(client, post)
    client.context = sc.Context("urn:uuid:00000000-0000-0000-0000-000000000000", mine.secret, "", mine.version,
                                mine.created, mine.expires)  # fmt: skip
    with pytest.raises(ClientError, match="BadContextToken"):
        call(client, post)


def test_key_of_a_cancelled_context_refused(gw) -> None:
    client, post = client_of(gw, "direct", derived=False)
    ctx = client.context
    client.cancel(post)
    client.context = ctx
    with pytest.raises(ClientError, match="BadContextToken"):
        call(client, post)


def test_key_of_an_expired_context_refused(gw) -> None:
    client, post = client_of(gw, "short", derived=False)
    time.sleep(1.2)
    with pytest.raises(ClientError, match="RenewNeeded"):
        call(client, post)


def test_derived_key_and_direct_key_of_two_contexts_in_one_message_refused(gw) -> None:
    """Signed with one context's own key, encrypted with a key derived from another: one context per message."""
    a, post = client_of(gw, "direct", derived=False)
    b, _ = client_of(gw, "direct", derived=True)
    assert a.context is not None and b.context is not None
    sign, _, _ = context_security(a.context, a.route, encrypt=False, derived=False)
    _, encrypt, tokens = context_security(b.context, b.route, encrypt=True)
    with pytest.raises(ClientError, match="InvalidSecurity"):
        send(a, post, secured_with(a, sign, encrypt, tokens))
    sign, _, tokens = context_security(b.context, b.route, encrypt=False)  # and the other way round
    _, encrypt, _ = context_security(a.context, a.route, encrypt=True, derived=False)
    with pytest.raises(ClientError, match="InvalidSecurity"):
        send(a, post, secured_with(a, sign, encrypt, tokens))


def test_unsigned_body_with_the_context_key_refused(gw) -> None:
    """Encrypted with the context's key but signed with nothing; or signed, the signed Body moved into a header
    and another Body in its place (the signature still verifies over the moved one)."""
    client, post = client_of(gw, "direct", derived=False)
    assert client.context is not None
    sign, encrypt, tokens = context_security(client.context, client.route, encrypt=True, derived=False)
    assert send(client, post, secured_with(client, sign, encrypt, tokens)) == "pay 10"  # the control: all signed
    env = parse_envelope(echo("pay 10"), client.route.limits)
    sending.secure(env, datetime.now(UTC), timestamp_ttl_s=300, sign=None, encrypt=encrypt)
    with pytest.raises(ClientError, match="InvalidSecurity"):
        send(client, post, env.serialize())
    root = etree.fromstring(secured_with(client, sign, None, tokens))
    header, body = root[0], root[1]
    forged = etree.fromstring(etree.tostring(body).replace(b"pay 10", b"pay 99"))
    forged.attrib.clear()
    etree.SubElement(header, "{urn:example:wrap}Wrapper").append(body)
    root.append(forged)
    with pytest.raises(ClientError, match=r"InvalidSecurity|not a valid SOAP message"):  # whichever check comes first
        send(client, post, etree.tostring(root))
