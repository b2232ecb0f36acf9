"""Issue #22 through the running gateway: callers who prove who they are with a SAML assertion (signed by signxml,
an IdP library we did not write), sent by `wsgate client --assertion`; bearer over the HTTPS listener; the
backend told the subject and the mapped attributes, nothing a client could set itself."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import saml as S
from tests.support.harness import GatewayFactory, LiveGateway, fault_code
from tests.support.wss_helpers import echo


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, pki: Path) -> LiveGateway:
    bearer = {"confirmation": ["bearer"], "attesting_certificates": [], "versions": ["2.0"]}
    return module_gateway([
        S.saml_doc(pki, replay={"store": "auto"}),
        # bearer only, and nobody the anchors vouch for may sign for it: TLS is what keeps the assertion
        S.saml_doc(pki, name="bearer", saml=bearer, replay={"store": "auto"},
                   rsa={"trust_anchors": [str(pki / "rogue-ca.pem")]}),
    ])  # fmt: skip


def cli(gw: LiveGateway, pki: Path, tmp: Path, route: str, assertion: Path, signer: str, url: str, *extra: str) -> str:
    request = tmp / "echo.xml"
    request.write_bytes(echo("from the cli"))
    run = subprocess.run(
        [sys.executable, "-m", "gateway.control.cli", "client", "--policies", str(gw.opts.policies), "--certs",
         str(pki), "--policy", route, "--url", url, "--key", f"{signer}.key", "--cert", f"{signer}.pem",
         "--assertion", str(assertion), *extra, str(request)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.parametrize(("version", "method", "signer"), [
    ("2.0", "sender-vouches", "client2"), ("2.0", "holder-of-key", "client"),
    ("1.1", "sender-vouches", "client2"), ("1.1", "holder-of-key", "client"),
])  # fmt: skip
def test_wsgate_client_sends_an_assertion_and_the_backend_is_told_who(
    version: str, method: str, signer: str, gw: LiveGateway, pki: Path, tmp_path: Path
) -> None:
    gw.clear()
    assertion = S.write(tmp_path, S.sign(S.assertion_xml(pki, version=version, method=method), pki))
    out = cli(gw, pki, tmp_path, "saml", assertion, signer, gw.url("saml"))
    assert "<d:text>from the cli</d:text>" in out and "Security" not in out
    (got,) = gw.received()
    assert got["headers"]["x-wsgate-subject"] == S.SUBJECT
    assert got["headers"]["x-wsgate-role"] == "clerk"
    assert "Assertion" not in got["body"]  # the Security header, assertion and all, stays at the gateway


@pytest.mark.parametrize("version", ["2.0", "1.1"])
def test_symmetric_holder_of_key_through_the_gateway(version: str, gw: LiveGateway, pki: Path, tmp_path: Path) -> None:
    """The assertion confirms a symmetric key encrypted to the gateway (an EncryptedKey made by `cryptography`);
    `wsgate client --proof-key` HMAC-signs with it. The same message with its Body changed is refused."""
    gw.clear()
    secret = os.urandom(32)
    proof = S.encrypted_key(pki, secret)
    assertion = S.sign(S.assertion_xml(pki, version=version, method="holder-of-key", proof=proof), pki)
    key_file = tmp_path / "proof.b64"
    key_file.write_text(base64.b64encode(secret).decode())
    out = cli(gw, pki, tmp_path, "saml", S.write(tmp_path, assertion), "client", gw.url("saml"),
              "--proof-key", str(key_file))  # fmt: skip
    assert "<d:text>from the cli</d:text>" in out
    (got,) = gw.received()
    assert got["headers"]["x-wsgate-subject"] == S.SUBJECT and "Assertion" not in got["body"]
    gw.clear()
    again = S.sign(S.assertion_xml(pki, version=version, method="holder-of-key", proof=proof), pki)
    data = S.client(gw.route("saml"), pki, S.write(tmp_path, again), proof_key=secret).secure(echo("pay 10"))[0]
    resp = gw.post("saml", data.replace(b"pay 10", b"pay 99"))
    assert resp.status_code == 500 and fault_code(resp) == "FailedCheck" and b"soap:Fault" in resp.content
    assert gw.received() == []


def test_bearer_is_taken_over_tls_and_refused_in_clear(gw: LiveGateway, pki: Path, tmp_path: Path) -> None:
    route = gw.route("bearer")
    gw.clear()

    def message() -> bytes:
        a = S.write(tmp_path, S.sign(S.assertion_xml(pki, method="bearer"), pki))
        return S.client(route, pki, a, signer="client").secure(echo())[0]

    clear = gw.post("bearer", message())
    assert clear.status_code == 500 and fault_code(clear) == "FailedAuthentication"
    assert gw.received() == []
    resp = gw.post("bearer", message(), tls=True, verify=str(pki / "ca.pem"))
    assert resp.status_code == 200
    assert gw.received()[0]["headers"]["x-wsgate-subject"] == S.SUBJECT


def test_identity_headers_a_client_sends_never_reach_the_backend(gw: LiveGateway, pki: Path, tmp_path: Path) -> None:
    gw.clear()
    a = S.write(tmp_path, S.sign(S.assertion_xml(pki, roles=()), pki))  # no role attribute: no role header
    data = S.client(gw.route("saml"), pki, a, signer="client2").secure(echo())[0]
    spoofed = {"x-wsgate-role": "admin", "X-WSGate-Subject": "root"}
    assert gw.post("saml", data, headers=spoofed).status_code == 200
    headers = gw.received()[0]["headers"]
    assert headers["x-wsgate-subject"] == S.SUBJECT and "x-wsgate-role" not in headers
