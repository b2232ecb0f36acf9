"""`wsgate up` checks every port it will bind before it starts anything: a port already in use is named with the
role that needs it, instead of "filter worker 0 did not start" after Redis, the backend and the other workers
were started."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.control.supervisor import Gateway, Options, check_ports
from tests.harness import write_policies

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
