"""Everything WSGate sends holds to the Basic Security Profile 1.1 (tests/support/bsp.py) and is laid out Timestamp first,
tokens before their use (WS-SecurityPolicy Strict and LaxTsFirst): the gateway's replies, read off the wire
through the running gateway, and the `wsgate client`'s requests, for every profile, SOAP 1.1 and 1.2, signed
faults and the WS-Trust answers of a secureconversation route.

Threat: a reply a BSP-enforcing stack (WSS4J/CXF by default, Membrane, WCF) refuses is an outage for its clients;
a layout that puts a Signature before what it needs is refused by Membrane and LaxTsFirst receivers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lxml import etree

from filters.engine import ns
from filters.engine.wss import secure_conversation as sc
from gateway.tools.client import ClientError, Post, http_post
from tests.support import bsp
from tests.support.harness import GatewayFactory, LiveGateway
from tests.support.wss_helpers import DEMO, echo, route_doc

BOTH_WAYS = {"require_request": True, "encrypt_response": True}
ENCRYPTED_SIGNATURE = {**BOTH_WAYS, "encrypt_signature": True}
CBC = {**BOTH_WAYS, "data_algorithms": ["aes256-cbc"], "response_algorithm": "aes256-cbc"}
USERS = {"required": True, "protection": "encrypted"}


def _routes(pki: Path) -> list[dict[str, Any]]:
    users = {**USERS, "users_file": str(pki / "users.yaml")}
    sc_opts = {"store": "memory"}
    return [
        route_doc(pki, "rsa", name="rsa"),
        route_doc(pki, "rsa", name="rsa-enc", encryption=BOTH_WAYS),
        route_doc(pki, "rsa", name="rsa-encsig", encryption=ENCRYPTED_SIGNATURE),
        route_doc(pki, "rsa", name="rsa-cbc", encryption=CBC),
        route_doc(pki, "hmac", name="hmac"),
        route_doc(pki, "hmac", name="hmac-enc", encryption=BOTH_WAYS),
        route_doc(pki, "hmac", name="hmac-encsig", encryption=ENCRYPTED_SIGNATURE),
        route_doc(pki, "hmac", name="username", username_token=users),
        route_doc(pki, "rsa", name="rsa-username", username_token=users),
        route_doc(pki, "secureconversation", name="sc", secureconversation=sc_opts, encryption=BOTH_WAYS),
        route_doc(
            pki, "secureconversation", name="sc-encsig", secureconversation=sc_opts, encryption=ENCRYPTED_SIGNATURE
        ),
    ]


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path) -> LiveGateway:
    return module_gateway(_routes(pki))


class Wire:
    """A Post that keeps what went each way."""

    def __init__(self, gw: LiveGateway, name: str) -> None:
        self.post: Post = http_post(gw.url(name))
        self.sent: list[bytes] = []
        self.got: list[bytes] = []

    def __call__(self, body: bytes, content_type: str) -> bytes:
        self.sent.append(body)
        self.got.append(self.post(body, content_type))
        return self.got[-1]


def assert_conformant(message: bytes) -> None:
    assert bsp.violations(message) == [], message.decode()[:3000]
    assert_layout(message)


def assert_layout(message: bytes) -> None:
    """Timestamp first; every token (BST, EncryptedKey, SCT, DKT) and ReferenceList before the Signature, or
    before the EncryptedData that holds it (CBC: the carriers of the signed ciphertext after it)."""
    root = etree.fromstring(message)
    security = root.find(f".//{bsp.SECURITY}")
    assert security is not None
    children = [c for c in security if isinstance(c.tag, str)]
    assert children[0].tag == bsp.TIMESTAMP, [c.tag for c in children]
    sig = next((c for c in children if c.tag == bsp.SIGNATURE or _holds_signature(c)), None)
    assert sig is not None
    wsc = [ns.q(v.wsc, t) for v in sc.VERSIONS for t in ("SecurityContextToken", "DerivedKeyToken")]
    tokens = {bsp.BST, bsp.EK, bsp.REFERENCE_LIST, *wsc}
    if b"xmlenc#aes256-cbc" in message or b"xmlenc#aes128-cbc" in message:
        # Encrypt-then-sign: what carries the key of the signed ciphertext follows the Signature (decrypted after it
        # is verified); the symmetric binding's own EncryptedKey, the signing key, still precedes it.
        tokens -= {bsp.EK, bsp.REFERENCE_LIST}
    assert all(children.index(c) < children.index(sig) for c in children if c.tag in tokens), [c.tag for c in children]


def _holds_signature(el: etree._Element) -> bool:
    """An EncryptedData in the header that no UsernameToken came from: the encrypted Signature (by position: last)."""
    return el.tag == bsp.ED and el.getnext() is None


def fault_request(version: str = "1.1") -> bytes:
    return echo("x", version).replace(b'<d:echo xmlns:d="urn:wsgate:demo"><d:text>x</d:text></d:echo>',
                                      f'<d:fault xmlns:d="{DEMO}"/>'.encode())  # fmt: skip


CASES = [
    ("rsa", {}),
    ("rsa-enc", {}),
    ("rsa-encsig", {}),
    ("rsa-cbc", {}),
    ("hmac", {"key_name": "demo-client"}),
    ("hmac", {}),
    ("hmac-enc", {"key_name": "demo-client"}),
    ("hmac-enc", {}),
    ("hmac-encsig", {"key_name": "demo-client"}),
    ("hmac-encsig", {}),
    ("username", {"key_name": "demo-client", "user": "bob", "password": "bob-demo-password"}),
    ("username", {"user": "alice", "password": "alice-demo-password", "password_digest": False}),
    ("rsa-username", {"user": "bob", "password": "bob-demo-password"}),
]


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize(("name", "cfg"), CASES, ids=[f"{n}-{'-'.join(c) or 'default'}" for n, c in CASES])
def test_requests_and_replies_hold_to_the_basic_security_profile(
    gw: Any, name: str, cfg: dict[str, Any], version: str
) -> None:
    client = gw.client(name, **cfg)
    wire = Wire(gw, name)
    secured, pending = client.secure(echo("bsp", version))
    reply = wire(secured, pending.content_type)
    opened = client.open(reply, pending)  # the client (the engine's receiving side) accepts the reply
    assert opened.body.findtext(f".//{{{DEMO}}}text") == "bsp"
    assert_conformant(secured)
    assert_conformant(reply)


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize("name", ["rsa-enc", "hmac-encsig"])
def test_signed_faults_hold_to_the_basic_security_profile(gw: Any, name: str, version: str) -> None:
    client = gw.client(name)
    wire = Wire(gw, name)
    secured, pending = client.secure(fault_request(version))
    reply = wire(secured, pending.content_type)
    with pytest.raises(ClientError, match="SOAP fault"):  # a verified, decrypted fault
        client.open(reply, pending)
    assert b"Security" in reply
    assert_conformant(reply)


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize("name", ["sc", "sc-encsig"])
def test_secure_conversation_and_ws_trust_answers_hold_to_the_basic_security_profile(
    gw: Any, name: str, version: str
) -> None:
    """Issue (RST signed like rsa, the RSTR carrying the SCT and its references), a message in the context (DKT
    keys), Cancel: every message both ways."""
    client = gw.client(name)
    wire = Wire(gw, name)
    client.establish(wire, version)
    secured, pending = client.secure(echo("in context", version))
    reply = wire(secured, pending.content_type)
    assert client.open(reply, pending).body.findtext(f".//{{{DEMO}}}text") == "in context"
    client.cancel(wire, version)
    assert len(wire.sent) == len(wire.got) == 3
    for message in [*wire.sent, *wire.got]:
        assert_conformant(message)


def test_the_checker_catches_what_earlier_versions_sent(gw: Any) -> None:
    """The checker is not vacuous: a bare ds:KeyName (the reply WSS4J refused), Signature before the Timestamp,
    a Nonce without EncodingType, two Timestamps are each found."""
    client = gw.client("username", key_name="demo-client", user="bob", password="bob-demo-password")
    client.route = client.route.model_copy(update={"username_token": client.route.username_token.model_copy(
        update={"protection": "tls"})})  # fmt: skip
    root = etree.fromstring(client.secure(echo())[0])
    security = root.find(f".//{bsp.SECURITY}")
    key_info = security.find(f"{bsp.SIGNATURE}/{bsp.KEY_INFO}")
    key_info[:] = [etree.Element(ns.q(ns.DS, "KeyName"))]
    security.find(f"{bsp.UT}/{ns.q(ns.WSSE, 'Nonce')}").attrib.pop("EncodingType")
    security.append(etree.fromstring(etree.tostring(security.find(bsp.TIMESTAMP))))
    found = {v.split(":")[0] for v in bsp.violations(etree.tostring(root))}
    assert {
        "r5417_sig_key_info_holds_a_security_token_reference",
        "r4220_r4221_nonce_encoding_type",
        "r3227_one_timestamp_per_security_header",
    } <= found
    security.insert(0, security.find(bsp.SIGNATURE))
    with pytest.raises(AssertionError):
        assert_layout(etree.tostring(root))


def test_the_checker_catches_misplaced_and_unlisted_encryption(gw: Any) -> None:
    """An EncryptedKey after the EncryptedData its list names (R3208), an EncryptedData no list names and with no
    KeyInfo (R3231/R3214, R5629), a PrefixList that misses a prefix in scope (R5405)."""
    client = gw.client("rsa-username", user="bob", password="bob-demo-password")
    root = etree.fromstring(client.secure(echo())[0])
    security = root.find(f".//{bsp.SECURITY}")
    ek = security.find(bsp.EK)
    security.append(ek)
    found = {v.split(":")[0] for v in bsp.violations(etree.tostring(root))}
    assert "r3208_encrypted_key_precedes_its_data" in found
    ek.remove(ek.find(bsp.REFERENCE_LIST))
    for inclusive in security.iter(bsp.INCLUSIVE):
        inclusive.set("PrefixList", "")
    found = {v.split(":")[0] for v in bsp.violations(etree.tostring(root))}
    assert {
        "r3231_r3214_every_encrypted_data_listed",
        "r5629_unlisted_encrypted_data_has_key_info",
        "r5407_r5405_r5408_inclusive_namespaces",
    } <= found
