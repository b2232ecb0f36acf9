"""A captured UsernameToken cannot be re-bound, through the running gateway (Envoy, two filter workers sharing
Redis, the demo backend): the attack run's message is refused and nothing reaches the backend; an HTTPS-only
UsernameToken route answers plain HTTP with 426; repeated failures for one user are refused for a window,
whichever worker they reach."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from gateway.tools.client import content_type
from tests.support.harness import GatewayFactory, LiveGateway, fault_code
from tests.support.wss_helpers import Keys, echo, route_doc
from tests.threats.test_username_capture import PARTS, captured, clear_token, rebound
from tests.unit.test_wssecurity import ENCRYPTED_DATA, ENCRYPTED_KEY, PASSWORDS


def users_doc(pki: Path, name: str, **ut: object) -> dict:
    return route_doc(pki, "hmac", name=name, replay={"store": "auto"}, signature=PARTS,
                     username_token={"required": True, "users_file": str(pki / "users.yaml"), **ut})  # fmt: skip


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path, gateway_keys: Keys) -> LiveGateway:
    """The gateway's keys in files, then in the token (each module-scoped gateway_keys param)."""
    routes = [
        users_doc(pki, "username", protection="encrypted"),
        users_doc(pki, "username-tls", protection="tls"),
        users_doc(pki, "throttled", protection="encrypted", max_failures=3, failure_window_s=3),
    ]
    return module_gateway([gateway_keys(r) for r in routes], workers=2)


@pytest.mark.parametrize("digest", [True, False], ids=["PasswordDigest", "PasswordText"])
def test_captured_username_token_cannot_be_rebound_under_attackers_encrypted_key(gw, pki: Path, digest: bool) -> None:
    route = gw.route("username")
    bobs, header = captured(pki, route, digest=digest)
    sealed = [el for el in header if el.tag in (ENCRYPTED_KEY, ENCRYPTED_DATA)]
    gw.clear()
    for attack in (
        rebound(pki, [clear_token(digest=digest)]),
        rebound(pki, sealed),
        rebound(pki, sealed, key_name="demo-client"),
    ):
        resp = gw.post("username", attack)
        assert resp.status_code == 500 and fault_code(resp) == "InvalidSecurity", resp.text
    assert gw.received() == []
    # The control: Bob's own message, delivered late but fresh, goes through and names him.
    resp = gw.post("username", bobs)
    assert resp.status_code == 200, resp.text
    assert gw.received()[-1]["headers"].get("x-wsgate-subject") == "bob"


def test_https_only_username_route_refuses_plain_http(gw, pki: Path) -> None:
    client = gw.client("username-tls", user="bob", password=PASSWORDS["bob"])
    secured, pending = client.secure(echo("over tls"))
    assert b"<wsse:UsernameToken" in secured  # readable inside the message: TLS is what keeps it
    gw.clear()
    resp = gw.post("username-tls", secured)
    assert resp.status_code == 426
    assert gw.received() == []
    resp = requests.post(f"https://localhost:{gw.opts.https_port}/username-tls/demo", data=secured, timeout=10,
                         headers={"content-type": content_type("1.1")}, verify=str(pki / "ca.pem"))  # fmt: skip
    assert resp.status_code == 200, resp.text
    client.open(resp.content, pending)
    assert gw.received()[-1]["headers"].get("x-wsgate-subject") == "bob"


def test_repeated_failures_for_a_user_are_refused_for_a_window(gw) -> None:
    wrong = gw.client("throttled", user="bob", password="guess")
    right = gw.client("throttled", user="bob", password=PASSWORDS["bob"])
    gw.clear()
    for _ in range(3):
        resp = gw.post("throttled", wrong.secure(echo())[0])
        assert fault_code(resp) == "FailedAuthentication"
    resp = gw.post("throttled", right.secure(echo())[0])  # whichever worker: the count is in Redis
    assert resp.status_code == 500 and fault_code(resp) == "FailedAuthentication"
    assert gw.received() == []
    time.sleep(3.2)
    resp = gw.post("throttled", right.secure(echo())[0])
    assert resp.status_code == 200, resp.text
