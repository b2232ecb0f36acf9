"""Interoperability with a real, unmodified Apache WSS4J 4.0.1 (the library under CXF), through the running gateway.

WSS4J secures each request (its WSSec* builders, as CXF's binding handlers call them, signing the WS-Addressing
headers as CXF, Metro and WCF do); the gateway must accept it and hand the demo backend plain SOAP; then WSS4J's
WSSecurityEngine, with its default Basic Security Profile enforcement, must verify (and decrypt) the gateway's
reply. Every secured profile, SOAP 1.1 and 1.2. One JVM serves the whole session (tests/support/wss4j.py); the jar is
built by `make wss4j` (a prerequisite of `make test`). Nothing here is skipped: a missing jar or java fails."""

from __future__ import annotations

import base64
import hashlib
import uuid
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from lxml import etree

from gateway.tools.client import http_post
from tests.support.harness import GatewayFactory, LiveGateway, content_type, fault_code
from tests.support.wss4j import (
    DS,
    WSA,
    WSSE,
    Wss4j,
    Wss4jError,
    addressed,
    encrypt_to_gateway,
    part,
    signed_parts,
    soap_ns,
    x509_sign,
)
from tests.support.wss_helpers import DEMO, Keys, route_doc

VERSIONS = ["1.1", "1.2"]
ACTION = "urn:wsgate:demo/echo"
XSI = "http://www.w3.org/2001/XMLSchema-instance"
ADDRESSING = {"parts": ["body", "timestamp", "addressing"]}
ENCRYPTED = {"require_request": True, "encrypt_response": True}
SC = {"encrypt_response": True}
NO_ANONYMOUS = {"allow_anonymous": False}  # the key or the UsernameToken is the credential
# How the gateway names a pre-shared key (the `bsp` branch's ns.PRE_SHARED_KEY): WSS4J writes it with
# WSConstants.CUSTOM_SYMM_SIGNING and this as the custom token ValueType, and resolves it on replies by name.
PRE_SHARED_KEY = "urn:wsgate:ws-security:PreSharedKey"
SIGNATURE = f"{{{DS}}}Signature"


def _routes(pki: Path) -> list[dict[str, Any]]:
    users = {"required": True, "users_file": str(pki / "users.yaml"), "protection": "encrypted"}
    sc = {"store": "memory", "master_keys_file": str(pki / "sct-master-keys.yaml")}
    return [
        route_doc(pki, "hmac", name="psk", signature=ADDRESSING, hmac=NO_ANONYMOUS),
        route_doc(pki, "rsa", name="rsa", signature=ADDRESSING),
        route_doc(pki, "rsa", name="rsa-encrypted", signature=ADDRESSING, encryption=ENCRYPTED),
        route_doc(pki, "hmac", name="username", signature=ADDRESSING, username_token=users, hmac=NO_ANONYMOUS),
        route_doc(pki, "secureconversation", name="sc", signature=ADDRESSING, secureconversation=sc, encryption=SC),
        route_doc(
            pki,
            "secureconversation",
            name="sc-direct",
            signature=ADDRESSING,
            encryption=SC,
            secureconversation={**sc, "derived_keys": False},
        ),
    ]


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path, gateway_keys: Keys) -> LiveGateway:
    """The gateway, its keys in files, then in the token (each module-scoped gateway_keys param)."""
    return module_gateway([gateway_keys(r) for r in _routes(pki)])


@pytest.fixture(scope="module")
def psk(pki: Path) -> str:
    """The demo client's pre-shared HMAC key, base64."""
    return yaml.safe_load((pki / "hmac-keys.yaml").read_text())["keys"]["demo-client"]


def request(gw: Any, route: str, version: str, text: str) -> bytes:
    return addressed(text, version, gw.url(route, "echo"), ACTION, f"urn:uuid:{uuid.uuid4()}")


def post(gw: Any, route: str, body: str | bytes, version: str) -> requests.Response:
    """POST as CXF does: the SOAP action (SOAPAction for 1.1, the action parameter for 1.2) is the signed wsa:Action."""
    data = body.encode() if isinstance(body, str) else body
    if version == "1.2":
        headers = {"content-type": f'{content_type(version)}; action="{ACTION}"'}
    else:
        headers = {"soapaction": f'"{ACTION}"'}
    return gw.post(route, data, version, path="echo", headers=headers, timeout=30)


def verify(wss4j: Wss4j, pki: Path, reply: bytes, **params: Any) -> dict[str, Any]:
    """WSS4J's WSSecurityEngine over the gateway's reply, BSP on: the demo CA trusted, the client's key decrypts."""
    return wss4j.verify(reply, trust=[str(pki / "ca.pem")], key=str(pki / "client.key"), cert=str(pki / "client.pem"),
                        bsp=True, **params)  # fmt: skip


def backend_got(gw: Any, text: str, version: str, message_id: bytes) -> dict[str, Any]:
    """The one request the backend received: plain SOAP of the request's version, no WS-Security left, the
    signed WS-Addressing headers passed on as the client sent them."""
    got = gw.received()
    assert len(got) == 1, got
    body = got[0]["body"].encode()
    assert WSSE.encode() not in body and b"EncryptedData" not in body, body
    root = etree.fromstring(body)
    assert etree.QName(root).namespace == soap_ns(version)
    assert root.findtext(f".//{{{DEMO}}}echo/{{{DEMO}}}text") == text
    assert root.findtext(f".//{{{WSA}}}MessageID").encode() == message_id
    assert root.findtext(f".//{{{WSA}}}Action") == ACTION
    return got[0]


def message_id(xml: bytes) -> bytes:
    return etree.fromstring(xml).findtext(f".//{{{WSA}}}MessageID").encode()


def reply_text(verified: dict[str, Any], version: str) -> str | None:
    """The echoResponse text in the envelope WSS4J processed (decrypted in place where it was encrypted)."""
    root = etree.fromstring(verified["xml"].encode())
    assert etree.QName(root).namespace == soap_ns(version)
    return root.findtext(f".//{{{DEMO}}}echoResponse/{{{DEMO}}}text")


def der(path: Path) -> str:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()


def signed(verified: dict[str, Any], version: str) -> set[str]:
    """The local names WSS4J verified as signed, checked to include the Body and the Timestamp."""
    names = set(verified["signed"])
    assert f"{{{soap_ns(version)}}}Body" in names, names
    assert any(n.endswith("}Timestamp") for n in names), names
    return names


def exchange(gw: Any, route: str, version: str, secured: str, text: str, xml: bytes) -> requests.Response:
    """Send a WSS4J-secured request; it must pass, and the backend must get plain SOAP."""
    gw.clear()
    resp = post(gw, route, secured, version)
    assert resp.status_code == 200, resp.text
    backend_got(gw, text, version, message_id(xml))
    return resp


# ---------------------------------------------------------------------------------------------------------
# Every secured profile, both SOAP versions: WSS4J's request accepted, the gateway's reply verified by WSS4J.


@pytest.mark.parametrize("version", VERSIONS)
def test_wss4j_pre_shared_key_request_accepted_and_reply_verified_with_bsp(
    gw: Any, pki: Path, wss4j: Wss4j, psk: str, version: str
) -> None:
    """hmac with a pre-shared key: WSS4J names the key as it does (a Reference to the key name, custom ValueType);
    the gateway's reply must name it with a SecurityTokenReference WSS4J resolves by name (BSP R5417)."""
    text = f"psk-{version}"
    xml = request(gw, "psk", version, text)
    sign = {"do": "sign", "with": "psk", "name": "demo-client", "secret": psk, "value_type": PRE_SHARED_KEY,
            "parts": signed_parts(version)}  # fmt: skip
    secured = wss4j.secure(xml, [{"do": "timestamp"}, sign], layout="append")["xml"]
    resp = exchange(gw, "psk", version, secured, text, xml)
    assert gw.received()[0]["headers"]["x-wsgate-subject"] == "key:demo-client"
    verified = verify(wss4j, pki, resp.content, secrets={"demo-client": psk})
    signed(verified, version)
    assert verified["signature_key_sha256"] == hashlib.sha256(base64.b64decode(psk)).hexdigest()
    assert reply_text(verified, version) == text


@pytest.mark.parametrize("version", VERSIONS)
def test_wss4j_x509_request_accepted_and_reply_verified_with_bsp(
    gw: Any, pki: Path, wss4j: Wss4j, version: str
) -> None:
    text = f"rsa-{version}"
    xml = request(gw, "rsa", version, text)
    secured = wss4j.secure(xml, [{"do": "timestamp"}, x509_sign(pki, signed_parts(version))])["xml"]
    resp = exchange(gw, "rsa", version, secured, text, xml)
    assert gw.received()[0]["headers"]["x-wsgate-subject"] == "CN=Demo Client,O=WSGate Demo"
    verified = verify(wss4j, pki, resp.content)
    signed(verified, version)
    assert verified["signer_der"] == der(pki / "gateway-sign.pem")
    assert reply_text(verified, version) == text


@pytest.mark.parametrize("version", VERSIONS)
def test_wss4j_signed_and_encrypted_request_accepted_and_encrypted_reply_verified_with_bsp(
    gw: Any, pki: Path, wss4j: Wss4j, version: str
) -> None:
    """rsa with encryption: WSS4J's "Timestamp Signature Encrypt" (Body content, AES-256-GCM, RSA-OAEP)."""
    text = f"rsa-enc-{version}"
    xml = request(gw, "rsa-encrypted", version, text)
    steps = [{"do": "timestamp"}, x509_sign(pki, signed_parts(version)),
             encrypt_to_gateway(pki, [part("Body", soap_ns(version), "Content")])]  # fmt: skip
    secured = wss4j.secure(xml, steps)["xml"]
    assert text not in secured
    resp = exchange(gw, "rsa-encrypted", version, secured, text, xml)
    assert text.encode() not in resp.content
    verified = verify(wss4j, pki, resp.content)
    signed(verified, version)
    assert f"{{{soap_ns(version)}}}Body" in verified["decrypted"]
    assert verified["signer_der"] == der(pki / "gateway-sign.pem")
    assert reply_text(verified, version) == text


@pytest.mark.parametrize("version", VERSIONS)
def test_wss4j_encrypted_signature_request_accepted(gw: Any, pki: Path, wss4j: Wss4j, version: str) -> None:
    """WSS4J's encryptSignature (sp:EncryptSignature): one EncryptedKey whose ReferenceList names the Body
    content and the ds:Signature; the gateway decrypts the Signature and verifies it like a clear one."""
    text = f"encsig-{version}"
    xml = request(gw, "rsa-encrypted", version, text)
    parts = [part("Body", soap_ns(version), "Content"), part("Signature", DS)]
    steps = [{"do": "timestamp"}, x509_sign(pki, signed_parts(version)), encrypt_to_gateway(pki, parts)]
    secured = wss4j.secure(xml, steps)["xml"]
    assert "<ds:SignedInfo" not in secured  # the Signature travels encrypted
    resp = exchange(gw, "rsa-encrypted", version, secured, text, xml)
    verified = verify(wss4j, pki, resp.content)
    assert reply_text(verified, version) == text


@pytest.mark.parametrize("version", VERSIONS)
def test_wss4j_encrypted_body_redeclaring_the_envelopes_prefix_verifies_and_keeps_its_qnames(
    gw: Any, pki: Path, wss4j: Wss4j, version: str
) -> None:
    """Decryption must not change what was signed (issue 19 item 3): the Envelope binds d to the demo namespace,
    the echo declares its own prefix e for it and names a type with it (xsi:type="e:Echo"); WSS4J signs the Body,
    then encrypts its content. The gateway verifies, and the backend gets e and its declarations as sent."""
    text = f"redeclared-{version}"
    xml = (
        request(gw, "rsa-encrypted", version, text)
        .replace(b"<soap:Envelope ", f'<soap:Envelope xmlns:d="{DEMO}" '.encode(), 1)
        .replace(b'<d:echo xmlns:d="urn:wsgate:demo"><d:text>',
                 f'<e:echo xmlns:e="{DEMO}" xmlns:xsi="{XSI}" xsi:type="e:Echo"><e:text>'.encode())
        .replace(b"</d:text></d:echo>", b"</e:text></e:echo>")
    )  # fmt: skip
    steps = [{"do": "timestamp"}, x509_sign(pki, signed_parts(version)),
             encrypt_to_gateway(pki, [part("Body", soap_ns(version), "Content")])]  # fmt: skip
    secured = wss4j.secure(xml, steps)["xml"]
    assert text not in secured
    exchange(gw, "rsa-encrypted", version, secured, text, xml)
    echo = etree.fromstring(gw.received()[0]["body"].encode()).find(f".//{{{DEMO}}}echo")
    assert echo is not None and echo.prefix == "e" and echo.get(f"{{{XSI}}}type") == "e:Echo"
    assert echo.nsmap["e"] == DEMO


@pytest.mark.parametrize("version", VERSIONS)
def test_wss4j_encrypted_username_token_request_accepted_and_reply_verified_with_bsp(
    gw: Any, pki: Path, wss4j: Wss4j, version: str
) -> None:
    """username: CXF's symmetric binding with an EncryptedSupportingTokens UsernameToken. A fresh key in an
    EncryptedKey to the gateway signs (HMAC) and encrypts the token; the reply is signed with that same key,
    named by EncryptedKeySHA1, which WSS4J resolves through its CallbackHandler."""
    text = f"user-{version}"
    xml = request(gw, "username", version, text)
    token = part("UsernameToken", WSSE)
    steps = [
        {"do": "timestamp"},
        {"do": "encrypted_key", "cert": str(pki / "gateway-enc.pem")},
        {"do": "username", "user": "bob", "password": "bob-demo-password", "digest": True},
        {"do": "sign", "with": "encrypted_key", "parts": signed_parts(version, token)},
        {"do": "encrypt", "with": "encrypted_key", "parts": [token]},
    ]
    got = wss4j.secure(xml, steps, layout="append")
    assert "bob" not in got["xml"]  # the token travels encrypted
    resp = exchange(gw, "username", version, got["xml"], text, xml)
    assert gw.received()[0]["headers"]["x-wsgate-subject"] == "bob"
    verified = verify(wss4j, pki, resp.content)
    signed(verified, version)
    assert verified["signature_key_sha256"] == got["session_key_sha256"]
    assert reply_text(verified, version) == text


@pytest.mark.parametrize("sct_in_header", [True, False], ids=["sct-in-header", "sct-by-identifier"])
@pytest.mark.parametrize("version", VERSIONS)
def test_wss4j_derived_key_request_in_a_gateway_context_accepted_and_reply_verified_with_bsp(
    gw: Any, pki: Path, wss4j: Wss4j, version: str, sct_in_header: bool
) -> None:
    """secureconversation: the context is issued by the gateway (WS-Trust Issue by the project's client); WSS4J
    signs with a DerivedKeyToken from its secret, the SCT in the header (CXF's IncludeToken) or named by its
    Identifier; the gateway's reply (derived keys, signed and encrypted) is verified and decrypted by WSS4J."""
    client = gw.client("sc")
    ctx = client.establish(http_post(gw.url("sc", "echo")), soap_version=version)
    secret = base64.b64encode(ctx.secret).decode()
    text = f"sc-{version}"
    xml = request(gw, "sc", version, text)
    steps = [
        {"do": "timestamp"},
        {"do": "sct", "identifier": ctx.identifier, "secret": secret, "in_header": sct_in_header},
        {"do": "sign", "with": "sct", "parts": signed_parts(version)},
    ]
    secured = wss4j.secure(xml, steps, layout="append")["xml"]
    resp = exchange(gw, "sc", version, secured, text, xml)
    assert gw.received()[0]["headers"]["x-wsgate-subject"] == "CN=Demo Client,O=WSGate Demo"
    verified = verify(wss4j, pki, resp.content, secrets={ctx.identifier: secret})
    signed(verified, version)
    assert "DerivedKeyToken" in verified["actions"]
    assert f"{{{soap_ns(version)}}}Body" in verified["decrypted"]
    assert reply_text(verified, version) == text


@pytest.mark.parametrize("sct_in_header", [True, False], ids=["sct-in-header", "sct-by-identifier"])
@pytest.mark.parametrize("version", VERSIONS)
def test_wss4j_request_signed_with_the_context_key_itself_accepted_and_reply_verified(
    gw: Any, pki: Path, wss4j: Wss4j, version: str, sct_in_header: bool
) -> None:
    """A route without sp:RequireDerivedKeys: WSS4J signs with the context's own secret (WSSecSignature, a
    reference to the SCT); the gateway's reply, signed and encrypted with that key too, WSS4J verifies and opens.
    The same request to a route that requires derived keys is refused."""
    client = gw.client("sc-direct")
    ctx = client.establish(http_post(gw.url("sc-direct", "echo")), soap_version=version)
    secret = base64.b64encode(ctx.secret).decode()
    text = f"sc-direct-{version}"
    steps = [
        {"do": "timestamp"},
        {"do": "sct", "identifier": ctx.identifier, "secret": secret, "in_header": sct_in_header},
        {"do": "sign", "with": "sct_direct", "parts": signed_parts(version)},
    ]
    xml = request(gw, "sc-direct", version, text)
    secured = wss4j.secure(xml, steps, layout="append")["xml"]
    assert "DerivedKeyToken" not in secured
    resp = exchange(gw, "sc-direct", version, secured, text, xml)
    assert b"DerivedKeyToken" not in resp.content
    verified = verify(wss4j, pki, resp.content, secrets={ctx.identifier: secret})
    signed(verified, version)
    assert f"{{{soap_ns(version)}}}Body" in verified["decrypted"]
    assert reply_text(verified, version) == text
    refused = post(gw, "sc", wss4j.secure(request(gw, "sc", version, text), steps, layout="append")["xml"], version)
    assert fault_code(refused) == "InvalidSecurity", refused.text


# ---------------------------------------------------------------------------------------------------------
# A reply whose Signature is encrypted (the route's encryption.encrypt_signature): its own gateway, as the
# option is new.


@pytest.fixture(scope="module")
def gw_encrypted_signature(module_gateway: GatewayFactory, pki: Path) -> LiveGateway:
    route = route_doc(pki, "rsa", name="rsa-encrypted", signature=ADDRESSING,
                      encryption={**ENCRYPTED, "encrypt_signature": True})  # fmt: skip
    return module_gateway([route])


@pytest.mark.parametrize("version", VERSIONS)
def test_reply_with_encrypted_signature_verified_by_wss4j(
    gw_encrypted_signature: Any, pki: Path, wss4j: Wss4j, version: str
) -> None:
    """The gateway encrypts its reply's Signature with the Body (digests of a plaintext Body would let a reader
    confirm guesses of it); WSS4J decrypts the Signature, then verifies it, BSP on."""
    gw = gw_encrypted_signature
    text = f"reply-encsig-{version}"
    xml = request(gw, "rsa-encrypted", version, text)
    steps = [{"do": "timestamp"}, x509_sign(pki, signed_parts(version)),
             encrypt_to_gateway(pki, [part("Body", soap_ns(version), "Content")])]  # fmt: skip
    resp = exchange(gw, "rsa-encrypted", version, wss4j.secure(xml, steps)["xml"], text, xml)
    assert b"SignedInfo" not in resp.content
    verified = verify(wss4j, pki, resp.content)
    assert SIGNATURE in verified["decrypted"] and f"{{{soap_ns(version)}}}Body" in verified["decrypted"]
    signed(verified, version)
    assert verified["signer_der"] == der(pki / "gateway-sign.pem")
    assert reply_text(verified, version) == text


# ---------------------------------------------------------------------------------------------------------
# Threats: what WSS4J sends, altered or signed by the wrong key, is refused with a fault of its SOAP version.


def assert_refused(gw: Any, resp: requests.Response, version: str, *codes: str) -> None:
    """A SOAP fault of the request's version with one of `codes`, and nothing reached the backend."""
    assert resp.status_code == 500, resp.text
    root = etree.fromstring(resp.content)
    assert etree.QName(root).namespace == soap_ns(version)
    assert root.find(f"{{{soap_ns(version)}}}Body/{{{soap_ns(version)}}}Fault") is not None
    assert fault_code(resp) in codes, resp.text
    assert gw.received() == []


TAMPERING = {
    "body": lambda xml, text: xml.replace(f">{text}<", ">transfer everything<"),
    "wsa-to": lambda xml, text: xml.replace("/rsa/echo</wsa:To>", "/elsewhere/echo</wsa:To>"),
    "wsa-reply-to": lambda xml, text: xml.replace("/addressing/anonymous<", "/addressing/none<"),
}


@pytest.mark.parametrize("where", TAMPERING)
@pytest.mark.parametrize("version", VERSIONS)
def test_wss4j_request_tampered_after_signing_is_refused(
    gw: Any, pki: Path, wss4j: Wss4j, version: str, where: str
) -> None:
    text = f"tamper-{version}"
    xml = request(gw, "rsa", version, text)
    secured = wss4j.secure(xml, [{"do": "timestamp"}, x509_sign(pki, signed_parts(version))])["xml"]
    tampered = TAMPERING[where](secured, text)
    assert tampered != secured
    gw.clear()
    assert_refused(gw, post(gw, "rsa", tampered, version), version, "FailedCheck")


@pytest.mark.parametrize("version", VERSIONS)
def test_wss4j_request_signed_by_an_untrusted_certificate_is_refused(
    gw: Any, pki: Path, wss4j: Wss4j, version: str
) -> None:
    xml = request(gw, "rsa", version, "rogue")
    secured = wss4j.secure(xml, [{"do": "timestamp"}, x509_sign(pki, signed_parts(version), stem="rogue")])["xml"]
    gw.clear()
    assert_refused(gw, post(gw, "rsa", secured, version), version, "FailedAuthentication")


@pytest.mark.parametrize("version", VERSIONS)
def test_wss4j_request_signed_with_an_unknown_pre_shared_key_is_refused(gw: Any, wss4j: Wss4j, version: str) -> None:
    """A key name the gateway does not hold (with a key the attacker made up) is no credential."""
    xml = request(gw, "psk", version, "stranger")
    made_up = base64.b64encode(b"\x42" * 32).decode()
    sign = {"do": "sign", "with": "psk", "name": "stranger", "secret": made_up, "value_type": PRE_SHARED_KEY,
            "parts": signed_parts(version)}  # fmt: skip
    secured = wss4j.secure(xml, [{"do": "timestamp"}, sign], layout="append")["xml"]
    gw.clear()
    # SecurityTokenUnavailable once the name is looked up as a key (the bsp branch); InvalidSecurity before.
    assert_refused(gw, post(gw, "psk", secured, version), version, "SecurityTokenUnavailable", "InvalidSecurity")


@pytest.mark.parametrize("version", VERSIONS)
def test_wss4j_request_with_unsigned_addressing_headers_is_refused(
    gw: Any, pki: Path, wss4j: Wss4j, version: str
) -> None:
    """The route signs WS-Addressing: a request whose wsa:To and wsa:ReplyTo anyone could have rewritten is not
    taken (the signature covers the Body and Timestamp only)."""
    xml = request(gw, "rsa", version, "unsigned-wsa")
    parts = signed_parts(version, addressing=False)
    secured = wss4j.secure(xml, [{"do": "timestamp"}, x509_sign(pki, parts)])["xml"]
    gw.clear()
    assert_refused(gw, post(gw, "rsa", secured, version), version, "InvalidSecurity")


def test_wss4j_request_replayed_is_refused(gw: Any, pki: Path, wss4j: Wss4j) -> None:
    xml = request(gw, "rsa", "1.2", "once")
    secured = wss4j.secure(xml, [{"do": "timestamp"}, x509_sign(pki, signed_parts("1.2"))])["xml"]
    exchange(gw, "rsa", "1.2", secured, "once", xml)
    gw.clear()
    assert_refused(gw, post(gw, "rsa", secured, "1.2"), "1.2", "InvalidSecurity")


def test_wss4j_refuses_a_gateway_reply_altered_in_transit(gw: Any, pki: Path, wss4j: Wss4j) -> None:
    """The check on the far side can fail: WSS4J refuses the gateway's signed reply once its Body is changed."""
    xml = request(gw, "rsa", "1.1", "genuine")
    secured = wss4j.secure(xml, [{"do": "timestamp"}, x509_sign(pki, signed_parts("1.1"))])["xml"]
    resp = exchange(gw, "rsa", "1.1", secured, "genuine", xml)
    verify(wss4j, pki, resp.content)
    with pytest.raises(Wss4jError, match=r"(?i)signature|digest|reference"):
        verify(wss4j, pki, resp.content.replace(b">genuine<", b">forged<"))


def test_wss4j_verifier_enforces_the_basic_security_profile(gw: Any, pki: Path, wss4j: Wss4j, psk: str) -> None:
    """The far-side check is the strict one CXF runs: the same validly signed message is refused by WSS4J once its
    KeyInfo holds a bare ds:KeyName (the reply form of issue 12), by Basic Security Profile rule R5417."""
    xml = request(gw, "psk", "1.1", "bsp")
    sign = {"do": "sign", "with": "psk", "name": "demo-client", "secret": psk, "value_type": PRE_SHARED_KEY,
            "parts": signed_parts("1.1")}  # fmt: skip
    secured = wss4j.secure(xml, [{"do": "timestamp"}, sign], layout="append")["xml"].encode()
    verify(wss4j, pki, secured, secrets={"demo-client": psk})
    root = etree.fromstring(secured)
    key_info = root.find(f".//{{{DS}}}KeyInfo")
    key_info.remove(key_info[0])  # the KeyInfo is not signed: the signature stays valid
    etree.SubElement(key_info, f"{{{DS}}}KeyName").text = "demo-client"
    key_name = etree.tostring(root)
    assert key_name != secured
    with pytest.raises(Wss4jError, match="R5417"):
        verify(wss4j, pki, key_name, secrets={"demo-client": psk})
