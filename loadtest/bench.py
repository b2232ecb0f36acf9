"""`make bench`: the gateway's cost per profile and message size, in one run, on this machine.

Brings the gateway up (gateway.control.supervisor.Gateway on free loopback ports, loadtest/policies/bench.yaml: one route
per profile, replay detection on every secured route), then for each profile and size measures

  - throughput at saturation: wrk (2 threads, 16 connections) POSTing pre-generated bodies through
    loadtest/bench.lua. Secured bodies are made by gateway.tools.client.Client beforehand (the gateway is idle then)
    and each is sent exactly once: the replay cache sees real, distinct traffic (secureconversation: in one
    context, established through the gateway before the first point). A thread that runs out of
    bodies stops rather than repeat one, and the point is measured again with more;
  - latency at a fixed moderate rate: an open-loop paced client (asyncio, keep-alive connections; wrk cannot
    pace and Debian has no wrk2). Latency is counted from when a request was due, so queueing is not hidden
    (no coordinated omission). Sampled replies are verified with Client.open and compared with what was sent;
  - the gateway's CPU per request: utime+stime of Envoy and the filter workers from /proc/<pid>/stat around
    the saturation run, divided by the requests wrk completed (the load generator's CPU is not counted);
  - where the filter's time goes: the workers' wsgate_stage_seconds histograms (sum per stage), as van
    Engelen's Figure 3.

Prints the results normalized to `none` (Sosnoski's Figure 1: time and gateway CPU per request), the stage
breakdown, the targets, and the engine's CPU per exchange in process beside Apache WSS4J's (loadtest/engine_cpu.py,
the gateway down by then), and the SwA attachment rows beside OpenSSL's floor, in process and through the gateway
(loadtest/attachment_gateway.py); writes loadtest/out/bench.csv, attachments.csv and bench.png. `run_bench()` is the same
machinery with every knob, for tests (a one-second smoke run) and for people.

    .venv/bin/python -m loadtest.bench [--profiles xml,hmac] [--sizes small] [--duration 10] ..."""

from __future__ import annotations

import argparse
import asyncio
import collections
import csv
import math
import multiprocessing
import os
import re
import resource
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from certs import hsm, pki
from filters.engine.wss import secure_conversation as sc
from gateway.control.ports import free_ports
from gateway.control.supervisor import Gateway, Options, default_workers
from gateway.policy import PolicySet, load_dir
from loadtest import attachment_gateway, engine_cpu, outbound, targets, variants
from loadtest.archive import with_archive
from loadtest.messages import (
    ENCRYPTED_KEY,
    HMAC_KEY_NAME,
    PROFILES,
    SIZE_LABELS,
    SIZES,
    CheckFailed,
    Factory,
    Message,
)

HERE = Path(__file__).resolve().parent
LUA = HERE / "bench.lua"
DEFAULT_OUT = HERE / "out"
DEFAULT_POLICIES = HERE / "policies"
CLK_TCK = os.sysconf("SC_CLK_TCK")
BENCH_PROFILES = {**PROFILES, **outbound.PROFILES}  # the inbound rows, then the outbound ones (loadtest/outbound.py)

# Upper bounds on what any XML route can reach, used to size the body pools before `xml` itself was measured
# (secured routes do everything `xml` does and more, so xml's measured rate bounds theirs once known).
DEFAULT_CAP_RPS = {"small": 3000.0, "large": 1500.0, "huge": 150.0}
CAP_MARGIN = 1.3
PLAIN_BODIES_PER_THREAD = 256  # none/tls/xml: distinct bodies, cycled (no replay detection there)

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


@dataclass
class Point:
    """One profile at one size: everything measured, as written to bench.csv."""

    profile: str
    size: str
    route: str
    request_bytes: float = 0.0  # average body sent (secured: as it went on the wire)
    response_bytes: float = 0.0  # average bytes read per response (wrk: headers included)
    duration_s: float = 0.0
    requests: int = 0
    rps: float = 0.0
    sat_p50_ms: float = 0.0
    sat_p99_ms: float = 0.0
    errors: int = 0  # wrk: non-2xx/3xx + socket errors + timeouts
    pool: int = 0  # bodies pre-generated for the saturation run
    pool_exhausted: bool = False  # still out of bodies after the retry: rps is a lower bound
    gen_s: float = 0.0  # time to pre-generate the saturation bodies (the gateway idle)
    gen_us_per_msg: float = 0.0
    paced_rate: float = 0.0
    paced_sent: int = 0
    paced_p50_ms: float = 0.0
    paced_p99_ms: float = 0.0
    paced_max_ms: float = 0.0
    paced_errors: int = 0
    verified: int = 0  # sampled paced replies opened and compared
    verify_failures: int = 0
    envoy_cpu_us: float = 0.0
    filter_cpu_us: float = 0.0
    gateway_cpu_us: float = 0.0  # Envoy + filter workers
    redis_cpu_us: float = 0.0  # the shared replay store (not in gateway_cpu_us)
    backend_cpu_us: float = 0.0  # the demo backend (not in gateway_cpu_us)
    wrk_cpu_us: float = 0.0  # the load generator
    other_cores: float = 0.0  # CPU used by unrelated processes during the run, in cores (noise)
    softirq_cores: float = 0.0  # the kernel's interrupt work (loopback networking, mostly), not per process
    time_ratio: float = 0.0  # time per request at saturation / none's, at this size (Sosnoski's Figure 1)
    cpu_ratio: float = 0.0  # gateway CPU per request / none's
    stages_ms: dict[str, float] = field(default_factory=dict)  # filter stage time per request
    # At the paced rate (no queueing): the worker's stages, and Envoy's account of each ext_proc phase (the time
    # from sending a phase's message to the filter's answer: the gRPC round trip plus the stages inside it).
    paced_stages_ms: dict[str, float] = field(default_factory=dict)
    extproc_ms: dict[str, float] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)  # wsgate_faults_total deltas by reason
    envoy_problems: dict[str, int] = field(default_factory=dict)
    quota_checks: dict[str, int] = field(default_factory=dict)  # at saturation, by stage: requests the service admitted
    notes: list[str] = field(default_factory=list)

    @property
    def stage_total_ms(self) -> float:
        return sum(self.stages_ms.values())

    @property
    def round_trip_ms(self) -> float:
        """The ext_proc exchange's own cost per request: Envoy's phase latencies less the worker's stages."""
        return max(0.0, sum(self.extproc_ms.values()) - sum(self.paced_stages_ms.values()))


# ---- the gateway


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


# ---- pre-generating messages (in worker processes, while the gateway is idle)

_factories: dict[str, Factory] = {}
_gen_args: tuple[Path, Path, str] | None = None


def _init_generator(policies: Path, certs: Path, hmac_key: str) -> None:
    global _gen_args
    _gen_args = (policies, certs, hmac_key)
    _factories.clear()


def _factory(profile: str, context: sc.Context | None = None) -> Factory:
    if profile not in _factories:
        assert _gen_args is not None
        policies, certs, hmac_key = _gen_args
        _factories[profile] = Factory(BENCH_PROFILES[profile], load_dir(policies), certs=certs, hmac_key=hmac_key)
    factory = _factories[profile]
    if factory.client is not None and context is not None:
        factory.client.context = context  # secureconversation: the context bench.py established
    return factory


def _write_bodies(profile: str, size: str, count: int, path: str, context: sc.Context | None = None) -> int:
    """Make `count` messages into a body file for bench.lua; returns the bytes written (bodies only)."""
    factory = _factory(profile, context)
    total = 0
    with open(path, "wb") as out:
        for _ in range(count):
            body = factory.make(size).body
            out.write(b"%d\n" % len(body))
            out.write(body)
            total += len(body)
    return total


def _make_messages(profile: str, size: str, count: int, context: sc.Context | None = None) -> list[Message]:
    factory = _factory(profile, context)
    return [factory.make(size) for _ in range(count)]


# ---- wrk


@dataclass
class WrkResult:
    requests: int
    duration_s: float
    bytes: int
    errors: int
    p50_ms: float
    p99_ms: float
    exhausted: bool
    raw: str

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


def run_wrk(url: str, path: str, content_type: str, bodies: Path, once: bool, threads: int, connections: int,
            duration: float) -> WrkResult:  # fmt: skip
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk not found: apt-get install wrk (Debian's package)")
    argv = [wrk, f"-t{threads}", f"-c{connections}", f"-d{max(1, round(duration))}s", "--timeout", "30s",
            "-s", str(LUA), url, "--", path, content_type, str(bodies), "once" if once else "cycle"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 120)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("WSGATE ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stdout}\n{proc.stderr}")
    v = {k: int(x) for k, x in (kv.split("=") for kv in line.split()[1:])}
    return WrkResult(
        requests=v["requests"], duration_s=v["duration_us"] / 1e6, bytes=v["bytes"],
        errors=v["connect"] + v["read"] + v["write"] + v["status"] + v["timeout"],
        p50_ms=v["p50_us"] / 1000, p99_ms=v["p99_us"] / 1000, exhausted=v["exhausted_threads"] > 0,
        raw=proc.stdout,
    )  # fmt: skip


# ---- the paced client


@dataclass
class PacedResult:
    sent: int
    latencies_ms: list[float]
    statuses: collections.Counter[int]
    errors: list[str]
    replies: dict[int, tuple[int, bytes]]  # sampled: index -> (status, body)
    duration_s: float


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        k, sep, v = line.partition(":")
        if sep:
            headers[k.strip().lower()] = v.strip()
    keep_alive = headers.get("connection", "").lower() != "close"
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass
                break
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        body = b"".join(parts)
    else:
        body, keep_alive = await reader.read(), False
    return status, body, keep_alive


async def _paced(host: str, port: int, tls: ssl.SSLContext | None, path: str, content_type: str,
                 bodies: list[bytes], rate: float, connections: int, sample: set[int],
                 timeout: float) -> PacedResult:  # fmt: skip
    queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()
    latencies: list[float] = []
    statuses: collections.Counter[int] = collections.Counter()
    errors: list[str] = []
    replies: dict[int, tuple[int, bytes]] = {}
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(host, port, ssl=tls, limit=1 << 20)

    async def worker(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None) -> None:
        while (item := await queue.get()) is not None:
            i, due = item
            body = bodies[i]
            try:
                if conn is None:
                    conn = await connect()
                reader, writer = conn
                writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
                status, reply, keep_alive = await asyncio.wait_for(_read_response(reader), timeout)
                latencies.append((time.perf_counter() - due) * 1000)
                statuses[status] += 1
                if i in sample or (status != 200 and len(replies) < len(sample) + 5):
                    replies[i] = (status, reply)
                if not keep_alive:
                    writer.close()
                    conn = None
            except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as exc:
                errors.append(f"request {i}: {type(exc).__name__}: {exc}")
                if conn is not None:
                    conn[1].close()
                conn = None
        if conn is not None:
            conn[1].close()

    conns = [await connect() for _ in range(connections)]
    tasks = [asyncio.create_task(worker(c)) for c in conns]
    # perf_counter, not loop.time(): uvloop's clock has millisecond steps.
    start = time.perf_counter() + 0.05
    for i in range(len(bodies)):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        queue.put_nowait((i, due))
    for _ in tasks:
        queue.put_nowait(None)
    await asyncio.gather(*tasks)
    return PacedResult(len(bodies), latencies, statuses, errors, replies, time.perf_counter() - start)


def run_paced(url: str, path: str, content_type: str, bodies: list[bytes], rate: float, connections: int = 16,
              sample: Iterable[int] = (), ca: Path | None = None, timeout: float = 30) -> PacedResult:  # fmt: skip
    """Send `bodies` at `rate` per second (open loop) over `connections` keep-alive connections."""
    scheme, _, hostport = url.partition("://")
    host, _, port = hostport.rstrip("/").rpartition(":")
    tls = ssl.create_default_context(cafile=str(ca) if ca else None) if scheme == "https" else None
    coro = _paced(host, int(port), tls, path, content_type, bodies, rate, connections, set(sample), timeout)
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# ---- one point


@dataclass
class Bench:
    gw: Gateway
    policies: PolicySet
    out: Path
    pool: Any  # multiprocessing Pool
    duration: float
    huge_duration: float
    paced_duration: float
    rate: float
    threads: int
    connections: int
    hmac_key: str
    log: IO[str]
    measured: dict[tuple[str, str], float] = field(default_factory=dict)  # (profile, size) -> rps
    contexts: dict[str, sc.Context] = field(default_factory=dict)

    def url(self, tls: bool) -> str:
        o = self.gw.opts
        return f"https://127.0.0.1:{o.https_port}" if tls else f"http://127.0.0.1:{o.http_port}"

    def say(self, text: str) -> None:
        print(text, file=self.log, flush=True)

    def cap_rps(self, profile: str, size: str) -> float:
        if profile != "xml" and ("xml", size) in self.measured:
            return self.measured[("xml", size)] * CAP_MARGIN
        return DEFAULT_CAP_RPS[size]

    def context(self, profile: str) -> sc.Context | None:
        """secureconversation: one context, established once through the gateway, for the whole bench."""
        if not BENCH_PROFILES[profile].context:
            return None
        if profile not in self.contexts:
            factory = Factory(profile, self.policies, certs=self.gw.opts.certs, hmac_key=self.hmac_key)
            route = self.policies.route(BENCH_PROFILES[profile].route)
            tls = BENCH_PROFILES[profile].tls
            self.contexts[profile] = factory.establish(
                f"{self.url(tls)}{route.match.path_prefix}demo", verify=str(self.gw.opts.certs / "ca.pem")
            )
        return self.contexts[profile]

    def make_bodies(self, profile: str, size: str, per_thread: int) -> tuple[Path, int, float]:
        prefix = self.out / "bodies" / f"{profile}-{size}"
        prefix.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        ctx = self.context(profile)
        jobs = [(profile, size, per_thread, f"{prefix}.{t}", ctx) for t in range(self.threads)]
        total = sum(self.pool.starmap(_write_bodies, jobs))
        return prefix, total, time.perf_counter() - started

    def measure(self, profile_name: str, size: str) -> Point:
        profile = BENCH_PROFILES[profile_name]
        route = self.policies.route(profile.route)
        path = f"{route.match.path_prefix}demo"
        # Outbound rows: plain SOAP to the route's own listener (the gateway secures it for its partner).
        url = f"http://{route.outbound.listen}" if route.outbound else self.url(profile.tls)
        ctype = "text/xml; charset=utf-8"
        point = Point(profile_name, size, route.name)
        duration = self.huge_duration if size == "huge" else self.duration

        if route.outbound is not None:
            # One call first: an outbound secureconversation route gets its context now, not under load (its
            # partner, this gateway, would find every worker busy waiting for it).
            body = _make_messages(profile_name, "small", 1)[0].body
            request = urllib.request.Request(url + path, data=body, headers={"content-type": ctype})
            with urllib.request.urlopen(request, timeout=30) as reply:
                reply.read()

        # Saturation.
        once = profile.secured
        if once:
            per_thread = math.ceil(self.cap_rps(profile_name, size) * duration / self.threads) + self.connections
        else:
            per_thread = PLAIN_BODIES_PER_THREAD
        for attempt in (1, 2):
            prefix, body_bytes, gen_s = self.make_bodies(profile_name, size, per_thread)
            point.pool, point.gen_s = per_thread * self.threads, gen_s
            point.gen_us_per_msg = gen_s / point.pool * 1e6
            point.request_bytes = body_bytes / point.pool
            before = snapshot(self.gw)
            wrk = run_wrk(url, path, ctype, prefix, once, self.threads, self.connections, duration)
            after = snapshot(self.gw)
            for t in range(self.threads):
                Path(f"{prefix}.{t}").unlink(missing_ok=True)
            if not wrk.exhausted:
                break
            if attempt == 1:
                self.say(f"    {per_thread * self.threads} bodies ran out at {wrk.rps:.0f} req/s: measuring again")
                per_thread = math.ceil(per_thread * 2.5)
        point.pool_exhausted = wrk.exhausted
        if wrk.exhausted:
            point.notes.append("pool exhausted twice: req/s is a lower bound")
        point.duration_s, point.requests, point.rps = wrk.duration_s, wrk.requests, wrk.rps
        point.sat_p50_ms, point.sat_p99_ms, point.errors = wrk.p50_ms, wrk.p99_ms, wrk.errors
        point.response_bytes = wrk.bytes / wrk.requests if wrk.requests else 0.0
        self.measured[(profile_name, size)] = wrk.rps
        self._account(point, before, after, wrk)

        # Latency at a fixed moderate rate.
        self._paced(point, profile_name, size, url, path, ctype)
        return point

    def _account(self, point: Point, before: Snapshot, after: Snapshot, wrk: WrkResult) -> None:
        n = max(1, wrk.requests)
        d = {role: after.cpu[role] - before.cpu[role] for role in after.cpu}
        point.envoy_cpu_us = d["envoy"] / n * 1e6
        point.filter_cpu_us = d["filter"] / n * 1e6
        point.gateway_cpu_us = point.envoy_cpu_us + point.filter_cpu_us
        point.redis_cpu_us = d["redis"] / n * 1e6
        point.backend_cpu_us = d["backend"] / n * 1e6
        wrk_cpu = after.children - before.children
        point.wrk_cpu_us = wrk_cpu / n * 1e6
        ours = sum(d.values()) + wrk_cpu + (after.own - before.own)
        seconds = max(wrk.duration_s, 1e-9)
        point.other_cores = max(0.0, (after.machine[0] - before.machine[0] - ours) / seconds)
        point.softirq_cores = (after.machine[1] - before.machine[1]) / seconds
        point.stages_ms = _stages_ms(before, after, point.route, n)
        for (route, reason), total in after.faults.items():
            delta = int(total - before.faults.get((route, reason), 0.0))
            if route == point.route and delta:
                point.faults[reason] = delta
        for name, value in after.envoy.items():
            delta = value - before.envoy.get(name, 0)
            if quota := _QUOTA_OK.match(name):
                if quota.group(1) == point.route and delta:
                    point.quota_checks[quota.group(2)] = delta
            elif delta > (self.connections if _CLIENT_RESET.match(name) else 0):
                point.envoy_problems[name] = delta

    def _paced(self, point: Point, profile: str, size: str, url: str, path: str, ctype: str) -> None:
        rate = max(1.0, min(self.rate, point.rps / 2))
        count = max(1, math.ceil(rate * self.paced_duration))
        per_job = math.ceil(count / self.threads)
        ctx = self.context(profile)
        batches = self.pool.starmap(_make_messages, [(profile, size, per_job, ctx)] * self.threads)
        messages = [m for batch in batches for m in batch][:count]
        want = 5 if size == "huge" else 20
        sample = set(range(0, count, max(1, count // want)))
        log = self.gw.logs / "envoy.log"
        log_start = log.stat().st_size if log.exists() else 0
        before = snapshot(self.gw)
        result = run_paced(url, path, ctype, [m.body for m in messages], rate, self.connections, sample,
                           ca=self.gw.opts.certs / "ca.pem")  # fmt: skip
        after = snapshot(self.gw)
        point.paced_rate, point.paced_sent = rate, result.sent
        time.sleep(1.2)  # Envoy flushes its access log every second (wsgate up: --file-flush-interval-msec)
        if log.exists():
            with log.open() as f:
                f.seek(log_start)
                point.extproc_ms, logged = extproc_latencies(f, point.route)
            if logged:
                point.paced_stages_ms = _stages_ms(before, after, point.route, logged)
        point.paced_p50_ms = percentile(result.latencies_ms, 50)
        point.paced_p99_ms = percentile(result.latencies_ms, 99)
        point.paced_max_ms = max(result.latencies_ms, default=float("nan"))
        point.paced_errors = len(result.errors) + sum(c for s, c in result.statuses.items() if s != 200)
        for err in result.errors[:3]:
            point.notes.append(f"paced: {err}")
        factory = Factory(BENCH_PROFILES[profile], self.policies, certs=self.gw.opts.certs, hmac_key=self.hmac_key,
                          context=ctx)  # fmt: skip
        for i, (status, reply) in sorted(result.replies.items()):
            try:
                factory.check(status, reply, messages[i])
                point.verified += 1
            except CheckFailed as exc:
                point.verify_failures += 1
                if point.verify_failures <= 3:
                    point.notes.append(f"paced reply {i} failed its check: {exc}")


# ---- reporting


def _fmt(value: float, digits: int = 0) -> str:
    if value != value:  # NaN
        return "-"
    return f"{value:,.{digits}f}"


def _ratio(value: float) -> str:
    return "-" if not value or value != value else f"{value:.1f}x"


def normalize(points: list[Point]) -> None:
    """time_ratio and cpu_ratio against `none` at the same size (Sosnoski's Figure 1 normalizes to plain)."""
    base = {p.size: p for p in points if p.profile == "none"}
    for p in points:
        b = base.get(p.size)
        if b is None:
            continue
        p.time_ratio = b.rps / p.rps if p.rps else 0.0
        p.cpu_ratio = p.gateway_cpu_us / b.gateway_cpu_us if b.gateway_cpu_us else 0.0


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True)))
    ]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        )
    return "\n".join(lines)


def report(points: list[Point], floors: targets.Floors, out: IO[str]) -> None:
    normalize(points)
    profiles = [p for p in BENCH_PROFILES if any(x.profile == p for x in points)]
    sizes = [s for s in SIZES if any(x.size == s for x in points)]
    at = {(p.profile, p.size): p for p in points}

    def grid(title: str, cell: Any) -> None:
        print(f"\n{title}", file=out)
        header = ["profile", *(f"{s} ({SIZE_LABELS[s]})" for s in sizes)]
        rows = [[prof, *(cell(at[(prof, s)]) if (prof, s) in at else "-" for s in sizes)] for prof in profiles]
        print(_table(header, rows), file=out)

    grid(
        "Throughput at saturation, req/s (wrk) -- in brackets: time per request relative to none, as Sosnoski's "
        "Figure 1",
        lambda p: f"{_fmt(p.rps)}{'+' if p.pool_exhausted else ''} ({_ratio(p.time_ratio)})",
    )
    grid(
        "Latency at a fixed moderate rate, p50 / p99 ms (open loop; rate in req/s in brackets)",
        lambda p: f"{_fmt(p.paced_p50_ms, 1)} / {_fmt(p.paced_p99_ms, 1)} ({_fmt(p.paced_rate)}/s)",
    )
    grid(
        "Gateway CPU per request at saturation, us: Envoy + filter workers = total (relative to none)",
        lambda p: (
            f"{_fmt(p.envoy_cpu_us)} + {_fmt(p.filter_cpu_us)} = {_fmt(p.gateway_cpu_us)} ({_ratio(p.cpu_ratio)})"
        ),
    )
    grid(
        "Demo backend CPU per request, us (the service behind the gateway, not counted above; it bounds none)",
        lambda p: _fmt(p.backend_cpu_us),
    )
    grid(
        "Message sizes on the wire, bytes: request / response (wrk's response bytes include HTTP headers)",
        lambda p: f"{_fmt(p.request_bytes)} / {_fmt(p.response_bytes)}",
    )

    staged = [p for p in points if p.stages_ms]
    if staged:
        seen = {s for p in staged for s in p.stages_ms}
        stages = [s for s in STAGES if s in seen] + sorted(seen - set(STAGES))
        print(
            "\nWhere the filter's time goes (workers' wsgate_stage_seconds sums, request and response sides "
            "together), % of the staged time -- as van Engelen's Figure 3",
            file=out,
        )
        header = ["profile/size", *stages, "staged ms/req", "filter CPU ms/req", "staged/CPU"]
        rows = []
        for p in sorted(staged, key=lambda x: (profiles.index(x.profile), sizes.index(x.size))):
            total = p.stage_total_ms
            rows.append([
                f"{p.profile} {p.size}",
                *(f"{100 * p.stages_ms.get(s, 0.0) / total:.0f}%" if total else "-" for s in stages),
                f"{total:.3f}", f"{p.filter_cpu_us / 1000:.3f}",
                f"{100 * total / (p.filter_cpu_us / 1000):.0f}%" if p.filter_cpu_us else "-",
            ])  # fmt: skip
        print(_table(header, rows), file=out)
        print(
            "  (stages are wall-clock time inside the worker; staged/CPU under 100%: the rest of the filter's CPU is "
            "the ext_proc exchange itself (the compiled frame, the call into Python); over 100%: the worker waited for a core)",
            file=out,
        )

    tripped = [p for p in points if p.extproc_ms]
    if tripped:
        print(
            "\nThe ext_proc hop at the paced rate, ms per request: Envoy's latency of each phase (message sent to the "
            "filter's answer), the worker's stages inside them, and the rest -- the gRPC round trips themselves",
            file=out,
        )
        header = ["profile/size", *EXTPROC_PHASES.values(), "stages", "round trips", "round trips %"]
        rows = []
        for p in sorted(tripped, key=lambda x: (profiles.index(x.profile), sizes.index(x.size))):
            hop = sum(p.extproc_ms.values())
            rows.append([
                f"{p.profile} {p.size}", *(f"{p.extproc_ms.get(k, 0.0):.3f}" for k in EXTPROC_PHASES),
                f"{sum(p.paced_stages_ms.values()):.3f}", f"{p.round_trip_ms:.3f}",
                f"{100 * p.round_trip_ms / hop:.0f}%" if hop else "-",
            ])  # fmt: skip
        print(_table(header, rows), file=out)

    quoted = [p for p in points if p.quota_checks]
    if quoted:
        print("\nQuotas (--quotas): requests the rate-limit service admitted at saturation, per stage, per request",
              file=out)  # fmt: skip
        stages = sorted({s for p in quoted for s in p.quota_checks})
        rows = [[f"{p.profile} {p.size}", *(f"{p.quota_checks.get(s, 0) / max(1, p.requests):.2f}" for s in stages)]
                for p in quoted]  # fmt: skip
        print(_table(["profile/size", *stages], rows), file=out)

    outbound.report(points, out)
    targets.report(lambda prof, size: at.get((prof, size)), floors, out)

    problems = [p for p in points if p.errors or p.paced_errors or p.verify_failures or p.faults or p.notes
                or p.envoy_problems]  # fmt: skip
    print("\nErrors and anomalies", file=out)
    if not problems:
        print("  none: every request answered 2xx, every sampled reply verified", file=out)
    for p in problems:
        bits = []
        if p.errors:
            bits.append(f"wrk errors {p.errors} of {p.requests}")
        if p.paced_errors:
            bits.append(f"paced errors {p.paced_errors} of {p.paced_sent}")
        if p.verify_failures:
            bits.append(f"{p.verify_failures} of {p.verified + p.verify_failures} sampled replies failed checks")
        if p.faults:
            bits.append("filter faults " + ", ".join(f"{k}={v}" for k, v in sorted(p.faults.items())))
        if p.envoy_problems:
            bits.append("envoy " + ", ".join(f"{k}=+{v}" for k, v in sorted(p.envoy_problems.items())))
        bits.extend(p.notes)
        print(f"  {p.profile} {p.size}: " + "; ".join(bits), file=out)
    noisy = [p for p in points if p.other_cores > 0.15]
    if noisy:
        print(
            "  noise: other processes on this machine used CPU during "
            + ", ".join(f"{p.profile} {p.size} ({p.other_cores:.2f} cores)" for p in noisy),
            file=out,
        )


_DICTS = ("stages_ms", "paced_stages_ms", "extproc_ms", "faults", "envoy_problems", "quota_checks", "notes")
CSV_FIELDS = [f for f in Point.__dataclass_fields__ if f not in _DICTS]
# Exclusive times (filters/engine/metrics.py): security_header and secure are what is left of the header's processing
# and building once the finer stages inside them are counted apart.
STAGES = ("parse", "decrypt", "c14n", "digest", "signature_check", "replay", "security_header", "schema",
          "signature_creation", "encryption", "secure", "serialize")  # fmt: skip


def write_csv(points: list[Point], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = sorted({s for p in points for s in p.stages_ms} - set(STAGES))
    stage_cols = [f"stage_{s}_ms" for s in (*STAGES, *extra)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        trip_cols = [f"extproc_{k}_ms" for k in EXTPROC_PHASES]
        w.writerow([*CSV_FIELDS, *stage_cols, *trip_cols, "round_trip_ms", "faults", "envoy_problems", "notes"])
        for p in points:
            d = asdict(p)
            w.writerow([
                *(round(d[k], 3) if isinstance(d[k], float) else d[k] for k in CSV_FIELDS),
                *(round(p.stages_ms.get(c[6:-3], 0.0), 4) for c in stage_cols),
                *(round(p.extproc_ms.get(k, 0.0), 4) for k in EXTPROC_PHASES), round(p.round_trip_ms, 4),
                ";".join(f"{k}={v}" for k, v in sorted(p.faults.items())),
                ";".join(f"{k}={v}" for k, v in sorted(p.envoy_problems.items())),
                " | ".join(p.notes),
            ])  # fmt: skip


def write_chart(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = [p for p in BENCH_PROFILES if any(x.profile == p for x in points)]
    sizes = [s for s in SIZES if any(x.size == s for x in points)]
    at = {(p.profile, p.size): p for p in points}
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    width = 0.8 / len(sizes)
    xs = range(len(profiles))

    def bars(ax: Any, metric: str, title: str, log: bool = False) -> None:
        for j, s in enumerate(sizes):
            vals = [getattr(at[(p, s)], metric) if (p, s) in at else 0 for p in profiles]
            pos = [x + (j - (len(sizes) - 1) / 2) * width for x in xs]
            ax.bar(pos, vals, width, color=f"C{j}", label=f"{s} ({SIZE_LABELS[s]})")
        ax.set_xticks(list(xs), profiles, rotation=20)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)

    bars(axes[0][0], "rps", "throughput at saturation (req/s)", log=True)
    bars(axes[0][1], "time_ratio", "time per request relative to none (Sosnoski Fig. 1)")
    # CPU: the gateway's total per request, with Envoy's part hatched over it (log scale: sizes differ 1000x).
    ax = axes[1][0]
    for j, s in enumerate(sizes):
        pos = [x + (j - (len(sizes) - 1) / 2) * width for x in xs]
        total = [at[(p, s)].gateway_cpu_us if (p, s) in at else 0 for p in profiles]
        envoy = [at[(p, s)].envoy_cpu_us if (p, s) in at else 0 for p in profiles]
        ax.bar(pos, total, width, color=f"C{j}", label=f"{s} ({SIZE_LABELS[s]})")
        ax.bar(pos, envoy, width, fill=False, hatch="//", edgecolor="black", linewidth=0,
               label="of which Envoy" if j == len(sizes) - 1 else None)  # fmt: skip
    ax.set_xticks(list(xs), profiles, rotation=20)
    ax.set_yscale("log")
    ax.set_ylim(bottom=10)
    ax.set_title("gateway CPU per request (us): Envoy + filter workers; Envoy's part hatched")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    bars(axes[1][1], "paced_p99_ms", "p99 latency at a moderate fixed rate (ms)", log=True)
    fig.suptitle("WSGate benchmark (loadtest/bench.py)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- the whole run


def run_bench(
    profiles: Iterable[str] = tuple(BENCH_PROFILES),
    sizes: Iterable[str] = ("small", "large", "huge"),
    duration: float = 10.0,
    huge_duration: float = 5.0,
    paced_duration: float = 5.0,
    rate: float = 200.0,
    threads: int = 2,
    connections: int = 16,
    workers: int | None = None,
    out: Path = DEFAULT_OUT,
    policies: Path = DEFAULT_POLICIES,
    certs: Path = pki.DEFAULT_DIR,
    hmac_key: str = HMAC_KEY_NAME,
    chart: bool = True,
    log: IO[str] = sys.stdout,
    engine_scale: float = 1.0,
) -> list[Point]:
    """Measure every (profile, size) on a gateway of its own; print the report, write bench.csv (and bench.png).
    Then, the gateway down, the engine's CPU per exchange in process beside WSS4J's (loadtest/engine_cpu.py;
    `engine_scale` multiplies its exchange counts, 0 skips it), and the attachment rows (loadtest/attachment_gateway.py:
    those through the gateway measured before it goes down, the same scale)."""
    profiles, sizes = list(profiles), list(sizes)
    for p in profiles:
        if p not in BENCH_PROFILES:
            raise ValueError(f"unknown profile {p!r}: one of {', '.join(BENCH_PROFILES)}")
    for s in sizes:
        if s not in SIZES:
            raise ValueError(f"unknown size {s!r}: one of {', '.join(SIZES)}")
    # Plain first: `none` is the baseline, and xml's rate bounds the secured routes' pool sizes.
    profiles = sorted(profiles, key=list(BENCH_PROFILES).index)
    out = Path(out).resolve()
    certs = pki.init(Path(certs)).resolve()
    policies = Path(policies).resolve()
    if any(p in outbound.PROFILES for p in profiles):
        policies = outbound.policy_dir(policies, out / "policies-outbound")
    workers = workers or default_workers()
    inbound = [p for p in profiles if p in PROFILES]  # the engine's in-process measure has no outbound rows
    engine_rows = engine_scale > 0 and engine_cpu.secured(inbound)
    started = time.monotonic()
    points: list[Point] = []
    print(
        f"WSGate bench: {len(profiles)} profiles x {len(sizes)} sizes; wrk {threads} threads {connections} "
        f"connections, {duration:g} s per point ({huge_duration:g} s huge); paced {paced_duration:g} s at "
        f"min({rate:g}, saturation/2) req/s; {workers} filter workers, Envoy --concurrency 1; {os.cpu_count()} "
        f"cores shared by gateway, backend and load generators",
        file=log,
    )
    print(
        f"Replay detection on for every secured route (store auto); every secured body is sent once. hmac and "
        f"username sign with {'a fresh key per message in an EncryptedKey' if hmac_key == ENCRYPTED_KEY else f'the pre-shared key {hmac_key!r}'}.",
        file=log,
        flush=True,
    )  # fmt: skip
    with bench_gateway(policies, certs, out / "run", workers) as gw:
        policy_set = load_dir(policies)
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(threads, _init_generator, (policies, certs, hmac_key)) as pool:
            _init_generator(policies, certs, hmac_key)
            bench = Bench(gw, policy_set, out, pool, duration, huge_duration, paced_duration, rate, threads,
                          connections, hmac_key, log)  # fmt: skip
            for prof in profiles:
                for size in sizes:
                    pids = _pids(gw)
                    p = bench.measure(prof, size)
                    gw.supervise_once()  # restarts a worker that died; Envoy dying raises
                    if _pids(gw) != pids:
                        p.notes.append("a filter worker died during this point and was restarted")
                    points.append(p)
                    print(
                        f"  {prof:14} {size:5} {p.rps:8.0f} req/s  p50 {p.paced_p50_ms:7.1f} ms  p99 "
                        f"{p.paced_p99_ms:7.1f} ms at {p.paced_rate:.0f}/s  CPU {p.envoy_cpu_us:5.0f}+"
                        f"{p.filter_cpu_us:6.0f} us/req  errors {p.errors + p.paced_errors}  pool {p.pool} "
                        f"(made in {p.gen_s:.1f} s)",
                        file=log,
                        flush=True,
                    )
        swa = attachment_gateway.run(gw, policy_set, certs, engine_scale) if engine_rows else []
        shutil.rmtree(out / "bodies", ignore_errors=True)
    report(points, targets.measure_floors(sizes), log)
    written = [out / "bench.csv"]
    if engine_rows:
        with _env(WSGATE_BENCH_CERTS=str(certs)):
            policy_set = load_dir(policies)
        engine_cpu.report(engine_cpu.run(inbound, sizes, policy_set, certs, engine_scale), log)
        swa_csv = out / "attachments.csv"
        written.append(attachment_gateway.report_all(swa, policy_set, certs, engine_scale, log, swa_csv))
    write_csv(points, out / "bench.csv")
    if chart:
        write_chart(points, out / "bench.png")
        written.append(out / "bench.png")
    gen = sum(p.gen_s for p in points)
    print(
        f"\nWrote {', '.join(str(w) for w in written)}; {time.monotonic() - started:.0f} s in all, of which "
        f"{gen:.0f} s pre-generating {sum(p.pool for p in points if BENCH_PROFILES[p.profile].secured):,} secured "
        "saturation bodies",
        file=log,
        flush=True,
    )
    return points


def hsm_policies(policies: Path, certs: Path, out: Path) -> Path:
    """`policies` copied into `out` with the gateway's private keys (gateway-sign, gateway-enc) in a SoftHSM2 token
    made from `certs` (certs/hsm.py), SOFTHSM2_CONF set for this process and the gateway it starts: the rsa rows
    then measure the token beside a run without --hsm (the file keys)."""
    os.environ["SOFTHSM2_CONF"] = str(hsm.init(certs, certs))
    out.mkdir(parents=True, exist_ok=True)
    for src in policies.glob("*.yaml"):
        text = src.read_text()
        for label in hsm.KEYS:
            text = text.replace(f'"${{WSGATE_BENCH_CERTS:-certs/out}}/{label}.key"', f'"{hsm.uri(certs, label)}"')
        (out / src.name).write_text(text)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", default=",".join(BENCH_PROFILES), help="comma-separated: " + ", ".join(BENCH_PROFILES))
    p.add_argument("--sizes", default="small,large,huge", help="comma-separated: small, large, huge")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of wrk per point")
    p.add_argument("--huge-duration", type=float, default=5.0, help="seconds of wrk per huge point")
    p.add_argument("--paced-duration", type=float, default=5.0, help="seconds of paced load per point")
    p.add_argument("--rate", type=float, default=200.0, help="paced rate, req/s (at most half the saturation)")
    p.add_argument("--threads", type=int, default=2, help="wrk threads (and message generator processes)")
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--workers", type=int, default=None, help="filter workers (default: one per core)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--policies", type=Path, default=DEFAULT_POLICIES)
    p.add_argument("--certs", type=Path, default=pki.DEFAULT_DIR)
    p.add_argument("--hmac-key", default=HMAC_KEY_NAME,
                   help=f"hmac/username signing key: a pre-shared key name, or {ENCRYPTED_KEY!r}")  # fmt: skip
    p.add_argument("--no-chart", action="store_true")
    p.add_argument("--hsm", action="store_true",
                   help="the gateway's private keys in a SoftHSM2 token (compare the rsa rows with a run without)")  # fmt: skip
    p.add_argument("--archive", action="store_true",
                   help="every secured route archives (docs/audit.md): compare its rows with a run without")  # fmt: skip
    p.add_argument("--tracing", metavar="HOST:PORT",
                   help="trace to this OTLP/HTTP collector (docs/tracing.md): the rows with tracing on, then on "
                        "beside off in one run (loadtest/tracing_ab.py)")  # fmt: skip
    p.add_argument("--sampling-percent", type=float, default=1.0, help="with --tracing (the policy's default: 1)")
    p.add_argument("--quotas", action="store_true",
                   help="every route's quotas on, never reached (docs/quotas.md): the rows with quotas on")  # fmt: skip
    p.add_argument("--engine-scale", type=float, default=1.0,
                   help="multiply the in-process engine measure's exchange counts (0: skip it)")  # fmt: skip
    args = p.parse_args(argv)
    if args.hsm:
        args.policies = hsm_policies(args.policies, args.certs, args.out / "policies-hsm")
    if args.archive:
        args.policies = with_archive(args.policies, args.out / "policies-archive", args.out / "archive")
    untraced = args.policies
    if args.tracing or args.quotas:
        out = args.out / "policies-observed"
        args.policies = variants.write(args.policies, out, args.tracing, args.sampling_percent, args.quotas)
    try:
        run_bench(
            profiles=[x for x in args.profiles.split(",") if x], sizes=[x for x in args.sizes.split(",") if x],
            duration=args.duration, huge_duration=args.huge_duration, paced_duration=args.paced_duration,
            rate=args.rate, threads=args.threads, connections=args.connections, workers=args.workers,
            out=args.out, policies=args.policies, certs=args.certs, hmac_key=args.hmac_key,
            chart=not args.no_chart, engine_scale=args.engine_scale, log=sys.stdout,
        )  # fmt: skip
        if args.tracing:  # issue 27's row: on beside off in one run, finer than these rows beside another run's
            ab = [sys.executable, "-m", "loadtest.tracing_ab", "--collector", args.tracing, "--sampling-percent",
                  str(args.sampling_percent), "--out", str(args.out), "--policies", str(untraced), "--certs",
                  str(args.certs), *(["--workers", str(args.workers)] if args.workers else [])]  # fmt: skip
            sys.stdout.flush()
            subprocess.run(ab, check=True)  # a process of its own: tracing_ab builds on this module
    except (ValueError, RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
