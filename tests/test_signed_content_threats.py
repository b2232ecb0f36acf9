"""Issue #10, through the running gateway: nothing unverified reaches a secured service.

- Replay keys are the values that were verified, read whole: a resent message whose SignatureValue (or a
  UsernameToken's Nonce) is split by a comment, CDATA or a character reference, re-wrapped or re-padded is
  still the same message, refused; the backend gets it once.
- Comments inside signed content never reach the backend: C14N without comments ignores them, so a reader that
  stops at the first text node would see part of what was signed (the 2018 SAML comment-truncation class).
- The backend is told who signed (`key:<name>`, `anonymous`, the user, the certificate subject); header blocks
  the signature does not cover are stripped or refused; a SOAPAction must agree with a signed wsa:Action."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import requests
import yaml
from lxml import etree

from filters.engine import ns
from filters.engine.wss import username_token, wssecurity
from gateway.policy import Route
from gateway.tools.client import Client, ClientConfig, Pending, content_type, http_post
from tests.harness import clear, envelope, fault_code, received, running_gateway
from tests.wss_helpers import DEMO, echo, route_doc

CERT_SUBJECT = "CN=Demo Client,O=WSGate Demo"
VERSIONS = ["1.1", "1.2"]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Path):
    users = {"required": True, "users_file": str(pki / "users.yaml"), "protection": "encrypted"}
    sc = {"store": "sealed", "master_keys_file": str(pki / "sct-master-keys.yaml")}
    routes = [
        route_doc(pki, "rsa", name="rsa", replay={"store": "auto"}),
        route_doc(pki, "rsa", name="rsa-enc", replay={"store": "auto"},
                  encryption={"require_request": True, "encrypt_response": True}),
        route_doc(pki, "hmac", name="hmac", replay={"store": "auto"}),  # allow_anonymous: true (route_doc)
        route_doc(pki, "hmac", name="hmac-default", replay={"store": "auto"}, hmac={"allow_anonymous": False}),
        route_doc(pki, "hmac", name="username", replay={"store": "auto"}, username_token=users,
                  hmac={"allow_anonymous": False},
                  signature={"parts": ["body", "timestamp", "username_token"]}),
        route_doc(pki, "hmac", name="addressing", replay={"store": "auto"},
                  signature={"parts": ["body", "timestamp", "addressing"]}),
        route_doc(pki, "hmac", name="forward", replay={"store": "auto"},
                  unsigned_headers={"default": "forward", "addressing": "forward"}),
        route_doc(pki, "hmac", name="refuse", replay={"store": "auto"}, unsigned_headers={"addressing": "refuse"}),
        route_doc(pki, "secureconversation", name="sc", replay={"store": "auto"}, secureconversation=sc,
                  encryption={"encrypt_response": True}),
        {"name": "xml", "match": {"path_prefix": "/xml/"}, "upstream": {"address": "BACKEND"}, "profile": "xml"},
    ]  # fmt: skip
    with running_gateway(tmp_path_factory.mktemp("signed"), routes, pki) as g:
        yield g


def client(gw, pki: Path, name: str, **cfg: object) -> Client:
    docs = yaml.safe_load((gw.opts.policies / "routes.yaml").read_text())["routes"]
    route = Route.model_validate(next(r for r in docs if r["name"] == name))
    got = Client(route, ClientConfig(certs=pki, **cfg))  # type: ignore[arg-type]
    if route.profile == "secureconversation":
        got.establish(http_post(f"http://127.0.0.1:{gw.opts.http_port}/{name}/demo"))
    return got


def send(gw, name: str, body: bytes, version: str = "1.1", **headers: str) -> requests.Response:
    return requests.post(f"http://127.0.0.1:{gw.opts.http_port}/{name}/demo", data=body, timeout=10,
                         headers={"content-type": content_type(version), **headers})  # fmt: skip


def refused(resp: requests.Response, *codes: str) -> None:
    assert resp.status_code == 500, resp.text
    assert fault_code(resp) in codes, resp.text


# ---------------------------------------------------------------------------------------------------------
# Class 3: replay keys are the verified values, read whole


def _value(data: bytes, tag: bytes) -> tuple[int, int]:
    """Start and end of the text of the first <...:tag> element in `data`."""
    m = re.search(rb"<([\w-]+:)?" + tag + rb"[^>]*>([^<]*)</", data)
    assert m is not None, tag
    return m.start(2), m.end(2)


def _respell(data: bytes, tag: bytes, spell: Callable[[bytes], bytes]) -> bytes:
    start, end = _value(data, tag)
    return data[:start] + spell(data[start:end]) + data[end:]


def _repadded(value: bytes) -> bytes:
    """The same bytes in base64 whose unused trailing bits are set (decoders that ignore them read the same)."""
    text = value.strip()
    pad = len(text) - len(text.rstrip(b"="))
    assert pad, "a value with padding"
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    last = alphabet.index(text[-pad - 1 : -pad])
    bumped = alphabet[last | (0b1111 if pad == 2 else 0b11)]
    return text[: -pad - 1] + bytes([bumped]) + text[-pad:]


# Splits fall on 4-character boundaries: each piece is valid base64 on its own, as a reader of only the first
# text node would want.
SPELLINGS: dict[str, Callable[[bytes], bytes]] = {
    "comment-split": lambda v: v[:8] + b"<!---->" + v[8:],
    "comment-split-twice": lambda v: v[:4] + b"<!--a-->" + v[4:20] + b"<!--b-->" + v[20:],
    "cdata-split": lambda v: v[:8] + b"<![CDATA[" + v[8:32] + b"]]>" + v[32:],
    "character-reference": lambda v: b"&#%d;" % v[0] + v[1:],
    "line-breaks": lambda v: b"\n".join(v[i : i + 16] for i in range(0, len(v), 16)),
    "surrounding-whitespace": lambda v: b"\r\n\t " + v + b" \n",
    "non-canonical-padding": _repadded,
    "element-split": lambda v: v[:8] + b"<x/>" + v[8:],
}
SECURED = ["rsa", "hmac", "username", "sc"]
CREDENTIALS: dict[str, dict[str, object]] = {"username": {"user": "bob", "password": "bob-demo-password"}}


@pytest.fixture(scope="module")
def clients(gw, pki: Path) -> dict[str, Client]:
    return {name: client(gw, pki, name, **CREDENTIALS.get(name, {})) for name in SECURED}


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("name", SECURED)
def test_replay_with_a_respelled_signature_value_is_refused(gw, clients, name: str, spelling: str) -> None:
    secured, pending = clients[name].secure(echo(f"pay once {spelling}"))
    clear(gw)
    resp = send(gw, name, secured)
    assert resp.status_code == 200, resp.text
    clients[name].open(resp.content, pending)
    replay = _respell(secured, b"SignatureValue", SPELLINGS[spelling])
    assert replay != secured
    refused(send(gw, name, replay), "InvalidSecurity")
    assert len(received(gw)) == 1  # delivered once


# Spellings C14N does not see (the token stays validly signed when they are made on the wire) and those it does
# (made before the attacker's client signs its message).
INVISIBLE = {"comment-split", "comment-split-twice", "cdata-split", "character-reference"}
NONCE_SPELLINGS = [k for k in SPELLINGS if k != "element-split"]


def _captured_token(spelling: str, create: Callable[..., etree._Element]) -> Iterator[etree._Element]:
    """UsernameTokens for two messages: a fresh one, then the same (nonce, created, digest) with the Nonce
    respelled, as an attacker who captured it would attach it to a message of their own."""
    first = create("bob", "bob-demo-password", True, datetime.now(UTC), "UT-1")
    yield first
    if spelling in INVISIBLE:
        # The token travels encrypted (protection: encrypted): the respelling is made inside what gets encrypted.
        yield etree.fromstring(_respell(etree.tostring(first), b"Nonce", SPELLINGS[spelling]))
        return
    again = etree.fromstring(etree.tostring(first))
    nonce = again.find(ns.q(ns.WSSE, "Nonce"))
    assert nonce is not None
    nonce.text = SPELLINGS[spelling]((nonce.text or "").encode()).decode()
    yield again


@pytest.mark.parametrize("spelling", NONCE_SPELLINGS)
def test_username_token_nonce_replayed_in_another_spelling_is_refused(
    gw, clients, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    tokens = _captured_token(spelling, username_token.create)
    monkeypatch.setattr(wssecurity.username_token, "create", lambda *_a, **_k: next(tokens))
    clear(gw)
    secured, _ = clients["username"].secure(echo("first"))
    resp = send(gw, "username", secured)
    assert resp.status_code == 200, resp.text
    again, _ = clients["username"].secure(echo("second"))  # a new message (new key, signature), the same token
    refused(send(gw, "username", again), "FailedAuthentication")
    assert len(received(gw)) == 1


# ---------------------------------------------------------------------------------------------------------
# Class 4: the backend receives what was verified, without comments


COMMENTED = "user@victim.example<!---->ATK"
SIGNED_TEXT = "user@victim.exampleATK"  # what C14N without comments verified


def _commented(data: bytes) -> bytes:
    assert data.count(SIGNED_TEXT.encode()) == 1
    return data.replace(SIGNED_TEXT.encode(), COMMENTED.encode())


def _backend_text(gw) -> str:
    got = received(gw)
    assert len(got) == 1
    body = got[0]["body"]
    assert "<!--" not in body, body
    text = etree.fromstring(body.encode()).find(f".//{{{DEMO}}}text")
    assert text is not None and len(text) == 0  # one text node, as the backend's simplest reader sees it
    return text.text or ""


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", ["rsa", "hmac", "username", "sc"])
def test_comment_inside_signed_body_never_reaches_the_backend(gw, clients, name: str, version: str) -> None:
    secured, pending = clients[name].secure(echo(SIGNED_TEXT, version))
    clear(gw)
    resp = send(gw, name, _commented(secured), version)
    assert resp.status_code == 200, resp.text  # still validly signed: comments are not part of C14N
    clients[name].open(resp.content, pending)
    assert _backend_text(gw) == SIGNED_TEXT


@pytest.mark.parametrize("version", VERSIONS)
def test_comment_inside_encrypted_signed_content_never_reaches_the_backend(
    gw, pki: Path, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    # The attacker's client signs and encrypts a Body that holds a comment: after decryption it is signed
    # content like any other.
    monkeypatch.setattr(wssecurity, "drop_comments", lambda el: None)
    c = client(gw, pki, "rsa-enc")
    secured, _ = c.secure(echo(COMMENTED, version))
    assert b"victim" not in secured
    clear(gw)
    resp = send(gw, "rsa-enc", secured, version)
    assert resp.status_code == 200, resp.text
    assert _backend_text(gw) == SIGNED_TEXT


def test_comments_in_the_backend_response_are_not_signed_for_the_client(gw, clients) -> None:
    # The gateway signs responses: it signs no comment either (the client's C14N would ignore it).
    secured, pending = clients["rsa"].secure(echo("<!--r-->hello"))
    resp = send(gw, "rsa", secured)
    assert resp.status_code == 200, resp.text
    assert b"<!--" not in resp.content
    assert clients["rsa"].open(resp.content, pending).body.findtext(f".//{{{DEMO}}}text") == "hello"


def test_xml_route_forwards_comments_as_sent(gw) -> None:
    # No signature claims anything on an `xml` route: the body passes unchanged, comments included.
    clear(gw)
    body = envelope(f'<d:echo xmlns:d="{DEMO}"><d:text>{COMMENTED}</d:text></d:echo>')
    assert send(gw, "xml", body).status_code == 200
    assert COMMENTED in received(gw)[0]["body"]


# ---------------------------------------------------------------------------------------------------------
# Class 12: who signed it, and header blocks the signature does not cover


@pytest.mark.parametrize(
    ("name", "cfg", "identity"),
    [
        ("rsa", {}, CERT_SUBJECT),
        ("hmac", {"key_name": "demo-client"}, "key:demo-client"),
        ("hmac", {}, "anonymous"),
        ("hmac-default", {"key_name": "demo-client"}, "key:demo-client"),
        ("username", {"user": "bob", "password": "bob-demo-password"}, "bob"),
        ("sc", {}, CERT_SUBJECT),
    ],
)
def test_backend_is_told_who_signed(gw, pki: Path, name: str, cfg: dict, identity: str) -> None:
    c = client(gw, pki, name, **cfg)
    secured, pending = c.secure(echo("who"))
    clear(gw)
    resp = send(gw, name, secured, **{"x-wsgate-subject": "key:spoofed"})
    assert resp.status_code == 200, resp.text
    c.open(resp.content, pending)
    assert received(gw)[0]["headers"]["x-wsgate-subject"] == identity


@pytest.mark.parametrize("encrypt", [False, True])
def test_anonymous_encrypted_key_request_refused_unless_the_route_allows_it(gw, pki: Path, encrypt: bool) -> None:
    secured, _ = client(gw, pki, "hmac-default", encrypt=encrypt).secure(echo("anonymous"))
    clear(gw)
    refused(send(gw, "hmac-default", secured), "FailedAuthentication")
    assert received(gw) == []


WSA_2004 = "http://schemas.xmlsoap.org/ws/2004/08/addressing"


def _with_headers(blocks: str, version: str = "1.1") -> bytes:
    plain = echo("routed", version)
    return plain.replace(b"<soap:Body>", f"<soap:Header>{blocks}</soap:Header><soap:Body>".encode())


def _addressing(ns_uri: str, action: str = "urn:wsgate:demo/echo", to: str = "http://backend/admin") -> str:
    return f'<wsa:Action xmlns:wsa="{ns_uri}">{action}</wsa:Action><wsa:To xmlns:wsa="{ns_uri}">{to}</wsa:To>'


def _unsigned_block_added(c: Client, blocks: str, version: str = "1.1") -> tuple[bytes, Pending]:
    """A secured request with `blocks` added after signing, next to the Security header: nothing signed them."""
    secured, pending = c.secure(echo("routed", version))
    head = b"<wsse:Security"
    assert head in secured
    return secured.replace(head, blocks.encode() + head, 1), pending


@pytest.mark.parametrize("wsa", [ns.WSA, WSA_2004])
@pytest.mark.parametrize("version", VERSIONS)
def test_unsigned_addressing_headers_beside_a_signed_body_are_stripped(gw, pki: Path, wsa: str, version: str) -> None:
    c = client(gw, pki, "hmac", key_name="demo-client")
    secured, pending = _unsigned_block_added(c, _addressing(wsa), version)
    clear(gw)
    resp = send(gw, "hmac", secured, version)
    assert resp.status_code == 200, resp.text
    c.open(resp.content, pending)
    got = received(gw)[0]
    assert "Action" not in got["body"] and "admin" not in got["body"] and "Header" not in got["body"]
    assert got["headers"]["x-wsgate-subject"] == "key:demo-client"


def test_unsigned_addressing_headers_refused_where_the_route_says(gw, pki: Path) -> None:
    secured, _ = _unsigned_block_added(client(gw, pki, "refuse", key_name="demo-client"), _addressing(ns.WSA))
    clear(gw)
    refused(send(gw, "refuse", secured), "InvalidSecurity")
    assert received(gw) == []


def test_unsigned_headers_forwarded_only_where_the_route_says(gw, pki: Path) -> None:
    blocks = _addressing(ns.WSA) + '<a:Trace xmlns:a="urn:app">t-1</a:Trace>'
    secured, _ = _unsigned_block_added(client(gw, pki, "forward", key_name="demo-client"), blocks)
    clear(gw)
    assert send(gw, "forward", secured).status_code == 200
    body = received(gw)[0]["body"]
    assert "admin" in body and "t-1" in body


@pytest.mark.parametrize("version", VERSIONS)
def test_unsigned_must_understand_header_is_refused_not_dropped(gw, pki: Path, version: str) -> None:
    soap = ns.SOAP12 if version == "1.2" else ns.SOAP11
    value = "true" if version == "1.2" else "1"
    block = f'<a:Tx xmlns:a="urn:app" xmlns:s="{soap}" s:mustUnderstand="{value}">commit</a:Tx>'
    secured, _ = _unsigned_block_added(client(gw, pki, "hmac", key_name="demo-client"), block, version)
    clear(gw)
    refused(send(gw, "hmac", secured, version), "InvalidSecurity")
    assert received(gw) == []


def _signed_action_request(gw, pki: Path, version: str, action: str = "urn:wsgate:demo/echo") -> bytes:
    c = client(gw, pki, "addressing", key_name="demo-client")
    plain = echo("act", version).replace(
        b"<soap:Body>", f"<soap:Header>{_addressing(ns.WSA, action)}</soap:Header><soap:Body>".encode()
    )
    return c.secure(plain)[0]


@pytest.mark.parametrize(
    ("version", "headers", "accepted"),
    [
        ("1.1", {"soapaction": '"urn:wsgate:demo/echo"'}, True),
        ("1.1", {"soapaction": "urn:wsgate:demo/echo"}, True),
        ("1.1", {"soapaction": '""'}, True),
        ("1.1", {"soapaction": '"urn:wsgate:demo/admin"'}, False),
        ("1.1", {"soapaction": "urn:wsgate:demo/admin"}, False),
        ("1.2", {"content-type": 'application/soap+xml; charset=utf-8; action="urn:wsgate:demo/echo"'}, True),
        ("1.2", {"content-type": 'application/soap+xml; charset=utf-8; action="urn:wsgate:demo/admin"'}, False),
        ("1.2", {"content-type": "application/soap+xml;action=urn:wsgate:demo/admin"}, False),
        ("1.2", {"soapaction": "urn:wsgate:demo/admin"}, False),
    ],
)
def test_soap_action_must_agree_with_the_signed_wsa_action(
    gw, pki: Path, version: str, headers: dict[str, str], accepted: bool
) -> None:
    secured = _signed_action_request(gw, pki, version)
    clear(gw)
    resp = send(gw, "addressing", secured, version, **headers)
    if accepted:
        assert resp.status_code == 200, resp.text
        assert "urn:wsgate:demo/echo" in received(gw)[0]["body"]  # the signed wsa:Action reaches the backend
    else:
        refused(resp, "InvalidSecurity")
        assert received(gw) == []


def test_unsigned_wsa_action_beside_a_signed_one_is_refused(gw, pki: Path) -> None:
    # A route that forwards unsigned addressing blocks still never forwards two Actions, one of them unverified.
    c = client(gw, pki, "forward", key_name="demo-client")
    signed_parts = c.route.signature.model_copy(update={"parts": ["body", "timestamp", "addressing"]})
    c.route = c.route.model_copy(update={"signature": signed_parts})
    plain = echo("act").replace(b"<soap:Body>", f"<soap:Header>{_addressing(ns.WSA)}</soap:Header><soap:Body>".encode())
    secured, _ = c.secure(plain)
    extra = f'<wsa:Action xmlns:wsa="{ns.WSA}">urn:wsgate:demo/admin</wsa:Action>'.encode()
    clear(gw)
    assert send(gw, "forward", secured).status_code == 200  # the signed Action alone is fine
    secured, _ = c.secure(plain)
    refused(send(gw, "forward", secured.replace(b"<wsse:Security", extra + b"<wsse:Security", 1)), "InvalidSecurity")
    assert len(received(gw)) == 1


@pytest.mark.parametrize(("spelling", "accepted"), [("comment-split", True), ("element-split", False)])
def test_digest_value_split_reads_the_same_on_every_path(gw, clients, spelling: str, accepted: bool) -> None:
    # A DigestValue split by a comment is one value (the direct path and xmlsec agree); an element is refused.
    secured, pending = clients["rsa"].secure(echo("digest"))
    respelled = _respell(secured, b"DigestValue", SPELLINGS[spelling])
    clear(gw)
    resp = send(gw, "rsa", respelled)
    if accepted:
        assert resp.status_code == 200, resp.text
        clients["rsa"].open(resp.content, pending)
        assert len(received(gw)) == 1
    else:
        refused(resp, "InvalidSecurity")
        assert received(gw) == []
