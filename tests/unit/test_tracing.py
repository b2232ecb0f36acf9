"""Tracing in the model and Envoy's configuration: the tracer and its collector, trace headers kept only on the
trusted callers' filter chain, and the worker's spans from the engine's stage hook (posted over OTLP/HTTP to a
loopback receiver that decodes them). Through the running gateway, into a real collector: tests/e2e/test_tracing_e2e.py."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

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


class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver on loopback: the requests the worker's exporter posts, decoded."""

    def __init__(self) -> None:
        self.posted: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.paths.append(f"{self.path} {self.headers['content-type']}")
                receiver.posted.append(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def spans(self) -> list[Span]:
        return [span for r in self.posted for rs in r.resource_spans for ss in rs.scope_spans for span in ss.spans]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def worker_tracer(receiver: Receiver) -> worker_tracing.Tracer:
    return worker_tracing.Tracer(TRACED.model_copy(update={"collector": f"127.0.0.1:{receiver.server_port}"}))


def test_the_workers_stage_spans_are_children_of_envoys_span(pki: Path, receiver: Receiver) -> None:
    tracer = worker_tracer(receiver)
    route = make_route(pki, "rsa", name="rsa")
    spans = tracer.start({"traceparent": SAMPLED}, "rsa", "rsa", "request")
    assert spans is not None
    metrics.stages.hook = spans
    try:
        with metrics.stage(route, "security_header"), metrics.stage(None, "signature_check"):
            metrics.then("c14n")
        with metrics.stage(route, "schema"):
            pass
    finally:
        metrics.stages.hook = None
    spans.finish("FailedCheck")
    tracer.shutdown()  # what is batched goes out
    assert receiver.paths == ["/v1/traces application/x-protobuf"]
    (resource,) = [rs.resource for r in receiver.posted for rs in r.resource_spans]
    assert [(a.key, a.value.string_value) for a in resource.attributes] == [("service.name", "wsgate-filter")]
    by_name = {s.name: s for s in receiver.spans()}
    assert sorted(by_name) == ["c14n", "schema", "security_header", "signature_check", "wsgate.request"]
    phase, header, check, c14n = (by_name[n] for n in ("wsgate.request", "security_header", "signature_check", "c14n"))
    assert {s.trace_id.hex() for s in by_name.values()} == {SAMPLED.split("-")[1]}
    assert phase.parent_span_id.hex() == SAMPLED.split("-")[2]  # Envoy's ext_proc span
    assert header.parent_span_id == phase.span_id and check.parent_span_id == header.span_id
    assert c14n.parent_span_id == header.span_id and by_name["schema"].parent_span_id == phase.span_id
    assert len({s.span_id for s in by_name.values()}) == 5 and all(len(s.span_id) == 8 for s in by_name.values())
    assert all(phase.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano <= phase.end_time_unix_nano
               for s in by_name.values())  # fmt: skip
    assert {a.key: a.value.string_value for a in phase.attributes} == {
        "wsgate.route": "rsa", "wsgate.profile": "rsa", "wsgate.phase": "request", "wsgate.fault": "FailedCheck"}  # fmt: skip
    assert phase.status.code == Status.StatusCode.STATUS_CODE_ERROR
    assert all(not s.attributes and s.status.code == Status.StatusCode.STATUS_CODE_UNSET
               for s in by_name.values() if s is not phase)  # fmt: skip


def test_a_stage_a_fault_left_open_ends_with_its_phase(receiver: Receiver) -> None:
    tracer = worker_tracer(receiver)
    spans = tracer.start({"traceparent": SAMPLED}, "rsa", "rsa", "response")
    assert spans is not None
    spans.enter("secure")
    spans.enter("signature_creation")
    spans.finish(None)
    tracer.shutdown()
    by_name = {s.name: s for s in receiver.spans()}
    assert sorted(by_name) == ["secure", "signature_creation", "wsgate.response"]
    assert {s.end_time_unix_nano for s in by_name.values()} == {by_name["wsgate.response"].end_time_unix_nano}
    assert by_name["wsgate.response"].status.code == Status.StatusCode.STATUS_CODE_UNSET


@pytest.mark.parametrize("value", [SAMPLED[:-2] + "00", "garbage", SAMPLED + "-01", "01" + SAMPLED[2:],
                                   SAMPLED.replace("0af7", "zzzz"), f"00-{'0' * 32}-b7ad6b7169203331-01",
                                   f"00-0af7651916cd43dd8448eb211c80319c-{'0' * 16}-01", SAMPLED[:-1]])  # fmt: skip
def test_no_span_unless_envoy_samples_the_exchange(value: str, receiver: Receiver) -> None:
    tracer = worker_tracer(receiver)
    assert tracer.start({}, "rsa", "rsa", "request") is None
    assert tracer.start({"traceparent": value}, "rsa", "rsa", "request") is None
    tracer.shutdown()
    assert receiver.posted == []
    assert worker_tracing.Tracer(None).start({"traceparent": SAMPLED}, "rsa", "rsa", "request") is None


def test_a_collector_down_drops_spans_and_fails_nothing(receiver: Receiver) -> None:
    tracer = worker_tracer(receiver)
    receiver.shutdown()
    receiver.server_close()  # nothing listens on its port now
    spans = tracer.start({"traceparent": SAMPLED}, "rsa", "rsa", "request")
    assert spans is not None
    spans.finish(None)
    tracer.shutdown()
    assert receiver.posted == []


def test_kubernetes_lets_envoy_and_the_filters_reach_the_collector_only(pki: Path) -> None:
    from gateway.control import kubernetes

    route = make_route(pki, "rsa", name="rsa", replay={"store": "redis"})
    policies = PolicySet(routes=[route], sources={"rsa": "r"}, edge=Edge(tracing=Tracing(collector="10.9.8.7:4318")))
    found = {p["metadata"]["name"]: p["spec"].get("egress", []) for p in
             kubernetes.network_policies(policies, kubernetes.topology(), kubernetes.Options())}  # fmt: skip
    to_collector = {"to": [{"ipBlock": {"cidr": "10.9.8.7/32"}}], "ports": [{"protocol": "TCP", "port": 4318}]}
    assert to_collector in found[kubernetes.ENVOY] and to_collector in found[kubernetes.FILTER]
    assert to_collector not in found.get(kubernetes.REDIS, [])
