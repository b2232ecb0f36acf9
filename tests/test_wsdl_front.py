"""Front an existing service from its WSDL, as docs/interop.md's session does it: `wsgate import` the service's WSDL
(tests/wsdl/demo-asymmetric.wsdl: the demo echo service with a CXF-style X.509 AsymmetricBinding), `wsgate
check` the result, start the gateway on it, and let zeep build its client from the gateway's `?wsdl` and make a
signed call. What the backend receives is plain SOAP; what the WSDL's schema forbids never reaches it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
import zeep
from lxml import etree
from zeep.wsse.compose import Compose

from filters.engine import ns
from gateway.policy import Route
from gateway.tools.client import Client, ClientConfig
from tests.harness import content_type, fault_code, received, running_gateway
from tests.test_interop import SignWithClientVerifyGateway, ZeepTimestamp, zeep_signer
from tests.wss_helpers import DEMO

REPO = Path(__file__).resolve().parents[1]
WSDL = REPO / "tests" / "wsdl" / "demo-asymmetric.wsdl"
SOAP_ADDRESS = "{http://schemas.xmlsoap.org/wsdl/soap/}address"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway.control.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("front") / "routes.yaml"
    done = _cli("import", str(WSDL), "--upstream", "127.0.0.1:9", "--validate", "-o", str(out))
    assert done.returncode == 0, done.stderr
    # What an operator edits: the PKI paths (the test's own) and the backend's address.
    route = yaml.safe_load(out.read_text().replace("certs/out/", f"{pki}/"))["routes"][0]
    return {**route, "upstream": {"address": "BACKEND"}}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Path, imported: dict[str, Any]) -> Iterator[Any]:
    with running_gateway(tmp_path_factory.mktemp("front-gw"), [imported], pki) as g:
        yield g


def test_imported_policy_is_what_the_wsdl_asks_and_passes_check(imported: dict[str, Any], tmp_path: Path) -> None:
    assert imported["profile"] == "rsa"
    assert imported["match"] == {"path_prefix": "/demo/echo", "soap_action": "urn:wsgate:demo#echo"}
    assert imported["signature"]["parts"] == ["body", "timestamp"]
    assert imported["wsdl"] == {"file": str(WSDL), "publish": True}
    (tmp_path / "routes.yaml").write_text(yaml.safe_dump({"routes": [{**imported, "upstream": {"address": "h:1"}}]}))
    check = _cli("check", str(tmp_path))
    assert check.returncode == 0, check.stderr


def test_published_wsdl_points_clients_at_the_gateway_with_its_policy(gw: Any) -> None:
    resp = requests.get(f"http://127.0.0.1:{gw.opts.http_port}/demo/echo?wsdl", timeout=10)
    assert resp.status_code == 200
    root = etree.fromstring(resp.content)
    assert root.find(f".//{SOAP_ADDRESS}").get("location") == f"http://127.0.0.1:{gw.opts.http_port}/demo/echo"
    assert root.find(f".//{{{ns.SP12}}}AsymmetricBinding") is not None
    assert b"demo.internal" not in resp.content  # the backend's own address is not given away


def test_zeep_from_the_published_wsdl_makes_a_signed_call_the_backend_gets_plain(gw: Any, pki: Path) -> None:
    requests.delete(f"http://{gw.backend_addr}/_received", timeout=5)
    sign = SignWithClientVerifyGateway(zeep_signer(pki, sha256=True), (pki / "gateway-sign.pem").read_bytes())
    client = zeep.Client(f"http://127.0.0.1:{gw.opts.http_port}/demo/echo?wsdl", wsse=Compose([ZeepTimestamp(), sign]))
    assert client.service.echo(text="from the published WSDL") == "from the published WSDL"
    assert sign.verified == 1  # zeep checked the gateway's signature on the reply
    got = received(gw)
    assert len(got) == 1 and "Security" not in got[0]["body"]
    assert got[0]["headers"]["x-wsgate-subject"] == "CN=Demo Client,O=WSGate Demo"


def test_a_signed_request_the_wsdl_schema_forbids_never_reaches_the_backend(
    gw: Any, pki: Path, imported: dict[str, Any]
) -> None:
    requests.delete(f"http://{gw.backend_addr}/_received", timeout=5)
    route = Route.model_validate({**imported, "upstream": {"address": "h:1"}})
    client = Client(route, ClientConfig(certs=pki))
    body = f'<d:echo xmlns:d="{DEMO}"><d:text>one</d:text><d:text>two</d:text></d:echo>'
    envelope = f'<s:Envelope xmlns:s="http://schemas.xmlsoap.org/soap/envelope/"><s:Body>{body}</s:Body></s:Envelope>'
    secured, _ = client.secure(envelope.encode())
    resp = requests.post(f"http://127.0.0.1:{gw.opts.http_port}/demo/echo", data=secured, timeout=10,
                         headers={"content-type": content_type("1.1"), "soapaction": '"urn:wsgate:demo#echo"'})  # fmt: skip
    assert resp.status_code == 500
    assert fault_code(resp) == "Client"
    assert received(gw) == []
    assert "schema invalid: request payload" in (gw.logs / "filter-0.log").read_text()
