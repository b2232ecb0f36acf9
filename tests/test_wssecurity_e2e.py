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
from gateway.policy import Route
from gateway.tools.client import Client, ClientConfig, ClientError, content_type
from tests.harness import clear, fault_code, received, running_gateway
from tests.wss_helpers import DEMO, echo, route_doc

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def routes(pki: Path) -> list[dict]:
    return [
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


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Path, routes: list[dict]):
    # Two workers: the replay store must be shared (the supervisor's Redis), or a replay could reach the other one.
    with running_gateway(tmp_path_factory.mktemp("wss"), routes, pki, workers=2, metrics=True) as g:
        yield g


def route_of(gw, name: str) -> Route:
    return Route.model_validate(
        {**next(r for r in _routes(gw) if r["name"] == name), "upstream": {"address": gw.backend_addr}}
    )


def _routes(gw) -> list[dict]:
    import yaml

    return yaml.safe_load((gw.opts.policies / "routes.yaml").read_text())["routes"]


def send(gw, name: str, body: bytes, version: str = "1.1") -> requests.Response:
    return requests.post(f"http://127.0.0.1:{gw.opts.http_port}/{name}/demo", data=body,
                         headers={"content-type": content_type(version)}, timeout=10)  # fmt: skip


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
def test_round_trip(gw, pki: Path, name: str, cfg: dict, identity: str | None, version: str) -> None:
    client = Client(route_of(gw, name), ClientConfig(certs=pki, **cfg))
    secured, pending = client.secure(echo("round trip", version))
    assert b"wsse:Security" in secured
    clear(gw)
    resp = send(gw, name, secured, version)
    assert resp.status_code == 200, resp.text
    assert b"wsse:Security" in resp.content  # the response is secured on its way back
    plain = client.open(resp.content, pending)
    assert plain.body.findtext(f".//{{{DEMO}}}text") == "round trip"
    got = received(gw)[-1]
    assert "Security" not in got["body"] and "wsu:Id" not in got["body"] and "Header" not in got["body"]
    assert "round trip" in got["body"]  # decrypted content reached the backend
    assert got["headers"].get("x-wsgate-subject") == identity


@pytest.mark.parametrize(
    ("name", "cfg", "identity"), [CASES[0], ("hmac", {"key_name": "demo-client"}, "key:demo-client")]
)
@pytest.mark.parametrize("chunked", [False, True])
def test_client_cannot_spoof_gateway_headers(
    gw, pki: Path, name: str, cfg: dict, identity: str | None, chunked: bool
) -> None:
    # Envoy removes the client's own x-wsgate-* headers before the filter runs, on both ext_proc paths (with a
    # Content-Length, bodies only; chunked, with the headers phase); only the verified subject reaches the backend.
    client = Client(route_of(gw, name), ClientConfig(certs=pki, **cfg))
    secured, pending = client.secure(echo("spoof", "1.1"))
    clear(gw)
    data = iter([secured]) if chunked else secured
    resp = requests.post(f"http://127.0.0.1:{gw.opts.http_port}/{name}/demo", data=data, timeout=10,
                         headers={"content-type": content_type("1.1"), "x-wsgate-subject": "CN=Mallory",
                                  "X-WSGate-Anything": "forged"})  # fmt: skip
    assert resp.status_code == 200, resp.text
    client.open(resp.content, pending)
    got = received(gw)[-1]["headers"]
    assert got.get("x-wsgate-subject") == identity
    assert "x-wsgate-anything" not in got


def test_tampered_request_refused_and_counted(gw, pki: Path) -> None:
    client = Client(route_of(gw, "rsa"), ClientConfig(certs=pki))
    secured, _ = client.secure(echo("pay 10"))
    clear(gw)
    resp = send(gw, "rsa", secured.replace(b"pay 10", b"pay 99"))
    assert resp.status_code == 500
    assert fault_code(resp) == "FailedCheck"
    assert "The signature or decryption was invalid" in resp.text
    assert received(gw) == []
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
        resp = send(gw, "hmac", f'<soap:Envelope xmlns:soap="{soap}">{inner}</soap:Envelope>'.encode())
        assert resp.status_code == 500
    metrics = "".join(requests.get(u, timeout=5).text for u in gw.metrics_urls())
    reasons = {
        line.split('reason="', 1)[1].split('"', 1)[0]
        for line in metrics.splitlines()
        if line.startswith("wsgate_faults_total{")
    }
    assert reasons and reasons <= faults.LABELS, reasons - faults.LABELS
    assert len(reasons) <= 4


def test_replay_refused_across_workers(gw, pki: Path) -> None:
    client = Client(route_of(gw, "hmac"), ClientConfig(certs=pki, key_name="demo-client"))
    secured, _ = client.secure(echo("once"))
    clear(gw)
    codes = [send(gw, "hmac", secured).status_code for _ in range(6)]
    assert codes == [200, 500, 500, 500, 500, 500]
    assert len(received(gw)) == 1


def test_untrusted_signer_refused(gw, pki: Path) -> None:
    client = Client(route_of(gw, "rsa"), ClientConfig(certs=pki, key="rogue.key", certificate="rogue.pem"))
    secured, _ = client.secure(echo())
    clear(gw)
    resp = send(gw, "rsa", secured)
    assert fault_code(resp) == "FailedAuthentication"
    assert received(gw) == []


def test_plain_request_on_secured_route_refused(gw) -> None:
    clear(gw)
    resp = send(gw, "rsa", echo(version="1.2"), "1.2")
    assert resp.status_code == 500
    assert resp.headers["content-type"].startswith("application/soap+xml")
    assert fault_code(resp) == "InvalidSecurity"
    assert received(gw) == []


def test_wrong_password_refused(gw, pki: Path) -> None:
    client = Client(route_of(gw, "username"), ClientConfig(certs=pki, user="bob", password="guess"))
    secured, pending = client.secure(echo())
    resp = send(gw, "username", secured)
    assert fault_code(resp) == "FailedAuthentication"
    with pytest.raises(ClientError, match="FailedAuthentication"):
        client.open(resp.content, pending)


def test_backend_fault_is_secured(gw, pki: Path) -> None:
    client = Client(route_of(gw, "rsa"), ClientConfig(certs=pki))
    plain = echo().replace(b'<d:echo xmlns:d="urn:wsgate:demo"><d:text>hello</d:text></d:echo>',
                           b'<d:fault xmlns:d="urn:wsgate:demo"/>')  # fmt: skip
    secured, pending = client.secure(plain)
    resp = send(gw, "rsa", secured)
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


def test_shared_store_down_fails_closed_and_recovers(tmp_path: Path, pki: Path) -> None:
    routes = [route_doc(pki, "hmac", name="hmac", replay={"store": "auto"})]
    with running_gateway(tmp_path, routes, pki, workers=2) as g:
        client = Client(route_of(g, "hmac"), ClientConfig(certs=pki, key_name="demo-client"))
        assert send(g, "hmac", client.secure(echo())[0]).status_code == 200
        assert g.redis is not None
        g.redis.kill()
        g.redis.wait()
        clear(g)
        resp = send(g, "hmac", client.secure(echo())[0])
        assert resp.status_code == 500  # no replay check possible: refused, never passed on unchecked
        assert received(g) == []
        g.supervise_once()  # the supervisor brings Redis back
        assert send(g, "hmac", client.secure(echo())[0]).status_code == 200


def test_replay_remembered_across_a_replaced_worker(tmp_path: Path, pki: Path) -> None:
    # One worker, replay store auto: the supervisor still gives it Redis, because a restarted (or recycled)
    # worker starting with an empty memory would accept again what its predecessor saw.
    routes = [route_doc(pki, "hmac", name="hmac", replay={"store": "auto"})]
    with running_gateway(tmp_path, routes, pki, workers=1) as g:
        assert g.redis is not None
        client = Client(route_of(g, "hmac"), ClientConfig(certs=pki, key_name="demo-client"))
        secured, _ = client.secure(echo("once", "1.1"))
        assert send(g, "hmac", secured).status_code == 200
        os.kill(g.workers[0].pid, signal.SIGKILL)
        g.workers[0].wait()
        g.supervise_once()  # the supervisor restarts the worker
        deadline = time.monotonic() + 15
        while (resp := send(g, "hmac", secured)).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert resp.status_code == 500
        assert fault_code(resp) == "InvalidSecurity"
