"""The gateway's WS-Security engine for the `rsa` and `hmac` profiles, without Envoy.

A Client secures a request as its route asks, SecuredPipeline.request verifies and decrypts it into plain SOAP for
the backend, SecuredPipeline.response secures the backend's answer and the Client opens it. Every refusal carries
its WS-Security fault code with the generic message of faults.WSSE_CODES and leaves nothing for the backend.

Real keys from the session PKI (tests/conftest.py) and real crypto; messages the Client cannot make (encrypt-then-
sign, attacks) are built with the engine's own pieces (sending.secure, signing.Signer, encryption). Only the
client's clock is ever moved, for the freshness tests."""

from __future__ import annotations

import base64
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.serialization import Encoding
from lxml import etree

from certs import pki as pki_mod
from filters.engine import faults, ns
from filters.engine.engine import Exchange, Outcome
from filters.engine.profiles import SecuredPipeline
from filters.engine.wss import encryption, keys, signing, wssecurity
from filters.engine.wss import wssecurity_sending as sending
from filters.engine.xml.soap import Envelope
from filters.engine.xml.threat_protection import parse_envelope
from filters.stores import replay
from filters.stores.factory import RouteStores
from filters.stores.replay import MemoryReplayCache
from gateway.policy import Limits, Route
from gateway.tools.client import Client, ClientError, Pending
from tests.support.wss_helpers import DEMO, client_for, echo, echo_response, make_route

SOAP11, SOAP12 = ns.SOAP11, ns.SOAP12
SECURITY = ns.q(ns.WSSE, "Security")
SIGNATURE = ns.q(ns.DS, "Signature")
TIMESTAMP = ns.q(ns.WSU, "Timestamp")
BST = ns.q(ns.WSSE, "BinarySecurityToken")
USERNAME_TOKEN = ns.q(ns.WSSE, "UsernameToken")
ENCRYPTED_KEY = ns.q(ns.XENC, "EncryptedKey")
ENCRYPTED_DATA = ns.q(ns.XENC, "EncryptedData")
REFERENCE_LIST = ns.q(ns.XENC, "ReferenceList")
CIPHER_VALUE = ns.q(ns.XENC, "CipherValue")
WSU_ID = ns.q(ns.WSU, "Id")
ATTACK = "urn:attacker"
APP = "urn:wsgate:app"
EVIL = f'<d:echo xmlns:d="{DEMO}"><d:text>evil</d:text></d:echo>'
PASSWORDS = pki_mod.DEMO_USERS
ENCRYPT_BOTH_WAYS = {"require_request": True, "encrypt_response": True}
CLIENT_SUBJECT = "CN=Demo Client,O=WSGate Demo"
CLIENT2_SUBJECT = "CN=Demo Client Two,O=WSGate Demo"


# --- routes, exchanges, assertions ----------------------------------------------------------------------


def users_route(pki: Path, profile: str = "hmac", **extra: Any) -> Route:
    """A route that requires a UsernameToken from the demo users (alice: PasswordText hash, bob: digest-capable),
    encrypted under the signing key (EncryptedSupportingTokens)."""
    ut = {"required": True, "users_file": str(pki / "users.yaml"), "protection": "encrypted"}
    return make_route(pki, profile, username_token={**ut, **extra.pop("username_token", {})}, **extra)


@dataclass
class Trip:
    backend: bytes  # what the backend got
    headers: dict[str, str]  # headers the gateway set on the request, but the content-type (always UTF-8 here)
    reply: bytes  # the secured response, as the client receives it
    opened: Envelope  # the response, verified and decrypted by the client


def trip(
    pipeline: SecuredPipeline,
    client: Client,
    plain: bytes | None = None,
    *,
    secured: tuple[bytes, Pending] | None = None,
    backend: Callable[[bytes], bytes] = echo_response,
) -> Trip:
    """One exchange through the gateway's engine: the client's request (or a prepared one) there and back."""
    data, pending = secured or client.secure(plain or echo())
    ex = Exchange(route=pipeline.route)
    outcome = pipeline.request(data, {}, ex)
    assert outcome.body is not None
    headers = dict(outcome.set_headers)
    assert headers.pop("content-type").endswith("; charset=utf-8")  # the gateway's serialization is UTF-8
    reply = pipeline.response(backend(outcome.body), ex).body
    assert reply is not None
    return Trip(outcome.body, headers, reply, client.open(reply, pending))


def accept(pipeline: SecuredPipeline, data: bytes) -> Outcome:
    ex = Exchange(route=pipeline.route)
    outcome = pipeline.request(data, {}, ex)
    assert outcome.body is not None and ex.security is not None
    return outcome


def refuse(pipeline: SecuredPipeline, data: bytes, code: str | None = None) -> faults.Fault:
    """Refused with `code` (any code when None) and its generic message; nothing is left for the backend."""
    ex = Exchange(route=pipeline.route)
    outcome: Outcome | None = None
    with pytest.raises(faults.Fault) as info:
        outcome = pipeline.request(data, {}, ex)
    assert outcome is None
    assert ex.security is None
    fault = info.value
    if code is not None:
        assert fault.code == code, fault.reason
    if fault.code:
        assert fault.code_ns == ns.WSSE
        assert fault.message == faults.WSSE_CODES[fault.code]
    else:  # threat protection: a plain Client fault
        assert fault.sender and fault.message == "The request is not a valid SOAP message"
    return fault


def assert_plain(backend: bytes, text: str = "hello", version: str = "1.1", headers_left: int = 0) -> None:
    """Plain SOAP for the backend: no security header, no empty Header, no ciphertext, the content back."""
    root = etree.fromstring(backend)
    soap = SOAP12 if version == "1.2" else SOAP11
    assert root.tag == ns.q(soap, "Envelope")
    assert next(root.iter(SECURITY, SIGNATURE, ENCRYPTED_DATA, ENCRYPTED_KEY, TIMESTAMP, BST), None) is None
    header = root.find(ns.q(soap, "Header"))
    if headers_left:
        assert header is not None and len(header) == headers_left
    else:
        assert header is None
    body = root.find(ns.q(soap, "Body"))
    assert body is not None and body.get(WSU_ID) is None
    assert body.findtext(f"{{{DEMO}}}echo/{{{DEMO}}}text") == text


def assert_secured_reply(reply: bytes, *, encrypted: bool, version: str = "1.1", text: str = "hello") -> None:
    root = etree.fromstring(reply)
    soap = SOAP12 if version == "1.2" else SOAP11
    assert root.tag == ns.q(soap, "Envelope")
    security = root.find(f"{ns.q(soap, 'Header')}/{SECURITY}")
    assert security is not None and security.find(SIGNATURE) is not None and security.find(TIMESTAMP) is not None
    assert security.get(ns.q(soap, "mustUnderstand")) == ("true" if version == "1.2" else "1")
    body = root.find(ns.q(soap, "Body"))
    assert body is not None
    assert (body.find(ENCRYPTED_DATA) is not None) == encrypted
    assert (text.encode() in reply) != encrypted


def assert_opened(env: Envelope, text: str = "hello", version: str = "1.1") -> None:
    assert env.version == version
    assert env.header is None or env.header.find(SECURITY) is None
    assert env.body.findtext(f"{{{DEMO}}}echoResponse/{{{DEMO}}}text") == text


def security_children(data: bytes) -> list[str]:
    security = etree.fromstring(data).find(f".//{SECURITY}")
    assert security is not None
    return [etree.QName(c).localname for c in security if isinstance(c.tag, str)]


def psk(pki: Path) -> bytes:
    return keys.load_hmac_keys(pki / "hmac-keys.yaml")["demo-client"]


def keys_file(tmp_path: Path, name: str, secret: bytes) -> str:
    path = tmp_path / f"{name}-keys.yaml"
    path.write_text(yaml.safe_dump({"keys": {name: base64.b64encode(secret).decode()}}))
    return str(path)


# --- building messages by hand ----------------------------------------------------------------------------


def bare(plain: bytes | None = None, *, timestamp: bool = True) -> Envelope:
    """A request with a Security header holding only a Timestamp (or nothing): the start of a hand-made message."""
    env = parse_envelope(plain or echo(), Limits())
    # A fresh Body id: RSA PKCS#1 v1.5 signatures are deterministic, and the replay store would see the same
    # signature value in two tests that sign the same content.
    env.body.set(WSU_ID, sending.new_id("id"))
    sending.secure(env, datetime.now(UTC), timestamp_ttl_s=300 if timestamp else None, sign=None)
    return env


def security_of(env: Envelope) -> etree._Element:
    security = wssecurity.find_security(env)
    assert security is not None
    return security


def timestamp_of(env: Envelope) -> etree._Element:
    ts = security_of(env).find(TIMESTAMP)
    assert ts is not None
    return ts


def sign_x509(
    env: Envelope,
    pki: Path,
    elements: list[etree._Element],
    *,
    at: int = 0,
    who: str = "client",
    algorithm: str = "rsa-sha256",
) -> etree._Element:
    """Sign `elements` with `who`'s key; BinarySecurityToken and Signature land at position `at` of the header."""
    security = security_of(env)
    bst_id = sending.new_id("X509")
    signer = signing.Signer(keys.load_private_key(pki / f"{who}.key"), algorithm, "sha256")
    sig = signer.sign(env, security, elements, keys.str_reference(bst_id, ns.X509V3))
    security.remove(sig)
    security.insert(at, sig)
    security.insert(at, keys.make_bst(keys.load_certificate(pki / f"{who}.pem"), bst_id))
    return sig


def sign_hmac(
    env: Envelope, secret: bytes, key_info: etree._Element, elements: list[etree._Element], *, at: int = 0
) -> etree._Element:
    security = security_of(env)
    sig = signing.Signer(secret, "hmac-sha256", "sha256").sign(env, security, elements, key_info)
    security.remove(sig)
    security.insert(at, sig)
    return sig


def gateway_cert(pki: Path) -> x509.Certificate:
    return keys.load_certificate(pki / "gateway-enc.pem")


def attacker_encrypted(
    pki: Path, content: str = EVIL, *, algorithm: str = "aes256-gcm"
) -> tuple[etree._Element, etree._Element]:
    """What anyone can make with the gateway's public certificate: an EncryptedData (Type Content) of `content`
    and the EncryptedKey that opens it."""
    key = encryption.new_key(algorithm)
    ed_id = sending.new_id("ED")
    ed = encryption.encrypt_content(etree.fromstring(f"<holder>{content}</holder>"), key, algorithm, ed_id, None)
    cert = gateway_cert(pki)
    ek_id = sending.new_id("EK")
    ek = encryption.encrypt_key(key, cert, "rsa-oaep-mgf1p", ek_id, keys.str_issuer_serial(cert), [ed_id])
    return ed, ek


def parts(root: etree._Element, soap: str = SOAP11) -> tuple[etree._Element, etree._Element, etree._Element]:
    """(Header, our wsse:Security, Body) of a parsed request."""
    header = root.find(ns.q(soap, "Header"))
    assert header is not None
    security = header.find(SECURITY)
    body = root.find(ns.q(soap, "Body"))
    assert security is not None and body is not None
    return header, security, body


def mutate(data: bytes, change: Callable[[etree._Element], None]) -> bytes:
    root = etree.fromstring(data)
    change(root)
    return etree.tostring(root)


# =========================================================================================================
# Happy paths


def test_rsa_sign(pki: Path) -> None:
    route = make_route(pki, "rsa")
    client = client_for(route, pki)
    secured, pending = client.secure(echo())
    assert security_children(secured) == ["Timestamp", "BinarySecurityToken", "Signature"]
    t = trip(SecuredPipeline(route, RouteStores()), client, secured=(secured, pending))
    assert_plain(t.backend)
    assert_secured_reply(t.reply, encrypted=False)
    assert_opened(t.opened)
    # The reply is signed with the gateway's signing certificate, sent as a token.
    bst = etree.fromstring(t.reply).find(f".//{BST}")
    assert bst is not None
    assert keys.parse_bst(bst) == keys.load_certificate(pki / "gateway-sign.pem")


def test_rsa_sign_and_encrypt_both_ways(pki: Path) -> None:
    route = make_route(pki, "rsa", encryption=ENCRYPT_BOTH_WAYS)
    client = client_for(route, pki)
    secured, pending = client.secure(echo("secret words"))
    assert b"secret words" not in secured
    t = trip(SecuredPipeline(route, RouteStores()), client, secured=(secured, pending))
    assert_plain(t.backend, "secret words")
    assert_secured_reply(t.reply, encrypted=True, text="secret words")
    assert_opened(t.opened, "secret words")


def _pre_shared_key_reference(message: bytes) -> str | None:
    """The URI of the Signature's KeyInfo reference, checked to be the pre-shared key form (BSP R5417)."""
    sig = etree.fromstring(message).find(f".//{SIGNATURE}")
    assert sig is not None
    ref = sig.find(f"{ns.q(ns.DS, 'KeyInfo')}/{keys.STR}/{ns.q(ns.WSSE, 'Reference')}")
    assert ref is not None and ref.get("ValueType") == ns.PRE_SHARED_KEY
    return ref.get("URI")


def test_hmac_pre_shared_key(pki: Path) -> None:
    route = make_route(pki, "hmac")
    client = client_for(route, pki, key_name="demo-client")
    secured, pending = client.secure(echo())
    assert security_children(secured) == ["Timestamp", "Signature"]
    assert _pre_shared_key_reference(secured) == "#demo-client"
    t = trip(SecuredPipeline(route, RouteStores()), client, secured=(secured, pending))
    assert_plain(t.backend)
    assert_secured_reply(t.reply, encrypted=False)
    assert_opened(t.opened)
    # The reply's HMAC names the same pre-shared key; the backend is told which key signed.
    assert _pre_shared_key_reference(t.reply) == "#demo-client"
    assert t.headers == {"x-wsgate-subject": "key:demo-client"}


def test_hmac_symmetric_binding(pki: Path) -> None:
    route = make_route(pki, "hmac")
    client = client_for(route, pki)
    secured, pending = client.secure(echo())
    assert security_children(secured) == ["Timestamp", "EncryptedKey", "Signature"]
    assert pending.secret is not None and pending.encrypted_key_sha1 is not None
    t = trip(SecuredPipeline(route, RouteStores()), client, secured=(secured, pending))
    assert_plain(t.backend)
    assert_secured_reply(t.reply, encrypted=False)
    assert_opened(t.opened)
    # The reply names the request's key by its EncryptedKeySHA1, as WS-Security 1.1 has it.
    identifier = etree.fromstring(t.reply).find(f".//{ns.q(ns.WSSE, 'KeyIdentifier')}")
    assert identifier is not None and identifier.get("ValueType") == ns.ENCKEY_SHA1
    assert identifier.text == pending.encrypted_key_sha1


@pytest.mark.parametrize("key_name", [None, "demo-client"], ids=["symmetric-binding", "pre-shared-key"])
def test_hmac_sign_and_encrypt_both_ways(pki: Path, key_name: str | None) -> None:
    route = make_route(pki, "hmac", encryption=ENCRYPT_BOTH_WAYS)
    client = client_for(route, pki, key_name=key_name)
    secured, pending = client.secure(echo("secret words"))
    assert b"secret words" not in secured
    assert "ReferenceList" in security_children(secured)
    t = trip(SecuredPipeline(route, RouteStores()), client, secured=(secured, pending))
    assert_plain(t.backend, "secret words")
    assert_secured_reply(t.reply, encrypted=True, text="secret words")
    assert_opened(t.opened, "secret words")


@pytest.mark.parametrize(
    ("user", "digest"), [("alice", False), ("bob", True), ("bob", False)], ids=["alice-text", "bob-digest", "bob-text"]
)
def test_username_token(pki: Path, user: str, digest: bool) -> None:
    route = users_route(pki)
    client = client_for(route, pki, key_name="demo-client", user=user, password=PASSWORDS[user], password_digest=digest)
    secured, pending = client.secure(echo())
    assert b"<wsse:UsernameToken" not in secured and PASSWORDS[user].encode() not in secured  # travels encrypted
    t = trip(SecuredPipeline(route, RouteStores()), client, secured=(secured, pending))
    assert_plain(t.backend)
    assert_opened(t.opened)
    assert t.headers == {"x-wsgate-subject": user}  # on an hmac route the user is who the backend is told


def test_username_token_signed_as_a_part(pki: Path) -> None:
    route = users_route(pki, signature={"parts": ["body", "timestamp", "username_token"]})
    client = client_for(route, pki, user="bob", password=PASSWORDS["bob"])
    t = trip(SecuredPipeline(route, RouteStores()), client)
    assert_plain(t.backend)
    assert_opened(t.opened)


def test_username_token_with_x509_signature_names_the_signer(pki: Path) -> None:
    route = users_route(pki, "rsa")
    client = client_for(route, pki, user="bob", password=PASSWORDS["bob"])
    t = trip(SecuredPipeline(route, RouteStores()), client)
    assert_plain(t.backend)
    assert_opened(t.opened)
    assert t.headers == {"x-wsgate-subject": CLIENT_SUBJECT}  # the signer, not the user: the signature is the proof


SOAP12_CASES = [
    ("rsa", {}, {}),
    ("rsa", {"encryption": ENCRYPT_BOTH_WAYS}, {}),
    ("hmac", {}, {"key_name": "demo-client"}),
    ("hmac", {"encryption": ENCRYPT_BOTH_WAYS}, {}),
]


@pytest.mark.parametrize(("profile", "extra", "cfg"), SOAP12_CASES, ids=["rsa", "rsa-enc", "hmac-psk", "hmac-enc"])
def test_soap12(pki: Path, profile: str, extra: dict[str, Any], cfg: dict[str, Any]) -> None:
    route = make_route(pki, profile, **extra)
    client = client_for(route, pki, **cfg)
    secured, pending = client.secure(echo(version="1.2"))
    security = etree.fromstring(secured).find(f".//{SECURITY}")
    assert security is not None and security.get(ns.q(SOAP12, "mustUnderstand")) == "true"
    t = trip(SecuredPipeline(route, RouteStores()), client, secured=(secured, pending))
    assert_plain(t.backend, version="1.2")
    assert_secured_reply(t.reply, encrypted=bool(extra), version="1.2")
    assert_opened(t.opened, version="1.2")


def test_unsigned_application_headers_reach_the_backend_only_when_the_route_forwards_them(pki: Path) -> None:
    plain = echo().replace(
        b"<soap:Body>", f'<soap:Header><a:Trace xmlns:a="{APP}">t-1</a:Trace></soap:Header><soap:Body>'.encode()
    )
    route = make_route(pki, "rsa", encryption=ENCRYPT_BOTH_WAYS, unsigned_headers={"default": "forward"})
    t = trip(SecuredPipeline(route, RouteStores()), client_for(route, pki), plain)
    assert_plain(t.backend, headers_left=1)
    assert etree.fromstring(t.backend).findtext(f".//{{{APP}}}Trace") == "t-1"
    route = make_route(pki, "rsa", encryption=ENCRYPT_BOTH_WAYS)  # default: strip
    t = trip(SecuredPipeline(route, RouteStores()), client_for(route, pki), plain)
    assert_plain(t.backend)
    route = make_route(pki, "rsa", encryption=ENCRYPT_BOTH_WAYS, unsigned_headers={"default": "refuse"})
    fault = refuse(SecuredPipeline(route, RouteStores()), client_for(route, pki).secure(plain)[0], "InvalidSecurity")
    assert "Trace" in fault.reason


def test_sign_then_encrypt_decrypts_before_it_verifies(pki: Path) -> None:
    """The Client's order (WSS4J's "Signature Encrypt"): the EncryptedKey on top, the Body signed in plaintext."""
    route = make_route(pki, "rsa", encryption=ENCRYPT_BOTH_WAYS)
    client = client_for(route, pki)
    secured, pending = client.secure(echo())
    order = security_children(secured)
    assert order.index("EncryptedKey") < order.index("Signature")
    t = trip(SecuredPipeline(route, RouteStores()), client, secured=(secured, pending))
    assert_plain(t.backend)
    assert_opened(t.opened)


def encrypt_then_sign(pki: Path, mode: str, plain: bytes) -> tuple[bytes, Pending]:
    """The Body content encrypted first, then the Body (holding the EncryptedData) and the Timestamp signed; the
    Signature sits above the EncryptedKey/ReferenceList so the receiver verifies, then decrypts."""
    env = parse_envelope(plain, Limits())
    now = datetime.now(UTC)
    pending = Pending()
    if mode == "rsa":
        sending.secure(
            env,
            now,
            timestamp_ttl_s=300,
            sign=None,
            encrypt=sending.EncryptFor("aes256-gcm", certificate=gateway_cert(pki)),
        )
        sign_x509(env, pki, [env.body, timestamp_of(env)])
    elif mode == "hmac-psk":
        secret = psk(pki)
        sending.secure(
            env,
            now,
            timestamp_ttl_s=300,
            sign=None,
            encrypt=sending.EncryptFor(
                "aes256-gcm", secret=secret, secret_key_info=lambda: keys.key_name("demo-client")
            ),
        )
        sign_hmac(env, secret, keys.key_name("demo-client"), [env.body, timestamp_of(env)])
        pending.secret = secret
    else:  # the symmetric binding: the EncryptedKey (no ReferenceList) first, as the signature needs its key
        secret = os.urandom(32)
        got = sending.secure(
            env,
            now,
            timestamp_ttl_s=300,
            sign=None,
            encrypt=sending.EncryptFor("aes256-gcm", secret=secret),
            symmetric_binding=(secret, gateway_cert(pki), "rsa-oaep-mgf1p"),
        )
        ek = security_of(env).find(ENCRYPTED_KEY)
        assert ek is not None and ek.find(REFERENCE_LIST) is None
        key_info = keys.str_reference(ek.get("Id") or "", ns.ENCKEY_TOKEN)
        sign_hmac(env, secret, key_info, [env.body, timestamp_of(env)], at=2)  # Timestamp, EncryptedKey, here
        pending.secret, pending.encrypted_key_sha1 = secret, got.encrypted_key_sha1
    return env.serialize(), pending


@pytest.mark.parametrize("mode", ["rsa", "hmac-psk", "hmac-binding"])
def test_encrypt_then_sign(pki: Path, mode: str) -> None:
    profile = "rsa" if mode == "rsa" else "hmac"
    route = make_route(pki, profile, encryption=ENCRYPT_BOTH_WAYS)
    client = client_for(route, pki, key_name="demo-client" if mode == "hmac-psk" else None)
    secured, pending = encrypt_then_sign(pki, mode, echo("secret words"))
    order = security_children(secured)
    decrypting = "EncryptedKey" if mode == "rsa" else "ReferenceList"
    assert order.index("Signature") < order.index(decrypting)
    assert b"secret words" not in secured
    t = trip(SecuredPipeline(route, RouteStores()), client, secured=(secured, pending))
    assert_plain(t.backend, "secret words")
    assert_secured_reply(t.reply, encrypted=True, text="secret words")
    assert_opened(t.opened, "secret words")


def backend_fault(version: str) -> Callable[[bytes], bytes]:
    def answer(_: bytes) -> bytes:
        return faults.render(faults.server("backend broke", "Order service unavailable"), version)

    return answer


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize(("profile", "extra", "cfg"), SOAP12_CASES, ids=["rsa", "rsa-enc", "hmac-psk", "hmac-enc"])
def test_backend_faults_are_secured(
    pki: Path, profile: str, extra: dict[str, Any], cfg: dict[str, Any], version: str
) -> None:
    route = make_route(pki, profile, **extra)
    client = client_for(route, pki, **cfg)
    pipeline = SecuredPipeline(route, RouteStores())
    secured, pending = client.secure(echo(version=version))
    ex = Exchange(route=route)
    pipeline.request(secured, {}, ex)
    reply = pipeline.response(backend_fault(version)(b""), ex).body
    assert reply is not None
    assert_secured_reply(reply, encrypted=bool(extra), version=version, text="Order service unavailable")
    # The client verified (and decrypted) the secured fault before reporting it.
    with pytest.raises(ClientError, match=r"^SOAP fault: .*Order service unavailable"):
        client.open(reply, pending)
    start = reply.index(b"<ds:SignatureValue>") + len(b"<ds:SignatureValue>")
    flipped = b"B" if reply[start : start + 1] == b"A" else b"A"  # the same length, another value
    tampered = reply[:start] + flipped + reply[start + 1 :]
    with pytest.raises(ClientError, match=r"reply refused \(FailedCheck\)"):
        client.open(tampered, pending)


def test_backend_faults_pass_unsecured_when_the_policy_says_so(pki: Path) -> None:
    route = make_route(pki, "rsa", secure_faults=False)
    client = client_for(route, pki)
    pipeline = SecuredPipeline(route, RouteStores())
    ex = Exchange(route=route)
    pipeline.request(client.secure(echo())[0], {}, ex)
    assert pipeline.response(backend_fault("1.1")(b""), ex).body is None  # passed on unchanged


@pytest.mark.parametrize(("who", "subject"), [("client", CLIENT_SUBJECT), ("client2", CLIENT2_SUBJECT)])
def test_identity_header_is_the_signer_subject(pki: Path, who: str, subject: str) -> None:
    assert keys.load_certificate(pki / f"{who}.pem").subject.rfc4514_string() == subject
    route = make_route(pki, "rsa", identity_header="x-caller")
    client = client_for(route, pki, key=f"{who}.key", certificate=f"{who}.pem")
    t = trip(SecuredPipeline(route, RouteStores()), client)
    assert t.headers == {"x-caller": subject}


def test_no_identity_header_when_the_route_has_none(pki: Path) -> None:
    route = make_route(pki, "rsa", identity_header=None)
    assert trip(SecuredPipeline(route, RouteStores()), client_for(route, pki)).headers == {}


def test_allowed_subject_accepted(pki: Path) -> None:
    route = make_route(pki, "rsa", rsa={"allowed_subjects": [CLIENT2_SUBJECT]})
    client = client_for(route, pki, key="client2.key", certificate="client2.pem")
    assert trip(SecuredPipeline(route, RouteStores()), client).headers == {"x-wsgate-subject": CLIENT2_SUBJECT}


@pytest.mark.parametrize("profile", ["rsa", "hmac"])
def test_rsa_1_5_key_transport_accepted_when_allowed(pki: Path, profile: str) -> None:
    # The client sends rsa-1_5 (its first choice); the gateway answers with OAEP, which the client also takes.
    client_route = make_route(
        pki, profile, encryption={**ENCRYPT_BOTH_WAYS, "key_transport": ["rsa-1_5", "rsa-oaep-mgf1p"]}
    )
    client = client_for(client_route, pki)
    secured, pending = client.secure(echo())
    assert encryption.KEY_TRANSPORTS["rsa-1_5"].encode() in secured
    route = make_route(pki, profile, encryption={**ENCRYPT_BOTH_WAYS, "key_transport": ["rsa-oaep-mgf1p", "rsa-1_5"]})
    t = trip(SecuredPipeline(route, RouteStores()), client, secured=(secured, pending))
    assert_plain(t.backend)
    assert_opened(t.opened)


def test_timestamp_within_the_clock_skew_accepted(pki: Path, client_clock: Callable[[timedelta], None]) -> None:
    route = make_route(pki, "rsa")
    client_clock(timedelta(minutes=4))  # the client runs four minutes fast: inside the five-minute skew
    accept(SecuredPipeline(route, RouteStores()), client_for(route, pki).secure(echo())[0])


def test_timestamp_optional_when_not_required(pki: Path) -> None:
    route = make_route(pki, "hmac", timestamp={"required": False})
    env = bare(timestamp=False)
    sign_hmac(env, psk(pki), keys.key_name("demo-client"), [env.body])
    pipeline = SecuredPipeline(route, RouteStores())
    pipeline.credentials.replay = MemoryReplayCache(epoch_ms=0)  # a store that has seen everything since 1970
    assert_plain(accept(pipeline, env.serialize()).body or b"")


def test_without_a_timestamp_a_store_that_lost_its_memory_refuses_until_a_copy_would_have_expired(pki: Path) -> None:
    # Nothing signed says when the message was made: a fresh store (a worker restarted) cannot tell it from one
    # accepted before, until max_age + 2 x skew after its epoch.
    route = make_route(pki, "hmac", timestamp={"required": False, "max_age_s": 60, "clock_skew_s": 10})
    env = bare(timestamp=False)
    sign_hmac(env, psk(pki), keys.key_name("demo-client"), [env.body])
    pipeline = SecuredPipeline(route, RouteStores())
    pipeline.credentials.replay = MemoryReplayCache(epoch_ms=replay.now_ms() - 79_000)
    refuse(pipeline, env.serialize(), "MessageExpired")
    pipeline.credentials.replay = MemoryReplayCache(epoch_ms=replay.now_ms() - 81_000)
    assert_plain(accept(pipeline, env.serialize()).body or b"")


# =========================================================================================================
# Refusals


def test_plain_soap_refused(pki: Path) -> None:
    refuse(SecuredPipeline(make_route(pki, "rsa"), RouteStores()), echo(), "InvalidSecurity")


@pytest.mark.parametrize(("profile", "cfg"), [("rsa", {}), ("hmac", {"key_name": "demo-client"}), ("hmac", {})])
def test_tampered_body_fails_check(pki: Path, profile: str, cfg: dict[str, Any]) -> None:
    route = make_route(pki, profile)
    secured, _ = client_for(route, pki, **cfg).secure(echo("pay 10"))
    refuse(SecuredPipeline(route, RouteStores()), secured.replace(b"pay 10", b"pay 99"), "FailedCheck")


def test_tampered_timestamp_fails_check(pki: Path) -> None:
    route = make_route(pki, "rsa")
    secured, _ = client_for(route, pki).secure(echo())

    def later(root: etree._Element) -> None:
        expires = root.find(f".//{ns.q(ns.WSU, 'Expires')}")
        assert expires is not None
        expires.text = "2099-01-01T00:00:00.000Z"

    refuse(SecuredPipeline(route, RouteStores()), mutate(secured, later), "FailedCheck")


def test_wrong_hmac_key_fails_check(pki: Path, tmp_path: Path) -> None:
    route = make_route(pki, "hmac")
    other = make_route(pki, "hmac", hmac={"keys_file": keys_file(tmp_path, "demo-client", os.urandom(32))})
    secured, _ = client_for(other, pki, key_name="demo-client").secure(echo())
    refuse(SecuredPipeline(route, RouteStores()), secured, "FailedCheck")


def test_unknown_pre_shared_key_name(pki: Path, tmp_path: Path) -> None:
    route = make_route(pki, "hmac")
    other = make_route(pki, "hmac", hmac={"keys_file": keys_file(tmp_path, "stranger", os.urandom(32))})
    secured, _ = client_for(other, pki, key_name="stranger").secure(echo())
    refuse(SecuredPipeline(route, RouteStores()), secured, "SecurityTokenUnavailable")


@pytest.mark.parametrize(
    ("delta", "ttl"),
    [(timedelta(minutes=20), 300), (timedelta(minutes=-20), 300), (timedelta(seconds=-400), 1)],
    ids=["created-in-the-future", "created-too-long-ago", "expires-passed"],
)
def test_stale_or_future_timestamp_expired(
    pki: Path, client_clock: Callable[[timedelta], None], delta: timedelta, ttl: int
) -> None:
    route = make_route(pki, "rsa")
    client_clock(delta)
    secured, _ = client_for(route, pki, timestamp_ttl_s=ttl).secure(echo())
    refuse(SecuredPipeline(route, RouteStores()), secured, "MessageExpired")


def test_username_token_created_in_the_future_expired(pki: Path, client_clock: Callable[[timedelta], None]) -> None:
    route = users_route(pki, timestamp={"required": False})
    client_clock(timedelta(minutes=20))
    client = client_for(route, pki, key_name="demo-client", user="bob", password=PASSWORDS["bob"])
    # Without its (equally future) Timestamp and re-signed, the UsernameToken's own Created is what is refused.
    env = parse_envelope(client.secure(echo())[0], Limits())
    security_of(env).remove(timestamp_of(env))
    sig = security_of(env).find(SIGNATURE)
    assert sig is not None
    security_of(env).remove(sig)
    sign_hmac(env, psk(pki), keys.key_name("demo-client"), [env.body])
    refuse(SecuredPipeline(route, RouteStores()), env.serialize(), "MessageExpired")


@pytest.mark.parametrize(
    ("profile", "extra", "cfg"),
    [
        ("rsa", {}, {}),
        ("rsa", {"encryption": ENCRYPT_BOTH_WAYS}, {}),
        ("hmac", {}, {"key_name": "demo-client"}),
        ("hmac", {"encryption": ENCRYPT_BOTH_WAYS}, {}),
    ],
    ids=["rsa", "rsa-enc", "hmac-psk", "hmac-enc"],
)
def test_replayed_message_refused(pki: Path, profile: str, extra: dict[str, Any], cfg: dict[str, Any]) -> None:
    route = make_route(pki, profile, **extra)
    pipeline = SecuredPipeline(route, RouteStores())
    secured, _ = client_for(route, pki, **cfg).secure(echo())
    accept(pipeline, secured)
    fault = refuse(pipeline, secured, "InvalidSecurity")
    assert fault.reason.startswith("replay")
    # A rebuilt pipeline (a policy reload) still remembers it.
    refuse(SecuredPipeline(route, RouteStores()), secured, "InvalidSecurity")


@pytest.mark.parametrize(("user", "digest"), [("alice", False), ("bob", True)], ids=["alice-text", "bob-digest"])
def test_replayed_username_token_nonce_refused(pki: Path, user: str, digest: bool) -> None:
    """A fresh, validly signed message that carries a UsernameToken seen before (Body and Timestamp signed, the
    token not, readable: the route relies on TLS): the nonce gives it away."""
    route = users_route(pki, username_token={"protection": "tls"})
    pipeline = SecuredPipeline(route, RouteStores())
    client = client_for(route, pki, key_name="demo-client", user=user, password=PASSWORDS[user], password_digest=digest)
    first, _ = client.secure(echo())
    accept(pipeline, first)
    second, _ = client.secure(echo())
    old_token = etree.fromstring(first).find(f".//{USERNAME_TOKEN}")
    assert old_token is not None

    def swap(root: etree._Element) -> None:
        token = root.find(f".//{USERNAME_TOKEN}")
        assert token is not None
        token.getparent().replace(token, old_token)

    fault = refuse(pipeline, mutate(second, swap), "FailedAuthentication")
    assert "nonce" in fault.reason


def test_unsigned_body_refused(pki: Path) -> None:
    """A signature over the Timestamp only: the Body could be anything."""
    env = bare()
    sign_x509(env, pki, [timestamp_of(env)])
    fault = refuse(SecuredPipeline(make_route(pki, "rsa"), RouteStores()), env.serialize(), "InvalidSecurity")
    assert "Body" in fault.reason


def test_required_timestamp_missing(pki: Path) -> None:
    env = bare(timestamp=False)
    sign_x509(env, pki, [env.body])
    fault = refuse(SecuredPipeline(make_route(pki, "rsa"), RouteStores()), env.serialize(), "InvalidSecurity")
    assert "Timestamp" in fault.reason


def test_unsigned_timestamp_refused(pki: Path) -> None:
    env = bare()
    sign_x509(env, pki, [env.body])
    fault = refuse(SecuredPipeline(make_route(pki, "rsa"), RouteStores()), env.serialize(), "InvalidSecurity")
    assert "Timestamp is not signed" in fault.reason


@pytest.mark.parametrize("profile", ["rsa", "hmac"])
def test_required_signature_missing(pki: Path, profile: str) -> None:
    fault = refuse(SecuredPipeline(make_route(pki, profile), RouteStores()), bare().serialize(), "InvalidSecurity")
    assert "signature" in fault.reason


def test_untrusted_certificate(pki: Path) -> None:
    route = make_route(pki, "rsa")
    secured, _ = client_for(route, pki, key="rogue.key", certificate="rogue.pem").secure(echo())
    refuse(SecuredPipeline(route, RouteStores()), secured, "FailedAuthentication")


def test_subject_not_allowed(pki: Path) -> None:
    route = make_route(pki, "rsa", rsa={"allowed_subjects": [CLIENT2_SUBJECT]})
    secured, _ = client_for(route, pki).secure(echo())
    fault = refuse(SecuredPipeline(route, RouteStores()), secured, "FailedAuthentication")
    assert "allow-list" in fault.reason


@pytest.mark.parametrize(
    ("profile", "gateway", "client", "cfg"),
    [
        ("rsa", {"algorithms": ["rsa-sha256"]}, {"algorithms": ["rsa-sha1"]}, {}),
        ("hmac", {"algorithms": ["hmac-sha256"]}, {"algorithms": ["hmac-sha1"]}, {"key_name": "demo-client"}),
        ("rsa", {"digests": ["sha256"]}, {"digests": ["sha1"]}, {}),
    ],
    ids=["rsa-sha1", "hmac-sha1", "sha1-digest"],
)
def test_disallowed_signature_algorithm(
    pki: Path, profile: str, gateway: dict[str, Any], client: dict[str, Any], cfg: dict[str, Any]
) -> None:
    secured, _ = client_for(make_route(pki, profile, signature=client), pki, **cfg).secure(echo())
    refuse(SecuredPipeline(make_route(pki, profile, signature=gateway), RouteStores()), secured, "UnsupportedAlgorithm")


def test_hmac_keyed_with_the_signer_certificate_refused(pki: Path) -> None:
    """Algorithm confusion: an HMAC whose "key" is the public certificate the signature points at."""
    env = bare()
    cert = keys.load_certificate(pki / "client.pem")
    security_of(env).insert(0, keys.make_bst(cert, "X509-pub"))
    sign_hmac(
        env,
        cert.public_bytes(Encoding.DER),
        keys.str_reference("X509-pub", ns.X509V3),
        [env.body, timestamp_of(env)],
        at=1,
    )
    refuse(SecuredPipeline(make_route(pki, "rsa"), RouteStores()), env.serialize(), "UnsupportedAlgorithm")


def test_hmac_output_length_refused(pki: Path) -> None:
    route = make_route(pki, "hmac")
    secured, _ = client_for(route, pki, key_name="demo-client").secure(echo())

    def truncate(root: etree._Element) -> None:
        method = root.find(f".//{ns.q(ns.DS, 'SignatureMethod')}")
        assert method is not None
        etree.SubElement(method, ns.q(ns.DS, "HMACOutputLength")).text = "128"

    fault = refuse(SecuredPipeline(route, RouteStores()), mutate(secured, truncate), "InvalidSecurity")
    assert "HMACOutputLength" in fault.reason


@pytest.mark.parametrize("profile", ["rsa", "hmac"])
def test_cbc_refused_when_only_gcm_allowed(pki: Path, profile: str) -> None:
    client_route = make_route(pki, profile, encryption={"require_request": True, "data_algorithms": ["aes256-cbc"]})
    secured, _ = client_for(client_route, pki).secure(echo())
    assert encryption.DATA_ALGORITHMS["aes256-cbc"].encode() in secured
    route = make_route(pki, profile, encryption={"require_request": True})
    refuse(SecuredPipeline(route, RouteStores()), secured, "UnsupportedAlgorithm")


@pytest.mark.parametrize("profile", ["rsa", "hmac"])
def test_rsa_1_5_key_transport_refused_unless_allowed(pki: Path, profile: str) -> None:
    client_route = make_route(pki, profile, encryption={"require_request": True, "key_transport": ["rsa-1_5"]})
    secured, _ = client_for(client_route, pki).secure(echo())
    assert encryption.KEY_TRANSPORTS["rsa-1_5"].encode() in secured
    route = make_route(pki, profile, encryption={"require_request": True})
    refuse(SecuredPipeline(route, RouteStores()), secured, "UnsupportedAlgorithm")


@pytest.mark.parametrize(("profile", "cfg"), [("rsa", {}), ("hmac", {}), ("hmac", {"key_name": "demo-client"})])
def test_required_encryption_missing(pki: Path, profile: str, cfg: dict[str, Any]) -> None:
    route = make_route(pki, profile, encryption={"require_request": True})
    secured, _ = client_for(route, pki, encrypt=False, **cfg).secure(echo())
    assert b"hello" in secured
    fault = refuse(SecuredPipeline(route, RouteStores()), secured, "InvalidSecurity")
    assert "encrypted" in fault.reason


def test_anonymous_encrypted_key_refused_unless_the_hmac_route_allows_it(pki: Path) -> None:
    route = make_route(pki, "hmac", hmac={"allow_anonymous": False})
    pipeline = SecuredPipeline(route, RouteStores())
    secured, _ = client_for(route, pki).secure(echo())
    refuse(pipeline, secured, "FailedAuthentication")
    got = accept(pipeline, client_for(route, pki, key_name="demo-client").secure(echo())[0])  # pre-shared keys do
    assert got.set_headers["x-wsgate-subject"] == "key:demo-client"


def test_x509_signature_on_an_hmac_route(pki: Path) -> None:
    secured, _ = client_for(make_route(pki, "rsa"), pki).secure(echo())
    fault = refuse(SecuredPipeline(make_route(pki, "hmac"), RouteStores()), secured, "InvalidSecurity")
    assert "X.509" in fault.reason


@pytest.mark.parametrize(
    ("key_name", "code"),
    [("demo-client", "SecurityTokenUnavailable"), (None, "InvalidSecurity")],
    ids=["pre-shared-key", "symmetric-binding"],
)
def test_hmac_on_an_rsa_route(pki: Path, key_name: str | None, code: str) -> None:
    # An rsa route knows no pre-shared keys at all; a key it can open from an EncryptedKey is still no X.509 signer.
    secured, _ = client_for(make_route(pki, "hmac"), pki, key_name=key_name).secure(echo())
    refuse(SecuredPipeline(make_route(pki, "rsa"), RouteStores()), secured, code)


@pytest.mark.parametrize(
    ("user", "password", "digest"),
    [
        ("alice", "not-her-password", False),
        ("bob", "not-his-password", True),
        ("bob", "not-his-password", False),
        ("mallory", "whatever", False),
        ("mallory", "whatever", True),
        ("alice", PASSWORDS["alice"], True),  # only a hash is kept for alice: no digest can match
    ],
    ids=["alice-wrong-text", "bob-wrong-digest", "bob-wrong-text", "unknown-text", "unknown-digest", "alice-digest"],
)
def test_username_token_not_authenticated(pki: Path, user: str, password: str, digest: bool) -> None:
    route = users_route(pki)
    client = client_for(route, pki, key_name="demo-client", user=user, password=password, password_digest=digest)
    refuse(SecuredPipeline(route, RouteStores()), client.secure(echo())[0], "FailedAuthentication")


def test_password_type_not_allowed(pki: Path) -> None:
    route = make_route(
        pki,
        "hmac",
        username_token={"required": True, "users_file": str(pki / "users.yaml"), "password_types": ["digest"],
                        "protection": "encrypted"},
    )  # fmt: skip
    client = client_for(
        route, pki, key_name="demo-client", user="bob", password=PASSWORDS["bob"], password_digest=False
    )
    refuse(SecuredPipeline(route, RouteStores()), client.secure(echo())[0], "FailedAuthentication")


def test_required_username_token_missing(pki: Path) -> None:
    route = users_route(pki)
    secured, _ = client_for(route, pki, key_name="demo-client").secure(echo())
    fault = refuse(SecuredPipeline(route, RouteStores()), secured, "InvalidSecurity")
    assert "UsernameToken" in fault.reason


# --- decryption failures: one answer for all --------------------------------------------------------------


def _cipher(el: etree._Element) -> etree._Element:
    value = el.find(f".//{CIPHER_VALUE}")
    assert value is not None
    return value


def _flip(value: etree._Element, index: int) -> None:
    raw = bytearray(base64.b64decode(value.text or ""))
    raw[index] ^= 0x01
    value.text = base64.b64encode(bytes(raw)).decode()


def _own_key_and_data(
    pki: Path, root: etree._Element, plaintext: bytes, *, key_size: int = 32, cbc: bool = False
) -> None:
    """Replace the request's key and ciphertext with ones we made for the gateway: `plaintext` under a fresh key."""
    _, security, body = parts(root)
    ek = security.find(ENCRYPTED_KEY)
    ed = body.find(ENCRYPTED_DATA)
    assert ek is not None and ed is not None
    key = os.urandom(key_size)
    cert = gateway_cert(pki)
    new_ek = encryption.encrypt_key(
        key, cert, "rsa-oaep-mgf1p", ek.get("Id") or "", keys.str_issuer_serial(cert), [ed.get("Id") or ""]
    )
    security.replace(ek, new_ek)
    if cbc:
        iv = os.urandom(16)
        padded = plaintext + os.urandom(-len(plaintext) % 16)
        encryptor = Cipher(algorithms.AES(key), modes.CBC(iv)).encryptor()
        sealed = iv + encryptor.update(padded) + encryptor.finalize()
    else:
        iv = os.urandom(12)
        sealed = iv + AESGCM(key).encrypt(iv, plaintext, None)
    _cipher(ed).text = base64.b64encode(sealed).decode()


def _ek_to_someone_else(pki: Path, root: etree._Element) -> None:
    _, security, _ = parts(root)
    ek = security.find(ENCRYPTED_KEY)
    assert ek is not None
    public = keys.load_certificate(pki / "client.pem").public_key()
    assert isinstance(public, rsa.RSAPublicKey)
    oaep = padding.OAEP(mgf=padding.MGF1(hashes.SHA1()), algorithm=hashes.SHA1(), label=None)
    _cipher(ek).text = base64.b64encode(public.encrypt(os.urandom(32), oaep)).decode()


DECRYPTION_FAILURES: dict[str, tuple[dict[str, Any], Callable[[Path, etree._Element], None]]] = {
    "encrypted-key-bit-flip": ({}, lambda pki, root: _flip(_cipher(parts(root)[1].find(ENCRYPTED_KEY)), 5)),
    "encrypted-key-for-someone-else": ({}, _ek_to_someone_else),
    "encrypted-key-not-base64": (
        {},
        lambda pki, root: setattr(_cipher(parts(root)[1].find(ENCRYPTED_KEY)), "text", "%%%"),
    ),
    "data-bit-flip": ({}, lambda pki, root: _flip(_cipher(parts(root)[2]), 20)),
    "data-truncated": ({}, lambda pki, root: setattr(_cipher(parts(root)[2]), "text", "AAAAAAAA")),
    "key-of-the-wrong-length": ({}, lambda pki, root: _own_key_and_data(pki, root, b"<a/>", key_size=16)),
    "plaintext-not-xml": ({}, lambda pki, root: _own_key_and_data(pki, root, b"<a><b></a>")),
    "plaintext-with-a-pi": ({}, lambda pki, root: _own_key_and_data(pki, root, b"<?pi x?><a/>")),
    "rsa-1_5-garbage": (
        {"key_transport": ["rsa-1_5"]},
        lambda pki, root: _flip(_cipher(parts(root)[1].find(ENCRYPTED_KEY)), 5),
    ),
    "cbc-bad-padding": (
        {"data_algorithms": ["aes256-cbc"]},
        lambda pki, root: _own_key_and_data(pki, root, b"<a/>" + b"x" * 12 + bytes([0] * 16), cbc=True),
    ),
    "cbc-not-xml": (
        {"data_algorithms": ["aes256-cbc"]},
        lambda pki, root: _own_key_and_data(pki, root, b"<a><b></a>" + b" " * 5 + bytes([1]), cbc=True),
    ),
}


def test_decryption_failures_look_the_same(pki: Path) -> None:
    """Wrong key, broken ciphertext, bad padding, plaintext that is not XML: one code and message for the client
    (no padding or parse oracle), only the logged reason tells them apart."""
    seen: dict[str, faults.Fault] = {}
    for case, (enc, attack) in DECRYPTION_FAILURES.items():
        route = make_route(pki, "rsa", encryption={"require_request": True, **enc})
        secured, _ = client_for(route, pki).secure(echo())
        seen[case] = refuse(SecuredPipeline(route, RouteStores()), mutate(secured, lambda root, a=attack: a(pki, root)))
    answers = {(f.code, f.message, faults.render(f, "1.1")) for f in seen.values()}
    assert answers == {
        ("FailedCheck", faults.WSSE_CODES["FailedCheck"], faults.render(seen["data-bit-flip"], "1.1"))
    }, {k: (f.code, f.reason) for k, f in seen.items()}
    assert len({f.reason for f in seen.values()}) > 3  # the log still knows what happened


def test_decryption_failure_with_a_pre_shared_key_looks_the_same(pki: Path) -> None:
    route = make_route(pki, "hmac", encryption={"require_request": True})
    secured, _ = client_for(route, pki, key_name="demo-client").secure(echo())
    refuse(
        SecuredPipeline(route, RouteStores()),
        mutate(secured, lambda root: _flip(_cipher(parts(root)[2]), 20)),
        "FailedCheck",
    )


# --- CVE-2015-0227: EncryptedData the signature does not cover ---------------------------------------------


def _swap_in_attacker_body(pki: Path, root: etree._Element) -> None:
    """The Body's EncryptedData and its EncryptedKey replaced by the attacker's, the signature kept."""
    _, security, body = parts(root)
    ed, ek = attacker_encrypted(pki)
    old_ed = body.find(ENCRYPTED_DATA)
    old_ek = security.find(ENCRYPTED_KEY)
    assert old_ed is not None and old_ek is not None
    body.replace(old_ed, ed)
    security.remove(old_ek)
    security.insert(0, ek)


def _attacker_header_block(pki: Path, root: etree._Element) -> None:
    """The legitimate message left whole, plus an attacker's EncryptedData in a header block of its own."""
    header, security, _ = parts(root)
    ed, ek = attacker_encrypted(pki, f'<a:Pay xmlns:a="{ATTACK}">everything</a:Pay>')
    etree.SubElement(header, ns.q(ATTACK, "Instructions")).append(ed)
    security.insert(0, ek)


def _attacker_body_next_to_wrapped_original(pki: Path, root: etree._Element) -> None:
    header, security, body = parts(root)
    ed, ek = attacker_encrypted(pki)
    new_body = etree.SubElement(root, ns.q(SOAP11, "Body"))
    new_body.append(ed)
    etree.SubElement(header, ns.q(ATTACK, "Wrapper")).append(body)
    security.insert(0, ek)


CVE_2015_0227 = {
    "body-replaced-sign-then-encrypt": ("client", _swap_in_attacker_body, "FailedCheck"),
    "body-replaced-encrypt-then-sign": ("encrypt-then-sign", _swap_in_attacker_body, "FailedCheck"),
    "unsigned-encrypted-header-block": ("client", _attacker_header_block, "InvalidSecurity"),
    "unsigned-encrypted-header-block-encrypt-then-sign": (
        "encrypt-then-sign",
        _attacker_header_block,
        "InvalidSecurity",
    ),
    "signed-body-wrapped-away": ("encrypt-then-sign", _attacker_body_next_to_wrapped_original, ""),
}


@pytest.mark.parametrize("case", CVE_2015_0227)
def test_unsigned_encrypted_data_refused(pki: Path, case: str) -> None:
    """An attacker encrypts its own content to the gateway's public certificate and keeps the client's signature
    (CVE-2015-0227): whatever it decrypts to, it is not what was signed."""
    base, attack, code = CVE_2015_0227[case]
    route = make_route(pki, "rsa", encryption={"require_request": True})
    if base == "client":
        secured, _ = client_for(route, pki).secure(echo())
    else:
        secured, _ = encrypt_then_sign(pki, "rsa", echo())
    fault = refuse(SecuredPipeline(route, RouteStores()), mutate(secured, lambda root: attack(pki, root)), code)
    if case.startswith("unsigned-encrypted-header-block"):
        assert "not covered by the signature" in fault.reason


# --- signature wrapping, through the whole request path ---------------------------------------------------


def evil_body(**attrs: str) -> etree._Element:
    body = etree.fromstring(f'<soap:Body xmlns:soap="{SOAP11}">{EVIL}</soap:Body>')
    for name, value in attrs.items():
        body.set(name, value)
    return body


def _body_into_header_wrapper(pki: Path, root: etree._Element) -> None:
    header, _, body = parts(root)
    body.addprevious(evil_body())
    etree.SubElement(header, ns.q(ATTACK, "Wrapper")).append(body)


def _body_directly_into_header(pki: Path, root: etree._Element) -> None:
    header, _, body = parts(root)
    body.addprevious(evil_body())
    header.append(body)


def _body_into_security_object(pki: Path, root: etree._Element) -> None:
    _, security, body = parts(root)
    body.addprevious(evil_body())
    etree.SubElement(security, ns.q(ns.DS, "Object")).append(body)


def _body_into_signature_object(pki: Path, root: etree._Element) -> None:
    _, security, body = parts(root)
    body.addprevious(evil_body())
    sig = security.find(SIGNATURE)
    assert sig is not None
    etree.SubElement(sig, ns.q(ns.DS, "Object")).append(body)


def _body_into_other_actor_security(pki: Path, root: etree._Element) -> None:
    header, _, body = parts(root)
    body.addprevious(evil_body())
    other = etree.SubElement(header, SECURITY, {ns.q(SOAP11, "actor"): "urn:somebody-else"})
    other.append(body)


def _duplicate_body_id(pki: Path, root: etree._Element) -> None:
    """The signed content in a header block with the Body's wsu:Id, the Body itself rewritten, same id."""
    header, _, body = parts(root)
    fake = etree.SubElement(header, ns.q(ATTACK, "Fake"), {WSU_ID: body.get(WSU_ID) or ""})
    fake.extend(list(body))
    body.append(etree.fromstring(EVIL))


def _duplicate_timestamp_id(pki: Path, root: etree._Element) -> None:
    header, security, _ = parts(root)
    ts = security.find(TIMESTAMP)
    assert ts is not None
    etree.SubElement(header, ns.q(ATTACK, "Fake"), {WSU_ID: ts.get(WSU_ID) or ""})


def _second_body(pki: Path, root: etree._Element) -> None:
    parts(root)[2].addnext(evil_body())


def _signed_body_inside_new_body(pki: Path, root: etree._Element) -> None:
    _, _, body = parts(root)
    new = evil_body()
    body.addprevious(new)
    etree.SubElement(new, ns.q(ATTACK, "Wrapper")).append(body)


def _new_body_signed_timestamp_kept(pki: Path, root: etree._Element) -> None:
    _, _, body = parts(root)
    root.replace(body, evil_body())


def _id_as_plain_id_on_fake(pki: Path, root: etree._Element) -> None:
    """The Body's id moved to an unqualified Id on a fake header element holding the signed content."""
    header, _, body = parts(root)
    body_id = body.attrib.pop(WSU_ID)
    fake = etree.SubElement(header, ns.q(ATTACK, "Fake"), {"Id": body_id})
    fake.extend(list(body))
    body.append(etree.fromstring(EVIL))


def _xml_id_on_fake(pki: Path, root: etree._Element) -> None:
    header, _, body = parts(root)
    etree.SubElement(header, ns.q(ATTACK, "Fake"), {"{http://www.w3.org/XML/1998/namespace}id": body.get(WSU_ID) or ""})


def _second_security_header(pki: Path, root: etree._Element) -> None:
    header, security, _ = parts(root)
    ts = security.find(TIMESTAMP)
    assert ts is not None
    other = etree.SubElement(header, SECURITY)
    other.append(etree.fromstring(etree.tostring(ts).replace(b'wsu:Id="', b'wsu:Id="other-')))


def _encrypted_data_injected_into_body(pki: Path, root: etree._Element) -> None:
    _, security, body = parts(root)
    ed, ek = attacker_encrypted(pki)
    body.append(ed)
    security.insert(0, ek)


def _encrypted_data_injected_into_header(pki: Path, root: etree._Element) -> None:
    _attacker_header_block(pki, root)


def _signature_moved_out_of_security(pki: Path, root: etree._Element) -> None:
    header, security, _ = parts(root)
    sig = security.find(SIGNATURE)
    assert sig is not None
    header.append(sig)


def _timestamp_moved_out_of_security(pki: Path, root: etree._Element) -> None:
    header, security, _ = parts(root)
    ts = security.find(TIMESTAMP)
    assert ts is not None
    header.append(ts)


WRAPPING: dict[str, tuple[Callable[[Path, etree._Element], None], str]] = {
    # The signed Body moved elsewhere, an unsigned Body in its place (McIntosh and Austel; Somorovsky et al.).
    "body-into-header-wrapper": (_body_into_header_wrapper, ""),
    "body-directly-into-header": (_body_directly_into_header, ""),
    "body-into-security-ds-object": (_body_into_security_object, ""),
    "body-into-signature-ds-object": (_body_into_signature_object, ""),
    "body-into-other-actor-security": (_body_into_other_actor_security, ""),
    "signed-body-inside-new-body": (_signed_body_inside_new_body, ""),
    "second-body": (_second_body, ""),
    # Ids: the same id twice, or moved to another id attribute.
    "duplicate-body-wsu-id": (_duplicate_body_id, "InvalidSecurity"),
    "duplicate-timestamp-wsu-id": (_duplicate_timestamp_id, "InvalidSecurity"),
    "id-moved-to-plain-id-on-fake": (_id_as_plain_id_on_fake, "FailedCheck"),
    "xml-id-duplicate-on-fake": (_xml_id_on_fake, "InvalidSecurity"),
    # What the signature covers.
    "signed-timestamp-new-body": (_new_body_signed_timestamp_kept, "InvalidSecurity"),
    "timestamp-moved-out-of-security": (_timestamp_moved_out_of_security, "InvalidSecurity"),
    "signature-moved-out-of-security": (_signature_moved_out_of_security, "InvalidSecurity"),
    "second-security-header": (_second_security_header, "InvalidSecurity"),
    # Ciphertext added after signing.
    "encrypted-data-injected-into-body": (_encrypted_data_injected_into_body, "FailedCheck"),
    "encrypted-data-injected-into-header": (_encrypted_data_injected_into_header, "InvalidSecurity"),
}


@pytest.mark.parametrize("variant", WRAPPING)
def test_signature_wrapping_refused(pki: Path, variant: str) -> None:
    """Each variant keeps a valid signature over the client's content and offers the backend something else.
    Refused ("" = by threat protection, before the security header is read), and nothing goes to the backend."""
    build, code = WRAPPING[variant]
    route = make_route(pki, "rsa")
    secured, _ = client_for(route, pki).secure(echo())
    refuse(SecuredPipeline(route, RouteStores()), mutate(secured, lambda root: build(pki, root)), code)


def test_signature_wrapping_reference_nested_in_the_body_refused(pki: Path) -> None:
    """The client's signature covers an element inside the Body (and the Timestamp), not the Body: whatever sits
    next to that element in the Body would go to the backend unsigned."""
    env = bare()
    sign_x509(env, pki, [env.body[0], timestamp_of(env)])
    env.body.append(etree.fromstring(EVIL))
    fault = refuse(SecuredPipeline(make_route(pki, "rsa"), RouteStores()), env.serialize(), "InvalidSecurity")
    assert "not where a signed part may be" in fault.reason


BODY_MOVES = [
    "body-into-header-wrapper",
    "body-directly-into-header",
    "body-into-security-ds-object",
    "body-into-signature-ds-object",
    "body-into-other-actor-security",
    "signed-body-inside-new-body",
]


@pytest.mark.parametrize("variant", BODY_MOVES)
def test_body_moves_refused_by_the_security_header_alone(pki: Path, variant: str) -> None:
    """Defence in depth: with threat protection out of the way (the Envelope built directly), the header
    processor still refuses a signed Body that is no longer the Body."""
    route = make_route(pki, "rsa")
    pipeline = SecuredPipeline(route, RouteStores())
    build, _ = WRAPPING[variant]
    root = etree.fromstring(client_for(route, pki).secure(echo())[0])
    build(pki, root)
    with pytest.raises(faults.Fault) as info:
        wssecurity.process(Envelope(root, "1.1"), pipeline.requirements, pipeline.credentials, datetime.now(UTC))
    assert info.value.code == "InvalidSecurity"
    assert root.find(f".//{SECURITY}") is not None  # nothing was stripped for the backend


# =========================================================================================================
# Product bugs these tests expose (see the report that came with this file)


def _signature_on_top(root: etree._Element) -> None:
    _, security, _ = parts(root)
    sig = security.find(SIGNATURE)
    assert sig is not None
    security.insert(0, sig)


@pytest.mark.parametrize("order", ["signature-first", "timestamp-first"])
def test_replay_window_covers_a_client_clock_that_runs_ahead(
    pki: Path, client_clock: Callable[[timedelta], None], monkeypatch: pytest.MonkeyPatch, order: str
) -> None:
    """A client whose clock runs 290 s fast (inside the 300 s skew) sends Signature above Timestamp, as WSS4J and
    earlier Clients do. The message stays acceptable until Created + max_age + skew (~890 s after it first arrives), so the
    replay store must remember its signature that long. It remembers it for max_age + skew = 600 s only (the
    fallback TTL used when the signature is read before the Timestamp), so a replay at +601 s is accepted.
    (With the Timestamp above the Signature, the TTL comes from the Timestamp and the replay is caught.)"""
    route = make_route(pki, "rsa")
    client_clock(timedelta(seconds=290))
    secured, _ = client_for(route, pki).secure(echo())
    assert security_children(secured) == ["Timestamp", "BinarySecurityToken", "Signature"]
    if order == "signature-first":  # the header's order is not signed: the same message, read the other way
        secured = mutate(secured, _signature_on_top)
    elapsed = [0.0]
    pipeline = SecuredPipeline(route, RouteStores())
    pipeline.credentials.replay = MemoryReplayCache(clock=lambda: elapsed[0])
    accept(pipeline, secured)

    class Later(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return datetime.now(tz) + timedelta(seconds=601)

    monkeypatch.setattr("filters.engine.profiles.datetime", Later)
    elapsed[0] = 601.0
    fault = refuse(pipeline, secured, "InvalidSecurity")
    assert fault.reason.startswith("replay")


def test_hmac_route_with_aes128(pki: Path) -> None:
    """aes128-gcm is a valid data algorithm for any route; the Client's symmetric binding always makes a 32-byte
    key and hands it to aes128-gcm, which needs 16 bytes (ValueError before anything is sent)."""
    route = make_route(
        pki,
        "hmac",
        encryption={**ENCRYPT_BOTH_WAYS, "data_algorithms": ["aes128-gcm"], "response_algorithm": "aes128-gcm"},
    )
    t = trip(SecuredPipeline(route, RouteStores()), client_for(route, pki))
    assert_plain(t.backend)
    assert_opened(t.opened)


def test_response_encrypted_for_a_128_bit_symmetric_binding_key(pki: Path) -> None:
    """A Basic128 client (WSS4J, WCF) sends a 16-byte key in its EncryptedKey, signs and encrypts with it
    (aes128-gcm, allowed by default). The gateway accepts the request, then encrypts the response with that key
    and response_algorithm (aes256-gcm by default): ValueError instead of a secured reply."""
    route = make_route(pki, "hmac", encryption=ENCRYPT_BOTH_WAYS)
    client = client_for(route, pki)
    env = parse_envelope(echo(), Limits())
    secret = os.urandom(16)
    got = sending.secure(
        env,
        datetime.now(UTC),
        timestamp_ttl_s=300,
        sign=sending.SignWith(signing.Signer(secret, "hmac-sha256", "sha256"), None),
        encrypt=sending.EncryptFor("aes128-gcm", secret=secret),
        symmetric_binding=(secret, gateway_cert(pki), "rsa-oaep-mgf1p"),
    )
    pending = Pending(secret=secret, encrypted_key_sha1=got.encrypted_key_sha1)
    t = trip(SecuredPipeline(route, RouteStores()), client, secured=(env.serialize(), pending))
    assert_plain(t.backend)
    assert_secured_reply(t.reply, encrypted=True)
    assert_opened(t.opened)


KEY_REFERENCES = {
    "ski": lambda cert: keys.str_key_identifier(ns.X509_SKI, base64.b64encode(keys.ski(cert)).decode()),
    "thumbprint": lambda cert: keys.str_key_identifier(
        ns.THUMBPRINT_SHA1, base64.b64encode(keys.thumbprint_sha1(cert)).decode()
    ),
    "issuer_serial": keys.str_issuer_serial,
}


@pytest.mark.parametrize("form", sorted(KEY_REFERENCES))
def test_signer_named_without_a_token(pki: Path, form: str) -> None:
    """X.509 signers named by SKI, thumbprint or IssuerSerial: accepted when the route knows the certificate."""
    cert = keys.load_certificate(pki / "client.pem")
    signer = signing.Signer(keys.load_private_key(pki / "client.key"), "rsa-sha256", "sha256")
    env = parse_envelope(echo("by reference"), Limits())
    sending.secure(
        env,
        datetime.now(UTC),
        timestamp_ttl_s=300,
        sign=sending.SignWith(signer, lambda: KEY_REFERENCES[form](cert)),
        unique_ids=True,
    )
    message = env.serialize()
    assert b"BinarySecurityToken" not in message
    known = make_route(pki, "rsa", rsa={"known_certificates": [str(pki / "client.pem")]})
    out = SecuredPipeline(known, RouteStores()).request(message, {}, Exchange(route=known))
    assert out.body is not None and b"by reference" in out.body
    assert out.set_headers["x-wsgate-subject"] == "CN=Demo Client,O=WSGate Demo"
    unknown = make_route(pki, "rsa")
    with pytest.raises(faults.Fault) as err:
        SecuredPipeline(unknown, RouteStores()).request(message, {}, Exchange(route=unknown))
    assert err.value.code == "SecurityTokenUnavailable"


# --- issue #10: values read whole, comments never forwarded, who signed ------------------------------------


@pytest.mark.parametrize("profile", ["rsa", "hmac"])
def test_comment_split_signature_value_has_the_replay_key_of_the_original(pki: Path, profile: str) -> None:
    route = make_route(pki, profile)
    pipeline = SecuredPipeline(route, RouteStores())
    secured, _ = client_for(route, pki).secure(echo())
    accept(pipeline, secured)
    start = secured.index(b"<ds:SignatureValue>") + len(b"<ds:SignatureValue>")
    split = secured[: start + 8] + b"<!--x-->" + secured[start + 8 :]
    fault = refuse(pipeline, split, "InvalidSecurity")
    assert "replay" in fault.reason


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize("profile", ["rsa", "hmac"])  # encrypted content: tests/threats/test_signed_content_threats.py
def test_comments_in_signed_content_are_not_forwarded(pki: Path, profile: str, version: str) -> None:
    route = make_route(pki, profile)
    secured, _ = client_for(route, pki).secure(echo("user@victim.exampleATK", version))
    secured = secured.replace(b"victim.example", b"victim.example<!---->")
    got = accept(SecuredPipeline(route, RouteStores()), secured).body
    assert got is not None and b"<!--" not in got
    assert_plain(got, "user@victim.exampleATK", version)


def test_the_gateway_signs_no_comment(pki: Path) -> None:
    route = make_route(pki, "rsa")
    client = client_for(route, pki)
    t = trip(
        SecuredPipeline(route, RouteStores()),
        client,
        backend=lambda b: echo_response(b).replace(b"<d:text>", b"<d:text><!--c-->"),
    )
    assert b"<!--" not in t.reply
    assert_opened(t.opened)


@pytest.mark.parametrize(
    ("cfg", "subject"),
    [
        ({"key_name": "demo-client"}, "key:demo-client"),
        ({}, "anonymous"),
        ({"user": "bob", "password": PASSWORDS["bob"]}, "bob"),
        ({"key_name": "demo-client", "user": "bob", "password": PASSWORDS["bob"]}, "bob"),
    ],
    ids=["pre-shared-key", "encrypted-key", "encrypted-key-and-user", "pre-shared-key-and-user"],
)
def test_identity_names_the_credential(pki: Path, cfg: dict[str, Any], subject: str) -> None:
    route = make_route(pki, "hmac", username_token={"users_file": str(pki / "users.yaml"), "protection": "encrypted"})
    assert trip(SecuredPipeline(route, RouteStores()), client_for(route, pki, **cfg)).headers == {
        "x-wsgate-subject": subject
    }


def test_an_encrypted_key_with_a_user_is_not_anonymous(pki: Path) -> None:
    route = users_route(pki, hmac={"allow_anonymous": False})
    client = client_for(route, pki, user="bob", password=PASSWORDS["bob"])
    assert trip(SecuredPipeline(route, RouteStores()), client).headers == {"x-wsgate-subject": "bob"}
