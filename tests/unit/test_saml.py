"""Issue #22: the `saml` profile in-process: its policy model, EncryptedAssertion (encrypted by libxmlsec1, not our
code), issuers known by trust anchors, SAML 1.1 and 2.0 from the same IdP, the client's `--assertion`."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import xmlsec
from lxml import etree

from filters.engine import faults, ns
from filters.engine.engine import Exchange
from filters.engine.profiles import SamlPipeline
from filters.stores.factory import RouteStores
from gateway.policy import Route
from gateway.tools.wsdl_import import import_wsdl
from tests.support import saml as S
from tests.support.wss_helpers import echo, echo_response, route_doc


def pipeline_for(route: Route) -> SamlPipeline:
    return SamlPipeline(route, RouteStores())


def send(route: Route, pki: Path, tmp: Path, assertion: etree._Element, signer: str = "client2") -> dict[str, str]:
    """Through the engine and back: the headers the backend gets; the reply opened by the client."""
    client = S.client(route, pki, S.write(tmp, assertion), signer=signer)
    data, pending = client.secure(echo())
    pipeline = pipeline_for(route)
    ex = Exchange(route=route)
    out = pipeline.request(data, {}, ex)
    assert out.body is not None
    reply = pipeline.response(echo_response(out.body), ex).body
    assert reply is not None
    client.open(reply, pending)
    return dict(out.set_headers)


def encrypted(assertion: etree._Element, pki: Path, algorithm: xmlsec.Transform) -> etree._Element:
    """An EncryptedAssertion to the gateway's encryption certificate, made with libxmlsec1 as IdPs do (a fresh
    AES key in an RSA-OAEP EncryptedKey inside the EncryptedData's KeyInfo)."""
    holder = etree.Element(ns.q(ns.SAML2, "EncryptedAssertion"), nsmap={"saml": ns.SAML2})
    holder.append(assertion)
    data = xmlsec.template.encrypted_data_create(holder, algorithm, type=xmlsec.EncryptionType.ELEMENT, ns="xenc")
    xmlsec.template.encrypted_data_ensure_cipher_value(data)
    key_info = xmlsec.template.encrypted_data_ensure_key_info(data, ns="ds")
    key = xmlsec.template.add_encrypted_key(key_info, xmlsec.Transform.RSA_OAEP)
    xmlsec.template.encrypted_data_ensure_cipher_value(key)
    manager = xmlsec.KeysManager()
    manager.add_key(xmlsec.Key.from_file(str(pki / "gateway-enc.pem"), xmlsec.constants.KeyDataFormatCertPem))
    ctx = xmlsec.EncryptionContext(manager)
    bits = 128 if algorithm == xmlsec.Transform.AES128_GCM else 256
    ctx.key = xmlsec.Key.generate(xmlsec.constants.KeyDataAes, bits, xmlsec.constants.KeyDataTypeSession)
    ctx.encrypt_xml(data, assertion)
    return holder


def test_policy_saml_options_go_with_the_saml_profile(pki: Path) -> None:
    doc = S.saml_doc(pki)
    doc["upstream"] = {"address": "127.0.0.1:1"}
    Route.model_validate(doc)
    with pytest.raises(ValueError, match="saml profile"):
        Route.model_validate({**doc, "profile": "rsa"})
    with pytest.raises(ValueError, match="saml profile"):
        Route.model_validate({**route_doc(pki, "saml"), "upstream": {"address": "127.0.0.1:1"}})
    bad = [
        {"attribute_headers": {S.ROLE: "x-role"}},  # not the gateway's prefix: a client could send it
        {"attribute_headers": {S.ROLE: "x-wsgate-Role"}},
        {"attesting_certificates": []},  # sender-vouches without anyone to vouch
        {"issuers": [{"name": S.ISSUER}]},  # neither certificates nor anchors
        {"issuers": [{"name": S.ISSUER, "certificates": ["a.pem"], "trust_anchors": ["ca.pem"]}]},
        {"audiences": []},
        {"algorithms": ["hmac-sha256"]},
    ]
    for change in bad:
        with pytest.raises(ValueError):
            Route.model_validate({**doc, "saml": {**doc["saml"], **change}})


@pytest.mark.parametrize("algorithm", ["aes256-gcm", "aes128-gcm"])
def test_encrypted_assertion_is_opened_and_checked(algorithm: str, pki: Path, tmp_path: Path) -> None:
    route = S.saml_route(pki)
    transform = xmlsec.Transform.AES256_GCM if algorithm == "aes256-gcm" else xmlsec.Transform.AES128_GCM
    holder = encrypted(S.sign(S.assertion_xml(pki, method="bearer"), pki), pki, transform)
    headers = send(route, pki, tmp_path, holder, signer="client")  # a bearer assertion, a signer the CA vouches for
    assert headers["x-wsgate-subject"] == S.SUBJECT


def test_encrypted_assertion_under_cbc_is_refused_where_cbc_is_not_listed(pki: Path, tmp_path: Path) -> None:
    """XML Encryption's oracle rules hold for assertions too: CBC only where the route lists it."""
    route = S.saml_route(pki)
    holder = encrypted(S.sign(S.assertion_xml(pki, method="bearer"), pki), pki, xmlsec.Transform.AES256)
    with pytest.raises(faults.Fault) as info:
        send(route, pki, tmp_path, holder, signer="client")
    assert info.value.code == "UnsupportedAlgorithm", info.value.reason


def test_encrypted_assertion_with_a_changed_ciphertext_is_refused(pki: Path, tmp_path: Path) -> None:
    route = S.saml_route(pki)
    holder = encrypted(S.sign(S.assertion_xml(pki, method="bearer"), pki), pki, xmlsec.Transform.AES256_GCM)
    value = holder.find(f"{{{ns.XENC}}}EncryptedData/{{{ns.XENC}}}CipherData/{{{ns.XENC}}}CipherValue")
    raw = bytearray(base64.b64decode(value.text))
    raw[-20] ^= 1
    value.text = base64.b64encode(bytes(raw)).decode()
    with pytest.raises(faults.Fault):
        send(route, pki, tmp_path, holder, signer="client")


def test_issuer_by_trust_anchor_takes_its_key_info_certificate_only_when_it_chains(pki: Path, tmp_path: Path) -> None:
    """An issuer known by anchors: the certificate in KeyInfo is taken when the demo CA vouches for it; the rogue
    IdP's (another CA), with the same name and issuer, is not."""
    issuers = [{"name": S.ISSUER, "trust_anchors": [str(pki / "ca.pem")]}]
    route = S.saml_route(pki, saml={"issuers": issuers})
    assert send(route, pki, tmp_path, S.sign(S.assertion_xml(pki), pki))["x-wsgate-subject"] == S.SUBJECT
    with pytest.raises(faults.Fault) as info:
        send(route, pki, tmp_path, S.sign(S.assertion_xml(pki), pki, stem="saml-rogue-idp"))
    assert info.value.code == "FailedAuthentication"


def test_versions_the_route_does_not_take_are_refused(pki: Path, tmp_path: Path) -> None:
    route = S.saml_route(pki, saml={"versions": ["2.0"]})
    assert send(route, pki, tmp_path, S.sign(S.assertion_xml(pki), pki))
    with pytest.raises(faults.Fault):
        send(route, pki, tmp_path, S.sign(S.assertion_xml(pki, version="1.1"), pki))


def test_a_message_without_an_assertion_is_refused(pki: Path) -> None:
    route = S.saml_route(pki)
    rsa = S.saml_route(pki).model_copy(update={"profile": "rsa", "saml": None})
    from gateway.tools.client import Client, ClientConfig

    data, _ = Client(rsa, ClientConfig(certs=pki, key="client2.key", certificate="client2.pem")).secure(echo())
    with pytest.raises(faults.Fault) as info:
        pipeline_for(route).request(data, {}, Exchange(route=route))
    assert info.value.code == "InvalidSecurity"


def test_wsgate_import_maps_saml_tokens_to_the_saml_profile() -> None:
    """SamlToken and IssuedToken ports become `saml` routes with the confirmation the token's place implies; a
    confirmation the gateway could not check as the policy says gives no route, with the reason."""
    path = Path(__file__).resolve().parents[1] / "wsdl" / "saml-policies.wsdl"
    got = import_wsdl(path.read_bytes(), path, str(path))
    routes = {r.route["name"]: r.route for r in got.routes}
    confirmations = {
        name: (r["profile"], r["saml"]["confirmation"], r["saml"]["versions"]) for name, r in routes.items()
    }
    assert confirmations == {
        "bearerport": ("saml", ["bearer"], ["1.1"]),
        "tlsbearerport": ("saml", ["bearer"], ["2.0"]),
        "sendervouchesport": ("saml", ["sender-vouches"], ["1.1"]),
        "holderofkeyport": ("saml", ["holder-of-key"], ["2.0"]),
        "issuedtokenport": ("saml", ["holder-of-key"], ["2.0"]),
    }
    assert routes["sendervouchesport"]["saml"]["attesting_certificates"]
    assert routes["holderofkeyport"]["signature"]["algorithms"] == ["rsa-sha256"]
    for r in routes.values():
        Route.model_validate(r)  # the policy model takes what the import writes
    skipped = " ".join(got.notes)
    assert "TlsSenderVouchesPort" in skipped and "TlsEndorsingPort" in skipped
