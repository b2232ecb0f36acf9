"""Interoperability of the saml profile with a SAML-capable WS-Security client we did not write: Eclipse Metro
4.0.4 (webservices-rt, which needs no OpenSAML). Metro's SAMLCallback makes the client supply the assertion
(tests/interop/metro: SamlHandler), here one signed by the test IdP with signxml (tests/support/saml.py); the
WS-SecurityPolicy Metro follows is the gateway's published `rsa` policy with its initiator token a SamlToken
(holder-of-key: Metro signs with the key the assertion confirms) or a SamlToken as a signed supporting token
(sender-vouches: Metro signs as the attesting party). Forged variants are refused and reach no backend."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from lxml import etree

from filters.engine import ns
from tests.support import saml as saml_support
from tests.support.harness import clear, received, running_gateway
from tests.support.metro import Metro, MetroError
from tests.support.recording_proxy import RecordingProxy
from tests.support.wss_helpers import DEMO, route_doc

WSDL_FILE = Path(__file__).parents[1] / "wsdl" / "publish" / "echo.wsdl"
SERVICE = "{urn:wsgate:demo:service}EchoService"
PORTS = {"1.1": "{urn:wsgate:demo:service}EchoPort", "1.2": "{urn:wsgate:demo:service}EchoPort12"}
ACTION = "urn:wsgate:demo#echo"
WSP = "http://www.w3.org/ns/ws-policy"
SP = "http://docs.oasis-open.org/ws-sx/ws-securitypolicy/200702"
ALWAYS = f"{SP}/IncludeToken/AlwaysToRecipient"


@pytest.fixture(scope="module")
def metro(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Metro]:
    log = (tmp_path_factory.mktemp("metro-saml") / "metro.log").open("wb")
    client = Metro(log)
    yield client
    client.close()
    log.close()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[Any]:
    # The rsa route publishes the WSDL (and its schema import) whose policy the test turns into a SAML one.
    rsa = route_doc(pki, "rsa", name="rsa", match={"path_prefix": "/rsa/service"},
                    wsdl={"file": str(WSDL_FILE), "publish": True})  # fmt: skip
    saml = saml_support.saml_doc(pki, name="saml", match={"path_prefix": "/saml/service"})
    with running_gateway(tmp_path_factory.mktemp("metro-saml-gw"), [rsa, saml], pki) as g:
        yield g


def _saml_token() -> etree._Element:
    token = etree.Element(etree.QName(SP, "SamlToken"), nsmap={"sp": SP, "wsp": WSP})
    token.set(etree.QName(SP, "IncludeToken"), ALWAYS)
    etree.SubElement(etree.SubElement(token, etree.QName(WSP, "Policy")), etree.QName(SP, "WssSamlV20Token11"))
    return token


@pytest.fixture(scope="module")
def wsdls(gw: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The published rsa WSDL with a SAML policy, per confirmation method: file URLs for Metro."""
    published = requests.get(f"http://127.0.0.1:{gw.opts.http_port}/rsa/service?wsdl", timeout=10).content
    out, folder = {}, tmp_path_factory.mktemp("metro-saml-wsdl")
    for method in ("holder-of-key", "sender-vouches"):
        root = etree.fromstring(published)
        binding = root.find(f".//{{{SP}}}AsymmetricBinding")
        if method == "holder-of-key":  # the message is signed with the key the assertion confirms
            initiator = binding.find(f"{{{WSP}}}Policy/{{{SP}}}InitiatorToken/{{{WSP}}}Policy")
            initiator.replace(initiator[0], _saml_token())
        else:  # signed as before, by the attesting party, the assertion a signed supporting token
            supporting = etree.Element(etree.QName(SP, "SignedSupportingTokens"))
            etree.SubElement(supporting, etree.QName(WSP, "Policy")).append(_saml_token())
            binding.addnext(supporting)
        path = folder / f"{method}.wsdl"
        path.write_bytes(etree.tostring(root))
        out[method] = path.as_uri()
    return out


def call(metro: Metro, gw: Any, pki: Path, wsdl: str, assertion: etree._Element, signer: str, version: str = "1.1",
         proxy: RecordingProxy | None = None) -> str:  # fmt: skip
    """Metro's echo through the saml route, sending `assertion`, its key store holding `signer`'s key."""
    text = f"metro-saml-{uuid.uuid4().hex[:8]}"
    base = proxy.url if proxy is not None else f"http://127.0.0.1:{gw.opts.http_port}"
    params = {
        "key": str(pki / f"{signer}.key"),
        "cert": str(pki / f"{signer}.pem"),
        "trust": [str(pki / "ca.pem"), str(pki / "gateway-enc.pem")],
        "peer": "gateway-enc",
        "action": ACTION,
        "endpoint": f"{base}/saml/service",
        "assertion": etree.tostring(assertion).decode(),
    }
    payload = f'<d:echo xmlns:d="{DEMO}"><d:text>{text}</d:text></d:echo>'
    (reply,) = metro.invoke(wsdl, SERVICE, PORTS[version], [payload], **params)
    assert etree.fromstring(reply.encode()).findtext(f"{{{DEMO}}}text") == text
    return text


def issued(pki: Path, method: str, **kw: Any) -> etree._Element:
    return saml_support.sign(saml_support.assertion_xml(pki, method=method, **kw), pki)


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize(
    ("method", "signer"),
    [("holder-of-key", "client"), ("sender-vouches", "client2")],
)
def test_metro_saml_client_gets_through(
    metro: Metro, gw: Any, pki: Path, wsdls: dict[str, str], method: str, signer: str, version: str
) -> None:
    clear(gw)
    text = call(metro, gw, pki, wsdls[method], issued(pki, method), signer, version)
    (got,) = received(gw)
    assert text in got["body"] and "Assertion" not in got["body"]
    assert got["headers"]["x-wsgate-subject"] == saml_support.SUBJECT
    assert got["headers"]["x-wsgate-role"] == "clerk"


@pytest.mark.parametrize(
    ("forgery", "reason"),
    [
        ({"stem": "saml-rogue-idp"}, "signature"),  # an issuer the route does not list, same name
        ({"subject": "CN=Administrator"}, "signature"),  # the subject changed after the IdP signed
        ({"holder": "client2"}, "does not verify"),  # confirms another key than the one Metro signs with
        ({"audience": "urn:elsewhere"}, "audience"),
        ({"issued_ago_s": 3600}, "expired|older"),
    ],
)
def test_metro_forged_holder_of_key_assertion_refused(
    metro: Metro, gw: Any, pki: Path, wsdls: dict[str, str], forgery: dict[str, Any], reason: str
) -> None:
    clear(gw)
    stem = forgery.pop("stem", "saml-idp")
    subject = forgery.pop("subject", None)
    ago = forgery.pop("issued_ago_s", 0)
    xml = saml_support.assertion_xml(pki, method="holder-of-key", issued=saml_support.now() - timedelta(seconds=ago),
                                     valid_s=300, **forgery)  # fmt: skip
    assertion = saml_support.sign(xml, pki, stem)
    if subject is not None:
        assertion.find(f".//{{{ns.SAML2}}}NameID").text = subject
    before = _log(gw)
    with pytest.raises(MetroError, match="Security"):
        call(metro, gw, pki, wsdls["holder-of-key"], assertion, "client")
    assert received(gw) == []
    assert re.search(reason, _log(gw)[len(before) :], re.I), _log(gw)[len(before) :][-2000:]


def test_metro_saml_message_replayed_refused(metro: Metro, gw: Any, pki: Path, wsdls: dict[str, str]) -> None:
    proxy = RecordingProxy(f"http://127.0.0.1:{gw.opts.http_port}")
    try:
        clear(gw)
        call(metro, gw, pki, wsdls["holder-of-key"], issued(pki, "holder-of-key"), "client", proxy=proxy)
        sent = proxy.exchanges[-1]
        assert b"Assertion" in sent.request and sent.status == 200
        again = requests.post(f"http://127.0.0.1:{gw.opts.http_port}/saml/service", data=sent.request,
                              headers=sent.headers, timeout=30)  # fmt: skip
        assert again.status_code == 500 and len(received(gw)) == 1
    finally:
        proxy.close()


def _log(gw: Any) -> str:
    return "".join(p.read_text() for p in sorted((gw.opts.run_dir / "logs").glob("filter-*.log")))


def test_metro_sender_vouches_by_a_party_not_allowed_to_vouch_refused(
    metro: Metro, gw: Any, pki: Path, wsdls: dict[str, str]
) -> None:
    """Metro's STR-Transform signature verifies, but `client` is not listed as attesting: nothing reaches the
    backend (the control is test_metro_saml_client_gets_through with `client2`)."""
    clear(gw)
    before = _log(gw)
    with pytest.raises(MetroError, match="Security"):
        call(metro, gw, pki, wsdls["sender-vouches"], issued(pki, "sender-vouches"), "client")
    assert received(gw) == []
    assert "no subject confirmation" in _log(gw)[len(before) :]
