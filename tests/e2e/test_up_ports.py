"""`wsgate up` checks every port it will bind before it starts anything: a port already in use is named with the
role that needs it, instead of "filter worker 0 did not start" after Redis, the backend and the other workers
were started."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests
import yaml

from gateway.control.ports import PortInUse
from gateway.control.supervisor import Gateway, Options, check_ports
from tests.support.harness import received, running_gateway, write_policies
from tests.support.wss_helpers import echo

ROUTES = [{"name": "plain", "profile": "xml", "match": {"path_prefix": "/"}, "upstream": {"address": "127.0.0.1:1"}}]

# Which port of the options a role needs, and the words naming it.
ROLES: dict[str, tuple[Callable[[Options], int], str]] = {
    "worker-0-metrics": (lambda o: o.metrics_port or 0, "port {} (filter worker 0's metrics)"),
    "worker-1-grpc": (lambda o: o.filter_port + 1, "port {} (filter worker 1's gRPC)"),
    "replacement-worker-grpc": (lambda o: o.filter_port + 2, "port {} (filter worker 0's replacement's gRPC)"),
    "http-listener": (lambda o: o.http_port, "port {} (Envoy's HTTP listener)"),
    "https-listener": (lambda o: o.https_port, "port {} (Envoy's HTTPS listener)"),
    "admin": (lambda o: o.admin_port, "port {} (Envoy's admin interface)"),
    "backend": (lambda o: int((o.backend or ":0").rsplit(":", 1)[1]), "port {} (the demo backend)"),
}


def _options(tmp_path: Path) -> Options:
    opts = Options.on_free_ports(2, policies=tmp_path / "policies", certs=tmp_path / "certs", run_dir=tmp_path / "run")
    write_policies(opts.policies, ROUTES)
    return opts


@pytest.mark.parametrize("role", list(ROLES), ids=list(ROLES))
def test_port_squatter_named_before_anything_starts(tmp_path: Path, role: str) -> None:
    opts = _options(tmp_path)
    port_of, words = ROLES[role]
    port = port_of(opts)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        gw = Gateway(opts)
        with pytest.raises(RuntimeError) as info:
            gw.start()
        gw.stop()
    message = str(info.value)
    assert words.format(port) in message and "nothing was started" in message
    assert message.count("is taken") == 1  # only the squatted port is named
    assert gw.workers == [] and gw.envoy is None and gw.backend is None and gw.redis is None
    assert not (opts.run_dir / "logs").exists() or not any((opts.run_dir / "logs").iterdir())
    assert not opts.certs.exists()  # not even the demo PKI was made


def test_port_check_passes_when_every_port_is_free(tmp_path: Path) -> None:
    opts = _options(tmp_path)
    check_ports(opts)
    ports = [p for _, p, _ in opts.ports()]
    assert len(ports) == 3 + 2 * 2 * 2 + 1  # Envoy 3, workers' gRPC and metrics with their replacements, backend


def _squat_once_spawned(log: Path, port: Callable[[], int], held: list[socket.socket]) -> threading.Thread:
    """Another process's listener taking `port()` once the process logging to `log` is spawned, before it binds:
    the race a port chosen ahead of its server's start can lose."""

    def squat() -> None:
        deadline = time.monotonic() + 60
        while not log.exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        try:
            held.append(socket.create_server(("127.0.0.1", port())))
        except OSError:  # the process bound it first: no race this time (`held` stays empty)
            pass

    thread = threading.Thread(target=squat, daemon=True)
    thread.start()
    return thread


# The process that loses its port to a squatter after the start's port check, and which of its ports.
LOST: dict[str, tuple[str, Callable[[Options], int]]] = {
    "envoy-http-listener": ("envoy", lambda o: o.http_port),
    "envoy-admin": ("envoy", lambda o: o.admin_port),
    "worker-grpc": ("filter-0", lambda o: o.filter_port),
    "worker-metrics": ("filter-0", lambda o: o.metrics_port or 0),
    "backend": ("backend", lambda o: int((o.backend or ":0").rsplit(":", 1)[1])),
}


@pytest.mark.parametrize("role", list(LOST), ids=list(LOST))
def test_port_lost_after_the_check_fails_the_start_as_port_in_use(tmp_path: Path, role: str) -> None:
    opts = _options(tmp_path)
    name, port_of = LOST[role]
    held: list[socket.socket] = []
    squatter = _squat_once_spawned(opts.run_dir / "logs" / f"{name}.log", lambda: port_of(opts), held)
    gw = Gateway(opts)
    try:
        with pytest.raises(PortInUse, match="address already in use"):
            gw.start()
    finally:
        gw.stop()
        squatter.join()
        for s in held:
            s.close()
    # Never "started" with another process serving on one of its ports.
    assert gw.envoy is None or gw.envoy.poll() is not None


def test_test_gateway_that_lost_a_port_starts_again_on_others(
    tmp_path: Path, pki: Path, caplog: pytest.LogCaptureFixture
) -> None:
    routes = [{**ROUTES[0], "upstream": {"address": "BACKEND"}}]

    def http_port(base: Path) -> int:  # from the rendered listeners: the squatter does not know the options
        lds = yaml.safe_load((base / "run" / "envoy" / "lds.yaml").read_text())
        http = next(r for r in lds["resources"] if r["name"] == "http")
        return http["address"]["socket_address"]["port_value"]

    # On a busy machine Envoy may bind before the squatter: then the start is made again until the race happens.
    for attempt in range(5):
        base = tmp_path / f"attempt-{attempt}"
        base.mkdir()
        held: list[socket.socket] = []
        squatter = _squat_once_spawned(base / "run" / "logs" / "envoy.log", lambda b=base: http_port(b), held)
        try:
            with running_gateway(base, routes, pki) as gw:
                squatter.join()
                if not held:
                    continue
                assert gw.opts.http_port != held[0].getsockname()[1]
                r = requests.post(
                    f"http://127.0.0.1:{gw.opts.http_port}/", data=echo(), headers={"content-type": "text/xml"}
                )
                assert r.status_code == 200 and received(gw)
                break
        finally:
            for s in held:
                s.close()
    else:
        pytest.fail("Envoy bound its port before the squatter in every attempt: the race never happened")
    assert "address already in use" in (base / "run" / "logs" / "envoy.log").read_text().lower()
    assert [r.message for r in caplog.records if "starting it again on other ports" in r.message]
