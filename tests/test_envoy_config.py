"""The Envoy configuration is rendered from the policies, deterministically, and Envoy accepts it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from gateway import envoy_config
from gateway.policy import load_dir

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
TOPO = envoy_config.Topology(certs_dir="/etc/wsgate/certs", config_dir="/etc/wsgate/envoy")


def render_repo() -> dict[str, str]:
    os.environ.pop("BACKEND_ADDR", None)
    return envoy_config.render(load_dir(REPO / "policies"), TOPO)


def test_render_matches_golden_files() -> None:
    """Regenerate with: WSGATE_UPDATE_GOLDEN=1 pytest tests/test_envoy_config.py"""
    files = render_repo()
    for name, text in files.items():
        golden = GOLDEN / f"local-{name}"
        if os.environ.get("WSGATE_UPDATE_GOLDEN"):
            golden.write_text(text)
        assert golden.read_text() == text, f"{name} differs from {golden}"


def test_render_is_deterministic() -> None:
    assert render_repo() == render_repo()


def test_envoy_validates_rendered_config(tmp_path: Path, pki: Path) -> None:
    topo = envoy_config.Topology(certs_dir=str(pki), config_dir=str(tmp_path))
    files = envoy_config.render(load_dir(REPO / "policies"), topo)
    envoy_config.write(files, tmp_path)
    envoy = str(Path(sys.executable).with_name("envoy"))
    # validate mode checks the bootstrap; the listener and cluster files are checked by loading them as static.
    doc = yaml.safe_load(files["envoy.yaml"])
    doc.pop("dynamic_resources")
    doc["static_resources"] = {
        "listeners": [
            {k: v for k, v in r.items() if k != "@type"} for r in yaml.safe_load(files["lds.yaml"])["resources"]
        ],
        "clusters": [
            {k: v for k, v in r.items() if k != "@type"} for r in yaml.safe_load(files["cds.yaml"])["resources"]
        ],
    }
    static = tmp_path / "static.yaml"
    static.write_text(yaml.safe_dump(doc))
    run = subprocess.run([envoy, "--mode", "validate", "-c", str(static)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def routes_of(files: dict[str, str]) -> list[dict]:
    lds = yaml.safe_load(files["lds.yaml"])
    out = []
    for listener in lds["resources"]:
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        out.append(hcm["route_config"])
    return out


def test_compose_and_local_render_the_same_routes() -> None:
    ps = load_dir(REPO / "policies")
    local = envoy_config.render(ps, TOPO)
    compose = envoy_config.render(ps, envoy_config.compose_topology())
    assert routes_of(local) == routes_of(compose)
    cds = yaml.safe_load(compose["cds.yaml"])["resources"]
    filt = next(c for c in cds if c["name"] == envoy_config.FILTER_CLUSTER)
    assert filt["type"] == "STRICT_DNS"  # every filter replica behind one name


def test_xml_routes_call_the_filter_and_others_do_not() -> None:
    files = render_repo()
    routes = routes_of(files)[0]["virtual_hosts"][0]["routes"]
    by_name = {r["name"]: r for r in routes if "route" in r}  # the entries that forward
    ext = envoy_config.EXT_PROC
    assert by_name["xml"]["typed_per_filter_config"][ext]["overrides"]["grpc_initial_metadata"] == [
        {"key": "x-wsgate-route", "value": "xml"}
    ]
    assert {"name": ":method", "string_match": {"exact": "POST"}} in by_name["xml"]["match"]["headers"]
    assert by_name["plain"]["typed_per_filter_config"][ext]["disabled"] is True
    # Any other method on an XML route is answered by Envoy, without an ext_proc stream.
    refusal = next(r for r in routes if r["name"] == "xml" and "direct_response" in r)
    assert refusal["direct_response"] == {"status": 405}
    assert refusal["typed_per_filter_config"][ext]["disabled"] is True
    lds = yaml.safe_load(files["lds.yaml"])
    ext_cfg = lds["resources"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"][0]["typed_config"]
    assert ext_cfg["failure_mode_allow"] is False


def test_each_xml_route_buffers_up_to_its_own_limit() -> None:
    """Connections keep Envoy's small default; a route that needs whole bodies raises its own stream's limit to
    its larger direction, so a small route never buffers what a large one may."""
    files = render_repo()
    ps = load_dir(REPO / "policies")
    forwarding = [r for r in routes_of(files)[0]["virtual_hosts"][0]["routes"] if "route" in r]
    assert {r["name"] for r in forwarding} >= {p.name for p in ps.routes if p.touches_xml}
    for entry in forwarding:
        policy = ps.route(entry["name"])
        wanted = max(policy.limits.max_body_bytes, policy.response_limits.max_body_bytes)
        assert entry.get("request_body_buffer_limit") == (wanted if policy.touches_xml else None)
    for listener in yaml.safe_load(files["lds.yaml"])["resources"]:
        assert listener["per_connection_buffer_limit_bytes"] == envoy_config.CONNECTION_BUFFER_BYTES


def test_render_cli_prints_all_files() -> None:
    run = subprocess.run([sys.executable, "-m", "gateway.cli", "render", "--policies", str(REPO / "policies")],
                         capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert run.returncode == 0, run.stderr
    for name in ("envoy.yaml", "lds.yaml", "cds.yaml"):
        assert f"# ---- {name}" in run.stdout
