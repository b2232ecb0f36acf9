"""Tracing in the model and Envoy's configuration: the tracer and its collector, trace headers kept only on the
trusted callers' filter chain, and the worker's spans from the engine's stage hook (no collector here: the spans
are read from an in-memory exporter). Through the running gateway, into a real collector: tests/e2e/test_tracing_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from filters import tracing as worker_tracing
from filters.engine import metrics
from gateway.control import envoy_config, tracing
from gateway.policy import Edge, PolicyError, PolicySet, Tracing, load_dir
from tests.support.wss_helpers import make_route
from tests.unit.test_envoy_config import assert_envoy_accepts

TRACED = Tracing(collector="127.0.0.1:4318", sampling_percent=5, trusted_callers=["10.1.0.0/16"])


def rendered(pki: Path, traced: Tracing | None = TRACED) -> dict[str, str]:
    route = make_route(pki, "rsa", name="rsa")
    policies = PolicySet(routes=[route], sources={"rsa": "r"}, edge=Edge(tracing=traced))
    return envoy_config.render(policies, envoy_config.Topology())


def chains(files: dict[str, str]) -> list[tuple[str, list[dict]]]:
    return [(lis["name"], lis["filter_chains"]) for lis in yaml.safe_load(files["lds.yaml"])["resources"]]


def removed(chain: dict) -> set[str]:
    hcm = chain["filters"][0]["typed_config"]
    mutations = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    return {m["remove"] for m in mutations if "remove" in m}


def test_only_trusted_callers_may_send_trace_headers(pki: Path) -> None:
    for name, (trusted, default) in chains(rendered(pki)):
        assert trusted["filter_chain_match"] == {
            "source_prefix_ranges": [{"address_prefix": "10.1.0.0", "prefix_len": 16}]
        }
        assert "filter_chain_match" not in default
        assert not removed(trusted) & set(tracing.TRACE_HEADERS), name
        assert removed(default) >= set(tracing.TRACE_HEADERS), name  # a stranger cannot pick or force a trace
        for chain in (trusted, default):
            hcm = chain["filters"][0]["typed_config"]
            assert hcm["tracing"]["random_sampling"] == {"value": 5.0}
        if name == "https":
            assert trusted["transport_socket"] == default["transport_socket"]


def test_without_trusted_callers_every_caller_loses_its_trace_headers(pki: Path) -> None:
    files = rendered(pki, Tracing(collector="127.0.0.1:4318"))
    for _, only in chains(files):
        assert len(only) == 1 and removed(only[0]) >= set(tracing.TRACE_HEADERS)
    assert tracing.CLUSTER in files["cds.yaml"]


def test_tracing_off_changes_nothing(pki: Path) -> None:
    files = rendered(pki, None)
    assert "tracing" not in files["lds.yaml"] and tracing.CLUSTER not in files["cds.yaml"]
    assert all("traceparent" not in removed(c[0]) for _, c in chains(files))  # the backend's own tracing passes


def test_envoy_accepts_the_tracing_configuration(tmp_path: Path, pki: Path) -> None:
    route = make_route(pki, "rsa", name="rsa")
    policies = PolicySet(routes=[route], sources={"rsa": "r"}, edge=Edge(tracing=TRACED))
    files = envoy_config.render(policies, envoy_config.Topology(certs_dir=str(pki), config_dir=str(tmp_path)))
    envoy_config.write(files, tmp_path)
    assert_envoy_accepts(files, tmp_path)


@pytest.mark.parametrize("bad", [{"collector": "no-port"}, {"collector": "c:4318", "sampling_percent": 101},
                                 {"collector": "c:4318", "trusted_callers": ["10.0.0.1"]}])  # fmt: skip
def test_tracing_errors_name_the_field(tmp_path: Path, bad: dict) -> None:
    doc = {"routes": [{"name": "p", "match": {"path_prefix": "/p/"}, "upstream": {"address": "127.0.0.1:1"},
                       "profile": "xml"}], "edge": {"tracing": bad}}  # fmt: skip
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(PolicyError, match=r"field edge\.tracing\."):
        load_dir(tmp_path)


SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def worker_tracer() -> tuple[worker_tracing.Tracer, InMemorySpanExporter]:
    tracer = worker_tracing.Tracer(TRACED)
    exported = InMemorySpanExporter()
    assert tracer.provider is not None
    tracer.provider.add_span_processor(SimpleSpanProcessor(exported))
    return tracer, exported


def test_the_workers_stage_spans_are_children_of_envoys_span(pki: Path) -> None:
    tracer, exported = worker_tracer()
    route = make_route(pki, "rsa", name="rsa")
    spans = tracer.start({"traceparent": SAMPLED}, "rsa", "rsa", "request")
    assert spans is not None
    metrics.stages.hook = spans
    try:
        with metrics.stage(route, "security_header"), metrics.stage(None, "signature_check"):
            pass
    finally:
        metrics.stages.hook = None
    spans.finish("FailedCheck")
    by_name = {s.name: s for s in exported.get_finished_spans()}
    phase, header, check = by_name["wsgate.request"], by_name["security_header"], by_name["signature_check"]
    assert phase.context.trace_id == int(SAMPLED.split("-")[1], 16)
    assert phase.parent.span_id == int(SAMPLED.split("-")[2], 16)  # Envoy's ext_proc span
    assert header.parent.span_id == phase.context.span_id and check.parent.span_id == header.context.span_id
    assert phase.attributes == {"wsgate.route": "rsa", "wsgate.profile": "rsa", "wsgate.phase": "request",
                                "wsgate.fault": "FailedCheck"}  # fmt: skip
    tracer.shutdown()


@pytest.mark.parametrize("headers", [{}, {"traceparent": SAMPLED[:-2] + "00"}, {"traceparent": "garbage"}])
def test_no_span_unless_envoy_samples_the_exchange(headers: dict[str, str]) -> None:
    tracer, exported = worker_tracer()
    assert tracer.start(headers, "rsa", "rsa", "request") is None
    assert exported.get_finished_spans() == ()
    assert worker_tracing.Tracer(None).start({"traceparent": SAMPLED}, "rsa", "rsa", "request") is None
    tracer.shutdown()


def test_kubernetes_lets_envoy_and_the_filters_reach_the_collector_only(pki: Path) -> None:
    from gateway.control import kubernetes

    route = make_route(pki, "rsa", name="rsa", replay={"store": "redis"})
    policies = PolicySet(routes=[route], sources={"rsa": "r"}, edge=Edge(tracing=Tracing(collector="10.9.8.7:4318")))
    found = {p["metadata"]["name"]: p["spec"].get("egress", []) for p in
             kubernetes.network_policies(policies, kubernetes.topology(), kubernetes.Options())}  # fmt: skip
    to_collector = {"to": [{"ipBlock": {"cidr": "10.9.8.7/32"}}], "ports": [{"protocol": "TCP", "port": 4318}]}
    assert to_collector in found[kubernetes.ENVOY] and to_collector in found[kubernetes.FILTER]
    assert to_collector not in found.get(kubernetes.REDIS, [])
