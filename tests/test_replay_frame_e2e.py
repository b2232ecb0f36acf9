"""The replay check of routes whose replay store is Redis, made by the frame (filters/frame/src/replay.rs): the engine
returns a verified message's keys with its verdict and the frame sets them (SET NX, one pipelined round trip) off
the worker's Python thread, before the message goes on. Through the running gateway, with the supervisor's Redis."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from gateway.tools.client import Client, ClientConfig, http_post
from tests.harness import running_gateway
from tests.test_wssecurity_e2e import clear, fault_code, received, route_of, send
from tests.wss_helpers import echo, route_doc


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Path):
    # One worker: its one Python thread serves every exchange, so a wait on Redis there would stall them all.
    routes = [
        route_doc(pki, "hmac", name="hmac", replay={"store": "auto"}),
        {"name": "xml", "match": {"path_prefix": "/xml/"}, "profile": "xml", "upstream": {"address": "BACKEND"}},
        route_doc(pki, "secureconversation", name="sc", replay={"store": "auto"},
                  secureconversation={"store": "memory", "max_contexts": 2,
                                      "master_keys_file": str(pki / "sct-master-keys.yaml")}),
    ]  # fmt: skip
    with running_gateway(tmp_path_factory.mktemp("replayframe"), routes, pki, workers=1, metrics=True) as g:
        assert g.redis is not None
        yield g


def _metric(gw, name: str, **labels: str) -> float:
    text = "".join(requests.get(u, timeout=5).text for u in gw.metrics_urls())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_forged_copy_sent_first_does_not_burn_the_originals_replay_key(gw, pki: Path) -> None:
    client = Client(route_of(gw, "hmac"), ClientConfig(certs=pki, key_name="demo-client"))
    original, _ = client.secure(echo("pay 10"))
    forged = original.replace(b"pay 10", b"pay 99")  # same Signature, other content
    assert forged != original
    clear(gw)
    replays = _metric(gw, "wsgate_replays_total", route="hmac")
    checks = _metric(gw, "wsgate_frame_replay_checks_total", outcome="replayed")
    assert fault_code(send(gw, "hmac", forged)) == "FailedCheck"
    assert send(gw, "hmac", original).status_code == 200  # its key was not set by the forgery
    resp = send(gw, "hmac", original)  # the frame's SET NX finds the key: refused as the engine refused replays
    assert (resp.status_code, fault_code(resp)) == (500, "InvalidSecurity")
    assert [b"pay 10" in r["body"].encode() for r in received(gw)] == [True]
    assert _metric(gw, "wsgate_replays_total", route="hmac") == replays + 1
    assert _metric(gw, "wsgate_frame_replay_checks_total", outcome="replayed") == checks + 1
    assert _metric(gw, "wsgate_faults_total", route="hmac", reason="InvalidSecurity") >= 1


def test_a_stalled_replay_store_does_not_stall_the_workers_other_exchanges(gw, pki: Path) -> None:
    client = Client(route_of(gw, "hmac"), ClientConfig(certs=pki, key_name="demo-client"))
    assert send(gw, "hmac", client.secure(echo("warm"))[0]).status_code == 200  # the frame's connection is open
    stalled, _ = client.secure(echo("while redis hangs"))
    xml = echo("no security here")
    clear(gw)
    answers: list[requests.Response] = []
    unanswered = _metric(gw, "wsgate_frame_replay_checks_total", outcome="unavailable")
    os.kill(gw.redis.pid, signal.SIGSTOP)
    try:
        waiting = threading.Thread(target=lambda: answers.append(send(gw, "hmac", stalled)))
        waiting.start()
        time.sleep(0.2)  # the hmac exchange now waits on Redis (up to the frame's 1 s timeout)
        started = time.monotonic()
        resp = requests.post(f"http://127.0.0.1:{gw.opts.http_port}/xml/demo", data=xml,
                             headers={"content-type": "text/xml; charset=utf-8"}, timeout=10)  # fmt: skip
        elapsed = time.monotonic() - started
        # Answered while the hmac exchange still waits: the worker's thread was free.
        assert resp.status_code == 200 and waiting.is_alive(), elapsed
        assert elapsed < 0.6, elapsed
        waiting.join(10)
    finally:
        os.kill(gw.redis.pid, signal.SIGCONT)
    assert [r.status_code for r in answers] == [500]  # unchecked: refused, never passed on (fail closed)
    assert fault_code(answers[0]) != "InvalidSecurity"  # a server fault, not a replay
    assert [r["path"] for r in received(gw)] == ["/xml/demo"]
    assert _metric(gw, "wsgate_frame_replay_checks_total", outcome="unavailable") == unanswered + 1
    assert send(gw, "hmac", client.secure(echo("after"))[0]).status_code == 200  # Redis answers again: used again


def test_a_replayed_issue_request_is_refused_before_it_takes_a_context(gw, pki: Path) -> None:
    # Issue and Cancel change the context store: their keys are set before the answer, not after (a replayed
    # Issue would otherwise fill the store with contexts nobody can use).
    post = http_post(f"http://127.0.0.1:{gw.opts.http_port}/sc/demo")
    issues: list[tuple[bytes, str]] = []

    def capturing(body: bytes, ctype: str) -> bytes:
        issues.append((body, ctype))
        return post(body, ctype)

    client = Client(route_of(gw, "sc"), ClientConfig(certs=pki))
    client.establish(capturing)  # the store's first context of two
    issue, ctype = issues[0]
    for _ in range(3):
        resp = requests.post(f"http://127.0.0.1:{gw.opts.http_port}/sc/demo", data=issue,
                             headers={"content-type": ctype}, timeout=10)  # fmt: skip
        assert (resp.status_code, fault_code(resp)) == (500, "InvalidSecurity")
    Client(route_of(gw, "sc"), ClientConfig(certs=pki)).establish(post)  # room left for a second context
    clear(gw)
    secured, _ = client.secure(echo("in context"))
    assert send(gw, "sc", secured).status_code == 200
    resp = send(gw, "sc", secured)  # a message signed with the context's derived key, replayed
    assert (resp.status_code, fault_code(resp)) == (500, "InvalidSecurity")
    assert len(received(gw)) == 1
