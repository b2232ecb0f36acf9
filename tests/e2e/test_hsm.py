"""The gateway's private keys in a PKCS#11 token (SoftHSM2, filters/engine/wss/token.py): the token signs and
unwraps, the key never leaves it, and a token that goes away fails closed (503) until it is back, without a
restart. The token is the session's (tests/conftest.py `hsm`), holding the demo PKI's gateway keys."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, utils
from lxml import etree
from pydantic import ValidationError

from certs import hsm as hsm_mod
from filters.engine import faults, ns
from filters.engine.profiles import SecuredPipeline
from filters.engine.wss import encryption, keys, signature, signing, token
from filters.engine.wss.optimizations import Optimizations
from filters.engine.xml.threat_protection import parse_envelope
from filters.stores.factory import RouteStores
from gateway.policy import Limits, Route
from gateway.tools.client import Client, ClientConfig, content_type, http_post
from tests.support.harness import received, running_gateway
from tests.support.wss_helpers import DEMO, echo, round_trip, route_doc, token_route

REPO = Path(__file__).resolve().parents[2]
OAEP_SHA1 = padding.OAEP(padding.MGF1(hashes.SHA1()), hashes.SHA1(), None)


def model(doc: dict) -> Route:
    return Route.model_validate({**doc, "upstream": {"address": "127.0.0.1:1"}})


@pytest.fixture
def quick_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token, "RETRY_S", 0.05)


# ---------------------------------------------------------------------------------------------------------
# The engine with token keys


@pytest.mark.parametrize("direct", [True, False], ids=["direct-c14n", "xmlsec-template"])
@pytest.mark.parametrize("algorithm", ["rsa-sha256", "rsa-sha1"])
def test_token_signature_is_the_file_keys(hsm: Path, pki: Path, direct: bool, algorithm: str) -> None:
    """PKCS#1 v1.5 is deterministic: the token's SignatureValue over the same SignedInfo is the file key's, on
    both signing paths (the canonical SignedInfo signed directly; xmlsec's template with the stand-in key, then
    re-signed), a default namespace in the Body's content included (that one is always xmlsec's)."""
    body = b'<soap:Body><echo xmlns="urn:default"><text>signed</text></echo></soap:Body>'
    values = []
    for key in (
        keys.load_private_key(pki / "gateway-sign.key"),
        keys.load_private_key(hsm_mod.uri(hsm, "gateway-sign")),
    ):
        env = parse_envelope(
            b'<soap:Envelope xmlns:soap="http://schemas.xmlsoap.org/soap/envelope/"><soap:Header>'
            b'<wsse:Security xmlns:wsse="' + ns.WSSE.encode() + b'"/></soap:Header>' + body + b"</soap:Envelope>",
            Limits(),
        )
        security = env.root[0][0]
        opts = Optimizations.for_route(model(route_doc(pki, "rsa"))) if direct else None
        sig = signing.Signer(key, algorithm, "sha256").sign(
            env, security, [env.body], keys.key_name("k"), new_id=iter(["b", "s"]).__next__, optimizations=opts
        )
        values.append("".join(sig.findtext(f"{{{ns.DS}}}SignatureValue").split()))
        # And it verifies with the certificate, as any receiver checks it.
        cert = keys.load_certificate(pki / "gateway-sign.pem")
        policy = model(route_doc(pki, "rsa", signature={"algorithms": [algorithm]})).signature
        signature.verify(sig, env, cert, policy)
    assert values[0] == values[1]


CASES = [
    ("rsa", {"encryption": {"require_request": True, "encrypt_response": True}}, {}),
    ("hmac", {}, {"encrypt": True}),
]


@pytest.mark.parametrize("direct_c14n", [True, False])
@pytest.mark.parametrize(("profile", "extra", "cfg"), CASES, ids=["rsa-encrypted", "hmac-encrypted-key"])
def test_round_trip_with_token_keys(
    hsm: Path, pki: Path, profile: str, extra: dict, cfg: dict, direct_c14n: bool
) -> None:
    route = model(token_route(pki, hsm, profile, optimizations={"direct_c14n": direct_c14n}, **extra))
    pipeline = SecuredPipeline(route, RouteStores())
    assert isinstance(pipeline.credentials.decryption_key, token.TokenKey)
    backend_got, reply = round_trip(pipeline, Client(route, ClientConfig(certs=pki, **cfg)), echo("by the token"))
    assert b"by the token" in backend_got and b"EncryptedData" not in backend_got
    assert b"by the token" in reply


def test_key_not_on_a_reachable_token_is_refused_at_load(hsm: Path) -> None:
    """A label the token does not hold is the policy's error, refused as the route loads (a reload keeps the
    running policies); only a token that cannot be reached is waited for."""
    with pytest.raises(faults.Fault, match="no such key"):
        keys.load_private_key(hsm_mod.uri(hsm, "gateway-sign").replace("object=gateway-sign", "object=not-there"))


def test_token_key_does_not_leave_the_token(hsm: Path) -> None:
    key = keys.load_private_key(hsm_mod.uri(hsm, "gateway-sign"))
    with pytest.raises(TypeError):
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    with pytest.raises(TypeError):
        key.private_numbers()


def test_token_key_its_attributes_keep_from_signing_or_decrypting_is_a_policy_fault(
    hsm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pkcs11 gives a key `sign` and `decrypt` only where its CKA_SIGN and CKA_DECRYPT are true: a key without is
    named as the policy's error (a 500 fault), not an internal error; a signature without a DigestInfo is refused
    as any padding the token does not do."""
    key = keys.load_private_key(hsm_mod.uri(hsm, "gateway-sign"))
    with pytest.raises(ValueError, match="DigestInfo"):
        key.sign(b"\x00" * 32, padding.PKCS1v15(), utils.NoDigestInfo())
    monkeypatch.setattr(token, "_find_key", lambda entry, ref: object())  # a key of neither capability
    with pytest.raises(faults.Fault, match="CKA_SIGN is false") as signing:
        key.sign(b"data", padding.PKCS1v15(), hashes.SHA256())
    with pytest.raises(faults.Fault, match="CKA_DECRYPT is false"):
        key.decrypt(b"\x00" * 256, OAEP_SHA1)
    assert signing.value.http_status == 500


@pytest.mark.parametrize(
    "uri",
    [
        "pkcs11:token=wsgate;object=k?module-path=/m.so&pin-value=1234",
        "pkcs11:token=wsgate;object=k;pin-value=1234?module-path=/m.so&pin-source=env:P",
    ],
)
def test_pin_in_the_policy_refused(pki: Path, uri: str) -> None:
    with pytest.raises(ValueError):
        token.parse_uri(uri)
    with pytest.raises(ValidationError, match="PIN"):
        model(route_doc(pki, "rsa", rsa={"key": uri}))


def test_pin_from_environment(hsm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WSGATE_TEST_PIN", (hsm / "hsm-pin").read_text().strip())
    ref = token.parse_uri(
        hsm_mod.uri(hsm, "gateway-enc").replace(f"file:{(hsm / 'hsm-pin').resolve()}", "env:WSGATE_TEST_PIN")
    )
    assert (
        ref.pin_source == "env:WSGATE_TEST_PIN"
        and token.read_pin(ref.pin_source) == (hsm / "hsm-pin").read_text().strip()
    )
    monkeypatch.delenv("WSGATE_TEST_PIN")
    with pytest.raises(ValueError, match="not set"):
        token.read_pin(ref.pin_source)


def test_bleichenbacher_rsa15_refused_whatever_the_block(hsm: Path, pki: Path) -> None:
    """A token gives no implicit rejection: whether a PKCS#1 v1.5 block decrypts would show. rsa-1_5 key transport
    with a token key is refused the same way for a good block and a bad one."""
    key = keys.load_private_key(hsm_mod.uri(hsm, "gateway-enc"))
    good = key.public_key().encrypt(b"k" * 32, padding.PKCS1v15())
    for block in (good, b"\x01" * 256):
        with pytest.raises(faults.Fault) as err:
            key.decrypt(block, padding.PKCS1v15())
        assert err.value.code == "UnsupportedAlgorithm"


def test_forged_encrypted_key_is_failed_check_not_token_down(hsm: Path, pki: Path) -> None:
    """SoftHSM answers GeneralError for a block that does not decrypt: that must read as the client's bad data
    (FailedCheck), not as the token gone (503 for everyone)."""
    key = keys.load_private_key(hsm_mod.uri(hsm, "gateway-enc"))
    with pytest.raises(ValueError):
        key.decrypt(b"\x01" * 256, OAEP_SHA1)
    assert key.decrypt(key.public_key().encrypt(b"s" * 32, OAEP_SHA1), OAEP_SHA1) == b"s" * 32
    ek = etree.fromstring(
        f'<xenc:EncryptedKey xmlns:xenc="{ns.XENC}"><xenc:EncryptionMethod Algorithm="{encryption.KEY_TRANSPORTS["rsa-oaep-mgf1p"]}"/>'
        f"<xenc:CipherData><xenc:CipherValue>{'AQ' * 170}AQ==</xenc:CipherValue></xenc:CipherData></xenc:EncryptedKey>"
    )
    with pytest.raises(faults.Fault) as err:
        encryption.decrypt_key(ek, key, ["rsa-oaep-mgf1p"], 32)
    assert err.value.code == "FailedCheck"


def test_logged_out_session_fails_closed_then_recovers(hsm: Path, quick_retry: None) -> None:
    key = keys.load_private_key(hsm_mod.uri(hsm, "gateway-sign"))
    assert isinstance(key, token.TokenKey)
    key.sign(b"x", padding.PKCS1v15(), hashes.SHA256())
    with key.pool.session() as entry:
        entry.session.close()  # C_Logout + C_CloseSession under the pool
    with pytest.raises(faults.Fault) as err:
        key.sign(b"x", padding.PKCS1v15(), hashes.SHA256())
    assert err.value.http_status == 503 and not err.value.sender
    assert faults.metric_reason(err.value) == "token unavailable"
    time.sleep(0.1)
    key.sign(b"x", padding.PKCS1v15(), hashes.SHA256())


def test_module_reinitialized_under_a_pool_does_not_starve_it(hsm: Path, quick_retry: None) -> None:
    """Another token's pool on the same module reinitializes it (C_Finalize kills every session): this pool's
    sessions from before are dropped and counted out, so a later failure cannot leave it waiting forever for a
    session that will never come back."""
    key = keys.load_private_key(hsm_mod.uri(hsm, "gateway-sign"))
    assert isinstance(key, token.TokenKey)
    key.sign(b"x", padding.PKCS1v15(), hashes.SHA256())
    key.pool.module.reinitialize()  # as another pool recovering would
    key.sign(b"x", padding.PKCS1v15(), hashes.SHA256())
    with key.pool.session() as entry:
        entry.session.close()
    outcomes: list[str] = []

    def sign() -> None:
        try:
            key.sign(b"x", padding.PKCS1v15(), hashes.SHA256())
            outcomes.append("signed")
        except faults.Fault as exc:
            outcomes.append(str(exc.http_status))

    for pause in (0, 0.1):
        time.sleep(pause)
        worker = threading.Thread(target=sign, daemon=True)
        worker.start()
        worker.join(timeout=10)
        assert not worker.is_alive(), "waiting for a session forever"
    assert outcomes == ["503", "signed"]


def test_token_key_not_its_certificates_refused_once_the_token_is_back(hsm: Path, pki: Path, quick_retry: None) -> None:
    """A rotating route's token key is checked against its decryption_certificate when the token is reached: at
    load, or, with the token down then, at its first use and every use after (a 500 fault, never the wrong key)."""
    previous = [{"key": str(pki / "gateway-enc.key"), "certificate": str(pki / "gateway-enc.pem")}]
    doc = token_route(pki, hsm, "rsa", encryption={"require_request": True})
    doc["rsa"] |= {"decryption_key": hsm_mod.uri(hsm, "gateway-sign"),  # not gateway-enc.pem's key
                   "decryption_certificate": str(pki / "gateway-enc.pem"), "previous_decryption_keys": previous}  # fmt: skip
    with pytest.raises(faults.Fault, match="not the decryption key's"):
        SecuredPipeline(model(doc), RouteStores())  # the token is up: refused at load
    keys._token_key.cache_clear()
    tokens, away = hsm / "softhsm-tokens", hsm / "softhsm-tokens.away"
    shutil.move(tokens, away)
    try:
        pipeline = SecuredPipeline(model(doc), RouteStores())  # the token down: loads
    finally:
        shutil.move(away, tokens)
        keys._token_key.cache_clear()
    key = pipeline.credentials.decryption_key
    assert isinstance(key, token.TokenKey)
    time.sleep(0.1)
    for _ in range(2):
        with pytest.raises(faults.Fault, match="not the decryption key's") as err:
            key.decrypt(b"\x01" * 256, OAEP_SHA1)
        assert err.value.http_status == 500


# ---------------------------------------------------------------------------------------------------------
# Through the running gateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Path, hsm: Path):
    routes = [
        token_route(pki, hsm, "rsa", name="rsa-enc", encryption={"require_request": True, "encrypt_response": True}),
        route_doc(pki, "rsa", name="rsa-file"),  # keys in files: untouched by the token's absence
        token_route(pki, hsm, "hmac", name="hmac-token"),  # the symmetric binding's EncryptedKey unwrapped by it
        token_route(pki, hsm, "secureconversation", name="sc-token", encryption={"encrypt_response": True},
                    secureconversation={"master_keys_file": str(pki / "sct-master-keys.yaml")}),
    ]  # fmt: skip
    with running_gateway(tmp_path_factory.mktemp("hsm-gw"), routes, pki) as g:
        yield g


def send(gw, pki: Path, name: str, version: str = "1.1") -> tuple[requests.Response, Client, object]:
    route = Route.model_validate({**_route_doc(gw, name), "upstream": {"address": gw.backend_addr}})
    client = Client(route, ClientConfig(certs=pki))
    secured, pending = client.secure(echo("via the token", version))
    resp = requests.post(f"http://127.0.0.1:{gw.opts.http_port}/{name}/demo", data=secured,
                         headers={"content-type": content_type(version)}, timeout=10)  # fmt: skip
    return resp, client, pending


def _route_doc(gw, name: str) -> dict:
    import yaml

    return next(
        r for r in yaml.safe_load((gw.opts.policies / "routes.yaml").read_text())["routes"] if r["name"] == name
    )


@pytest.mark.parametrize("version", ["1.1", "1.2"])
def test_gateway_round_trip_with_token_keys(gw, pki: Path, version: str) -> None:
    resp, client, pending = send(gw, pki, "rsa-enc", version)
    assert resp.status_code == 200, resp.text
    assert client.open(resp.content, pending).body.findtext(f".//{{{DEMO}}}text") == "via the token"
    assert "via the token" in received(gw)[-1]["body"]


def test_gateway_hmac_and_secure_conversation_with_token_keys(gw, pki: Path) -> None:
    """The symmetric binding's EncryptedKey, and SecureConversation's Issue (its entropy encrypted to the gateway,
    the RSTR signed by it) then messages in the context, with the gateway's keys in the token."""
    post = http_post(f"http://127.0.0.1:{gw.opts.http_port}/hmac-token/demo")
    client = Client(Route.model_validate({**_route_doc(gw, "hmac-token"), "upstream": {"address": gw.backend_addr}}),
                    ClientConfig(certs=pki, encrypt=True))  # fmt: skip
    secured, pending = client.secure(echo("symmetric"))
    assert client.open(post(secured, pending.content_type), pending).body.findtext(f".//{{{DEMO}}}text") == "symmetric"
    assert received(gw)[-1]["headers"].get("x-wsgate-subject") == "anonymous"
    route = Route.model_validate({**_route_doc(gw, "sc-token"), "upstream": {"address": gw.backend_addr}})
    client = Client(route, ClientConfig(certs=pki))
    post = http_post(f"http://127.0.0.1:{gw.opts.http_port}/sc-token/demo")
    client.establish(post)
    secured, pending = client.secure(echo("in context"))
    assert client.open(post(secured, pending.content_type), pending).body.findtext(f".//{{{DEMO}}}text") == "in context"


def test_token_gone_fails_closed_with_503_then_recovers_without_restart(gw, pki: Path, hsm: Path) -> None:
    tokens, away = hsm / "softhsm-tokens", hsm / "softhsm-tokens.away"
    assert send(gw, pki, "rsa-enc")[0].status_code == 200
    pids = [p.pid for p in gw.workers]
    shutil.move(tokens, away)
    try:
        for version in ("1.1", "1.2"):
            resp, _, _ = send(gw, pki, "rsa-enc", version)
            assert resp.status_code == 503, resp.text
            assert etree.fromstring(resp.content).find(".//{*}Fault") is not None  # a SOAP fault, as the request
            assert "token" not in resp.text.lower()  # the generic message only
        assert send(gw, pki, "rsa-file")[0].status_code == 200  # routes with file keys carry on
    finally:
        shutil.move(away, tokens)
    logs = "".join(p.read_text(errors="replace") for p in (gw.opts.run_dir / "logs").glob("filter-*.log"))
    assert "key token unavailable" in logs and "token 'wsgate' unavailable" in logs
    deadline = time.monotonic() + 10
    while (resp := send(gw, pki, "rsa-enc")[0]).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert resp.status_code == 200, resp.text
    assert [p.pid for p in gw.workers] == pids and all(p.poll() is None for p in gw.workers)  # not restarted


def test_token_down_when_the_worker_starts_does_not_keep_it_from_starting(tmp_path: Path, pki: Path, hsm: Path) -> None:
    """The worker starts without its token (the public halves are read once it is back): requests needing the
    token get the 503 fault, routes with file keys serve, and once the token is back all serve, no restart. A
    route rotating its token decryption key checks the key against its certificate then."""
    previous = [{"key": str(pki / "gateway-enc.key"), "certificate": str(pki / "gateway-enc.pem")}]
    rotating = token_route(pki, hsm, "rsa", name="rsa-rotating", encryption={"require_request": True})
    rotating["rsa"] |= {"decryption_certificate": str(pki / "gateway-enc.pem"), "previous_decryption_keys": previous}
    routes = [
        token_route(pki, hsm, "rsa", name="rsa-enc", encryption={"require_request": True, "encrypt_response": True}),
        rotating,
        route_doc(pki, "rsa", name="rsa-file"),
    ]
    tokens, away = hsm / "softhsm-tokens", hsm / "softhsm-tokens.away"
    shutil.move(tokens, away)
    try:
        with running_gateway(tmp_path, routes, pki) as gw:
            pids = [p.pid for p in gw.workers]
            for name in ("rsa-enc", "rsa-rotating"):
                for version in ("1.1", "1.2"):
                    resp = send(gw, pki, name, version)[0]
                    assert resp.status_code == 503, resp.text
                    assert etree.fromstring(resp.content).find(".//{*}Fault") is not None
            assert send(gw, pki, "rsa-file")[0].status_code == 200
            shutil.move(away, tokens)
            for name in ("rsa-enc", "rsa-rotating"):
                deadline = time.monotonic() + 10
                while (resp := send(gw, pki, name)[0]).status_code != 200 and time.monotonic() < deadline:
                    time.sleep(0.3)
                assert resp.status_code == 200, resp.text
            assert [p.pid for p in gw.workers] == pids and all(p.poll() is None for p in gw.workers)
            logs = "".join(p.read_text(errors="replace") for p in (gw.opts.run_dir / "logs").glob("filter-*.log"))
            assert "token 'wsgate' unavailable" in logs and "token 'wsgate' is back" in logs
    finally:
        if away.exists():
            shutil.move(away, tokens)


def test_demo_keys_in_softhsm_one_command(tmp_path: Path) -> None:
    """`wsgate certs init --hsm` (what `make run-hsm` runs): the demo policy, read with its hsm.env, takes the
    gateway keys from the token; a fresh process, as `wsgate up`'s workers (SoftHSM reads its configuration once)."""
    out = tmp_path / "certs" / "out"  # where the demo policy looks, from tmp_path
    wsgate = Path(sys.executable).parent / "wsgate"
    subprocess.run([wsgate, "certs", "init", "--out", out, "--hsm"], check=True, capture_output=True, cwd=tmp_path)
    env = dict(os.environ)
    for line in (out / "hsm.env").read_text().splitlines():
        name, _, value = line.partition("=")
        env[name] = value.strip("'")
    assert env["WSGATE_SIGNING_KEY"].startswith("pkcs11:") and "pin-value" not in env["WSGATE_SIGNING_KEY"]
    shutil.copytree(REPO / "policies", tmp_path / "policies")
    script = """
import sys
from pathlib import Path
from filters.engine.profiles import SecuredPipeline
from filters.engine.wss import token
from filters.stores.factory import RouteStores
from gateway.policy import load_dir
from gateway.tools.client import Client, ClientConfig
from tests.support.wss_helpers import echo, round_trip
route = load_dir("policies").route("rsa-encrypted")
pipeline = SecuredPipeline(route, RouteStores())
assert isinstance(pipeline.credentials.decryption_key, token.TokenKey)
got, reply = round_trip(pipeline, Client(route, ClientConfig(certs=Path("certs/out"))), echo("demo token"))
assert b"demo token" in got and b"demo token" in reply
print("ok")
"""
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr
