"""Tracing through the running gateway into a real collector (Jaeger v2, tests/support/collector.py): one trace
per request with Envoy's spans and the filter worker's, a trusted caller's traceparent continued, a stranger's
ignored, and nothing of the message, keys or identity in any span (docs/tracing.md)."""

from __future__ import annotations

import http.client
import io
import json
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest import tracing_ab
from tests.support.collector import Collector, jaeger
from tests.support.harness import GatewayFactory, LiveGateway
from tests.support.wss_helpers import echo, route_doc

TRUSTED = "127.0.0.2"  # a loopback address of its own: the one trusted caller


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collector]:
    with jaeger(tmp_path_factory.mktemp("jaeger")) as c:
        yield c


@pytest.fixture(scope="module")
def traced(module_gateway: GatewayFactory, pki: Path, collector: Collector) -> LiveGateway:
    edge = {"tracing": {"collector": collector.otlp, "sampling_percent": 100, "trusted_callers": [f"{TRUSTED}/32"]}}
    return module_gateway([route_doc(pki, "rsa", name="rsa", replay={"store": "auto"})], edge=edge)


def post_from(g: LiveGateway, source: str, body: bytes, headers: dict[str, str] | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", g.opts.http_port, timeout=10, source_address=(source, 0))
    try:
        conn.request("POST", "/rsa/demo", body, {"content-type": "text/xml; charset=utf-8", **(headers or {})})
        return conn.getresponse().status
    finally:
        conn.close()


def services(trace: dict) -> dict[str, str]:
    return {pid: p["serviceName"] for pid, p in trace["processes"].items()}


def test_one_trace_holds_envoys_and_the_workers_stage_spans(traced: LiveGateway, collector: Collector) -> None:
    trace_id = secrets.token_hex(16)
    body, _ = traced.client("rsa").secure(echo("pay 4711 to Mallory"))
    parent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
    assert post_from(traced, TRUSTED, body, {"traceparent": parent}) == 200
    trace = _wait_trace(collector, trace_id, {"wsgate.response"})
    names = {s["operationName"] for s in trace["spans"]}
    assert {"wsgate.request", "wsgate.response", "parse", "security_header", "signature_check", "serialize",
            "secure"} <= names  # fmt: skip
    by_id = {s["spanID"]: s for s in trace["spans"]}
    who = services(trace)
    request = next(s for s in trace["spans"] if s["operationName"] == "wsgate.request")
    ext_proc = by_id[request["references"][0]["spanID"]]
    assert who[request["processID"]] == "wsgate-filter" and who[ext_proc["processID"]] == "wsgate-envoy"
    assert "ExternalProcessor" in ext_proc["operationName"]
    ingress = by_id[ext_proc["references"][0]["spanID"]]
    assert ingress["operationName"] == "ingress" and ingress["references"][0]["spanID"] == parent.split("-")[2]
    upstream = next(s for s in trace["spans"] if s["operationName"] == "router upstream_rsa egress")
    assert upstream["references"][0]["spanID"] == ingress["spanID"]  # the backend's time, in the same trace
    stage = next(s for s in trace["spans"] if s["operationName"] == "signature_check")
    assert by_id[stage["references"][0]["spanID"]]["operationName"] == "security_header"
    # Nothing of the message, the caller or a key: only fixed-set attributes.
    text = json.dumps(trace)
    assert "4711" not in text and "Mallory" not in text and "Demo Client" not in text and "BEGIN" not in text


def _wait_trace(collector: Collector, trace_id: str, needs: set[str], timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        for trace in collector.traces("wsgate-envoy"):
            if trace["traceID"] == trace_id and needs <= {s["operationName"] for s in trace["spans"]}:
                return trace
        if time.monotonic() > deadline:
            raise AssertionError(f"no complete trace {trace_id} in the collector")
        time.sleep(0.2)


def test_a_strangers_traceparent_is_ignored(traced: LiveGateway, collector: Collector) -> None:
    chosen = secrets.token_hex(16)
    body, _ = traced.client("rsa").secure(echo("hello"))
    before = len(collector.traces("wsgate-envoy"))
    assert post_from(traced, "127.0.0.1", body, {"traceparent": f"00-{chosen}-{secrets.token_hex(8)}-01"}) == 200
    traces = collector.wait_for("wsgate-envoy", before + 1)
    assert len(traces) == before + 1  # traced (100%)...
    assert all(t["traceID"] != chosen for t in traces)  # ...under Envoy's own trace id
    assert all(t["traceID"] != chosen for t in collector.traces("wsgate-filter"))


def test_an_unsampled_trace_costs_the_worker_no_span(traced: LiveGateway, collector: Collector) -> None:
    """A trusted caller's unsampled traceparent (flags 00): no span anywhere, the worker's neither (the frame gives
    the engine a traceparent only when it is sampled), while the same caller's sampled one is."""
    unsampled = secrets.token_hex(16)
    body, _ = traced.client("rsa").secure(echo("hello"))
    assert post_from(traced, TRUSTED, body, {"traceparent": f"00-{unsampled}-{secrets.token_hex(8)}-00"}) == 200
    assert unsampled not in _ids_after_sampled(traced, collector)


def malformed(trace: str, span: str) -> list[str]:
    """A trusted caller's traceparents naming `trace`, each sampled were it well formed. (Envoy takes upper-case
    hex and version ff as well formed: the trusted caller's own trace, which it may choose anyway; the frame's own
    parse of the ext_proc span's is tested in filters/frame/src/service.rs.)"""
    return [f"00-{trace}-{span}-01-more",  # version 00 has no more fields
            f"00-{trace}-{span}-1", f"00-{trace}-{span}-x1", f"00-{trace}-{span}", f"00-{trace}--01",
            f"00-{trace}-{span[:-1]}-01", f"00-{trace}-{span}-01,00-{trace}-{span}-01"]  # fmt: skip


def test_a_malformed_traceparent_cannot_fault_or_choose_the_trace(traced: LiveGateway, collector: Collector) -> None:
    """From a trusted caller, a malformed traceparent is ignored: the request passes (no fault) and is traced
    under Envoy's own trace id, never the one it names."""
    chosen = {}
    for i in range(len(malformed("", ""))):
        trace = secrets.token_hex(16)
        chosen[trace] = value = malformed(trace, secrets.token_hex(8))[i]  # the collector shows ids in lower case
        body, _ = traced.client("rsa").secure(echo("hello"))
        assert post_from(traced, TRUSTED, body, {"traceparent": value}) == 200, value
    traced_ids = _ids_after_sampled(traced, collector)
    assert not [value for trace, value in chosen.items() if trace in traced_ids]


def _ids_after_sampled(traced: LiveGateway, collector: Collector) -> set[str]:
    """The collector's trace ids (Envoy's and the workers') once a trusted caller's sampled request is traced by the
    worker: the spans of the requests before it were exported before it or with it."""
    trace = secrets.token_hex(16)
    body, _ = traced.client("rsa").secure(echo("hello"))
    assert post_from(traced, TRUSTED, body, {"traceparent": f"00-{trace}-{secrets.token_hex(8)}-01"}) == 200
    _wait_trace(collector, trace, {"wsgate.request", "wsgate.response"})
    return {t["traceID"] for service in ("wsgate-envoy", "wsgate-filter") for t in collector.traces(service)}


@pytest.mark.skipif(shutil.which("wrk") is None, reason="Debian's wrk is not installed (.ci/run installs it)")
def test_the_bench_row_measures_tracing_on_beside_off_in_one_run(
    tmp_path: Path, pki: Path, collector: Collector
) -> None:
    """loadtest/tracing_ab.py (issue 27's bench row): two gateways at once, slices of load alternating between
    them, a ratio per pair and the target line; the traced one's spans reach the collector. Last in this module:
    it floods the collector. A smoke run, never a measure."""
    log = io.StringIO()
    ratios = tracing_ab.run(collector.otlp, 100.0, ("hmac",), pairs=2, slice_s=1, workers=1, out=tmp_path,
                            certs=pki, log=log)  # fmt: skip
    assert len(ratios["hmac"]) == 2 and all(r > 0 for r in ratios["hmac"]), log.getvalue()
    assert re.search(r"#27 target: .* 100% sampling: \d\.\d{3}x \(hmac, the dearest\) -> (met|MISSED)", log.getvalue())
    routes = {tag["value"] for t in collector.traces("wsgate-filter") for s in t["spans"] for tag in s["tags"]
              if tag["key"] == "wsgate.route"}  # fmt: skip
    assert "hmac" in routes
