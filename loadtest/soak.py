"""The soak: load at a share of saturation across every profile while faults strike, `python -m loadtest.soak`.

It starts its own gateway (the default workers, the supervisor's private Redis, the demo backend; the policies of
`make bench`), finds saturation with a short closed-loop ramp, then drives `--share` of it (default 60%) for
`--duration` seconds from a pool of threads, every profile in turn; every reply is opened with the project's
client (gateway.tools.client: signatures verified, decrypted) and compared with what was sent. Faults strike at random
moments, seeded (`--seed`, printed): loadtest/faults.py.

Every request is counted once, per second and in total:

    ok         answered, verified, and the backend's answer to what was sent
    refused    a documented refusal while a fault settles (from its strike until SETTLE_S after it is over; a
               killed process is over once the supervisor replaced it): 503 (the backend or the
               worker down, a worker restarting), or a SOAP fault the fault explains (the replay store unavailable: 500 Server; a message signed before
               the store's replay epoch: MessageExpired; a context issued before it: BadContextToken)
    lost       a connection reset, a timeout, any other status or fault
    corrupted  a reply that fails verification or says something else than the backend said

and apart from the load: `replays accepted`, accepted messages sent again (a burst after each Redis kill and in
each hostile burst) that got through; `hostile accepted`, oversized/deep/namespace-flood requests that did;
with `--archive`, `archive missing`: accepted secured requests the archive does not hold (loadtest/archive.py);
with `--quotas` (every route's quotas on, never reached), the flood of a route with a per-second quota in each
hostile burst: `flood refused` (429, the SOAP fault, Retry-After) and `flood over limit` (admitted beyond it).
`--tracing HOST:PORT`: spans to that collector (docs/performance.md, "The soak").
Memory: VmRSS of Envoy, each worker and Redis, every second. Output: a table, loadtest/out/soak.csv (per second),
loadtest/out/soak.png."""

from __future__ import annotations

import argparse
import collections
import csv
import hashlib
import itertools
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import requests
from lxml import etree

from certs import pki
from gateway.control.supervisor import Gateway, _rss_mb, default_workers
from loadtest import faults, variants
from loadtest.archive import DSN_ENV, ArchiveDb, missing, with_archive
from loadtest.bench import DEFAULT_OUT, DEFAULT_POLICIES
from loadtest.bench_gateway import bench_gateway
from loadtest.bench_report import _table
from loadtest.load_generators import percentile
from loadtest.messages import PROFILES, CheckFailed, Factory, Message

COUNTS = ("sent", "ok", "refused", "lost", "corrupted", "replays sent", "replays accepted", "hostile sent",
          "hostile accepted")  # fmt: skip
# With --quotas: the attacker's flood of the flood route in each hostile burst (loadtest/variants.py), and what
# the rate-limit service made of it. `flood over limit`: admitted beyond the limit of the seconds it spanned.
FLOOD_COUNTS = ("flood sent", "flood refused", "flood admitted", "flood over limit")
FLOOD_PER_SECOND, FLOOD_REQUESTS = 5, 30
TIMEOUT_S = 15.0  # a reply slower than this is lost
# SOAP fault codes a fault explains while it settles (see the module docstring).
SETTLING_CODES = {"Server", "Receiver", "MessageExpired", "BadContextToken"}
REPLAYS_PER_BURST = 20
# The client's XML and crypto (lxml, xmlsec) are not safe to run on several threads at once (a double free in
# libxml2 was the soak's first finding, in the client): messages are made and opened one at a time, the HTTP
# exchanges run in parallel.
CLIENT = threading.Lock()


def fault_code(body: bytes) -> str | None:
    """The SOAP fault's code local name (1.1 faultcode, 1.2 Subcode or Code), or None when it is no fault."""
    try:
        with CLIENT:
            root = etree.fromstring(body)
    except etree.XMLSyntaxError:
        return None
    code = (
        root.findtext(".//faultcode") or root.findtext(".//{*}Subcode/{*}Value") or root.findtext(".//{*}Code/{*}Value")
    )
    return code.split(":")[-1] if code else None


@dataclass
class Tally:
    """What happened, per second of the run and per profile; thread-safe."""

    started: float
    seconds: dict[int, Counter[str]] = field(default_factory=lambda: collections.defaultdict(Counter))
    latency_ms: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    by_profile: dict[str, Counter[str]] = field(default_factory=lambda: collections.defaultdict(Counter))
    why: Counter[str] = field(default_factory=Counter)  # "lost: ...", "refused: ...", "corrupted: ..."
    memory: dict[int, dict[str, float]] = field(default_factory=dict)  # second -> process -> MiB
    events: list[tuple[float, str]] = field(default_factory=list)  # (seconds into the run, what happened)
    windows: list[list[float]] = field(default_factory=list)  # [when each fault began, when it has settled]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, what: str, profile: str | None = None, why: str | None = None) -> None:
        with self.lock:
            self.seconds[int(time.monotonic() - self.started)][what] += 1
            if profile is not None:
                self.by_profile[profile][what] += 1
            if why is not None:
                self.why[f"{what}: {why}"] += 1

    def settling(self) -> bool:
        now = time.monotonic()
        with self.lock:
            return any(begun <= now <= end for begun, end in self.windows)

    def strike(self) -> list[float]:
        """A fault begins: what it explains is documented from now until `settled` says (a backend stopped for
        3 s answers 503 during those 3 s, not only after them)."""
        window = [time.monotonic(), float("inf")]
        with self.lock:
            self.windows.append(window)
        return window

    def settled(self, window: list[float]) -> None:
        with self.lock:
            window[1] = time.monotonic() + faults.SETTLE_S

    def totals(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for c in self.seconds.values():
            total.update(c)
        return total


class Driver:
    """The load: `rate` requests per second (None: as fast as the threads go), every profile in turn."""

    def __init__(self, gw: Gateway, policies: Path, tally: Tally, threads: int) -> None:
        self.gw, self.policies, self.tally, self.threads = gw, policies, tally, threads
        self.profiles = list(PROFILES)
        self.turn = itertools.count()
        self.rate: float | None = None
        self.next_at = time.monotonic()
        self.pace = threading.Lock()
        self.stop = threading.Event()
        self.accepted: collections.deque[tuple[str, bytes]] = collections.deque(maxlen=500)
        self.accepted_digests: set[str] = set()  # every accepted secured request: the archive must hold each
        self.local = threading.local()
        self.flood_url: str | None = None  # the flood route, with --quotas
        self.ca = str(
            gw.opts.certs / "ca.pem"
        )  # passed with each request: REQUESTS_CA_BUNDLE would override a session's

    def url(self, profile: str) -> str:
        o = self.gw.opts
        p = PROFILES[profile]
        route = next(r for r in self._policy_set().routes if r.name == p.route)
        base = f"https://127.0.0.1:{o.https_port}" if p.tls else f"http://127.0.0.1:{o.http_port}"
        return f"{base}{route.match.path_prefix}demo"

    def _policy_set(self) -> Any:
        if not hasattr(self, "_policies"):
            from gateway.policy import load_dir

            self._policies = load_dir(self.policies)
        return self._policies

    def _session(self) -> requests.Session:
        if not hasattr(self.local, "session"):
            self.local.session = requests.Session()
            self.local.factories = {}
        return self.local.session

    def factory(self, profile: str) -> Factory:
        self._session()
        factories: dict[str, Factory] = self.local.factories
        if profile not in factories:
            factories[profile] = Factory(profile, self._policy_set(), certs=self.gw.opts.certs)
        f = factories[profile]
        if f.needs_context:
            with CLIENT:
                f.establish(self.url(profile), verify=self.ca)
        return f

    def _wait_turn(self) -> bool:
        if self.rate is None:
            return not self.stop.is_set()
        with self.pace:
            at = self.next_at = max(self.next_at + 1 / self.rate, time.monotonic() - 1)  # no catch-up bursts
        delay = at - time.monotonic()
        return not (delay > 0 and self.stop.wait(delay)) and not self.stop.is_set()

    def run(self) -> None:
        while self._wait_turn():
            profile = self.profiles[next(self.turn) % len(self.profiles)]
            try:
                self.one(profile)
            except Exception as exc:  # the soak must go on; a client-side failure is reported, never hidden
                self.tally.count("lost", profile, f"client error {type(exc).__name__}: {exc}"[:160])

    def one(self, profile: str) -> None:
        session = self._session()
        try:
            factory = self.factory(profile)
        except Exception as exc:  # establishing a context is a request too
            self.tally.count("sent", profile)
            self._refused_or_lost(profile, f"establish: {type(exc).__name__}: {exc}"[:160], explained=True)
            return
        with CLIENT:
            message = factory.make("small")
        self.tally.count("sent", profile)
        began = time.monotonic()
        try:
            resp = session.post(self.url(profile), data=message.body, timeout=TIMEOUT_S, verify=self.ca,
                                headers={"content-type": factory.content_type})  # fmt: skip
        except requests.RequestException as exc:
            self.tally.count("lost", profile, f"{type(exc).__name__}: {exc}"[:160])
            return
        elapsed_ms = (time.monotonic() - began) * 1000
        self.classify(profile, factory, message, resp.status_code, resp.content, elapsed_ms)

    def classify(self, profile: str, factory: Factory, message: Message, status: int, body: bytes, ms: float) -> None:
        if status == 200:
            try:
                with CLIENT:
                    factory.check(status, body, message)
            except CheckFailed as exc:
                self.tally.count("corrupted", profile, str(exc)[:160])
                return
            self.tally.count("ok", profile)
            with self.tally.lock:
                self.tally.latency_ms[profile].append(ms)
            if PROFILES[profile].secured:
                self.accepted.append((profile, message.body))
                self.accepted_digests.add(hashlib.sha256(message.body).hexdigest())
            return
        code = fault_code(body)
        if status == 503:
            self._refused_or_lost(profile, f"503 {code}", explained=True)
            return
        if code == "BadContextToken" and factory.client is not None:
            factory.client.context = None  # the context is gone (issued before the store's epoch): a new one
        self._refused_or_lost(profile, f"{status} {code}", explained=code in SETTLING_CODES)

    def _refused_or_lost(self, profile: str, why: str, explained: bool) -> None:
        """Documented while a fault settles and the fault explains it; lost otherwise."""
        settling = self.tally.settling()
        if settling and explained:
            self.tally.count("refused", profile, why)
        else:
            self.tally.count("lost", profile, why + ("" if settling else " (no fault settling)"))

    def replay_burst(self, rng: random.Random) -> int:
        """Send accepted messages again: each must be refused."""
        picks = rng.sample(list(self.accepted), min(REPLAYS_PER_BURST, len(self.accepted)))
        session = requests.Session()
        for profile, body in picks:
            self.tally.count("replays sent")
            try:
                resp = session.post(self.url(profile), data=body, timeout=TIMEOUT_S, verify=self.ca,
                                    headers={"content-type": "text/xml; charset=utf-8"})  # fmt: skip
            except requests.RequestException as exc:
                self.tally.count("lost", None, f"replay: {type(exc).__name__}")
                continue
            if resp.status_code == 200:
                self.tally.count("replays accepted", profile, f"replay of a {profile} message let through")
        return len(picks)

    def hostile_burst(self, rng: random.Random) -> str:
        route = next(r for r in self._policy_set().routes if r.name == PROFILES["xml"].route)
        session = requests.Session()
        for shape, body in faults.hostile_bodies(route.limits.max_body_bytes).items():
            self.tally.count("hostile sent")
            try:
                resp = session.post(self.url("xml"), data=body, timeout=TIMEOUT_S,
                                    headers={"content-type": "text/xml; charset=utf-8"})  # fmt: skip
            except requests.RequestException:
                continue  # Envoy may close the connection on an oversized body: refused either way
            if resp.status_code == 200:
                self.tally.count("hostile accepted", None, f"{shape} let through")
        replayed = self.replay_burst(rng)
        flood = f", {self.flood_burst()}" if self.flood_url else ""
        return f"hostile burst: oversized, deep, namespace flood, {replayed} replays{flood}"

    def flood_burst(self) -> str:
        """An attacker's flood of the flood route from one address: over its per-second quota each request must
        get 429 with the SOAP fault and Retry-After, and no more than the limit per second may pass."""
        assert self.flood_url is not None
        session, admitted, refused = requests.Session(), 0, 0
        first = time.time()
        for _ in range(FLOOD_REQUESTS):
            self.tally.count("flood sent")
            try:
                resp = session.post(self.flood_url, data=faults.plain_body(), timeout=TIMEOUT_S,
                                    headers={"content-type": "text/xml; charset=utf-8"})  # fmt: skip
            except requests.RequestException as exc:
                self.tally.count("lost", None, f"flood: {type(exc).__name__}")
                continue
            if resp.status_code == 200:
                admitted += 1
                self.tally.count("flood admitted")
            elif resp.status_code == 429 and fault_code(resp.content) == "Client" and "retry-after" in resp.headers:
                refused += 1
                self.tally.count("flood refused")
            elif resp.status_code == 503 and self.tally.settling():  # the service or Redis down: fail closed
                self.tally.count("refused", None, "flood: 503")
            else:
                self.tally.count("lost", None, f"flood: {resp.status_code} {fault_code(resp.content)}")
        windows = int(time.time()) - int(first) + 1  # the service counts whole seconds of the clock
        if admitted > FLOOD_PER_SECOND * windows:
            self.tally.count("flood over limit", None, f"{admitted} admitted in {windows} s of the flood")
        return f"flood {admitted} admitted, {refused} refused"


def _memory(gw: Gateway) -> dict[str, float]:
    procs = {"envoy": gw.envoy, "redis": gw.redis, "ratelimit": gw.ratelimit,
             **{f"worker {i}": w for i, w in enumerate(gw.workers)}}  # fmt: skip
    return {name: round(_rss_mb(p.pid), 1) for name, p in procs.items() if p is not None}


def saturation(driver: Driver, seconds: float) -> float:
    """Closed-loop throughput of the mix (every thread as fast as it goes), req/s answered."""
    probe = Tally(time.monotonic())
    driver.tally, real = probe, driver.tally
    threads = [threading.Thread(target=driver.run, daemon=True) for _ in range(driver.threads)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    driver.stop.set()
    for t in threads:
        t.join(TIMEOUT_S + 5)
    driver.stop.clear()
    driver.tally = real
    return probe.totals()["ok"] / seconds


@dataclass
class SoakResult:
    totals: Counter[str]
    tally: Tally
    saturation_rps: float
    rate: float
    seed: int
    schedule: list[tuple[float, str]]


def run_soak(
    duration: float = 600.0,
    share: float = 0.6,
    seed: int | None = None,
    kinds: list[str] | None = None,
    threads: int = 8,
    probe_s: float = 4.0,
    workers: int | None = None,
    out: Path = DEFAULT_OUT,
    policies: Path = DEFAULT_POLICIES,
    certs: Path = pki.DEFAULT_DIR,
    log: IO[str] = sys.stdout,
    chart: bool = True,
    archive: bool = False,
    archive_db: ArchiveDb | None = None,
    quotas: bool = False,
    tracing: str | None = None,
    sampling_percent: float = 1.0,
) -> SoakResult:
    """`archive`: every secured route archives (to the segment store, or with `archive_db` to that PostgreSQL
    server, which the archive_db_restart fault restarts); the result counts accepted requests not archived.
    `quotas`: every route's quotas on and never reached by the load (loadtest/variants.py), and a flood route the
    hostile bursts flood; `tracing`: spans to that OTLP/HTTP collector at `sampling_percent`."""
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    rng = random.Random(seed)
    kinds = list(kinds or faults.ALL)
    plan = faults.schedule(kinds, duration, rng)
    out = Path(out).resolve()
    certs = pki.init(Path(certs)).resolve()
    print(f"WSGate soak: {duration:g} s at {share:.0%} of saturation, seed {seed}; faults: "
          + ", ".join(f"{t:.1f}s {k}" for t, k in plan), file=log, flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="wsgate-soak-") as tmp:
        own = Path(tmp) / "policies"
        own.mkdir()
        if archive_db is not None:
            os.environ[DSN_ENV] = archive_db.dsn  # for the workers and this process's policy loads
        if archive:
            with_archive(Path(policies), own, Path(tmp) / "archive", db=archive_db is not None)
        for f in Path(policies).glob("*.y*ml") if not archive else ():
            shutil.copy(f, own)
        if quotas or tracing:
            own = variants.write(own, Path(tmp) / "policies-observed", tracing, sampling_percent, quotas)
        flood = variants.add_flood_route(own, PROFILES["xml"].route, FLOOD_PER_SECOND) if quotas else None
        with bench_gateway(own, certs, Path(tmp) / "run", workers or default_workers()) as gw:
            tally = Tally(time.monotonic())
            driver = Driver(gw, own, tally, threads)
            if flood:
                driver.flood_url = f"http://127.0.0.1:{gw.opts.http_port}{flood}demo"
            sat = saturation(driver, probe_s)
            driver.rate = max(1.0, sat * share)
            print(f"saturation {sat:.0f} req/s (closed loop, {threads} threads, the mix); driving {driver.rate:.0f} "
                  f"req/s", file=log, flush=True)  # fmt: skip
            result = _soak(gw, driver, plan, duration, rng, own, log, archive_db)
            result.saturation_rps, result.seed = sat, seed
        if archive:  # the gateway stopped: its workers wrote what they had queued
            dsn = archive_db.dsn if archive_db is not None else None
            archived, lost = missing(Path(tmp) / "archive", certs, driver.accepted_digests, dsn)
            os.environ.pop(DSN_ENV, None)
            result.totals["archived"], result.totals["archive missing"] = archived, lost
    report(result, log)
    write_csv(result.tally, out / "soak.csv")
    if chart:
        write_chart(result, out / "soak.png")
    return result


def _soak(gw: Gateway, driver: Driver, plan: list[tuple[float, str]], duration: float, rng: random.Random,
          policies: Path, log: IO[str], archive_db: ArchiveDb | None = None) -> SoakResult:  # fmt: skip
    tally = driver.tally = Tally(time.monotonic())
    lock = threading.Lock()
    injector = faults.Faults(gw, lock, rng, policies, archive_db=archive_db)
    stop = threading.Event()
    failures: list[BaseException] = []

    def supervise() -> None:
        while not stop.wait(0.25):
            try:
                with lock:
                    gw.supervise_once()
            except BaseException as exc:  # Envoy died: the run is over, and says so
                failures.append(exc)
                driver.stop.set()
                return

    def sample_memory() -> None:
        while not stop.wait(1.0):
            with lock:
                mem = _memory(gw)
            tally.memory[int(time.monotonic() - tally.started)] = mem

    helpers = [threading.Thread(target=supervise, daemon=True), threading.Thread(target=sample_memory, daemon=True)]
    load = [threading.Thread(target=driver.run, daemon=True) for _ in range(driver.threads)]
    for t in helpers + load:
        t.start()
    for at, kind in plan:
        if driver.stop.wait(max(0.0, tally.started + at - time.monotonic())):
            break
        window = tally.strike()
        begun = window[0]
        if kind == faults.HOSTILE:
            what = driver.hostile_burst(rng)
        else:
            what = {**faults.KINDS, **faults.OPTIONAL}[kind](injector)
        tally.settled(window)
        tally.events.append((begun - tally.started, what))
        print(f"  {begun - tally.started:6.1f}s  {what}", file=log, flush=True)
        if kind == "redis_kill":  # what was accepted before the loss must stay refused after it
            time.sleep(1.5)
            n = driver.replay_burst(rng)
            tally.events.append((time.monotonic() - tally.started, f"{n} replays after the Redis restart"))
    driver.stop.wait(max(0.0, tally.started + duration - time.monotonic()))
    driver.stop.set()
    for t in load:
        t.join(TIMEOUT_S + 5)
    stop.set()
    for t in helpers:
        t.join(5)
    if failures:
        raise RuntimeError(f"the gateway failed during the soak: {failures[0]}") from failures[0]
    return SoakResult(tally.totals(), tally, 0.0, driver.rate or 0.0, 0, plan)


# ---- output


def report(result: SoakResult, out: IO[str]) -> None:
    t, tally = result.totals, result.tally
    print(f"\nWSGate soak, seed {result.seed}: {len(tally.seconds)} s at {result.rate:.0f} req/s "
          f"({result.saturation_rps:.0f} req/s saturation)\n", file=out)  # fmt: skip
    counts = [*COUNTS, *(FLOOD_COUNTS if t["flood sent"] else ())]
    print(_table(["total", *counts], [["all", *(str(t[c]) for c in counts)]]), file=out)
    if "archived" in t:
        print(
            f"\narchive: {t['archived']} requests archived; accepted and not archived: {t['archive missing']}", file=out
        )
    rows = []
    for profile in PROFILES:
        c, lat = tally.by_profile[profile], tally.latency_ms[profile]
        rows.append([profile, *(str(c[k]) for k in ("sent", "ok", "refused", "lost", "corrupted")),
                     f"{percentile(lat, 50):.1f}", f"{percentile(lat, 99):.1f}"])  # fmt: skip
    print("\n" + _table(["profile", "sent", "ok", "refused", "lost", "corrupted", "p50 ms", "p99 ms"], rows), file=out)
    mem_rows = []
    seconds = sorted(tally.memory)
    for name in sorted({n for m in tally.memory.values() for n in m}):
        series = [tally.memory[s][name] for s in seconds if name in tally.memory[s]]
        quarter = max(1, len(series) // 4)
        first, last = percentile(series[:quarter], 50), percentile(series[-quarter:], 50)
        mem_rows.append([name, f"{first:.0f}", f"{last:.0f}", f"{max(series):.0f}", f"{last - first:+.0f}"])
    if mem_rows:
        print("\n" + _table(["RSS MiB", "first quarter", "last quarter", "max", "growth"], mem_rows), file=out)
    print("\nfaults:", file=out)
    for at, what in tally.events:
        print(f"  {at:6.1f}s  {what}", file=out)
    if tally.why:
        print("\nwhy (refused, lost, corrupted, replays and hostile requests let through):", file=out)
        for why, n in tally.why.most_common():
            print(f"  {n:6d}  {why}", file=out)
    out.flush()


def write_csv(tally: Tally, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    names = sorted({n for m in tally.memory.values() for n in m})
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["second", *COUNTS, *(f"rss_mib_{n.replace(' ', '_')}" for n in names)])
        for s in range(max(tally.seconds, default=-1) + 1):
            mem = tally.memory.get(s, {})
            w.writerow([s, *(tally.seconds[s][c] for c in COUNTS), *(mem.get(n, "") for n in names)])


def write_chart(result: SoakResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tally = result.tally
    seconds = list(range(max(tally.seconds, default=-1) + 1))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 8), sharex=True)
    for what, color in (("ok", "C2"), ("refused", "C1"), ("lost", "C3"), ("corrupted", "k")):
        top.plot(seconds, [tally.seconds[s][what] for s in seconds], color=color, label=what, linewidth=1)
    for at, what in tally.events:
        top.axvline(at, color="grey", alpha=0.4, linewidth=0.8)
        top.annotate(what.split(":")[0][:28], (at, top.get_ylim()[1]), rotation=90, fontsize=6, va="top")
    top.set_ylabel("requests per second")
    top.legend(fontsize=8, loc="lower left")
    top.grid(alpha=0.3)
    names = sorted({n for m in tally.memory.values() for n in m})
    mem_seconds = sorted(tally.memory)
    for name in names:
        bottom.plot(mem_seconds, [tally.memory[s].get(name, float("nan")) for s in mem_seconds], label=name)
    bottom.set_ylabel("resident memory (MiB)")
    bottom.set_xlabel("seconds")
    bottom.legend(fontsize=8, loc="upper left")
    bottom.grid(alpha=0.3)
    t = result.totals
    fig.suptitle(f"WSGate soak (loadtest/soak.py), seed {result.seed}: {t['sent']} sent, {t['ok']} ok, "
                 f"{t['refused']} refused (documented), {t['lost']} lost, {t['corrupted']} corrupted, "
                 f"{t['replays accepted']} of {t['replays sent']} replays accepted")  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--share", type=float, default=0.6, help="share of saturation to drive (default 0.6)")
    parser.add_argument("--seed", type=int, help="the faults' seed (default: random, printed)")
    parser.add_argument("--faults", default=",".join(faults.ALL), help=f"comma-separated: {', '.join(faults.ALL)}")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--workers", type=int, help="filter workers (default: one per core)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--no-chart", action="store_true")
    parser.add_argument("--archive", action="store_true", help="archive every secured route; count what is missing")
    parser.add_argument("--quotas", action="store_true",
                        help="every route's quotas on (never reached) and a flood route the hostile bursts flood")  # fmt: skip
    parser.add_argument("--tracing", metavar="HOST:PORT", help="spans to this OTLP/HTTP collector (docs/tracing.md)")
    parser.add_argument("--sampling-percent", type=float, default=1.0, help="with --tracing (the policy's default)")
    args = parser.parse_args(argv)
    kinds = [k for k in args.faults.split(",") if k]
    unknown = set(kinds) - set(faults.ALL)
    if unknown:
        parser.error(f"unknown faults: {', '.join(sorted(unknown))}")
    result = run_soak(args.duration, args.share, args.seed, kinds, args.threads, workers=args.workers, out=args.out,
                      chart=not args.no_chart, archive=args.archive, quotas=args.quotas, tracing=args.tracing,
                      sampling_percent=args.sampling_percent)  # fmt: skip
    t = result.totals
    clean = t["lost"] == t["corrupted"] == t["replays accepted"] == t["hostile accepted"] == t["archive missing"] == 0
    clean = clean and t["flood over limit"] == 0 and (not args.quotas or t["flood refused"] > 0)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
