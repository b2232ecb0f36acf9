"""The key inventory (filters/engine/wss/inventory.py): `wsgate keys list` names every key and certificate the
policies use, file or token; `wsgate check` warns 30 days before a certificate expires and refuses an expired one
(a gateway that would sign with it, or trust it, fails its clients on the day); the workers export each route's
expiry as wsgate_certificate_not_after_seconds{route,use}."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from prometheus_client import REGISTRY

from certs import pki as pki_mod
from filters.engine.engine import Engine
from filters.engine.wss import inventory, keys
from filters.stores.factory import RouteStores
from gateway.policy import PolicySet, Route
from tests.support.harness import write_policies
from tests.support.wss_helpers import eddsa_certificate, route_doc, token_route

WSGATE = Path(sys.executable).parent / "wsgate"


def wsgate(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([WSGATE, *map(str, args)], capture_output=True, text=True, timeout=60)


def with_upstream(doc: dict) -> dict:
    return {**doc, "upstream": {"address": "127.0.0.1:1"}}


def issued_with(pki: Path, out: Path, stem: str, days: int, started_days_ago: int = 0) -> Path:
    """A signing certificate (and its key) from the demo CA, valid `days` from `started_days_ago` days ago."""
    ca = pki_mod.Issued(keys.load_private_key(pki / "ca.key"), keys.load_certificate(pki / "ca.pem"))
    start = dt.datetime.now(dt.UTC) - dt.timedelta(days=started_days_ago)
    got = pki_mod.issue(ca, f"Gateway {stem}", days=days, not_before=start)
    (out / f"{stem}.pem").write_bytes(got.cert.public_bytes(serialization.Encoding.PEM))
    (out / f"{stem}.key").write_bytes(
        got.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return out / stem


def test_keys_list_names_every_key_file_or_token_and_its_routes(pki: Path, hsm: Path, tmp_path: Path) -> None:
    routes = [
        with_upstream(token_route(pki, hsm, "rsa", name="in-token")),
        with_upstream(route_doc(pki, "rsa", name="in-files")),
        with_upstream(route_doc(pki, "hmac", name="psk")),
    ]
    done = wsgate("keys", "list", write_policies(tmp_path / "policies", routes))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "signing       token RSA 2048 bits  pkcs11:token=wsgate;object=gateway-sign?" in out
    assert f"signing       file  RSA 2048 bits  {pki / 'gateway-sign.key'}" in out
    assert "subject CN=WSGate Gateway Signing,O=WSGate Demo; issuer CN=WSGate Demo CA,O=WSGate Demo; not after" in out
    assert f"hmac_keys     file  HMAC 1 keys  {pki / 'hmac-keys.yaml'}" in out
    # The encryption key file is used by all three, once in the list; its certificate is the .pem beside it.
    block = out.split(f"decryption    file  RSA 2048 bits  {pki / 'gateway-enc.key'}\n", 1)[1]
    assert block.startswith("    subject CN=WSGate Gateway Encryption") and "routes in-files, psk\n" in block
    assert (hsm / "hsm-pin").read_text().strip() not in out  # where the PIN is, never the PIN


def test_check_warns_thirty_days_before_a_certificate_expires(pki: Path, tmp_path: Path) -> None:
    soon = issued_with(pki, tmp_path, "soon", days=20)
    doc = route_doc(pki, "rsa", rsa={"key": f"{soon}.key", "certificate": f"{soon}.pem"})
    done = wsgate("check", write_policies(tmp_path / "policies", [with_upstream(doc)]))
    assert done.returncode == 0, done.stderr
    assert "warning: signing certificate 'CN=Gateway soon,O=WSGate Demo'" in done.stderr
    assert "expires in 19 days" in done.stderr


@pytest.mark.parametrize(("days", "ago"), [(10, 40), (30, -5)], ids=["expired", "not-yet-valid"])
def test_check_refuses_a_certificate_outside_its_validity(pki: Path, tmp_path: Path, days: int, ago: int) -> None:
    old = issued_with(pki, tmp_path, "old", days=days, started_days_ago=ago)
    doc = route_doc(pki, "rsa", rsa={"key": f"{old}.key", "certificate": f"{old}.pem"})
    done = wsgate("check", write_policies(tmp_path / "policies", [with_upstream(doc)]))
    assert done.returncode == 1
    assert "error: signing certificate 'CN=Gateway old,O=WSGate Demo'" in done.stderr


def test_certificate_expiry_metric_per_route_and_use(pki: Path, hsm: Path, tmp_path: Path) -> None:
    soon = issued_with(pki, tmp_path, "soon", days=20)
    routes = [
        Route.model_validate(with_upstream(token_route(pki, hsm, "rsa", name="metric-token"))),
        Route.model_validate(with_upstream(route_doc(pki, "rsa", name="metric-soon",
                                                     rsa={"key": f"{soon}.key", "certificate": f"{soon}.pem"}))),
    ]  # fmt: skip
    Engine(PolicySet(routes=routes, sources={r.name: "test" for r in routes}), RouteStores())

    def value(route: str, use: str) -> float | None:
        return REGISTRY.get_sample_value("wsgate_certificate_not_after_seconds", {"route": route, "use": use})

    sign = keys.load_certificate(pki / "gateway-sign.pem").not_valid_after_utc.timestamp()
    assert value("metric-token", "signing") == sign
    assert value("metric-soon", "signing") == keys.load_certificate(f"{soon}.pem").not_valid_after_utc.timestamp()
    assert (
        value("metric-soon", "decryption")
        == keys.load_certificate(pki / "gateway-enc.pem").not_valid_after_utc.timestamp()
    )
    assert value("metric-soon", "trust_anchor") == keys.load_certificate(pki / "ca.pem").not_valid_after_utc.timestamp()


def test_inventory_lists_an_eddsa_certificate_and_never_takes_it_for_an_rsa_keys(pki: Path, tmp_path: Path) -> None:
    """Not an internal error (an EdDSA key has neither a size nor numbers): listed without a size, and not the
    certificate of the decryption key it lies beside."""
    (tmp_path / "enc.key").write_bytes((pki / "gateway-enc.key").read_bytes())
    known = eddsa_certificate(tmp_path / "known.pem")
    eddsa_certificate(tmp_path / "enc.pem")
    doc = route_doc(pki, "rsa", rsa={"decryption_key": str(tmp_path / "enc.key"), "known_certificates": [str(known)]})
    items = {i.use: i for i in inventory.route_items(Route.model_validate(with_upstream(doc)))}
    assert (items["known_signer"].algorithm, items["known_signer"].size) == ("X.509", None)
    assert items["decryption"].size == 2048 and items["decryption"].certificate is None
