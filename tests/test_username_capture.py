"""A captured UsernameToken cannot be re-bound (issue #10, class 8), in the engine, without Envoy.

With the symmetric binding a key made by the sender proves nothing, so the UsernameToken is the credential: a
token anyone can read, or one sealed under a key other than the message's signing key, would let Mallory put
Bob's token into his own message (his EncryptedKey to the gateway's public certificate, his HMAC signature over
his Body and a fresh Timestamp). The gateway takes a token on such a route only encrypted under the key that
signs the message (`username_token.protection: encrypted`), or on an HTTPS-only route (`tls`); policy validation
refuses the unsafe combinations. Through the running gateway: tests/test_username_capture_e2e.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lxml import etree

from filters.engine import ns
from filters.engine.profiles import SecuredPipeline
from filters.engine.wss import encryption, keys, username_token, wssecurity
from filters.engine.wss import wssecurity_sending as sending
from filters.stores.factory import RouteStores
from gateway.policy import Route
from tests.test_wssecurity import (
    ENCRYPTED_DATA,
    ENCRYPTED_KEY,
    PASSWORDS,
    USERNAME_TOKEN,
    accept,
    bare,
    gateway_cert,
    psk,
    refuse,
    security_of,
    sign_hmac,
    timestamp_of,
    users_route,
)
from tests.wss_helpers import client_for, echo

# The attack run's route: the UsernameToken is not among the signed parts, Mallory signs it himself anyway.
PARTS = {"parts": ["body", "timestamp"]}


def captured(pki: Path, route: Route, *, digest: bool = True, user: str = "bob") -> tuple[bytes, list[etree._Element]]:
    """Bob's request as his client secures it for `route`, never delivered, and its Security header elements."""
    client = client_for(route, pki, user=user, password=PASSWORDS[user], password_digest=digest)
    secured, _ = client.secure(echo("bob's order"))
    security = etree.fromstring(secured).find(f".//{wssecurity.SECURITY}")
    assert security is not None
    return secured, [c for c in security if isinstance(c.tag, str)]


def clear_token(user: str = "bob", digest: bool = True) -> etree._Element:
    """A token as it travels in clear (from a client or route that does not protect it), fresh."""
    from datetime import UTC, datetime

    token = username_token.create(user, PASSWORDS[user], digest, datetime.now(UTC), sending.new_id("UsernameToken"))
    return etree.fromstring(etree.tostring(token))


def rebound(pki: Path, stolen: list[etree._Element], *, key_name: str | None = None) -> bytes:
    """Mallory's own message around `stolen` header elements: his Body and a fresh Timestamp, signed (with the
    stolen token or its EncryptedData) under his key: a fresh one in his EncryptedKey to the gateway's public
    certificate, or a pre-shared key he holds himself (`key_name`)."""
    env = bare(echo("pay mallory"))
    security = security_of(env)
    for el in reversed(stolen):
        security.insert(0, el)
    token = [el for el in stolen if el.tag in (USERNAME_TOKEN, ENCRYPTED_DATA)]
    if key_name is not None:
        secret, key_info = psk(pki), keys.key_name(key_name)
        sign_hmac(env, secret, key_info, [env.body, timestamp_of(env), *token])
        return env.serialize()
    secret, cert, ek_id = os.urandom(32), gateway_cert(pki), sending.new_id("EK")
    sign_hmac(env, secret, keys.str_reference(ek_id, ns.ENCKEY_TOKEN), [env.body, timestamp_of(env), *token])
    ek = encryption.encrypt_key(secret, cert, "rsa-oaep-mgf1p", ek_id, keys.str_issuer_serial(cert), [])
    security.insert(0, ek)
    return env.serialize()


def encrypted_route(pki: Path, **extra: object) -> Route:
    return users_route(pki, signature=PARTS, username_token={"protection": "encrypted"}, **extra)


# --- the attack and its variants ---------------------------------------------------------------------------


def test_bobs_own_encrypted_token_is_accepted(pki: Path) -> None:
    """The control: the message Bob's client makes passes, and names Bob, so the refusals below are the attack's."""
    route = encrypted_route(pki)
    secured, _ = captured(pki, route)
    outcome = accept(SecuredPipeline(route, RouteStores()), secured)
    assert outcome.set_headers["x-wsgate-subject"] == "bob"


@pytest.mark.parametrize("digest", [True, False], ids=["PasswordDigest", "PasswordText"])
def test_captured_username_token_cannot_be_rebound_under_attackers_encrypted_key(pki: Path, digest: bool) -> None:
    """The attack run's message: Mallory's EncryptedKey, his HMAC signature over his Body, the Timestamp and Bob's
    token as it travels in clear. A readable token is refused before its password is even checked."""
    fault = refuse(
        SecuredPipeline(encrypted_route(pki), RouteStores()),
        rebound(pki, [clear_token(digest=digest)]),
        "InvalidSecurity",
    )
    assert "not encrypted" in fault.reason


@pytest.mark.parametrize("key_name", [None, "demo-client"], ids=["attackers-encrypted-key", "attackers-psk"])
@pytest.mark.parametrize("digest", [True, False], ids=["PasswordDigest", "PasswordText"])
def test_encrypted_username_token_cannot_be_moved_into_another_message(
    pki: Path, digest: bool, key_name: str | None
) -> None:
    """Bob's token still sealed (his EncryptedKey and the EncryptedData, copied) in Mallory's message, signed with
    Mallory's own key: it decrypts, but under another key than the one that signs the message."""
    route = encrypted_route(pki)
    _, header = captured(pki, route, digest=digest)
    stolen = [el for el in header if el.tag in (ENCRYPTED_KEY, ENCRYPTED_DATA)]
    assert [el.tag for el in stolen] == [ENCRYPTED_KEY, ENCRYPTED_DATA]
    fault = refuse(SecuredPipeline(route, RouteStores()), rebound(pki, stolen, key_name=key_name), "InvalidSecurity")
    assert "another key" in fault.reason


def test_encrypted_username_token_without_its_key_is_refused(pki: Path) -> None:
    """Only Bob's EncryptedData, without the EncryptedKey it names: nothing opens it."""
    route = encrypted_route(pki)
    _, header = captured(pki, route)
    stolen = [el for el in header if el.tag == ENCRYPTED_DATA]
    refuse(SecuredPipeline(route, RouteStores()), rebound(pki, stolen), "SecurityTokenUnavailable")


def test_token_from_an_encrypted_message_sent_in_clear_is_refused(pki: Path) -> None:
    """Whoever got a token out of a protected message (or from a route that sent it readable) cannot use it
    readable: on an `encrypted` route a token outside an EncryptedData is never checked."""
    route = encrypted_route(pki)
    fault = refuse(
        SecuredPipeline(route, RouteStores()),
        rebound(pki, [clear_token(user="alice", digest=False)]),
        "InvalidSecurity",
    )
    assert "not encrypted" in fault.reason


def test_bobs_client_sends_no_readable_token(pki: Path) -> None:
    route = encrypted_route(pki)
    for digest in (True, False):
        secured, header = captured(pki, route, digest=digest)
        assert b"<wsse:UsernameToken" not in secured and b"bob-demo-password" not in secured
        ek = next(el for el in header if el.tag == ENCRYPTED_KEY)
        reflist = next(el for el in header if el.tag == ns.q(ns.XENC, "ReferenceList"))
        ed = next(el for el in header if el.tag == ENCRYPTED_DATA)
        # CXF's symmetric binding: a ReferenceList names the token's EncryptedData (Type Element), whose KeyInfo
        # names the EncryptedKey; both precede it (BSP R3208).
        assert encryption.reference_list(reflist) == [ed.get("Id")]
        assert ed.get("Type") == encryption.TYPE_ELEMENT
        assert keys.parse_key_info(encryption.key_for(ed)).value == ek.get("Id")
        assert header.index(ek) < header.index(reflist) < header.index(ed)


@pytest.mark.parametrize("cfg", [{"key_name": "demo-client"}, {"encrypt": True}], ids=["psk", "encrypted-body"])
def test_encrypted_token_with_other_keys_and_layouts(pki: Path, cfg: dict[str, object]) -> None:
    """A pre-shared signing key seals the token too; with the Body encrypted as well, both decrypt."""
    route = encrypted_route(pki)
    client = client_for(route, pki, user="bob", password=PASSWORDS["bob"], **cfg)
    secured, _ = client.secure(echo())
    assert b"<wsse:UsernameToken" not in secured
    assert accept(SecuredPipeline(route, RouteStores()), secured).set_headers["x-wsgate-subject"] == "bob"


def test_rsa_route_requires_the_token_encrypted(pki: Path) -> None:
    route = users_route(pki, "rsa", username_token={"protection": "encrypted"})
    secured, _ = client_for(route, pki, user="alice", password=PASSWORDS["alice"], password_digest=False).secure(echo())
    assert b"alice-demo-password" not in secured
    accept(SecuredPipeline(route, RouteStores()), secured)
    plain = users_route(pki, "rsa", username_token={"password_types": ["digest"], "protection": "tls"})
    readable, _ = client_for(plain, pki, user="bob", password=PASSWORDS["bob"]).secure(echo())
    fault = refuse(SecuredPipeline(route, RouteStores()), readable, "InvalidSecurity")
    assert "not encrypted" in fault.reason


# --- policy validation: the unsafe combinations do not load ------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "extra", "message"),
    [
        ("hmac", {}, "PasswordText needs protection"),
        ("hmac", {"username_token": {"password_types": ["digest"]}}, "only credential"),
        ("rsa", {"username_token": {"password_types": ["text"]}}, "PasswordText needs protection"),
        # An X.509 signer proves the signer, but the readable token could still be captured here and sealed by
        # its reader for a route that takes it encrypted.
        ("rsa", {"username_token": {"password_types": ["digest"]}}, "captured and re-bound"),
    ],
)
def test_unprotected_username_token_policies_refused(
    tmp_path: Path, pki: Path, profile: str, extra: dict[str, dict[str, object]], message: str
) -> None:
    import yaml

    from gateway.policy import PolicyError, load_dir
    from tests.wss_helpers import route_doc

    ut = {"required": True, "users_file": str(pki / "users.yaml"), **extra.pop("username_token", {})}
    doc = route_doc(pki, profile, name="pay", username_token=ut, **extra)
    doc["upstream"] = {"address": "127.0.0.1:9"}
    (tmp_path / "pay.yaml").write_text(yaml.safe_dump({"routes": [doc]}))
    with pytest.raises(PolicyError) as err:
        load_dir(tmp_path)
    assert f"{tmp_path / 'pay.yaml'}: route pay: field username_token.protection: " in str(err.value)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("profile", "ut", "hmac_opts"),
    [
        ("hmac", {"protection": "encrypted"}, {}),
        ("rsa", {"protection": "encrypted"}, {}),
        ("rsa", {"protection": "tls"}, {}),
        ("hmac", {"protection": "tls"}, {}),
    ],
)
def test_protected_username_token_policies_load(
    pki: Path, profile: str, ut: dict[str, object], hmac_opts: dict[str, object]
) -> None:
    route = users_route(pki, profile, username_token=ut, hmac=hmac_opts)
    assert route.https_only is (ut.get("protection") == "tls")
