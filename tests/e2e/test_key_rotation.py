"""Key rotation without downtime (docs/keys.md "Rotation"): a route holds its current and previous decryption keys,
the EncryptedKey's key reference picks one (an EncryptedKey for a certificate the route does not hold is refused,
never tried against every key); under load, the new key comes in, clients move to it, the old one goes, and
nothing that should pass is refused. SecureConversation contexts sealed under a retired master key stay valid
while it is kept; `wsgate keys rotate` adds and retires HMAC and master keys."""

from __future__ import annotations

import base64
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import requests
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from lxml import etree

from certs import hsm as hsm_mod
from certs import pki as pki_mod
from filters.engine import faults, ns
from filters.engine.profiles import SecuredPipeline
from filters.engine.wss import keys
from filters.engine.wss.secure_conversation import WSC_1_3
from filters.stores.contexts import MemoryRevocations, SealedContextStore, load_master_keys
from filters.stores.factory import RouteStores
from gateway.control import published_certificates
from gateway.policy import Route
from gateway.tools.client import Client, ClientConfig, content_type
from tests.support.harness import running_gateway, write_policies
from tests.support.wss_helpers import echo, round_trip, route_doc

WSGATE = Path(sys.executable).parent / "wsgate"
REPO = Path(__file__).resolve().parents[2]
DS = f"{{{ns.DS}}}"


def issue(pki: Path, out: Path, common_name: str, stem: str) -> Path:
    """A certificate and key from the demo CA, as out/stem.pem and out/stem.key; returns out/stem."""
    pki_mod.write(out, stem, pki_mod.issue(pki_mod.load_ca(pki), common_name))
    return out / stem


@pytest.fixture(scope="module")
def new_key(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second encryption certificate and key from the demo CA: the one the route rotates to."""
    return issue(pki, tmp_path_factory.mktemp("rotation"), "WSGate Gateway Encryption 2", "gateway-enc-2")


@pytest.fixture(scope="module")
def new_signer(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second signing certificate and key from the demo CA."""
    return issue(pki, tmp_path_factory.mktemp("rotation"), "WSGate Gateway Signing 2", "gateway-sign-2")


def rotating(pki: Path, profile: str, current: str, previous: list[dict], **extra: object) -> dict:
    opts = {"decryption_key": current, "previous_decryption_keys": previous}
    if current.startswith("pkcs11:"):
        opts["decryption_certificate"] = str(pki / "gateway-enc.pem")
    return route_doc(pki, profile, **{"rsa" if profile == "rsa" else "hmac": opts}, **extra)


def write_route(gw: object, doc: dict) -> None:
    """The gateway's policy file now holds this one route; reloaded."""
    text = yaml.safe_dump({"routes": [doc]}, sort_keys=False).replace("BACKEND", gw.backend_addr)  # type: ignore[attr-defined]
    (gw.opts.policies / "routes.yaml").write_text(text)  # type: ignore[attr-defined]
    assert gw.reload_if_changed() is True  # type: ignore[attr-defined]


def gw_url(gw: object, path: str) -> str:
    return f"http://127.0.0.1:{gw.opts.http_port}{path}"  # type: ignore[attr-defined]


def der(path: str | Path) -> bytes:
    return keys.load_certificate(path).public_bytes(serialization.Encoding.DER)


def model(doc: dict) -> Route:
    return Route.model_validate({**doc, "upstream": {"address": "127.0.0.1:1"}})


ENCRYPTED = {"encryption": {"require_request": True, "encrypt_response": True}}


@pytest.mark.parametrize("profile", ["rsa", "hmac"])
@pytest.mark.parametrize("old_in_token", [False, True], ids=["old-in-file", "old-in-token"])
def test_current_and_previous_keys_both_open_their_encrypted_keys(
    pki: Path, hsm: Path, new_key: Path, profile: str, old_in_token: bool
) -> None:
    old = hsm_mod.uri(hsm, "gateway-enc") if old_in_token else str(pki / "gateway-enc.key")
    previous = [{"key": old, "certificate": str(pki / "gateway-enc.pem")}]
    route = model(rotating(pki, profile, f"{new_key}.key", previous, **(ENCRYPTED if profile == "rsa" else {})))
    pipeline = SecuredPipeline(route, RouteStores())
    for cert in (pki / "gateway-enc.pem", f"{new_key}.pem"):
        cfg = ClientConfig(certs=pki, gateway_encryption_certificate=str(cert), encrypt=True)
        got, reply = round_trip(pipeline, Client(route, cfg), echo(f"to {Path(cert).stem}"))
        assert f"to {Path(cert).stem}".encode() in got and f"to {Path(cert).stem}".encode() in reply


def test_encrypted_key_for_a_certificate_the_route_does_not_hold_is_refused(pki: Path, new_key: Path) -> None:
    """Not tried against each key in turn (an oracle on every key the route holds, and a FailedCheck that says
    which): the reference must name one of the route's certificates."""
    previous = [{"key": str(pki / "gateway-enc.key"), "certificate": str(pki / "gateway-enc.pem")}]
    route = model(rotating(pki, "rsa", f"{new_key}.key", previous, **ENCRYPTED))
    pipeline = SecuredPipeline(route, RouteStores())
    cfg = ClientConfig(certs=pki, gateway_encryption_certificate=str(pki / "client2.pem"), encrypt=True)
    with pytest.raises(faults.Fault) as err:
        round_trip(pipeline, Client(route, cfg), echo("to a stranger"))
    assert err.value.code == "SecurityTokenUnavailable"


def test_previous_key_with_a_certificate_not_its_own_is_refused_at_load(pki: Path, new_key: Path) -> None:
    previous = [{"key": str(pki / "gateway-enc.key"), "certificate": f"{new_key}.pem"}]
    with pytest.raises(faults.Fault, match="not the decryption key's"):
        SecuredPipeline(model(rotating(pki, "rsa", f"{new_key}.key", previous)), RouteStores())


def test_rotation_under_load_refuses_nothing_that_should_pass(tmp_path: Path, pki: Path, new_key: Path) -> None:
    """Clients encrypting to the old certificate, then (once the new key is in) to the new one, run through two
    reloads: the new key added beside the old, then the old retired. Every request is answered 200."""
    old = {"key": str(pki / "gateway-enc.key"), "certificate": str(pki / "gateway-enc.pem")}
    step0 = route_doc(pki, "rsa", name="rot", **ENCRYPTED)
    step1 = rotating(pki, "rsa", f"{new_key}.key", [old], name="rot", **ENCRYPTED)
    step2 = rotating(pki, "rsa", f"{new_key}.key", [], name="rot", **ENCRYPTED)
    use_new = threading.Event()
    stop = threading.Event()
    statuses: list[tuple[str, int]] = []

    with running_gateway(tmp_path, [step0], pki) as gw:
        route = Route.model_validate({**step0, "upstream": {"address": gw.backend_addr}})  # type: ignore[attr-defined]
        clients = {
            "old": Client(route, ClientConfig(certs=pki, gateway_encryption_certificate=str(pki / "gateway-enc.pem"))),
            "new": Client(route, ClientConfig(certs=pki, gateway_encryption_certificate=f"{new_key}.pem")),
        }

        def load() -> None:
            with requests.Session() as s:
                while not stop.is_set():
                    which = "new" if use_new.is_set() else "old"
                    secured, pending = clients[which].secure(echo(which))
                    resp = s.post(gw_url(gw, "/rot/demo"), data=secured, timeout=10,
                                  headers={"content-type": content_type("1.1")})  # fmt: skip
                    if resp.status_code == 200:
                        clients[which].open(resp.content, pending)
                    statuses.append((which, resp.status_code))

        threads = [threading.Thread(target=load) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            write_route(gw, step1)  # the new key beside the old: both taken
            time.sleep(0.5)
            use_new.set()  # clients read the new certificate (published) and move
            time.sleep(0.5)
            count = len(statuses)
            while len(statuses) < count + 2:  # requests sent after the move, before the old key goes
                time.sleep(0.05)
            write_route(gw, step2)  # the old key retired
            time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join()
    assert statuses and all(code == 200 for _, code in statuses), [s for s in statuses if s[1] != 200]
    assert {"old", "new"} <= {which for which, _ in statuses}


def published_signers(gw: object, path: str) -> list[tuple[str, bytes]]:
    """(current|next, DER) for each signing certificate the route's ?wsdl publishes, in order."""
    resp = requests.get(gw_url(gw, f"{path}?wsdl"), timeout=10)
    assert resp.status_code == 200, resp.text
    ports = etree.fromstring(resp.content).findall(f".//{{{ns.WSDL}}}port")
    lists = [port.findall(f"{{{published_certificates.NS}}}SigningCertificates/{DS}KeyInfo") for port in ports]
    assert ports and all(len(infos) == len(lists[0]) for infos in lists)  # in every port
    infos = lists[0]
    return [(i.findtext(f"{DS}KeyName"), base64.b64decode(i.findtext(f"{DS}X509Data/{DS}X509Certificate")))
            for i in infos]  # fmt: skip


def response_signer(reply: bytes) -> bytes:
    """The certificate the gateway signed a response with: its BinarySecurityToken (DER)."""
    token = etree.fromstring(reply).find(f".//{{{ns.WSSE}}}BinarySecurityToken")
    return base64.b64decode(token.text)


def test_new_signing_certificate_published_before_responses_switch(tmp_path: Path, pki: Path, new_signer: Path) -> None:
    """docs/keys.md "The signing key": the next certificate is published (?wsdl, `wsgate certs published`) while
    responses are still signed with the current one; the reload that makes it current switches signing."""
    wsdl = {"file": str(REPO / "tests" / "wsdl" / "publish" / "echo.wsdl"), "publish": True}
    common = {"name": "rot", "match": {"path_prefix": "/rot/service"}, "wsdl": wsdl}
    old, new = (der(pki / "gateway-sign.pem"), der(f"{new_signer}.pem"))
    steps = [
        (route_doc(pki, "rsa", **common), [("current", old)], old),
        (route_doc(pki, "rsa", rsa={"next_certificate": f"{new_signer}.pem"}, **common),
         [("current", old), ("next", new)], old),
        (route_doc(pki, "rsa", rsa={"key": f"{new_signer}.key", "certificate": f"{new_signer}.pem"}, **common),
         [("current", new)], new),
    ]  # fmt: skip
    with running_gateway(tmp_path, [steps[0][0]], pki) as gw:
        route = Route.model_validate({**steps[0][0], "upstream": {"address": gw.backend_addr}})  # type: ignore[attr-defined]
        client = Client(route, ClientConfig(certs=pki))
        for i, (doc, published, signer) in enumerate(steps):
            if i:
                write_route(gw, doc)
            assert published_signers(gw, "/rot/service") == published
            bundle = wsgate("certs", "published", gw.opts.policies, "--route", "rot")
            assert bundle.returncode == 0, bundle.stderr
            pems = x509.load_pem_x509_certificates(bundle.stdout.encode())
            assert [c.public_bytes(serialization.Encoding.DER) for c in pems] == [d for _, d in published]
            for _ in range(3):
                secured, pending = client.secure(echo(f"step {i}"))
                resp = requests.post(gw_url(gw, "/rot/service"), data=secured, timeout=10,
                                     headers={"content-type": content_type("1.1")})  # fmt: skip
                assert resp.status_code == 200, resp.text
                assert response_signer(resp.content) == signer  # never the next one before the switch
                client.open(resp.content, pending)  # verified against the CA: clients need nothing else


def test_next_certificate_that_cannot_be_read_is_refused_by_the_policy_check(tmp_path: Path, pki: Path) -> None:
    """No worker reads it, so the check does: a reload with it missing (or not a certificate) keeps the running
    policies instead of publishing nothing."""
    (tmp_path / "not-a-cert.pem").write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    for bad in (tmp_path / "missing.pem", tmp_path / "not-a-cert.pem"):
        doc = route_doc(pki, "rsa", name="rot", rsa={"next_certificate": str(bad)}, upstream={"address": "127.0.0.1:1"})
        policies = write_policies(tmp_path / f"policies-{bad.stem}", [doc])
        done = wsgate("check", policies)
        assert done.returncode == 1 and "rsa.next_certificate" in done.stdout + done.stderr, done


# ---------------------------------------------------------------------------------------------------------
# Pre-shared and master keys: `wsgate keys rotate`


def wsgate(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([WSGATE, *map(str, args)], capture_output=True, text=True, timeout=60)


def test_keys_rotate_master_keys_keeps_contexts_sealed_under_the_old_key(pki: Path, tmp_path: Path) -> None:
    path = tmp_path / "sct-master-keys.yaml"
    path.write_bytes((pki / "sct-master-keys.yaml").read_bytes())
    before = load_master_keys(path)
    now = datetime.now(UTC)
    cancelled = MemoryRevocations(100, epoch=now - timedelta(minutes=1))  # kept across the reload (Redis)
    old_context = SealedContextStore(before, 3600, cancelled).issue(b"s" * 32, "CN=old", WSC_1_3, now)
    done = wsgate("keys", "rotate", "master-keys", path)
    assert done.returncode == 0, done.stderr
    after = load_master_keys(path)
    assert [k.id for k in after][1:] == [k.id for k in before] and after[0].id not in {k.id for k in before}
    assert (path.stat().st_mode & 0o777) == 0o600
    assert base64.b64encode(after[0].key).decode() not in done.stdout + done.stderr  # never printed
    rotated = SealedContextStore(after, 3600, cancelled)
    assert rotated.lookup(old_context.identifier, WSC_1_3, now).secret == b"s" * 32  # sealed before, still valid
    assert rotated.issue(b"t" * 32, "CN=new", WSC_1_3, now).identifier.startswith(f"urn:wsgate:sct:{after[0].id}:")
    done = wsgate("keys", "rotate", "master-keys", path, "--retire", before[0].id)
    assert done.returncode == 0, done.stderr
    assert [k.id for k in load_master_keys(path)] == [after[0].id]
    assert wsgate("keys", "rotate", "master-keys", path, "--retire", after[0].id).returncode == 1  # not the last


def test_keys_rotate_hmac_keys_adds_a_named_key_and_retires_the_old(pki: Path, tmp_path: Path) -> None:
    path = tmp_path / "hmac-keys.yaml"
    path.write_bytes((pki / "hmac-keys.yaml").read_bytes())
    assert wsgate("keys", "rotate", "hmac-keys", path, "--name", "demo-client-2").returncode == 0
    assert sorted(keys.load_hmac_keys(path)) == ["demo-client", "demo-client-2"]
    assert wsgate("keys", "rotate", "hmac-keys", path, "--name", "demo-client-2").returncode == 1  # taken
    assert wsgate("keys", "rotate", "hmac-keys", path, "--name", "9bad").returncode == 1  # not a reference
    assert wsgate("keys", "rotate", "hmac-keys", path, "--retire", "demo-client").returncode == 0
    assert sorted(keys.load_hmac_keys(path)) == ["demo-client-2"]
