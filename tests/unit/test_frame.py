"""The compiled ext_proc frame, spoken to as Envoy speaks to it: real gRPC on loopback to a real filter worker.

What the frame answers itself (refusals as SOAP faults, the headers the gateway vouches for, the body budget), what
it hands the engine (one call per body phase, the exchange carried from request to response), and how it lives:
a failing call into Python is a generic fault and never the worker's end; SIGHUP installs new policies; SIGTERM
lets the exchanges in flight finish. The end-to-end tests (test_gateway_e2e.py and others) run it behind Envoy."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import grpc
import pytest
import requests
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from wsgate_frame import Answer, ReplayOutcome, Route, Table

from filters.engine import faults
from filters.engine.pipeline import Exchange, Outcome, RoutePipeline
from filters.engine.wss.replay import DeferredKey, before_epoch
from filters.worker import FAULT_TABLE, MAX_MESSAGE_BYTES, REFUSALS, InFlight
from filters.worker import Worker as FilterWorker
from gateway.control.ports import free_ports
from tests.support.harness import content_type, envelope, write_policies

LIMIT = 600_000  # two bodies of this size do not fit the workers' 1 MiB budget
ROUTES = [{"name": "xml", "match": {"path_prefix": "/"}, "upstream": {"address": "127.0.0.1:1"}, "profile": "xml",
           "limits": {"max_body_bytes": LIMIT}, "response_limits": {"max_body_bytes": LIMIT},
           "identity_header": "x-user"}]  # fmt: skip
ECHO = envelope("<echo>hello</echo>")


class Worker:
    """`python -m filters.worker` as the supervisor starts it, or `script` (given the address and the ready file)."""

    def __init__(self, tmp: Path, script: str | None = None) -> None:
        self.port, self.metrics_port = free_ports(2)
        self.policies = write_policies(tmp / "policies", ROUTES)
        ready = tmp / "ready"
        ready.unlink(missing_ok=True)
        self.log = tmp / "worker.log"
        listen = f"127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "filters.worker", "--policies", str(self.policies), "--listen", listen,
                "--metrics-port", str(self.metrics_port), "--ready-file", str(ready), "--body-budget-mb", "1"]  # fmt: skip
        if script is not None:
            argv = [sys.executable, "-c", script, listen, str(ready)]
        self.proc = subprocess.Popen(argv, stdout=self.log.open("ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.02)
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]  # fmt: skip
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}", options=options)

    def stream(self, route: str = "xml") -> Stream:
        return Stream(self.channel, route)

    def metric(self, name: str) -> float:
        text = requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name)))

    def stop(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class Stream:
    """One ext_proc stream, message by message, as Envoy drives it."""

    def __init__(self, channel: grpc.Channel, route: str) -> None:
        self.outbox: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
        stub = pb_grpc.ExternalProcessorStub(channel)
        self.replies = stub.Process(iter(self.outbox.get, None), metadata=[("x-wsgate-route", route)])

    def send(self, msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
        self.outbox.put(msg)
        return next(self.replies)

    def end(self) -> None:
        self.outbox.put(None)
        assert next(self.replies, None) is None


def headers(kind: str, pairs: list[tuple[str, str]], end: bool = False) -> pb.ProcessingRequest:
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    return pb.ProcessingRequest(**{kind: pb.HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end)})


def post(length: int | str | None = None, version: str = "1.1", extra: list[tuple[str, str]] | None = None):  # type: ignore[no-untyped-def]
    pairs = [(":method", "POST"), (":path", "/"), ("content-type", content_type(version)), *(extra or [])]
    if length is not None:
        pairs.append(("content-length", str(length)))
    return headers("request_headers", pairs)


def body(kind: str, data: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(**{kind: pb.HttpBody(body=data, end_of_stream=True)})


def immediate(reply: pb.ProcessingResponse) -> tuple[int, str, bytes]:
    assert reply.WhichOneof("response") == "immediate_response", reply
    r = reply.immediate_response
    ct = {h.header.key: h.header.raw_value.decode() for h in r.headers.set_headers}["content-type"]
    return r.status.code, ct, r.body


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = Worker(tmp_path_factory.mktemp("frame"))
    yield w
    w.stop()


@pytest.mark.parametrize("version", ["1.1", "1.2"])
@pytest.mark.parametrize(
    ("message", "kind"),
    [
        (lambda v: headers("request_headers", [(":method", "GET"), ("content-type", content_type(v))]), "method"),
        (lambda v: headers("request_headers", [(":method", "post"), ("content-type", content_type(v))]), "method"),
        (lambda v: headers("request_headers", [(":method", "POST"), ("content-type", content_type(v))], end=True),
         "no_body"),
        (lambda v: post(LIMIT + 1, v), "too_large"),
        (lambda v: post("99999999999999999999999", v), "too_large"),
        (lambda v: post("12x", v), "bad_length"),
        (lambda v: post("-1", v), "bad_length"),
    ],
)  # fmt: skip
def test_requests_no_soap_service_takes_are_refused_before_their_body_is_buffered(
    worker: Worker,
    version: str,
    message,
    kind: str,  # type: ignore[no-untyped-def]
) -> None:
    status, ct, fault = immediate(worker.stream().send(message(version)))
    assert status == REFUSALS[kind].http_status
    assert ct == faults.content_type(version)
    assert fault == faults.render(REFUSALS[kind], version)  # the generic text only; the reason goes to the log


def test_a_backend_response_declared_over_the_limit_is_a_502_fault(worker: Worker) -> None:
    ex = worker.stream()
    ex.send(post(len(ECHO)))
    assert ex.send(body("request_body", ECHO)).WhichOneof("response") == "request_body"
    reply = ex.send(headers("response_headers", [(":status", "200"), ("content-length", str(LIMIT + 1))]))
    assert immediate(reply) == (502, faults.content_type("1.1"), faults.render(REFUSALS["response_too_large"], "1.1"))


def test_an_unknown_route_is_refused(worker: Worker) -> None:
    status, _, fault = immediate(worker.stream("nowhere").send(post(10)))
    assert (status, fault) == (500, faults.render(REFUSALS["no_route"], "1.1"))


def test_headers_the_gateway_vouches_for_are_removed_from_client_requests(worker: Worker) -> None:
    spoofed = [("x-wsgate-subject", "CN=admin"), ("x-wsgate-anything", "1"), ("x-user", "admin")]
    reply = worker.stream().send(post(10, extra=spoofed))
    removed = reply.request_headers.response.header_mutation.remove_headers
    assert sorted(removed) == ["x-user", "x-wsgate-anything", "x-wsgate-subject"]


def test_the_exchange_carries_the_request_s_soap_version_to_the_response(worker: Worker) -> None:
    # A SOAP 1.2 envelope sent as text/xml: only the engine, at the request body, knows it is 1.2; a fault about
    # the response must still be 1.2.
    ex = worker.stream()
    ex.send(post(None, "1.1"))
    passed = ex.send(body("request_body", envelope("<a/>", "1.2")))
    assert passed.WhichOneof("response") == "request_body"
    ex.send(headers("response_headers", [(":status", "200")]))
    status, ct, fault = immediate(ex.send(body("response_body", b"<not-soap/>")))
    assert (status, ct) == (502, faults.content_type("1.2"))
    assert b"env:Receiver" in fault


def test_a_broken_request_body_is_the_engine_s_fault_answered_as_soap(worker: Worker) -> None:
    ex = worker.stream()
    ex.send(post(None, "1.2"))
    status, ct, fault = immediate(ex.send(body("request_body", b"<broken")))
    assert (status, ct) == (500, faults.content_type("1.2"))
    assert b"env:Sender" in fault


def test_body_budget_admits_bodies_while_they_fit_and_frees_them_when_the_stream_ends(worker: Worker) -> None:
    big = envelope("<a>" + "x" * (LIMIT - 200) + "</a>")
    first = worker.stream()
    first.send(post(len(big)))  # declared: reserves nothing yet
    assert worker.metric("wsgate_body_bytes_in_flight") == 0
    assert first.send(body("request_body", big)).WhichOneof("response") == "request_body"
    assert worker.metric("wsgate_body_bytes_in_flight") == len(big)  # held while the backend answers
    second = worker.stream()
    second.send(post(len(big), "1.2"))
    refused_before = worker.metric('wsgate_frame_refusals_total{reason="busy"}')
    assert immediate(second.send(body("request_body", big))) == (
        503, faults.content_type("1.2"), faults.render(REFUSALS["busy"], "1.2"))  # fmt: skip
    assert worker.metric('wsgate_frame_refusals_total{reason="busy"}') == refused_before + 1
    assert worker.metric('wsgate_faults_total{profile="xml",reason="busy",route="xml"}') >= 1
    first.send(headers("response_headers", [(":status", "200")]))
    first.send(body("response_body", ECHO))  # the response's body replaces the request's
    assert worker.metric("wsgate_body_bytes_in_flight") == len(ECHO)
    first.end()
    deadline = time.monotonic() + 5
    while worker.metric("wsgate_body_bytes_in_flight") != 0:
        assert time.monotonic() < deadline, "the reservation was never released"
        time.sleep(0.02)
    third = worker.stream()
    third.send(post(len(big)))
    assert third.send(body("request_body", big)).WhichOneof("response") == "request_body"
    third.replies.cancel()  # an exchange Envoy gives up on (reset) releases its body too
    deadline = time.monotonic() + 5
    while worker.metric("wsgate_body_bytes_in_flight") != 0:
        assert time.monotonic() < deadline, "an abandoned exchange kept its reservation"
        time.sleep(0.02)


def test_sighup_installs_new_policies_for_new_exchanges(tmp_path: Path) -> None:
    w = Worker(tmp_path)
    try:
        assert w.stream().send(post(1000)).WhichOneof("response") == "request_headers"
        routes = [{**ROUTES[0], "limits": {"max_body_bytes": 500}}]
        write_policies(w.policies, routes)
        os.kill(w.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while (reply := w.stream().send(post(1000))).WhichOneof("response") != "immediate_response":
            assert time.monotonic() < deadline, "the new limit never applied"
            time.sleep(0.05)
        assert reply.immediate_response.status.code == 413
        # A broken policy is refused and the running one stays.
        (w.policies / "routes.yaml").write_text("routes: [{name: broken}]")
        os.kill(w.proc.pid, signal.SIGHUP)
        time.sleep(0.5)
        assert w.proc.poll() is None
        assert immediate(w.stream().send(post(1000)))[0] == 413
        assert w.stream().send(post(400)).WhichOneof("response") == "request_headers"
    finally:
        w.stop()


def test_sigterm_lets_the_exchange_in_flight_finish(tmp_path: Path) -> None:
    w = Worker(tmp_path)
    ex = w.stream()
    ex.send(post(len(ECHO)))
    w.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert w.proc.poll() is None  # waiting for the exchange
    assert ex.send(body("request_body", ECHO)).WhichOneof("response") == "request_body"
    ex.send(headers("response_headers", [(":status", "200")]))
    assert ex.send(body("response_body", ECHO)).WhichOneof("response") == "response_body"
    ex.end()
    assert w.proc.wait(10) == 0
    w.stop()


BROKEN_WORKER = """
import sys
import wsgate_frame
from filters.worker import FAULT_TABLE

class Broken:
    calls = 0
    def handle(self, route, phase, body, headers, in_flight, may_wait):
        Broken.calls += 1
        if Broken.calls == 1:
            raise RuntimeError("a bug in the glue")
        return "not an answer"
    def refused(self, *args): pass
    def reload(self): return None
    def ready(self): open(sys.argv[2], "w").write("ready")

table = wsgate_frame.Table({"xml": wsgate_frame.Route(max_request_bytes=1000, max_response_bytes=1000)}, FAULT_TABLE)
wsgate_frame.serve(Broken(), sys.argv[1], table, 1 << 20, 1 << 20)
"""


def test_a_failing_call_into_python_is_a_generic_fault_and_the_worker_lives_on(tmp_path: Path) -> None:
    w = Worker(tmp_path, BROKEN_WORKER)
    try:
        for _ in range(2):  # the handler raises, then answers nonsense
            ex = w.stream()
            ex.send(post(len(ECHO), "1.2"))
            assert immediate(ex.send(body("request_body", ECHO))) == (
                500, faults.content_type("1.2"), faults.render(REFUSALS["internal"], "1.2"))  # fmt: skip
        assert w.proc.poll() is None
        assert "a bug in the glue" in w.log.read_text()  # the traceback goes to the log, not to the client
    finally:
        w.stop()


def test_an_engine_bug_is_a_generic_fault_with_the_traceback_only_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = FilterWorker(write_policies(tmp_path, ROUTES), 1 << 20)

    class Buggy(RoutePipeline):
        def request(self, body: bytes, headers: Mapping[str, str], ex: Exchange) -> Outcome:
            raise KeyError("secret-detail")

    w.engine.pipelines["xml"] = Buggy(w.engine.pipelines["xml"].route)
    answer = w.handle("xml", "request", ECHO, {"content-type": content_type("1.2")}, None)
    assert (answer.status, answer.body) == (500, faults.render(REFUSALS["internal"], "1.2"))
    assert answer.headers == [("content-type", faults.content_type("1.2"))]
    assert answer.replay is None  # a refusal sets no replay key
    assert "secret-detail" in caplog.text and b"secret-detail" not in answer.body


# Passes every message on, each with a replay check against a Redis that is not there; its `replay_refused` is
# broken the other way: it too would pass the message on.
PASSING_REFUSAL_WORKER = """
import socket
import sys
import wsgate_frame
from wsgate_frame import Answer, ReplayCheck
from filters.worker import FAULT_TABLE

with socket.socket() as s:  # a port nothing listens on
    s.bind(("127.0.0.1", 0))
    UNREACHABLE = f"redis://127.0.0.1:{s.getsockname()[1]}/0"

class PassingRefusal:
    def handle(self, route, phase, body, headers, in_flight, may_wait):
        return Answer.forward(None, [], None, ReplayCheck(UNREACHABLE, [(b"sig:a", 60_000)], b"wsgate:epoch", 1))
    def replay_refused(self, route, in_flight, outcome):
        print("replay outcome", type(outcome).__name__, flush=True)
        return Answer.forward(None, [], in_flight)
    def refused(self, *args): pass
    def reload(self): return None
    def ready(self): open(sys.argv[2], "w").write("ready")

table = wsgate_frame.Table({"xml": wsgate_frame.Route(max_request_bytes=1000, max_response_bytes=1000)}, FAULT_TABLE)
wsgate_frame.serve(PassingRefusal(), sys.argv[1], table, 1 << 20, 1 << 20)
"""


def test_a_replay_refusal_that_would_pass_the_message_on_is_an_internal_fault(tmp_path: Path) -> None:
    w = Worker(tmp_path, PASSING_REFUSAL_WORKER)
    try:
        ex = w.stream()
        ex.send(post(len(ECHO)))
        assert immediate(ex.send(body("request_body", ECHO))) == (
            500, faults.content_type("1.1"), faults.render(REFUSALS["internal"], "1.1"))  # fmt: skip
        assert "replay outcome Unavailable" in w.log.read_text()  # a Redis that cannot answer: fail closed
    finally:
        w.stop()


# Moves every call: on the gRPC thread (may_wait False) it answers `elsewhere`, as a call about to wait on the
# network does (filters/engine/turn.py); where it may wait it answers, the body echoed after what it saw. Route
# "stubborn" answers `elsewhere` wherever it is called.
MOVING_WORKER = """
import sys
import threading
import wsgate_frame
from wsgate_frame import Answer
from filters.worker import FAULT_TABLE

class Moving:
    def handle(self, route, phase, body, headers, in_flight, may_wait):
        where = "grpc-thread" if threading.current_thread() is threading.main_thread() else "engine-thread"
        print("call", phase, may_wait, where, in_flight, flush=True)
        if route == "stubborn" or not may_wait:
            return Answer.elsewhere(in_flight)
        return Answer.forward([b"seen on ", where.encode(), b": ", bytes(body)], [], f"{in_flight}+{phase}")
    def refused(self, *args): pass
    def reload(self): return None
    def ready(self): open(sys.argv[2], "w").write("ready")

route = wsgate_frame.Route(max_request_bytes=1000, max_response_bytes=1000)
wsgate_frame.serve(Moving(), sys.argv[1], wsgate_frame.Table({"xml": route, "stubborn": route}, FAULT_TABLE), 1 << 20,
                   1 << 20)
"""


def test_a_call_about_to_wait_on_the_grpc_thread_is_made_again_on_an_engine_thread_with_its_exchange(
    tmp_path: Path,
) -> None:
    """A call about to wait on the network must not hold up the gRPC thread (every other exchange of the worker):
    made again where it may wait, with the same body and in-flight record, its answer is the exchange's; one that
    would move even from there is a failed call (fail closed)."""
    w = Worker(tmp_path, MOVING_WORKER)
    try:
        ex = w.stream()
        ex.send(post(len(ECHO)))
        passed = ex.send(body("request_body", ECHO))
        assert passed.request_body.response.body_mutation.body == b"seen on engine-thread: " + ECHO
        ex.send(headers("response_headers", [(":status", "200")]))
        passed = ex.send(body("response_body", b"<reply/>"))
        assert passed.response_body.response.body_mutation.body == b"seen on engine-thread: <reply/>"
        calls = [line for line in w.log.read_text().splitlines() if line.startswith("call ")]
        assert calls == [
            "call request False grpc-thread None",
            "call request True engine-thread None",
            "call response False grpc-thread None+request",
            "call response True engine-thread None+request",
        ]
        stubborn = w.stream("stubborn")
        stubborn.send(post(len(ECHO)))
        assert immediate(stubborn.send(body("request_body", ECHO))) == (
            500, faults.content_type("1.1"), faults.render(REFUSALS["internal"], "1.1"))  # fmt: skip
        assert w.proc.poll() is None
    finally:
        w.stop()


def test_each_replay_outcome_is_refused_with_its_own_fault_and_an_unknown_one_still_refuses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = FilterWorker(write_policies(tmp_path, ROUTES), 1 << 20)
    replayed = [faults.security("InvalidSecurity", f"replayed {what}") for what in ("signature", "nonce")]
    generic = faults.render(faults.server("any"), "1.2")

    def refused(outcome: ReplayOutcome) -> Answer:
        in_flight = InFlight({"content-type": content_type("1.2")}, label=("xml", "xml"))
        in_flight.replay = [DeferredKey(b"sig:a", 1000, replayed[0]), DeferredKey(b"ut:n1", 1000, replayed[1])]
        answer = w.replay_refused("xml", in_flight, outcome)
        assert answer.in_flight is in_flight and in_flight.replay == []
        assert answer.headers == [("content-type", faults.content_type("1.2"))] and answer.replay is None
        return answer

    def fault(f: faults.Fault) -> tuple[int, bytes]:
        return f.http_status, faults.render(f, "1.2")

    answer = refused(ReplayOutcome.Replayed(index=1))
    assert (answer.status, answer.body) == fault(replayed[1])
    answer = refused(ReplayOutcome.BeforeEpoch(epoch_ms=2_000, since_ms=1_000))
    assert (answer.status, answer.body) == fault(before_epoch(1_000, 2_000))
    answer = refused(ReplayOutcome.Unavailable(reason="timed out"))
    assert (answer.status, answer.body) == (500, generic)
    assert "replay store unavailable: timed out" in caplog.text
    # No such key, or no refusal at all: a bug in the frame is still a refusal, never a pass.
    for outcome in (ReplayOutcome.Replayed(index=2), ReplayOutcome.First()):
        answer = refused(outcome)
        assert (answer.status, answer.body) == (500, generic)


def test_a_table_the_frame_cannot_answer_from_is_refused_when_built() -> None:
    routes = {"xml": Route(max_request_bytes=10, max_response_bytes=20, identity_header="X-User")}
    assert routes["xml"].identity_header == "x-user"  # compared whatever the client's case
    Table(routes, FAULT_TABLE)
    with pytest.raises(ValueError, match="no fault for refusal busy"):
        Table(routes, {k: v for k, v in FAULT_TABLE.items() if k != "busy"})
    with pytest.raises(ValueError, match="no refusal"):
        Table(routes, {**FAULT_TABLE, "teapot": FAULT_TABLE["internal"]})
    with pytest.raises(TypeError):
        Table({"xml": (10, 20, None)}, FAULT_TABLE)  # type: ignore[dict-item]


@pytest.mark.parametrize("status", [0, 199, 600])
def test_an_answer_to_the_client_cannot_pass_the_message_on_by_its_status(status: int) -> None:
    with pytest.raises(ValueError, match="200-599"):
        Answer.reply(status, b"", [], None)
    assert Answer.forward(None, [], None).status is None  # passing on has its own constructor
