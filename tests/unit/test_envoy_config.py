"""The Envoy configuration is rendered from the policies, deterministically, and Envoy accepts it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.control import envoy_config
from gateway.policy import load_dir
from tests.support.harness import write_policies

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
TOPO = envoy_config.Topology(certs_dir="/etc/wsgate/certs", config_dir="/etc/wsgate/envoy")


def render_repo() -> dict[str, str]:
    os.environ.pop("BACKEND_ADDR", None)
    return envoy_config.render(load_dir(REPO / "policies"), TOPO)


def test_render_matches_golden_files() -> None:
    """Regenerate with: WSGATE_UPDATE_GOLDEN=1 pytest tests/unit/test_envoy_config.py"""
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
    assert_envoy_accepts(files, tmp_path)


def assert_envoy_accepts(files: dict[str, str], tmp_path: Path) -> None:
    """Envoy's own validation of a rendered configuration (its key files must exist where it names them)."""
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
        buffered = policy.touches_xml and not policy.streams_bodies
        assert entry.get("request_body_buffer_limit") == (wanted if buffered else None)
    for listener in yaml.safe_load(files["lds.yaml"])["resources"]:
        assert listener["per_connection_buffer_limit_bytes"] == envoy_config.CONNECTION_BUFFER_BYTES


def test_routes_taking_attachments_are_streamed_both_ways_and_others_buffered(tmp_path: Path) -> None:
    """Envoy streams a route's bodies to the frame (which holds them until the verdict) only where it takes
    attachments and does not ask for `streamed: false`; such a route buffers nothing in Envoy. Every other XML
    route keeps the filter's BUFFERED mode."""
    routes = [{"name": n, "match": {"path_prefix": f"/{n}/"}, "upstream": {"address": "127.0.0.1:1"}, "profile": "xml",
               **extra} for n, extra in (("docs", {"attachments": {"accept": True}}), ("soap", {}),
                                         ("legacy", {"attachments": {"accept": True, "streamed": False}}))]  # fmt: skip
    files = envoy_config.render(load_dir(write_policies(tmp_path, routes)), TOPO)
    by_name = {r["name"]: r for r in routes_of(files)[0]["virtual_hosts"][0]["routes"] if "route" in r}
    overrides = by_name["docs"]["typed_per_filter_config"][envoy_config.EXT_PROC]["overrides"]
    assert overrides["processing_mode"] == envoy_config.STREAMED_MODE
    assert {overrides["processing_mode"][f"{d}_body_mode"] for d in ("request", "response")} == {"FULL_DUPLEX_STREAMED"}
    assert {overrides["processing_mode"][f"{d}_trailer_mode"] for d in ("request", "response")} == {"SEND"}
    assert "request_body_buffer_limit" not in by_name["docs"]
    for buffered in ("soap", "legacy"):  # `streamed: false`: a backend that needs content-length gets it
        entry = by_name[buffered]
        assert "processing_mode" not in entry["typed_per_filter_config"][envoy_config.EXT_PROC]["overrides"]
        assert entry["request_body_buffer_limit"] == 10 * 1024 * 1024
    # A streamed route's backend is read in small pieces (each chunk the frame copies is held twice a moment); a
    # buffered route's reply must fit whole.
    clusters = {c["name"]: c for c in yaml.safe_load(files["cds.yaml"])["resources"]}
    assert clusters["upstream_docs"]["per_connection_buffer_limit_bytes"] == envoy_config.STREAMED_UPSTREAM_BUFFER_BYTES
    for buffered in ("soap", "legacy"):
        assert clusters[f"upstream_{buffered}"]["per_connection_buffer_limit_bytes"] == 10 * 1024 * 1024 + 65536


def test_render_cli_prints_all_files() -> None:
    run = subprocess.run([sys.executable, "-m", "gateway.control.cli", "render", "--policies", str(REPO / "policies")],
                         capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert run.returncode == 0, run.stderr
    for name in ("envoy.yaml", "lds.yaml", "cds.yaml"):
        assert f"# ---- {name}" in run.stdout


def hcm_of(files: dict[str, str]) -> list[dict]:
    lds = yaml.safe_load(files["lds.yaml"])
    return [listener["filter_chains"][0]["filters"][0]["typed_config"] for listener in lds["resources"]]


EDGE_POLICY = """
edge:
  request_headers_timeout_s: 2
  request_timeout_s: 7.5
  stream_idle_timeout_s: 40
  connection_idle_timeout_s: 90
  max_request_headers_kb: 32
  max_headers_count: 50
  xff_num_trusted_hops: 1
routes:
  - name: orders
    match: {path_prefix: /orders/}
    upstream: {address: "127.0.0.1:9000"}
    profile: rsa
    identity_header: x-orders-caller
  - name: portal
    match: {path_prefix: /portal/}
    upstream: {address: "127.0.0.1:9000"}
    profile: tls
    tls: {subject_header: x-portal-peer}
"""


def test_edge_settings_come_from_the_policy_on_both_listeners(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(EDGE_POLICY)
    for hcm in hcm_of(envoy_config.render(load_dir(tmp_path), TOPO)):
        assert hcm["request_headers_timeout"] == "2s" and hcm["request_timeout"] == "7.5s"
        assert hcm["stream_idle_timeout"] == "40s" and hcm["common_http_protocol_options"]["idle_timeout"] == "90s"
        assert hcm["max_request_headers_kb"] == 32 and hcm["common_http_protocol_options"]["max_headers_count"] == 50
        assert hcm["use_remote_address"] is True and hcm["xff_num_trusted_hops"] == 1
        mutations = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
        # A trusted proxy in front writes x-forwarded-*: kept. Identity headers never are.
        assert {"remove_on_match": {"key_matcher": {"prefix": "x-forwarded-"}}} not in mutations
        assert {"remove": "x-orders-caller"} in mutations and {"remove": "x-portal-peer"} in mutations


def test_defaults_normalize_paths_and_strip_what_the_gateway_vouches_for() -> None:
    for hcm in hcm_of(render_repo()):
        assert (hcm["normalize_path"], hcm["merge_slashes"]) == (True, True)
        assert hcm["path_with_escaped_slashes_action"] == "REJECT_REQUEST"
        assert hcm["common_http_protocol_options"]["headers_with_underscores_action"] == "DROP_HEADER"
        assert hcm["xff_num_trusted_hops"] == 0 and hcm["request_headers_timeout"] == "10s"
        mutations = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
        matchers = [m["remove_on_match"]["key_matcher"] for m in mutations if "remove_on_match" in m]
        assert {m.get("prefix") for m in matchers} == {"x-wsgate-", "x-envoy-", "x-forwarded-", None}
        odd = next(m["safe_regex"]["regex"] for m in matchers if "safe_regex" in m)
        names = ["x.wsgate.subject", "x-wsgate~subject", "x-wsgate-subject.", "_", "x_y", ":path", "host", "x-ok-1"]
        assert [n for n in names if re.fullmatch(odd, n)] == names[:5]
        assert {m["remove"] for m in mutations if "remove" in m} == {"forwarded", "x-real-ip", "x-client-subject"}
        first = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
        assert first["name"] == "ambiguous-path" and first["direct_response"] == {"status": 400}
        # ext_proc runs only where a route enables it: nothing before routing reaches a filter worker.
        assert hcm["http_filters"][0]["disabled"] is True


@pytest.mark.parametrize(
    ("path", "refused"),
    [("/xml/demo", False), ("/xml/%20%C3%A9/x", False), ("/xml/a;b", True), ("/xml/%3B", True), ("/xml/%25", True),
     ("/xml/%3f", True), ("/xml/%23", True), ("/xml/%09", True), ("/xml/%7F", True), ("/xml/%c0%ae", True),
     ("/xml/%E0%80%AE", True), ("/xml/%F0%80%80%AE", True), ("/xml/%zz", True), ("/xml/%a", True), ("/xml/%", True)],
)  # fmt: skip
def test_ambiguous_path_pattern(path: str, refused: bool) -> None:
    """The pattern Envoy (RE2) applies to the normalized path; Python's re reads this subset the same way."""
    assert bool(re.fullmatch(envoy_config.AMBIGUOUS_PATH, path)) is refused


def test_a_new_route_is_not_refused_for_a_cluster_envoy_has_not_read_yet() -> None:
    """lds.yaml and cds.yaml are applied in no fixed order (seen in Compose: a route added by a policy roll was
    refused, "unknown cluster", and never applied): routes must not make Envoy validate their clusters."""
    lds = yaml.safe_load(render_repo()["lds.yaml"])
    for listener in lds["resources"]:
        for chain in listener["filter_chains"]:
            hcm = chain["filters"][0]["typed_config"]
            assert hcm["route_config"]["validate_clusters"] is False, listener["name"]
