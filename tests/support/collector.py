"""A real trace collector for the tracing tests: Jaeger v2 (tests/support/jaeger, built by `make jaeger`), with
in-memory storage, OTLP/HTTP in and its query API out, on free loopback ports."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from gateway.control.ports import PortInUse, bind_failed, free_ports, retried_if_taken

MODULE = Path(__file__).resolve().parent / "jaeger"


def binary() -> Path:
    """Where `make jaeger` builds it (the Makefile's JAEGER_BIN)."""
    version = re.search(r"^require github\.com/jaegertracing/jaeger (\S+)$", (MODULE / "go.mod").read_text(), re.M)
    assert version, "tests/support/jaeger/go.mod names no Jaeger version"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "wsgate" / f"jaeger-{version.group(1)}" / "jaeger"


@dataclass(frozen=True)
class Collector:
    otlp: str  # host:port of OTLP/HTTP, as edge.tracing.collector names it
    query: str  # the query API's base URL

    def traces(self, service: str) -> list[dict]:
        resp = requests.get(f"{self.query}/api/traces", params={"service": service, "limit": 100}, timeout=5)
        resp.raise_for_status()
        return resp.json()["data"] or []

    def wait_for(self, service: str, count: int, timeout: float = 20) -> list[dict]:
        """The service's traces once there are `count` (spans arrive in batches)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.traces(service)
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.2)


def _config(otlp: int, query: int, query_grpc: int, health: int) -> dict:
    return {
        "service": {
            "extensions": ["jaeger_storage", "jaeger_query", "healthcheckv2"],
            "pipelines": {"traces": {"receivers": ["otlp"], "processors": [], "exporters": ["jaeger_storage_exporter"]}},
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "warn"}},
        },
        "extensions": {
            "jaeger_query": {"storage": {"traces": "memory"}, "http": {"endpoint": f"127.0.0.1:{query}"},
                             "grpc": {"endpoint": f"127.0.0.1:{query_grpc}"}},
            "jaeger_storage": {"backends": {"memory": {"memory": {"max_traces": 10000}}}},
            "healthcheckv2": {"use_v2": True, "http": {"endpoint": f"127.0.0.1:{health}"}},
        },
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"127.0.0.1:{otlp}"}}}},
        "exporters": {"jaeger_storage_exporter": {"trace_storage": "memory"}},
    }  # fmt: skip


def _start(exe: Path, tmp: Path) -> tuple[subprocess.Popen[bytes], Collector]:
    otlp, query, query_grpc, health = free_ports(4)
    config = tmp / f"jaeger-{otlp}.yaml"
    config.write_text(yaml.safe_dump(_config(otlp, query, query_grpc, health)))
    log = tmp / f"jaeger-{otlp}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(exe), "--config", f"file:{config}"], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(f"http://127.0.0.1:{health}/status", timeout=1).ok:
                return proc, Collector(otlp=f"127.0.0.1:{otlp}", query=f"http://127.0.0.1:{query}")
        except requests.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            said = log.read_bytes()
            if bind_failed(said):
                raise PortInUse(f"Jaeger could not bind one of its ports; see {log}")
            pytest.fail(f"Jaeger did not start: {said[-2000:].decode()}")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:  # its HTTP servers drain idle keep-alive connections first
        proc.kill()
        proc.wait()


@contextmanager
def jaeger(tmp: Path) -> Iterator[Collector]:
    exe = binary()
    if not exe.exists():
        pytest.fail(f"Jaeger is not built at {exe}: make jaeger")
    proc, collector = retried_if_taken(lambda: _start(exe, tmp), "Jaeger")
    try:
        yield collector
    finally:
        _stop(proc)
