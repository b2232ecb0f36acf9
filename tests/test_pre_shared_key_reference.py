"""Pre-shared keys named by a SecurityTokenReference (BSP R5417), through the running gateway.

The gateway and the client name a pre-shared key <wsse:Reference URI="#<name>" ValueType=ns.PRE_SHARED_KEY/>,
as WSS4J resolves a CallbackHandler secret. The gateway still takes the bare ds:KeyName earlier clients send
(tolerant where it is safe), and a key name never stands for a token of the message or the other way round:
elements of the message win, so no wsu:Id an attacker chooses can swap one key for another."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from lxml import etree

from filters.engine import ns
from filters.engine.wss import keys
from gateway.policy import Route
from gateway.tools.client import Client, ClientConfig, content_type
from tests.harness import clear, fault_code, received, running_gateway
from tests.wss_helpers import DEMO, echo, route_doc

SECURITY = ns.q(ns.WSSE, "Security")
SIGNATURE = ns.q(ns.DS, "Signature")
KEY_INFO = ns.q(ns.DS, "KeyInfo")
REFERENCE = ns.q(ns.WSSE, "Reference")
SUBJECT = "x-wsgate-subject"


def _routes(pki: Path) -> list[dict[str, Any]]:
    return [
        route_doc(pki, "hmac", name="hmac"),  # allow_anonymous: the symmetric binding alone is accepted
        route_doc(pki, "hmac", name="hmac-strict", hmac={"allow_anonymous": False}),
    ]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[Any]:
    with running_gateway(tmp_path_factory.mktemp("psk-gw"), _routes(pki), pki) as g:
        yield g


def client_of(gw: Any, pki: Path, name: str, **cfg: Any) -> Client:
    doc = next(r for r in _routes(pki) if r["name"] == name)
    route = Route.model_validate({**doc, "upstream": {"address": gw.backend_addr}})
    return Client(route, ClientConfig(certs=pki, **cfg))


def post(gw: Any, name: str, body: bytes) -> requests.Response:
    clear(gw)
    return requests.post(f"http://127.0.0.1:{gw.opts.http_port}/{name}/demo", data=body,
                         headers={"content-type": content_type("1.1")}, timeout=10)  # fmt: skip


def signature_reference(root: etree._Element) -> etree._Element:
    ref = root.find(f".//{SIGNATURE}/{KEY_INFO}/{keys.STR}/{REFERENCE}")
    assert ref is not None
    return ref


def edited(secured: bytes, edit: Any) -> bytes:
    root = etree.fromstring(secured)
    edit(root)
    return etree.tostring(root)


def backend_subject(gw: Any) -> str:
    got = received(gw)
    assert len(got) == 1
    return {k.lower(): v for k, v in got[0]["headers"].items()}[SUBJECT]


def test_the_client_and_the_gateway_name_a_pre_shared_key_by_reference(gw: Any, pki: Path) -> None:
    client = client_of(gw, pki, "hmac", key_name="demo-client")
    secured, pending = client.secure(echo("named"))
    ref = signature_reference(etree.fromstring(secured))
    assert (ref.get("URI"), ref.get("ValueType")) == ("#demo-client", ns.PRE_SHARED_KEY)
    r = post(gw, "hmac", secured)
    assert r.status_code == 200, r.text
    assert backend_subject(gw) == "key:demo-client"
    reply = etree.fromstring(r.content)
    ref = signature_reference(reply)
    assert (ref.get("URI"), ref.get("ValueType")) == ("#demo-client", ns.PRE_SHARED_KEY)
    assert reply.find(f".//{ns.q(ns.DS, 'KeyName')}") is None
    assert client.open(r.content, pending).body.findtext(f".//{{{DEMO}}}text") == "named"


@pytest.mark.parametrize("form", ["ds:KeyName", "Reference-without-ValueType"])
def test_earlier_and_looser_key_names_are_still_accepted(gw: Any, pki: Path, form: str) -> None:
    """Tolerant where it is safe: the bare ds:KeyName of earlier clients (BSP R5417 broken, nothing lost: the name
    resolves to the same configured key), a Reference without ValueType (R3059)."""
    client = client_of(gw, pki, "hmac", key_name="demo-client")
    secured, pending = client.secure(echo("old client"))

    def loosen(root: etree._Element) -> None:
        if form == "ds:KeyName":
            key_info = root.find(f".//{SIGNATURE}/{KEY_INFO}")
            key_info[:] = [keys.key_name("demo-client")]
        else:
            del signature_reference(root).attrib["ValueType"]

    r = post(gw, "hmac", edited(secured, loosen))
    assert r.status_code == 200, r.text
    assert backend_subject(gw) == "key:demo-client"
    # The reply names the key the BSP way whatever the request did.
    assert signature_reference(etree.fromstring(r.content)).get("ValueType") == ns.PRE_SHARED_KEY
    client.open(r.content, pending)


def _encrypted_key_named_like_the_pre_shared_key(root: etree._Element) -> None:
    """Mallory's own symmetric-binding key, its EncryptedKey given the Id "demo-client" and the signature's
    KeyInfo rewritten as a pre-shared key reference (KeyInfo is not signed: the signature still verifies)."""
    ek = root.find(f".//{ns.q(ns.XENC, 'EncryptedKey')}")
    ek.set("Id", "demo-client")
    ref = signature_reference(root)
    ref.set("URI", "#demo-client")
    ref.set("ValueType", ns.PRE_SHARED_KEY)
    ref.getparent().attrib.pop(ns.q(ns.WSSE11, "TokenType"), None)


def test_an_encrypted_key_with_a_key_names_id_does_not_pass_for_that_key(gw: Any, pki: Path) -> None:
    """The message's own EncryptedKey wins: the sender is anonymous, never key:demo-client."""
    secured, _ = client_of(gw, pki, "hmac").secure(echo("mallory"))
    r = post(gw, "hmac", edited(secured, _encrypted_key_named_like_the_pre_shared_key))
    assert r.status_code == 200, r.text
    assert backend_subject(gw) == "anonymous"


def test_an_encrypted_key_with_a_key_names_id_is_refused_where_anonymous_is(gw: Any, pki: Path) -> None:
    secured, _ = client_of(gw, pki, "hmac-strict").secure(echo("mallory"))
    r = post(gw, "hmac-strict", edited(secured, _encrypted_key_named_like_the_pre_shared_key))
    assert r.status_code == 500 and fault_code(r) == "FailedAuthentication", r.text
    assert received(gw) == []


@pytest.mark.parametrize("carrier", ["BinarySecurityToken", "header-block"])
def test_an_element_with_a_key_names_id_takes_the_reference_from_the_key(gw: Any, pki: Path, carrier: str) -> None:
    """Someone adds an element with wsu:Id "demo-client" to a message signed with that pre-shared key: the
    reference now names the element, never the key behind it, and the message is refused (not verified with
    a key the element could make the receiver pick)."""
    secured, _ = client_of(gw, pki, "hmac-strict", key_name="demo-client").secure(echo("x"))

    def add(root: etree._Element) -> None:
        security = root.find(f".//{SECURITY}")
        if carrier == "BinarySecurityToken":
            security.append(keys.make_bst(keys.load_certificate(pki / "client.pem"), "demo-client"))
        else:
            etree.SubElement(security.getparent(), "{urn:x}Note", {ns.q(ns.WSU, "Id"): "demo-client"})

    r = post(gw, "hmac-strict", edited(secured, add))
    assert r.status_code == 500 and fault_code(r) in ("InvalidSecurity", "SecurityTokenUnavailable"), r.text
    assert received(gw) == []


@pytest.mark.parametrize("name", ["two words", "1st", "a#b", "key/1", ""])
def test_key_names_that_cannot_be_a_reference_are_refused_when_loaded(tmp_path: Path, name: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(f'keys: {{"{name}": "{"A" * 44}"}}\n')
    with pytest.raises(ValueError):
        keys.load_hmac_keys(path)
    ok = tmp_path / "ok.yaml"
    ok.write_text(f'keys: {{"demo-client": "{"A" * 44}", "key_1.v2": "{"A" * 44}"}}\n')
    assert set(keys.load_hmac_keys(ok)) == {"demo-client", "key_1.v2"}
