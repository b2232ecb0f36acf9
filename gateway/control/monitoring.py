"""What an operator watches, as files `wsgate render --out DIR` writes beside Envoy's: a Grafana dashboard
(wsgate-dashboard.json; Prometheus data source chosen on import) and Prometheus alerting rules
(wsgate-alerts.yaml), described in docs/tracing.md "Dashboards and alerts". Both read the metrics the gateway exports: the filter workers' (filters/engine/metrics.py,
the frame's counters in filters/worker.py) and Envoy's (/stats/prometheus on its admin port). Labels are the
gateway's own bounded ones (route, profile, stage, reason, use), never a caller's."""

from __future__ import annotations

import json
from typing import Any

import yaml

DASHBOARD_FILE = "wsgate-dashboard.json"
ALERTS_FILE = "wsgate-alerts.yaml"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "5m"
# A worker is the process that exports the frame's body budget: restarts are counted on those only.
WORKER = "on (instance) group by (instance) (wsgate_body_bytes_in_flight)"
QUOTA_REJECTIONS = (
    f"sum by (envoy_cluster_name) (rate(envoy_cluster_ratelimit_quota_caller_over_limit[{RATE}])"
    f" or rate(envoy_cluster_ratelimit_quota_address_over_limit[{RATE}]))"
)
QUOTA_ERRORS = (
    f"sum(rate(envoy_cluster_ratelimit_quota_caller_error[{RATE}])"
    f" or rate(envoy_cluster_ratelimit_quota_address_error[{RATE}]))"
)

# (title, unit, [(expression, legend)]) per panel, in reading order.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Requests by route and outcome", "reqps",
     [(f"sum by (route, phase, outcome) (rate(wsgate_requests_total[{RATE}]))", "{{route}} {{phase}} {{outcome}}")]),
    ("Refusals by class", "reqps", [(f"sum by (reason) (rate(wsgate_faults_total[{RATE}]))", "{{reason}}")]),
    ("Latency by stage (p95)", "s",
     [(f"histogram_quantile(0.95, sum by (stage, le) (rate(wsgate_stage_seconds_bucket[{RATE}])))", "{{stage}}")]),
    ("Request latency through Envoy (p50, p99)", "ms",
     [(f"histogram_quantile({q}, sum by (le) (rate(envoy_http_downstream_rq_time_bucket[{RATE}])))", f"p{q * 100:g}")
      for q in (0.5, 0.99)]),
    ("Quota rejections by route", "reqps", [(QUOTA_REJECTIONS, "{{envoy_cluster_name}}")]),
    ("Certificate expiry (days left)", "d",
     [("(min by (route, use) (wsgate_certificate_not_after_seconds) - time()) / 86400", "{{route}} {{use}}")]),
    ("Filter worker restarts", "short",
     [(f"sum(changes(process_start_time_seconds[1h]) and {WORKER})", "restarts in the last hour")]),
    ("Redis (replay store) health", "short",
     [(f"sum by (outcome) (rate(wsgate_frame_replay_checks_total[{RATE}]))", "replay checks {{outcome}}"),
      (QUOTA_ERRORS, "rate-limit service errors")]),
    ("Body bytes in flight", "bytes", [("sum(wsgate_body_bytes_in_flight)", "in flight")]),
]  # fmt: skip


def _panel(i: int, title: str, unit: str, queries: list[tuple[str, str]]) -> dict[str, Any]:
    return {
        "id": i + 1,
        "type": "timeseries",
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
        "targets": [
            {"refId": chr(ord("A") + n), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
            for n, (expr, legend) in enumerate(queries)
        ],
    }


def dashboard() -> dict[str, Any]:
    return {
        "uid": "wsgate-gateway",
        "title": "WSGate",
        "description": "Refusals, latency by stage, quotas, certificates, workers and Redis (docs/tracing.md)",
        "tags": ["wsgate"],
        "timezone": "utc",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [{"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"}]
        },
        "annotations": {"list": []},
        "panels": [_panel(i, *p) for i, p in enumerate(PANELS)],
    }


def _alert(name: str, expr: str, for_: str, severity: str, summary: str) -> dict[str, Any]:
    return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
            "annotations": {"summary": summary}}  # fmt: skip


def alert_rules() -> dict[str, Any]:
    days = "(min by (route, use) (wsgate_certificate_not_after_seconds) - time()) / 86400"
    rules = [
        _alert("WsgateRefusalsHigh",
               f"sum by (route) (rate(wsgate_faults_total[{RATE}])) / sum by (route) "
               f"(rate(wsgate_requests_total{{phase=\"request\"}}[{RATE}])) > 0.2",
               "10m", "warning", "Over 20% of route {{ $labels.route }}'s requests are refused: an attack, or a client "
               "or key change (the workers' log has each reason)"),
        _alert("WsgateStageSlow",
               f"histogram_quantile(0.99, sum by (route, stage, le) (rate(wsgate_stage_seconds_bucket[{RATE}]))) > 0.25",
               "10m", "warning", "Stage {{ $labels.stage }} on route {{ $labels.route }} takes over 250 ms at p99"),
        _alert("WsgateQuotaRejections", f"{QUOTA_REJECTIONS} > 1", "15m", "info",
               "Callers of {{ $labels.envoy_cluster_name }} are over their quotas (docs/quotas.md)"),
        _alert("WsgateRateLimitServiceFailing", f"{QUOTA_ERRORS} > 0", "2m", "critical",
               "The rate-limit service does not answer: requests on routes with quotas are refused (503)"),
        _alert("WsgateCertificateExpiresSoon", f"{days} < 14", "1h", "warning",
               "The {{ $labels.use }} certificate of route {{ $labels.route }} expires within 14 days"),
        _alert("WsgateCertificateExpiring", f"{days} < 3", "5m", "critical",
               "The {{ $labels.use }} certificate of route {{ $labels.route }} expires within 3 days"),
        _alert("WsgateWorkerRestarts", f"changes(process_start_time_seconds[30m]) > 2 and {WORKER}", "0m", "warning",
               "Filter worker {{ $labels.instance }} restarted over twice in 30 minutes (crashes or memory recycling)"),
        _alert("WsgateRedisUnavailable",
               f"sum(increase(wsgate_frame_replay_checks_total{{outcome=\"unavailable\"}}[{RATE}])) > 0",
               "1m", "critical", "Replay checks cannot reach Redis: signed requests are refused (fail closed)"),
    ]  # fmt: skip
    return {"groups": [{"name": "wsgate", "rules": rules}]}


def render() -> dict[str, str]:
    return {
        DASHBOARD_FILE: json.dumps(dashboard(), indent=2) + "\n",
        ALERTS_FILE: yaml.safe_dump(alert_rules(), sort_keys=False, width=200),
    }
