"""Interoperability with a client we did not write, generated from the WSDL we publish: Eclipse Metro 4.0.4 (the
JAX-WS reference implementation with WSIT) reads the gateway's `?wsdl` and its WS-SecurityPolicy as they are,
with no hand-written client policy (only its keys and trust: tests/interop/metro), and calls every profile it
supports, SOAP 1.1 and 1.2. A recording proxy between Metro and the gateway keeps what went each way, so Metro's
own messages can be replayed and tampered with. One JVM serves the whole session (tests/support/metro.py); the jar is
built by `make metro` (a prerequisite of `make test`). Nothing here is skipped: a missing jar or java fails.

What maps (docs/interop.md): rsa is WS-SecurityPolicy's AsymmetricBinding, and Metro signs RSA-SHA256 because the
published AlgorithmSuite says so in Metro's own attribute; hmac is the SymmetricBinding with an X.509 protection
token (Metro's key in an EncryptedKey, an anonymous sender: pre-shared keys have no SP token), signed HMAC-SHA1 as
every SP suite says; encryption is AES-CBC (Metro has no GCM), which the gateway takes only under a single-use EncryptedKey or as
ciphertext signed by the key's holder; UsernameToken over TLS is the rsa binding with a signed supporting token on
the HTTPS listener (Metro encrypts the token whatever the policy says);
secureconversation is the SecureConversationToken with derived keys, bootstrapped by an encrypted Issue."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from lxml import etree

from certs.pki import DEMO_USERS
from filters.engine import ns
from tests.support.harness import clear, received, running_gateway
from tests.support.metro import Metro, MetroError
from tests.support.recording_proxy import Exchange, RecordingProxy
from tests.support.wss_helpers import DEMO, route_doc

WSDL_FILE = Path(__file__).parents[1] / "wsdl" / "publish" / "echo.wsdl"
SERVICE = "{urn:wsgate:demo:service}EchoService"
PORTS = {"1.1": "{urn:wsgate:demo:service}EchoPort", "1.2": "{urn:wsgate:demo:service}EchoPort12"}
VERSIONS = ["1.1", "1.2"]
ACTION = "urn:wsgate:demo#echo"
WST = "http://docs.oasis-open.org/ws-sx/ws-trust/200512"
CBC = {"data_algorithms": ["aes256-cbc"], "response_algorithm": "aes256-cbc"}
BOTH_WAYS = {"require_request": True, "encrypt_response": True, **CBC}
# Metro signs with symmetric keys in HMAC-SHA1 only, as every SP algorithm suite names it.
HMAC_SHA1 = {"algorithms": ["rsa-sha256", "hmac-sha256", "hmac-sha1"]}


def _routes(pki: Path) -> list[dict[str, Any]]:
    def published(name: str, profile: str, **extra: Any) -> dict[str, Any]:
        wsdl = {"file": str(WSDL_FILE), "publish": True}
        return route_doc(pki, profile, name=name, match={"path_prefix": f"/{name}/service"}, wsdl=wsdl, **extra)

    users = {"required": True, "users_file": str(pki / "users.yaml"), "protection": "tls"}
    sc = {"store": "memory", "master_keys_file": str(pki / "sct-master-keys.yaml")}
    return [
        published("rsa", "rsa"),
        published("rsa-encrypted", "rsa", encryption=BOTH_WAYS),
        published("hmac", "hmac", signature=HMAC_SHA1, encryption=BOTH_WAYS),
        published("username", "rsa", signature={"parts": ["body", "timestamp", "username_token"]},
                  username_token=users, encryption=CBC),
        published("sc", "secureconversation", secureconversation=sc, encryption={"encrypt_response": True, **CBC},
                  signature={**HMAC_SHA1, "parts": ["body", "timestamp", "addressing"]}),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[Any]:
    with running_gateway(tmp_path_factory.mktemp("metro-gw"), _routes(pki), pki) as g:
        yield g


@pytest.fixture
def proxy(gw: Any) -> Iterator[RecordingProxy]:
    p = RecordingProxy(f"http://127.0.0.1:{gw.opts.http_port}")
    yield p
    p.close()


def wsdl_url(gw: Any, route: str) -> str:
    if route == "username":  # served on the HTTPS listener only (the UsernameToken is kept by TLS)
        return f"https://127.0.0.1:{gw.opts.https_port}/{route}/service?wsdl"
    return f"http://127.0.0.1:{gw.opts.http_port}/{route}/service?wsdl"


def payload(text: str) -> str:
    return f'<d:echo xmlns:d="{DEMO}"><d:text>{text}</d:text></d:echo>'


def reply_text(reply: str) -> str | None:
    return etree.fromstring(reply.encode()).findtext(f"{{{DEMO}}}text")


def call(
    metro: Metro,
    gw: Any,
    pki: Path,
    route: str,
    version: str,
    texts: list[str],
    proxy: RecordingProxy | None = None,
    signer: str = "client",
) -> list[str]:
    """Metro's replies to an echo of each text, on one client built from the route's published WSDL."""
    params: dict[str, Any] = {
        "key": str(pki / f"{signer}.key"),
        "cert": str(pki / f"{signer}.pem"),
        "trust": [str(pki / "ca.pem"), str(pki / "gateway-enc.pem")],
        "peer": "gateway-enc",  # the certificate the RecipientToken (never sent) stands for
        "action": ACTION,
    }
    if route == "username":
        params |= {"username": "bob", "password": DEMO_USERS["bob"], "tls_trust": [str(pki / "ca.pem")]}
    if proxy is not None:
        params["endpoint"] = f"{proxy.url}/{route}/service"
    replies = metro.invoke(wsdl_url(gw, route), SERVICE, PORTS[version], [payload(t) for t in texts], **params)
    return [reply_text(r) or "" for r in replies]


def backend_texts(gw: Any) -> list[str]:
    """The echo texts the demo backend received, each as plain SOAP with no WS-Security left."""
    texts = []
    for got in received(gw):
        root = etree.fromstring(got["body"].encode())
        assert root.find(f".//{{{ns.WSSE}}}Security") is None and root.find(f".//{{{ns.XENC}}}EncryptedData") is None
        texts.append(root.findtext(f".//{{{DEMO}}}text"))
    return texts


def fault(response: bytes) -> str:
    root = etree.fromstring(response)
    return (root.findtext(".//faultcode") or root.findtext(".//{*}Subcode/{*}Value") or "").split(":")[-1]


def gateway_log(gw: Any) -> str:
    return "".join(p.read_text() for p in sorted((gw.opts.run_dir / "logs").glob("filter-*.log")))


# ---------------------------------------------------------------------------------------------------------
# Every profile Metro supports, both SOAP versions, from the published WSDL as it is.


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("route", ["rsa", "rsa-encrypted", "hmac", "username"])
def test_metro_from_the_published_wsdl_gets_through(
    metro: Metro, gw: Any, pki: Path, proxy: RecordingProxy, route: str, version: str
) -> None:
    """Metro's request is accepted and the backend gets plain SOAP; Metro verifies (and decrypts) the reply by the
    same published policy: a reply in an algorithm the policy does not state would fail in Metro."""
    clear(gw)
    text = f"{route}-{version}-{uuid.uuid4().hex[:8]}"
    assert call(metro, gw, pki, route, version, [text], proxy if route != "username" else None) == [text]
    assert backend_texts(gw) == [text]
    if route == "rsa-encrypted" or route == "hmac":
        sent = proxy.exchanges[-1].request
        assert b"xmlenc#aes256-cbc" in sent and text.encode() not in sent  # encrypted as the policy says
    if route != "hmac":  # the X.509 signer (the UsernameToken is checked too: see the wrong password below)
        assert received(gw)[0]["headers"]["x-wsgate-subject"] == "CN=Demo Client,O=WSGate Demo"
    if route != "username":  # through the recording proxy (the HTTPS route is called directly)
        # RSA-SHA256: Metro read the suite's signatureAlgorithm; HMAC-SHA1: Metro's only symmetric signature.
        method = b"xmldsig#hmac-sha1" if route == "hmac" else b"xmldsig-more#rsa-sha256"
        assert method in proxy.exchanges[-1].request


@pytest.mark.parametrize("version", VERSIONS)
def test_metro_secure_conversation_issue_calls_cancel(
    metro: Metro, gw: Any, pki: Path, proxy: RecordingProxy, version: str
) -> None:
    """Metro establishes a context with the gateway's own STS (an encrypted, signed Issue), makes two calls in it
    with derived keys, and cancels it when the client is closed; a call of that context replayed after the
    Cancel is refused (the context is gone, not only the message seen)."""
    clear(gw)
    texts = [f"sc-{version}-{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    assert call(metro, gw, pki, "sc", version, texts, proxy) == texts
    assert backend_texts(gw) == texts  # Issue and Cancel never reach the backend
    actions = [_action(ex) for ex in proxy.exchanges]
    assert actions == [f"{WST}/RST/SCT", ACTION, ACTION, f"{WST}/RST/SCT/Cancel"], actions
    assert all(ex.status == 200 for ex in proxy.exchanges)
    issue = proxy.exchanges[0].request
    assert b"xmlenc#aes256-cbc" in issue and b"RequestSecurityToken" not in issue  # the bootstrap's EncryptedParts
    for ex in proxy.exchanges[1:3]:
        assert b"DerivedKeyToken" in ex.request and b"xmldsig#hmac-sha1" in ex.request
    assert b"xmldsig#hmac-sha1" in proxy.exchanges[1].response  # answered in the algorithm the client used
    replayed = requests.post(proxy.upstream + "/sc/service", data=proxy.exchanges[1].request,
                             headers=proxy.exchanges[1].headers, timeout=30)  # fmt: skip
    assert replayed.status_code == 500
    assert fault(replayed.content) == "BadContextToken"  # the context is gone, not only this message seen
    assert backend_texts(gw) == texts


def test_metro_username_token_with_a_wrong_password_refused(metro: Metro, gw: Any, pki: Path) -> None:
    """The UsernameToken Metro sends (encrypted by Metro, over TLS) is checked: a wrong password is refused."""
    clear(gw)
    params = {"username": "bob", "password": "not-" + DEMO_USERS["bob"], "tls_trust": [str(pki / "ca.pem")]}
    with pytest.raises(MetroError):
        metro.invoke(wsdl_url(gw, "username"), SERVICE, PORTS["1.1"], [payload("wrong")], key=str(pki / "client.key"),
                     cert=str(pki / "client.pem"), trust=[str(pki / "ca.pem"), str(pki / "gateway-enc.pem")],
                     peer="gateway-enc", action=ACTION, **params)  # fmt: skip
    assert "FailedAuthentication" in gateway_log(gw).splitlines()[-1]
    assert backend_texts(gw) == []


def _action(ex: Exchange) -> str:
    """The exchange's WS-Addressing Action (signed, and in the clear, as Metro sends it)."""
    root = etree.fromstring(ex.request)
    return root.findtext(".//{http://www.w3.org/2005/08/addressing}Action") or ""


# ---------------------------------------------------------------------------------------------------------
# Refused: Metro's own messages from an untrusted signer, tampered with on the way, or sent twice.


@pytest.mark.parametrize("version", VERSIONS)
def test_metro_signed_by_an_untrusted_certificate_refused(
    metro: Metro, gw: Any, pki: Path, proxy: RecordingProxy, version: str
) -> None:
    """A certificate from another CA with the same subject (certs/pki.py's rogue): refused, nothing forwarded."""
    clear(gw)
    with pytest.raises(MetroError):
        call(metro, gw, pki, "rsa", version, ["rogue"], proxy, signer="rogue")
    assert [ex.status for ex in proxy.exchanges] == [500]
    assert fault(proxy.exchanges[0].response) == "FailedAuthentication"
    assert backend_texts(gw) == []


@pytest.mark.parametrize("route", ["rsa", "rsa-encrypted"])
def test_metro_message_tampered_on_the_way_refused(
    metro: Metro, gw: Any, pki: Path, proxy: RecordingProxy, route: str
) -> None:
    """One byte of Metro's signed Body (the text, or the CBC ciphertext that is signed) changed in transit: refused
    before anything is decrypted or forwarded, with the one generic fault."""
    clear(gw)
    proxy.tamper = _flip_body_byte
    with pytest.raises(MetroError):
        call(metro, gw, pki, route, "1.1", ["tamper-me"], proxy)
    assert [ex.status for ex in proxy.exchanges] == [500]
    assert fault(proxy.exchanges[0].response) == "FailedCheck"
    assert backend_texts(gw) == []


def _flip_body_byte(message: bytes) -> bytes:
    """The plain text if it is there, else a byte in the middle of the CipherValue of the Body."""
    if b"tamper-me" in message:
        return message.replace(b"tamper-me", b"tamper-ME")
    body = message.index(b"Body")
    start = message.index(b"CipherValue>", body) + len(b"CipherValue>")
    i = start + 40
    return message[:i] + (b"A" if message[i : i + 1] != b"A" else b"B") + message[i + 1 :]


@pytest.mark.parametrize("route", ["rsa", "rsa-encrypted", "hmac"])
def test_metro_message_replayed_refused(metro: Metro, gw: Any, pki: Path, proxy: RecordingProxy, route: str) -> None:
    """Metro's accepted request, sent again byte for byte with its headers: refused, the backend saw it once."""
    clear(gw)
    assert call(metro, gw, pki, route, "1.2", ["once"], proxy) == ["once"]
    first = proxy.exchanges[-1]
    again = requests.post(proxy.upstream + first.path, data=first.request, headers=first.headers, timeout=30)
    assert again.status_code == 500
    assert "replay" in gateway_log(gw).splitlines()[-1]
    assert backend_texts(gw) == ["once"]


# ---------------------------------------------------------------------------------------------------------
# The published policies Metro consumed, as the gateway states them (what docs/interop.md describes).


def test_published_wsdl_is_what_metro_consumed(gw: Any) -> None:
    """The rsa route's policy names RSA-SHA256 in Metro's attribute; CBC routes say EncryptBeforeSigning; the
    SecureConversation token requires derived keys and carries a bootstrap with Trust13 and protected parts."""
    rsa = requests.get(wsdl_url(gw, "rsa"), timeout=10).text
    assert 'signatureAlgorithm="SHA256withRSA"' in rsa and "EncryptBeforeSigning" not in rsa
    assert "EncryptBeforeSigning" in requests.get(wsdl_url(gw, "rsa-encrypted"), timeout=10).text
    sc = etree.fromstring(requests.get(wsdl_url(gw, "sc"), timeout=10).content)
    sp = "{http://docs.oasis-open.org/ws-sx/ws-securitypolicy/200702}"
    token = sc.find(f".//{sp}SecureConversationToken")
    assert token is not None and token.find(f".//{sp}RequireDerivedKeys") is not None
    bootstrap = token.find(f".//{sp}BootstrapPolicy")
    assert bootstrap is not None
    for name in ("Trust13", "SignedParts", "EncryptedParts", "AsymmetricBinding"):
        assert bootstrap.find(f".//{sp}{name}") is not None, name
    assert sc.find(".//{http://www.w3.org/2007/05/addressing/metadata}Addressing") is not None
