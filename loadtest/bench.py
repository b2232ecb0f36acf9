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
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from certs import pki
from filters.engine.wss import secure_conversation as sc
from gateway.control.supervisor import Gateway, default_workers
from gateway.policy import PolicySet, load_dir
from loadtest import attachment_gateway, engine_cpu, outbound, targets, variants
from loadtest.archive import with_archive
from loadtest.bench_gateway import (
    _CLIENT_RESET,
    _QUOTA_OK,
    Snapshot,
    _env,
    _pids,
    _stages_ms,
    bench_gateway,
    extproc_latencies,
    snapshot,
)
from loadtest.bench_report import BENCH_PROFILES, Point, report, write_chart, write_csv
from loadtest.load_generators import WrkResult, percentile, run_paced, run_wrk
from loadtest.messages import (
    ENCRYPTED_KEY,
    HMAC_KEY_NAME,
    PROFILES,
    SIZES,
    CheckFailed,
    Factory,
    Message,
)

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "out"
DEFAULT_POLICIES = HERE / "policies"

# Upper bounds on what any XML route can reach, used to size the body pools before `xml` itself was measured
# (secured routes do everything `xml` does and more, so xml's measured rate bounds theirs once known).
DEFAULT_CAP_RPS = {"small": 3000.0, "large": 1500.0, "huge": 150.0}
CAP_MARGIN = 1.3
PLAIN_BODIES_PER_THREAD = 256  # none/tls/xml: distinct bodies, cycled (no replay detection there)


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
        args.policies = variants.hsm_policies(args.policies, args.certs, args.out / "policies-hsm")
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
