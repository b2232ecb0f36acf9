"""rsa and hmac end to end: the client secures, Envoy and the filter workers verify and strip, the backend sees
plain SOAP, the response comes back secured and the client opens it. Refusals never reach the backend."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from filters.engine import faults
from gateway.tools.client import ClientError, content_type
from tests.support.harness import GatewayFactory, LiveGateway, fault_code
from tests.support.wss_helpers import DEMO, Keys, echo, route_doc

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def routes(pki: Path, gateway_keys: Keys) -> list[dict]:
    """The gateway's keys in files, then in the token (each module-scoped gateway_keys param)."""
    docs = [
        route_doc(pki, "rsa", name="rsa", replay={"store": "auto"}),
        route_doc(
            pki,
            "rsa",
            name="rsa-enc",
            replay={"store": "auto"},
            encryption={"require_request": True, "encrypt_response": True},
        ),
        route_doc(pki, "hmac", name="hmac", replay={"store": "auto"}),
        route_doc(
            pki,
            "hmac",
            name="username",
            replay={"store": "auto"},
            username_token={"required": True, "users_file": str(pki / "users.yaml"), "protection": "encrypted"},
        ),
    ]
    return [gateway_keys(d) for d in docs]


@pytest.fixture(scope="module")
def gw(module_gateway: GatewayFactory, routes: list[dict]) -> LiveGateway:
    # Two workers: the replay store must be shared (the supervisor's Redis), or a replay could reach the other one.
    return module_gateway(routes, workers=2, metrics=True)


CASES = [
    ("rsa", {}, "CN=Demo Client,O=WSGate Demo"),
    ("rsa-enc", {}, "CN=Demo Client,O=WSGate Demo"),
    ("hmac", {}, "anonymous"),
    ("hmac", {"key_name": "demo-client"}, "key:demo-client"),
    ("hmac", {"encrypt": True}, "anonymous"),
    ("username", {"user": "bob", "password": "bob-demo-password"}, "bob"),
    ("username", {"user": "alice", "password": "alice-demo-password", "password_digest": False}, "alice"),
]


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize(("name", "cfg", "identity"), CASES)
def test_round_trip(gw, name: str, cfg: dict, identity: str | None, version: str) -> None:
    client = gw.client(name, **cfg)
    secured, pending = client.secure(echo("round trip", version))
    assert b"wsse:Security" in secured
    gw.clear()
    resp = gw.post(name, secured, version)
    assert resp.status_code == 200, resp.text
    assert b"wsse:Security" in resp.content  # the response is secured on its way back
    plain = client.open(resp.content, pending)
    assert plain.body.findtext(f".//{{{DEMO}}}text") == "round trip"
    got = gw.received()[-1]
    assert "Security" not in got["body"] and "wsu:Id" not in got["body"] and "Header" not in got["body"]
    assert "round trip" in got["body"]  # decrypted content reached the backend
    assert got["headers"].get("x-wsgate-subject") == identity


@pytest.mark.parametrize(
    ("name", "cfg", "identity"), [CASES[0], ("hmac", {"key_name": "demo-client"}, "key:demo-client")]
)
@pytest.mark.parametrize("chunked", [False, True])
def test_client_cannot_spoof_gateway_headers(gw, name: str, cfg: dict, identity: str | None, chunked: bool) -> None:
    # Envoy removes the client's own x-wsgate-* headers before the filter runs, on both ext_proc paths (with a
    # Content-Length, bodies only; chunked, with the headers phase); only the verified subject reaches the backend.
    client = gw.client(name, **cfg)
    secured, pending = client.secure(echo("spoof", "1.1"))
    gw.clear()
    data = iter([secured]) if chunked else secured
    resp = requests.post(f"http://127.0.0.1:{gw.opts.http_port}/{name}/demo", data=data, timeout=10,
                         headers={"content-type": content_type("1.1"), "x-wsgate-subject": "CN=Mallory",
                                  "X-WSGate-Anything": "forged"})  # fmt: skip
    assert resp.status_code == 200, resp.text
    client.open(resp.content, pending)
    got = gw.received()[-1]["headers"]
    assert got.get("x-wsgate-subject") == identity
    assert "x-wsgate-anything" not in got


def test_tampered_request_refused_and_counted(gw) -> None:
    client = gw.client("rsa")
    secured, _ = client.secure(echo("pay 10"))
    gw.clear()
    resp = gw.post("rsa", secured.replace(b"pay 10", b"pay 99"))
    assert resp.status_code == 500
    assert fault_code(resp) == "FailedCheck"
    assert "The signature or decryption was invalid" in resp.text
    assert gw.received() == []
    metrics = "".join(requests.get(u, timeout=5).text for u in gw.metrics_urls())
    assert 'wsgate_faults_total{profile="rsa",reason="FailedCheck",route="rsa"}' in metrics


def test_client_chosen_fault_reasons_do_not_become_metric_labels(gw) -> None:
    """Each distinct attack once used to be a new wsgate_faults_total series (reasons carry the client's numbers and
    names): labels come from a fixed set, the precise reason goes to the log only."""
    bodies = [f"<soap:Body/>{'<soap:Body/>' * n}" for n in range(1, 12)]  # "envelope has N Body elements"
    bodies += [f"<soap:Body><x{n}:a xmlns:x{n}='urn:{n}'>" for n in range(12)]  # malformed, each message different
    bodies += [f"<soap:Header/><soap:Body/><soap:Extra{n}/>" for n in range(12)]
    soap = "http://schemas.xmlsoap.org/soap/envelope/"
    for inner in bodies:
        resp = gw.post("hmac", f'<soap:Envelope xmlns:soap="{soap}">{inner}</soap:Envelope>'.encode())
        assert resp.status_code == 500
    metrics = "".join(requests.get(u, timeout=5).text for u in gw.metrics_urls())
    reasons = {
        line.split('reason="', 1)[1].split('"', 1)[0]
        for line in metrics.splitlines()
        if line.startswith("wsgate_faults_total{")
    }
    assert reasons and reasons <= faults.LABELS, reasons - faults.LABELS
    assert len(reasons) <= 4


def test_replay_refused_across_workers(gw) -> None:
    client = gw.client("hmac", key_name="demo-client")
    secured, _ = client.secure(echo("once"))
    gw.clear()
    codes = [gw.post("hmac", secured).status_code for _ in range(6)]
    assert codes == [200, 500, 500, 500, 500, 500]
    assert len(gw.received()) == 1


def test_untrusted_signer_refused(gw) -> None:
    client = gw.client("rsa", key="rogue.key", certificate="rogue.pem")
    secured, _ = client.secure(echo())
    gw.clear()
    resp = gw.post("rsa", secured)
    assert fault_code(resp) == "FailedAuthentication"
    assert gw.received() == []


def test_plain_request_on_secured_route_refused(gw) -> None:
    gw.clear()
    resp = gw.post("rsa", echo(version="1.2"), "1.2")
    assert resp.status_code == 500
    assert resp.headers["content-type"].startswith("application/soap+xml")
    assert fault_code(resp) == "InvalidSecurity"
    assert gw.received() == []


def test_wrong_password_refused(gw) -> None:
    client = gw.client("username", user="bob", password="guess")
    secured, pending = client.secure(echo())
    resp = gw.post("username", secured)
    assert fault_code(resp) == "FailedAuthentication"
    with pytest.raises(ClientError, match="FailedAuthentication"):
        client.open(resp.content, pending)


def test_backend_fault_is_secured(gw) -> None:
    client = gw.client("rsa")
    plain = echo().replace(b'<d:echo xmlns:d="urn:wsgate:demo"><d:text>hello</d:text></d:echo>',
                           b'<d:fault xmlns:d="urn:wsgate:demo"/>')  # fmt: skip
    secured, pending = client.secure(plain)
    resp = gw.post("rsa", secured)
    assert resp.status_code == 500
    assert b"wsse:Security" in resp.content and b"ds:Signature" in resp.content
    with pytest.raises(ClientError, match="SOAP fault"):
        client.open(resp.content, pending)


def test_wsgate_client_cli(gw, pki: Path, tmp_path: Path) -> None:
    request = tmp_path / "echo.xml"
    request.write_bytes(echo("from the cli"))
    run = subprocess.run(
        [sys.executable, "-m", "gateway.control.cli", "client", "--policies", str(gw.opts.policies), "--certs", str(pki),
         "--policy", "rsa-enc", "--url", f"http://127.0.0.1:{gw.opts.http_port}/rsa-enc/demo", str(request)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "<d:text>from the cli</d:text>" in run.stdout
    assert "Security" not in run.stdout


def test_shared_store_down_fails_closed_and_recovers(gateway: GatewayFactory, pki: Path) -> None:
    routes = [route_doc(pki, "hmac", name="hmac", replay={"store": "auto"})]
    with gateway(routes, workers=2) as g:
        client = g.client("hmac", key_name="demo-client")
        assert g.post("hmac", client.secure(echo())[0]).status_code == 200
        assert g.redis is not None
        g.redis.kill()
        g.redis.wait()
        g.clear()
        resp = g.post("hmac", client.secure(echo())[0])
        assert resp.status_code == 500  # no replay check possible: refused, never passed on unchecked
        assert g.received() == []
        g.supervise_once()  # the supervisor brings Redis back
        assert g.post("hmac", client.secure(echo())[0]).status_code == 200


def test_replay_remembered_across_a_replaced_worker(gateway: GatewayFactory, pki: Path) -> None:
    # One worker, replay store auto: the supervisor still gives it Redis, because a restarted (or recycled)
    # worker starting with an empty memory would accept again what its predecessor saw.
    routes = [route_doc(pki, "hmac", name="hmac", replay={"store": "auto"})]
    with gateway(routes, workers=1) as g:
        assert g.redis is not None
        client = g.client("hmac", key_name="demo-client")
        secured, _ = client.secure(echo("once", "1.1"))
        assert g.post("hmac", secured).status_code == 200
        os.kill(g.workers[0].pid, signal.SIGKILL)
        g.workers[0].wait()
        g.supervise_once()  # the supervisor restarts the worker
        deadline = time.monotonic() + 15
        while (resp := g.post("hmac", secured)).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert resp.status_code == 500
        assert fault_code(resp) == "InvalidSecurity"
