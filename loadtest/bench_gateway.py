"""The benchmark's gateway and what it reads of it (loadtest/bench.py): the gateway on free loopback ports with the
demo backend, each process's CPU from /proc, the machine's, Envoy's counters, the workers' stage and fault metrics,
and the ext_proc phase latencies of Envoy's access log."""

from __future__ import annotations

import collections
import os
import re
import resource
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gateway.control.ports import free_ports
from gateway.control.supervisor import Gateway, Options

CLK_TCK = os.sysconf("SC_CLK_TCK")


# Envoy counters worth reporting when they move during a point. Normal: Envoy resets each ext_proc stream when
# the exchange is done, and wrk resets the requests it has in flight when its time is up (at most one per
# connection: rx_reset, and the rate-limit calls of those requests Envoy cancels, are reported only beyond that).
_ENVOY_PROBLEMS = re.compile(r"^(http\.(http|https)\.|cluster\.)\S*(5xx|4xx|timeout|fail|overflow|error|reset)")
_ENVOY_NORMAL = re.compile(r"^cluster\.wsgate_filter\.(http2\.tx_reset|upstream_rq_tx_reset)$")
_CLIENT_RESET = re.compile(
    r"^(http\.(http|https)\.downstream_rq_rx_reset|cluster\.wsgate_ratelimit\.(http2\.tx_reset|upstream_rq_tx_reset))$"
)
# With --quotas: the rate-limit service's answers by route and stage (cluster.upstream_<route>.ratelimit.<stage>.ok).
_QUOTA_OK = re.compile(r"^cluster\.upstream_(\S+)\.ratelimit\.(\w+)\.ok$")


@contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def bench_gateway(
    policies: Path, certs: Path, run_dir: Path, workers: int, kind: type[Gateway] = Gateway, **options: object
) -> Iterator[Gateway]:
    """The gateway (a `kind` of supervisor) on free loopback ports, with the demo backend; BACKEND_ADDR and
    WSGATE_BENCH_CERTS set for the policies (and for the processes that generate messages from them). `options`:
    more gateway Options."""
    opts = Options.on_free_ports(workers, policies=policies, certs=certs, run_dir=run_dir, **options)
    # The outbound routes' listener, and their partner: this gateway's HTTPS listener (loadtest/outbound.py).
    partner, listen = f"127.0.0.1:{opts.https_port}", f"127.0.0.1:{free_ports(1)[0]}"
    with _env(BACKEND_ADDR=opts.backend or "", WSGATE_BENCH_CERTS=str(certs), WSGATE_BENCH_PARTNER=partner,
              WSGATE_BENCH_OUTBOUND=listen):  # fmt: skip
        with kind(opts) as gw:
            yield gw


def _cpu_seconds(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14 and 15 of the line)


def _machine_seconds() -> tuple[float, float]:
    """CPU seconds of the whole machine since boot: (processes: user+nice+system, kernel: irq+softirq+steal)."""
    with open("/proc/stat") as f:
        parts = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in parts[:8])
    return (user + nice + system) / CLK_TCK, (irq + softirq + steal) / CLK_TCK


@dataclass
class Snapshot:
    cpu: dict[str, float]
    machine: tuple[float, float]
    children: float
    own: float
    envoy: dict[str, int]
    stages: dict[tuple[str, str], float]  # (route, stage) -> seconds
    faults: dict[tuple[str, str], float]  # (route, reason) -> count


def _pids(gw: Gateway) -> dict[str, list[int]]:
    return {
        "envoy": [gw.envoy.pid] if gw.envoy else [],
        "filter": [w.pid for w in gw.workers],
        "redis": [gw.redis.pid] if gw.redis else [],
        "backend": [gw.backend.pid] if gw.backend else [],
    }


def _get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _envoy_counters(gw: Gateway) -> dict[str, int]:
    out = {}
    try:
        text = _get(f"http://127.0.0.1:{gw.opts.admin_port}/stats?usedonly")
    except OSError:
        return out
    for line in text.splitlines():
        name, sep, value = line.partition(": ")
        problem = _ENVOY_PROBLEMS.match(name) and not _ENVOY_NORMAL.match(name)
        if sep and value.isdigit() and (problem or _QUOTA_OK.match(name)):
            out[name] = int(value)
    return out


def _worker_metrics(gw: Gateway) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    stages: dict[tuple[str, str], float] = collections.defaultdict(float)
    faults: dict[tuple[str, str], float] = collections.defaultdict(float)
    if not gw.opts.metrics_port:
        return stages, faults
    for url in gw.metrics_urls():
        try:
            text = _get(url)
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "wsgate_stage_seconds_sum":
                    stages[(s.labels["route"], s.labels["stage"])] += s.value
                elif s.name == "wsgate_faults_total":
                    faults[(s.labels["route"], s.labels["reason"])] += s.value
    return stages, faults


EXTPROC_PHASES = {"rh": "request headers", "rb": "request body", "sh": "response headers", "sb": "response body"}
_ACCESS_LINE = re.compile(r" route=(\S+) .* extproc=(\S+)$")


def extproc_latencies(lines: Iterable[str], route: str) -> tuple[dict[str, float], int]:
    """Mean ms per request of each ext_proc phase, from Envoy's access log (`extproc=rh:1037:0,rb:1:613:0,...`:
    headers phases are latency:status, body phases calls:total latency:status, in microseconds)."""
    totals: dict[str, float] = collections.defaultdict(float)
    n = 0
    for line in lines:
        m = _ACCESS_LINE.search(line.rstrip("\n"))
        if not m or m.group(1) != route or m.group(2) == "-":
            continue
        n += 1
        for item in m.group(2).split(","):
            parts = item.split(":")
            if parts[0] in ("rh", "sh") and len(parts) == 3:
                totals[parts[0]] += int(parts[1]) / 1000
            elif parts[0] in ("rb", "sb") and len(parts) == 4:
                totals[parts[0]] += int(parts[2]) / 1000
    return ({k: totals[k] / n for k in EXTPROC_PHASES if k in totals} if n else {}), n


def _stages_ms(before: Snapshot, after: Snapshot, route: str, requests: int) -> dict[str, float]:
    """The route's stage time per request, ms, between two snapshots."""
    return {
        stage: (total - before.stages.get((r, stage), 0.0)) / requests * 1000
        for (r, stage), total in after.stages.items()
        if r == route
    }


def snapshot(gw: Gateway) -> Snapshot:
    stages, faults = _worker_metrics(gw)
    envoy = _envoy_counters(gw)
    cpu = {role: sum(_cpu_seconds(p) for p in pids) for role, pids in _pids(gw).items()}
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return Snapshot(
        cpu=cpu, machine=_machine_seconds(), children=children.ru_utime + children.ru_stime,
        own=own.ru_utime + own.ru_stime, envoy=envoy, stages=stages, faults=faults,
    )  # fmt: skip
