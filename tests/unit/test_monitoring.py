"""The dashboard against Grafana's dashboard schema (the models grafana-foundation-sdk generates from it: a key the
schema does not know is dropped on the way through, and shows here), the alerting rules with promtool (Debian's
prometheus package): checked, and fired on series the gateway exports; `wsgate render --out` writes both."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

from gateway.control import monitoring

REPO = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool")


def missing(doc: Any, schema_view: Any, path: str = "") -> list[str]:
    """The parts of `doc` that are not in `schema_view` as they are."""
    if isinstance(doc, dict):
        if not isinstance(schema_view, dict):
            return [path]
        return [p for k, v in doc.items() for p in (missing(v, schema_view[k], f"{path}.{k}")
                                                     if k in schema_view else [f"{path}.{k}"])]  # fmt: skip
    if isinstance(doc, list):
        if not isinstance(schema_view, list) or len(doc) != len(schema_view):
            return [path]
        return [p for i, (a, b) in enumerate(zip(doc, schema_view, strict=True)) for p in missing(a, b, f"{path}[{i}]")]
    return [] if doc == schema_view else [path]


def test_the_dashboard_holds_only_what_grafanas_schema_defines() -> None:
    doc = monitoring.dashboard()
    through = json.loads(json.dumps(Dashboard.from_json(doc), cls=JSONEncoder))
    assert missing(doc, through) == []
    # The check itself: a field the schema lacks is caught.
    assert missing({**doc, "colour": "blue"}, through) == [".colour"]


def test_every_panel_queries_prometheus_by_the_chosen_data_source() -> None:
    doc = monitoring.dashboard()
    assert [v["type"] for v in doc["templating"]["list"]] == ["datasource"]
    titles = [p["title"] for p in doc["panels"]]
    for wanted in ("Refusals by class", "Latency by stage", "Quota rejections", "Certificate expiry",
                   "worker restarts", "Redis"):  # fmt: skip
        assert any(wanted.lower() in t.lower() for t in titles), wanted
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"])
    assert all(t["datasource"] == monitoring.DATASOURCE for p in doc["panels"] for t in p["targets"])


def promtool() -> str:
    assert PROMTOOL, "promtool is needed: apt-get install prometheus (.ci/run does)"
    return PROMTOOL


def test_promtool_accepts_the_alerting_rules(tmp_path: Path) -> None:
    rules = tmp_path / monitoring.ALERTS_FILE
    rules.write_text(monitoring.render()[monitoring.ALERTS_FILE])
    run = subprocess.run([promtool(), "check", "rules", rules], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(monitoring.alert_rules()['groups'][0]['rules'])} rules found" in run.stdout


def test_the_alerts_fire_on_the_series_the_gateway_exports(tmp_path: Path) -> None:
    (tmp_path / monitoring.ALERTS_FILE).write_text(monitoring.render()[monitoring.ALERTS_FILE])
    worker = 'instance="w:9102"'
    expiry_in_10_days = 10 * 86400 + 600  # promtool's clock starts at 0
    cases = {
        "rule_files": [monitoring.ALERTS_FILE],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": f'wsgate_certificate_not_after_seconds{{route="rsa",use="signing",{worker}}}',
                 "values": f"{expiry_in_10_days}x120"},
                {"series": f"wsgate_body_bytes_in_flight{{{worker}}}", "values": "0x120"},
                {"series": f"process_start_time_seconds{{{worker}}}", "values": "1 2 3 4 4 4 4 4 4 4"},
                {"series": f'wsgate_frame_replay_checks_total{{outcome="unavailable",{worker}}}',
                 "values": "0 0 0 5 10 15 20"},
                {"series": 'envoy_cluster_ratelimit_quota_caller_over_limit{envoy_cluster_name="upstream_rsa"}',
                 "values": "0+120x60"},
            ],
            "alert_rule_test": [
                {"eval_time": "90m", "alertname": "WsgateCertificateExpiresSoon", "exp_alerts": [
                    {"exp_labels": {"severity": "warning", "route": "rsa", "use": "signing"},
                     "exp_annotations": {"summary": "The signing certificate of route rsa expires within 14 days"}}]},
                {"eval_time": "90m", "alertname": "WsgateCertificateExpiring", "exp_alerts": []},
                {"eval_time": "5m", "alertname": "WsgateWorkerRestarts", "exp_alerts": [
                    {"exp_labels": {"severity": "warning", "instance": "w:9102"},
                     "exp_annotations": {"summary": "Filter worker w:9102 restarted over twice in 30 minutes "
                                                    "(crashes or memory recycling)"}}]},
                {"eval_time": "6m", "alertname": "WsgateRedisUnavailable", "exp_alerts": [
                    {"exp_labels": {"severity": "critical"},
                     "exp_annotations": {"summary": "Replay checks cannot reach Redis: signed requests are refused "
                                                    "(fail closed)"}}]},
                {"eval_time": "50m", "alertname": "WsgateQuotaRejections", "exp_alerts": [
                    {"exp_labels": {"severity": "info", "envoy_cluster_name": "upstream_rsa"},
                     "exp_annotations": {"summary": "Callers of upstream_rsa are over their quotas (docs/quotas.md)"}}]},
            ],
        }],
    }  # fmt: skip
    (tmp_path / "cases.yaml").write_text(yaml.safe_dump(cases, sort_keys=False))
    run = subprocess.run([promtool(), "test", "rules", "cases.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_render_writes_the_dashboard_and_alerts_beside_envoys_files(tmp_path: Path) -> None:
    wsgate = Path(sys.executable).with_name("wsgate")
    subprocess.run([wsgate, "render", "--policies", REPO / "policies", "--out", tmp_path], check=True,
                   capture_output=True)  # fmt: skip
    assert json.loads((tmp_path / monitoring.DASHBOARD_FILE).read_text()) == monitoring.dashboard()
    assert yaml.safe_load((tmp_path / monitoring.ALERTS_FILE).read_text()) == monitoring.alert_rules()
    assert (tmp_path / "lds.yaml").exists()
