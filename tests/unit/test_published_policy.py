"""The WS-SecurityPolicy a route publishes (gateway/control/published_policy.py) promises what the route takes, in the forms
the major stacks read; `wsgate check` names what it cannot say; and `wsgate import` of the gateway's own published
WSDL gives back a route that publishes the same policy (the round trip)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from lxml import etree

from filters.engine import ns
from gateway.control import published_policy
from gateway.policy import Route
from gateway.tools.wsdl_import import import_wsdl
from tests.support.wss_helpers import make_route

DEMO_WSDL = Path(__file__).parents[1] / "interop" / "demo.wsdl"
SP = f"{{{ns.SP12}}}"
CBC = {"data_algorithms": ["aes256-cbc"], "response_algorithm": "aes256-cbc"}
HMAC_SHA1 = {"algorithms": ["rsa-sha256", "hmac-sha256", "hmac-sha1"]}
USERS = {"required": True, "users_file": "users.yaml", "protection": "tls"}
SC = {"store": "memory"}

# The routes the Metro suite (tests/interop/test_metro_interop.py) calls, and the defaults.
ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "rsa-default": ("rsa", {}),
    "hmac-default": ("hmac", {}),
    "rsa-cbc": ("rsa", {"encryption": {"require_request": True, "encrypt_response": True, **CBC}}),
    "rsa-gcm": ("rsa", {"encryption": {"require_request": True, "encrypt_response": True}}),
    "hmac-cbc": ("hmac", {"signature": HMAC_SHA1, "encryption": {"require_request": True, "encrypt_response": True,
                                                                  **CBC}}),
    "rsa-username": ("rsa", {"signature": {"parts": ["body", "timestamp", "username_token"]}, "encryption": CBC,
                             "username_token": USERS}),
    "sc": ("secureconversation", {"secureconversation": SC, "encryption": {"encrypt_response": True, **CBC},
                                  "signature": {**HMAC_SHA1, "parts": ["body", "timestamp", "addressing"]}}),
    "sc-direct": ("secureconversation", {"secureconversation": {**SC, "derived_keys": False},
                                         "encryption": {"encrypt_response": True, **CBC},
                                         "signature": {**HMAC_SHA1, "parts": ["body", "timestamp", "addressing"]}}),
}  # fmt: skip


def route(pki: Path, name: str) -> Route:
    profile, extra = ROUTES[name]
    if "username_token" in extra:
        extra = {**extra, "username_token": {**USERS, "users_file": str(pki / "users.yaml")}}
    return make_route(pki, profile, name=name, **extra)


def published(r: Route) -> etree._Element:
    root = etree.parse(str(DEMO_WSDL)).getroot()
    published_policy.rewrite(root, r)
    return root


def policy_of(root: etree._Element) -> bytes:
    policy = root.find(f"{{{ns.WSP}}}Policy")
    assert policy is not None
    return etree.tostring(policy, method="c14n", exclusive=True)


@pytest.mark.parametrize("name", list(ROUTES))
def test_wsgate_import_of_the_published_wsdl_gives_back_an_equivalent_route(
    pki: Path, tmp_path: Path, name: str
) -> None:
    """Published, imported, published again: the same policy, byte for byte (canonical), and the same profile,
    signed parts, encryption directions and signature algorithm a client is told to use."""
    original = route(pki, name)
    document = tmp_path / "published.wsdl"
    document.write_bytes(etree.tostring(published(original)))
    got = import_wsdl(document.read_bytes(), document, str(document)).routes
    assert len(got) == 1
    doc = {**got[0].route, "name": original.name, "match": original.match.model_dump(exclude_none=True),
           "upstream": {"address": "127.0.0.1:1"}}  # fmt: skip
    if "username_token" in doc:
        doc["username_token"] = {**doc["username_token"], "users_file": str(pki / "users.yaml"),  # type: ignore[dict-item]
                                 "protection": original.username_token.protection}  # fmt: skip
    back = Route.model_validate(doc)
    assert back.profile == original.profile
    assert back.signature.parts == original.signature.parts
    assert (back.encryption.require_request, back.encryption.encrypt_response) == (
        original.encryption.require_request or original.encryption.encrypt_response,
        original.encryption.encrypt_response or original.encryption.require_request,
    ) or original.profile == "secureconversation"
    assert published_policy.accepts_cbc(back) == published_policy.accepts_cbc(original)
    assert back.secureconversation.derived_keys == original.secureconversation.derived_keys
    assert policy_of(published(back)) == policy_of(published(original))


def test_the_suite_carries_metros_signature_algorithm_where_the_route_signs_rsa_sha256(pki: Path) -> None:
    rsa = published(route(pki, "rsa-default")).find(f".//{SP}AlgorithmSuite")
    assert rsa is not None and rsa.get("signatureAlgorithm") == "SHA256withRSA"
    sha1 = make_route(pki, "rsa", signature={"algorithms": ["rsa-sha1"], "digests": ["sha1"]})
    suite = published(sha1).find(f".//{SP}AlgorithmSuite")
    assert suite is not None and suite.get("signatureAlgorithm") is None
    assert suite.find(f"{{{ns.WSP}}}Policy/{SP}Basic256") is not None


def test_cbc_is_published_as_encrypt_before_signing_and_gcm_only_is_not(pki: Path) -> None:
    assert published(route(pki, "rsa-cbc")).find(f".//{SP}EncryptBeforeSigning") is not None
    assert published(route(pki, "rsa-gcm")).find(f".//{SP}EncryptBeforeSigning") is None


def test_replies_encrypted_are_announced(pki: Path) -> None:
    replies_only = make_route(pki, "rsa", encryption={"encrypt_response": True})
    assert published(replies_only).find(f".//{SP}EncryptedParts/{SP}Body") is not None
    assert published(route(pki, "rsa-default")).find(f".//{SP}EncryptedParts") is None


def test_gaps_name_what_the_published_policy_cannot_say(pki: Path) -> None:
    """The defaults (RSA-SHA256, HMAC-SHA256, GCM) are not what the SP suites name: each gap is said once; the
    routes Metro was shown to call have only the RSA-SHA256 one (said in Metro's attribute, not the suite)."""
    rsa_gcm = published_policy.gaps(route(pki, "rsa-gcm"))
    assert [g.split(":")[0] for g in rsa_gcm] == ["X.509 signatures", "encryption"]
    assert [g.split(":")[0] for g in published_policy.gaps(route(pki, "hmac-default"))] == ["symmetric signatures"]
    for name in ("rsa-cbc", "rsa-username", "sc"):
        assert [g.split(":")[0] for g in published_policy.gaps(route(pki, name))] == ["X.509 signatures"], name
    assert published_policy.gaps(route(pki, "hmac-cbc")) == []
    unsigned_ut = make_route(pki, "rsa", username_token={**USERS, "users_file": str(pki / "users.yaml")})
    assert any(g.startswith("UsernameToken") for g in published_policy.gaps(unsigned_ut))


def test_wsgate_check_prints_the_gaps_of_published_routes(pki: Path, tmp_path: Path) -> None:
    doc = route(pki, "rsa-gcm").model_dump(mode="json", exclude_none=True)
    doc["wsdl"] = {"file": str(DEMO_WSDL), "publish": True}
    (tmp_path / "routes.yaml").write_text(yaml.safe_dump({"routes": [doc]}))
    run = subprocess.run(
        [sys.executable, "-m", "gateway.control.cli", "check", str(tmp_path)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("ok  rsa-gcm")
    assert [line.split(":")[1].strip() for line in lines[1:]] == ["X.509 signatures", "encryption"]


@pytest.mark.parametrize("derived", [True, False])
def test_require_derived_keys_is_published_and_imported_both_ways_as_the_route_says(
    pki: Path, tmp_path: Path, derived: bool
) -> None:
    """sp:RequireDerivedKeys only where the route derives; imported, inbound and outbound, as present or absent."""
    name = "sc" if derived else "sc-direct"
    root = published(route(pki, name))
    assert (root.find(f".//{SP}SecureConversationToken//{SP}RequireDerivedKeys") is not None) == derived
    document = tmp_path / "published.wsdl"
    document.write_bytes(etree.tostring(root))
    got = import_wsdl(document.read_bytes(), document, str(document)).routes[0]
    assert got.route["secureconversation"]["derived_keys"] is derived  # type: ignore[index]
    outbound = import_wsdl(document.read_bytes(), document, str(document), outbound="127.0.0.1:9300").routes[0]
    assert outbound.route["direction"] == "outbound"
    assert outbound.route.get("secureconversation") == (None if derived else {"derived_keys": False})
