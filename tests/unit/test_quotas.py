"""Quotas in the model and their rendering: the route's rate-limit descriptors, the rate-limit service's
configuration, the filters' order around ext_proc, and the operation a verified request is counted under.
Through the running gateway: tests/e2e/test_quotas_e2e.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from filters.engine import ns
from filters.engine.xml import header_blocks
from gateway.control import envoy_config, rate_limit
from gateway.policy import OPERATION_HEADER, PolicyError, PolicySet, load_dir
from tests.support.wss_helpers import make_route, route_doc
from tests.unit.test_envoy_config import assert_envoy_accepts
from tests.unit.test_header_blocks import env_with, signed

REPO = Path(__file__).resolve().parents[2]
QUOTAS = {
    "client_address": {"per_second": 20},
    "caller": {"per_second": 5, "per_day": 1000},
    "operations": {"urn:pay": {"per_day": 10}, "urn:balance": {"per_second": 2, "per_day": 50}},
    "backend": {"per_second": 100},
}


def policies(pki: Path, **quotas: object) -> PolicySet:
    route = make_route(pki, "rsa", name="rsa", quotas=quotas or QUOTAS)
    return PolicySet(routes=[route], sources={"rsa": "rsa.yaml"})


def test_caller_quotas_on_a_profile_that_verifies_no_caller_are_refused(tmp_path: Path) -> None:
    doc = {"name": "plain", "match": {"path_prefix": "/p/"}, "upstream": {"address": "127.0.0.1:1"},
           "profile": "xml", "quotas": {"caller": {"per_second": 1}}}  # fmt: skip
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"routes": [doc]}))
    with pytest.raises(PolicyError, match=r"route plain: field quotas\.caller: the xml profile verifies no caller"):
        load_dir(tmp_path)
    doc["quotas"] = {"client_address": {"per_second": 1}, "backend": {"per_day": 10}}  # counted without a caller
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"routes": [doc]}))
    assert load_dir(tmp_path).route("plain").quotas.enabled


@pytest.mark.parametrize(
    ("quotas", "field", "message"),
    [
        ({"caller": {}}, "quotas.caller", "needs per_second, per_day or both"),
        ({"caller": {"per_second": 0}}, "quotas.caller.per_second", "greater than 0"),
        # the rate-limit service's uint32: a larger limit fails its whole configuration (every request 503)
        ({"caller": {"per_day": 2**32}}, "quotas.caller.per_day", "less than or equal to 4294967295"),
        ({"operations": {"urn:a": {"per_day": 1}}}, "quotas.operations", "identity_header"),
    ],
)
def test_quota_errors_name_the_field(tmp_path: Path, pki: Path, quotas: dict, field: str, message: str) -> None:
    doc = route_doc(pki, "rsa", name="rsa", quotas=quotas, identity_header=None)
    doc["upstream"] = {"address": "127.0.0.1:1"}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({"routes": [doc]}))
    with pytest.raises(PolicyError, match=rf"route rsa: field {field}: .*{message}"):
        load_dir(tmp_path)


def test_descriptors_count_the_verified_identity_and_operation_headers(pki: Path) -> None:
    entries = rate_limit.route_rate_limits(policies(pki).routes[0])
    by_quota = {e["actions"][1]["generic_key"]["descriptor_value"]: e for e in entries}
    assert set(by_quota) == {"client_address-second", "caller-second", "caller-day", "operation-second",
                             "operation-day", "backend-second"}  # fmt: skip
    assert by_quota["client_address-second"]["stage"] == rate_limit.ADDRESS_STAGE
    assert by_quota["client_address-second"]["actions"][2] == {"remote_address": {}}
    assert {e["stage"] for q, e in by_quota.items() if not q.startswith("client_address")} == {rate_limit.CALLER_STAGE}
    caller = {"request_headers": {"header_name": "x-wsgate-subject", "descriptor_key": "caller"}}
    assert by_quota["caller-day"]["actions"][2:] == [caller]
    operation = {"request_headers": {"header_name": OPERATION_HEADER, "descriptor_key": "operation"}}
    assert by_quota["operation-day"]["actions"][2:] == [operation, caller]


def test_the_service_configuration_has_one_bucket_per_caller_and_operation(pki: Path) -> None:
    doc = yaml.safe_load(rate_limit.service_config(policies(pki)))
    assert doc["domain"] == rate_limit.DOMAIN
    (route,) = doc["descriptors"]
    tree = {d["value"]: d for d in route["descriptors"]}
    assert tree["caller-day"]["descriptors"] == [
        {"key": "caller", "rate_limit": {"unit": "day", "requests_per_unit": 1000}}
    ]  # no value: each caller its own count
    ops = {o["value"]: o["descriptors"][0]["rate_limit"] for o in tree["operation-day"]["descriptors"]}
    assert ops == {"urn:pay": {"unit": "day", "requests_per_unit": 10},
                   "urn:balance": {"unit": "day", "requests_per_unit": 50}}  # fmt: skip
    assert [o["value"] for o in tree["operation-second"]["descriptors"]] == ["urn:balance"]
    assert tree["backend-second"]["rate_limit"] == {"unit": "second", "requests_per_unit": 100}


def test_address_limits_run_before_the_filter_and_caller_limits_after_it(pki: Path) -> None:
    files = envoy_config.render(policies(pki), envoy_config.Topology())
    for listener in yaml.safe_load(files["lds.yaml"])["resources"]:
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        names = [f["name"] for f in hcm["http_filters"]]
        assert names.index(f"{rate_limit.FILTER}.quota_address") < names.index(envoy_config.EXT_PROC)
        assert names.index(envoy_config.EXT_PROC) < names.index(f"{rate_limit.FILTER}.quota_caller")
        assert names[-1] == "envoy.filters.http.router"
        for f in hcm["http_filters"]:
            if f["name"].startswith(rate_limit.FILTER):
                assert f["typed_config"]["failure_mode_deny"] is True  # no answer: refused, never unmetered
        entry = next(r for r in hcm["route_config"]["virtual_hosts"][0]["routes"] if "route" in r)
        assert entry["route"]["rate_limits"] == rate_limit.route_rate_limits(policies(pki).routes[0])
        assert OPERATION_HEADER in entry["request_headers_to_remove"]  # never reaches the backend
    assert rate_limit.CLUSTER in files["cds.yaml"]


def test_no_quota_no_rate_limit_filter_nor_service(pki: Path) -> None:
    route = make_route(pki, "rsa", name="rsa")
    files = envoy_config.render(PolicySet(routes=[route], sources={"rsa": "r"}), envoy_config.Topology())
    assert rate_limit.FILTER not in files["lds.yaml"] and rate_limit.CLUSTER not in files["cds.yaml"]


def test_envoy_accepts_the_quota_configuration(tmp_path: Path, pki: Path) -> None:
    topo = envoy_config.Topology(certs_dir=str(pki), config_dir=str(tmp_path))
    files = envoy_config.render(policies(pki), topo)
    envoy_config.write(files, tmp_path)
    assert_envoy_accepts(files, tmp_path)


@pytest.mark.parametrize(
    ("blocks", "covers", "headers", "expected"),
    [
        (f'<wsa:Action xmlns:wsa="{ns.WSA}">urn:signed</wsa:Action>', ("Action",), {}, "urn:signed"),
        (
            f'<wsa:Action xmlns:wsa="{ns.WSA}">urn:signed</wsa:Action>',
            ("Action",),
            {"soapaction": '"urn:signed"'},
            "urn:signed",
        ),
        ("", (), {"soapaction": '"urn:claimed"'}, "urn:claimed"),
        ("", (), {"content-type": 'application/soap+xml; action="urn:twelve"'}, "urn:twelve"),
        # An unsigned wsa:Action names nothing; a value that is not a plain header value is not counted under.
        (f'<wsa:Action xmlns:wsa="{ns.WSA}">urn:unsigned</wsa:Action>', (), {}, None),
        ("", (), {"soapaction": "urn:caf\u00e9"}, None),
        ("", (), {"soapaction": ""}, None),
    ],
)
def test_the_operation_is_the_signed_action_else_the_one_the_request_names(
    blocks: str, covers: tuple[str, ...], headers: dict[str, str], expected: str | None
) -> None:
    env = env_with(blocks) if blocks else env_with("<t:T xmlns:t='urn:t'/>")
    assert header_blocks.operation(env, signed(*covers), headers) == expected  # type: ignore[arg-type]


def test_the_service_settings_point_at_the_shared_redis(tmp_path: Path) -> None:
    tcp = rate_limit.environment("127.0.0.1:8089", tmp_path, "redis://:secret@redis.internal:6380/0")
    assert (tcp["REDIS_SOCKET_TYPE"], tcp["REDIS_URL"], tcp["GRPC_PORT"]) == ("tcp", "redis.internal:6380", "8089")
    assert tcp["REDIS_AUTH"] == "secret"
    unix = rate_limit.environment("127.0.0.1:8089", tmp_path, "unix:///run/wsgate/redis.sock")
    assert (unix["REDIS_SOCKET_TYPE"], unix["REDIS_URL"]) == ("unix", "/run/wsgate/redis.sock")


def test_render_writes_the_service_configuration_beside_envoys(tmp_path: Path, pki: Path) -> None:
    policies_dir = tmp_path / "policies"
    policies_dir.mkdir()
    doc = route_doc(pki, "rsa", name="rsa", quotas=QUOTAS)
    doc["upstream"] = {"address": "127.0.0.1:1"}
    (policies_dir / "r.yaml").write_text(yaml.safe_dump({"routes": [doc]}))
    out = tmp_path / "out"
    wsgate = Path(sys.executable).with_name("wsgate")
    subprocess.run([wsgate, "render", "--policies", policies_dir, "--out", out], check=True, capture_output=True)
    written = out / "ratelimit" / rate_limit.CONFIG_FILE
    assert written.read_text() == rate_limit.service_config(load_dir(policies_dir))


def test_compose_render_always_writes_the_service_configuration(tmp_path: Path, pki: Path) -> None:
    """Compose always runs the service: with quotas their limits, without any an empty domain (so a roll that
    removes the last quota leaves no stale limit behind); Envoy's cluster names the Compose service."""
    policies_dir = tmp_path / "policies"
    policies_dir.mkdir()
    doc = route_doc(pki, "rsa", name="rsa", quotas=QUOTAS, replay={"store": "redis"})
    doc["upstream"] = {"address": "127.0.0.1:1"}
    wsgate = Path(sys.executable).with_name("wsgate")
    for quotas in (QUOTAS, None):
        if quotas:
            doc["quotas"] = quotas
        else:
            del doc["quotas"]
        (policies_dir / "r.yaml").write_text(yaml.safe_dump({"routes": [doc]}))
        out = tmp_path / f"out-{bool(quotas)}"
        subprocess.run([wsgate, "render", "--policies", policies_dir, "--target", "compose", "--out", out],
                       check=True, capture_output=True)  # fmt: skip
        written = yaml.safe_load((out / "ratelimit" / rate_limit.CONFIG_FILE).read_text())
        assert written == yaml.safe_load(rate_limit.service_config(load_dir(policies_dir)))
        assert bool(written["descriptors"]) == bool(quotas)
        assert (
            f"address: {envoy_config.compose_topology().ratelimit.split(':')[0]}" in (out / "cds.yaml").read_text()
        ) == bool(quotas)


def test_the_bench_variant_counts_every_request_and_refuses_none(tmp_path: Path, monkeypatch) -> None:
    from loadtest import variants

    monkeypatch.setenv("WSGATE_BENCH_CERTS", "certs/out")
    out = variants.write(REPO / "loadtest" / "policies", tmp_path, "127.0.0.1:4318", 1.0, quotas=True)
    ps = load_dir(out)
    assert ps.edge.tracing is not None and ps.edge.tracing.sampling_percent == 1.0
    for r in ps.routes:
        assert r.quotas.client_address and r.quotas.backend
        assert (r.quotas.caller is not None) == r.detects_replays


def test_the_soak_flood_route_is_the_xml_route_with_a_per_address_quota(tmp_path: Path, monkeypatch) -> None:
    from loadtest import variants

    monkeypatch.setenv("WSGATE_BENCH_CERTS", "certs/out")
    out = variants.write(REPO / "loadtest" / "policies", tmp_path, None, 1.0, quotas=True)
    prefix = variants.add_flood_route(out, "xml", 5)
    ps = load_dir(out)
    flood, xml = ps.route(variants.FLOOD_ROUTE), ps.route("xml")
    assert flood.match.path_prefix == prefix and flood.profile == xml.profile and flood.upstream == xml.upstream
    assert flood.quotas.client_address is not None and flood.quotas.client_address.units() == [("second", 5)]
    assert "flood" in rate_limit.service_config(ps)
    with pytest.raises(ValueError, match="no route"):
        variants.add_flood_route(out, "missing", 5)
