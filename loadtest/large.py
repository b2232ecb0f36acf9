"""Large messages: ~10 MB SOAP bodies through the gateway both ways, one at a time and from K clients at once, on
an `xml` route and a secured one (`rsa`: the client signs the request, the gateway verifies it and signs the
~10 MB response). Prints each row's latency per message and the peak resident memory of Envoy and of the filter
workers, and from those the memory per request in flight ((peak - idle) / clients). Then it starts a gateway
whose workers have a small body budget and shows what K clients get when their bodies do not fit.

    python -m loadtest.large                                  # 10 MB, 1, 2, 4 and 8 clients, xml and rsa
    python -m loadtest.large --size-mb 5 --clients 1,16 --profiles rsa --workers 2

Every reply is checked: an echo of the request's texts, and on `rsa` a signature that verifies."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests
import yaml
from lxml import etree

from certs import pki
from filters.engine.xml import xmlsupport
from gateway.control.supervisor import Gateway, Options
from gateway.policy import DEFAULT_BODY_BUDGET_MB, Route
from gateway.tools.client import Client, ClientConfig, Pending
from loadtest.bench_gateway import bench_gateway

MIB = 1024 * 1024
DEMO_NS = "urn:wsgate:demo"
TEXT_CHARS = 1_000_000  # one d:text element: well under the default max_text_length (4 MiB)
PROFILE_NAMES = ("xml", "rsa")
_PARSER = xmlsupport.parser(huge_tree=True)


def _routes(certs: Path, limit: int | None) -> list[dict]:
    """An `xml` and an `rsa` route; `limit`: both directions' max_body_bytes (None: the default, 10 MiB)."""
    limits = (
        {} if limit is None else {"limits": {"max_body_bytes": limit}, "response_limits": {"max_body_bytes": limit}}
    )
    upstream = {"address": "${BACKEND_ADDR:-127.0.0.1:8081}"}
    rsa = {"trust_anchors": [str(certs / "ca.pem")], "key": str(certs / "gateway-sign.key"),
           "certificate": str(certs / "gateway-sign.pem"), "decryption_key": str(certs / "gateway-enc.key")}  # fmt: skip
    return [
        {"name": "xml", "match": {"path_prefix": "/xml/"}, "upstream": upstream, "profile": "xml", **limits},
        {"name": "rsa", "match": {"path_prefix": "/rsa/"}, "upstream": upstream, "profile": "rsa", "rsa": rsa,
         "replay": {"store": "auto"}, **limits},
    ]  # fmt: skip


def echo(size: int, tag: str) -> tuple[bytes, list[str]]:
    """A plain SOAP 1.1 echo request of about `size` bytes (never more), and the texts its reply must carry."""
    head = (
        f'<soap:Envelope xmlns:soap="http://schemas.xmlsoap.org/soap/envelope/"><soap:Body><d:echo xmlns:d="{DEMO_NS}">'
    )
    tail = "</d:echo></soap:Body></soap:Envelope>"
    room = size - len(head) - len(tail)
    element = len("<d:text></d:text>")
    texts = []
    while room > element + len(tag):
        n = min(TEXT_CHARS, room - element)
        texts.append((tag + "x" * n)[:n])
        room -= n + element
    body = head + "".join(f"<d:text>{t}</d:text>" for t in texts) + tail
    return body.encode(), texts


# ---- memory of the gateway's processes


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)


@dataclass
class Memory:
    envoy: float  # MiB
    workers: float  # MiB, all workers together
    envoy_heap: float = 0.0  # MiB, Envoy's own count (admin /memory: heap in use)


class Probe:
    """Envoy's and the workers' resident size now and at their peak since `reset`; Envoy's heap sampled."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.admin = f"http://127.0.0.1:{gw.opts.admin_port}/memory"
        self.heap_peak = 0.0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def _pids(self) -> tuple[int, list[int]]:
        assert self.gw.envoy is not None
        return self.gw.envoy.pid, [w.pid for w in self.gw.workers]

    def now(self) -> Memory:
        envoy, workers = self._pids()
        rss = [_status_kib(p, "VmRSS") / 1024 for p in (envoy, *workers)]
        return Memory(rss[0], sum(rss[1:]), self._heap())

    def _heap(self) -> float:
        with urllib.request.urlopen(self.admin, timeout=5) as r:
            m = json.loads(r.read())
        return (int(m["heap_size"]) - int(m["pageheap_unmapped"]) - int(m["pageheap_free"])) / MIB

    @contextmanager
    def peak(self) -> Iterator[Callable[[], Memory]]:
        """Inside: the peak so far. VmHWM gives the resident peaks exactly; Envoy's heap is sampled."""
        envoy, workers = self._pids()
        for pid in (envoy, *workers):
            _reset_peak(pid)
        self.heap_peak = self._heap()
        self._stop.clear()

        def sample() -> None:
            while not self._stop.wait(0.05):
                self.heap_peak = max(self.heap_peak, self._heap())

        self._sampler = threading.Thread(target=sample, daemon=True)
        self._sampler.start()

        def read() -> Memory:
            hwm = [_status_kib(p, "VmHWM") / 1024 for p in (envoy, *workers)]
            return Memory(hwm[0], sum(hwm[1:]), self.heap_peak)

        try:
            yield read
        finally:
            self._stop.set()
            self._sampler.join()


# ---- sending


@dataclass
class Outcome:
    status: int
    ms: float
    verified: bool
    fault: str = ""


class Sender:
    """Makes and sends messages for one profile, and checks their replies."""

    def __init__(self, profile: str, gw: Gateway, certs: Path, routes: list[dict]) -> None:
        self.profile = profile
        self.url = f"http://127.0.0.1:{gw.opts.http_port}/{profile}/demo"
        doc = next(r for r in routes if r["name"] == profile)
        route = Route.model_validate({**doc, "upstream": {"address": "127.0.0.1:1"}})
        self.client = Client(route, ClientConfig(certs=certs)) if profile == "rsa" else None

    def make(self, size: int, tag: str) -> tuple[bytes, list[str], Pending | None]:
        plain, texts = echo(size, tag)
        if self.client is None:
            return plain, texts, None
        secured, pending = self.client.secure(plain)
        return secured, texts, pending

    def send(self, session: requests.Session, body: bytes, texts: list[str], pending: Pending | None) -> Outcome:
        start = time.perf_counter()
        r = session.post(self.url, data=body, headers={"content-type": "text/xml; charset=utf-8"}, timeout=300)
        ms = (time.perf_counter() - start) * 1000
        if r.status_code != 200:
            return Outcome(r.status_code, ms, False, _fault_text(r.content))
        if self.client is not None and pending is not None:
            env = self.client.open(r.content, pending)  # raises unless the signature verifies
            got = [t.text for t in env.body.iter(f"{{{DEMO_NS}}}text")]
        else:
            got = _texts(r.content)
        return Outcome(200, ms, got == texts)


def _texts(reply: bytes) -> list[str]:
    root = etree.fromstring(reply, _PARSER)
    return [t.text or "" for t in root.iter(f"{{{DEMO_NS}}}text")]


def _fault_text(reply: bytes) -> str:
    try:
        root = etree.fromstring(reply, _PARSER)
    except etree.XMLSyntaxError:
        return reply[:80].decode("latin-1")
    return root.findtext(".//faultstring") or root.findtext(".//{*}Reason/{*}Text") or "?"


Work = list[list[tuple[bytes, list[str], Pending | None]]]


def prepare(sender: Sender, size: int, clients: int, per_client: int, tag: str) -> Work:
    """Each client's messages, made (and signed) before the clock starts."""
    return [[sender.make(size, f"{tag}-{c}-{i}-") for i in range(per_client)] for c in range(clients)]


def run_clients(sender: Sender, work: Work) -> list[Outcome]:
    """A thread per client, each with its own connection, sends its messages one after another."""
    clients = len(work)
    out: list[Outcome] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def client(mine: list[tuple[bytes, list[str], Pending | None]]) -> None:
        with requests.Session() as session:
            barrier.wait()
            for msg in mine:
                got = sender.send(session, *msg)
                with lock:
                    out.append(got)

    threads = [threading.Thread(target=client, args=(w,)) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# ---- the runs


def _write_policies(run_dir: Path, certs: Path, limit: int | None) -> Path:
    policies = run_dir / "policies"
    policies.mkdir(parents=True, exist_ok=True)
    (policies / "large.yaml").write_text(yaml.safe_dump({"routes": _routes(certs, limit)}, sort_keys=False))
    return policies


def measure(
    profiles: list[str], size: int, clients: list[int], messages: int, workers: int, budget_mb: int, certs: Path,
    run_dir: Path,
) -> None:  # fmt: skip
    limit = None if size <= 10 * MIB - 64 * 1024 else size + 64 * 1024  # the default limit unless too small
    routes = _routes(certs, limit)
    policies = _write_policies(run_dir / "measure", certs, limit)
    print(f"Large messages: {size / 1e6:.1f} MB echo requests and replies, {workers} filter worker(s), body budget "
          f"{budget_mb} MiB per worker, Envoy --concurrency {Options().envoy_concurrency}; a fresh gateway per row")  # fmt: skip
    print(
        f"{'profile':8} {'clients':>7} {'msgs':>5} {'ok':>4} {'median ms':>10} {'max ms':>8} {'MB/s':>6}"
        f" {'envoy idle/peak MiB':>20} {'workers idle/peak MiB':>22} {'per in-flight MiB envoy/workers':>32}"
        f" {'envoy heap MiB':>15}"
    )  # fmt: skip
    for profile in profiles:
        for k in clients:
            # A fresh gateway: memory a previous row freed but kept for reuse would hide this row's cost.
            run = run_dir / "measure" / f"run-{profile}-{k}"
            with bench_gateway(policies, certs, run, workers, body_budget_mb=budget_mb) as gw:
                probe = Probe(gw)
                sender = Sender(profile, gw, certs, routes)
                sender.send(requests.Session(), *sender.make(2000, "warm-up"))  # the code paths, not the buffers
                work = prepare(sender, size, k, max(1, math.ceil(messages / k)), f"{profile}{k}")
                time.sleep(0.5)
                idle = probe.now()
                start = time.perf_counter()
                with probe.peak() as peak_now:
                    outcomes = run_clients(sender, work)
                    peak = peak_now()
                wall = time.perf_counter() - start
            ok = sum(o.verified for o in outcomes)
            times = [o.ms for o in outcomes]
            mbps = ok * size * 2 / 1e6 / wall  # both ways
            print(
                f"{profile:8} {k:>7} {len(outcomes):>5} {ok:>4} {statistics.median(times):>10.0f}"
                f" {max(times):>8.0f} {mbps:>6.1f} {idle.envoy:>9.0f} / {peak.envoy:<8.0f}"
                f" {idle.workers:>10.0f} / {peak.workers:<9.0f}"
                f" {(peak.envoy - idle.envoy) / k:>18.1f} / {(peak.workers - idle.workers) / k:<11.1f}"
                f" {peak.envoy_heap:>15.0f}",
                flush=True,
            )  # fmt: skip
            for o in outcomes:
                if not o.verified:
                    print(f"    refused or wrong: HTTP {o.status} {o.fault}")


def over_budget(size: int, clients: int, certs: Path, run_dir: Path) -> None:
    """One worker whose budget holds about two bodies, `clients` sending at once: the rest are refused, not
    queued."""
    limit = size + 64 * 1024
    budget_mb = math.ceil(2 * limit / MIB)
    policies = _write_policies(run_dir / "busy", certs, limit)
    with bench_gateway(policies, certs, run_dir / "busy" / "run", 1, body_budget_mb=budget_mb) as gw:
        probe = Probe(gw)
        sender = Sender("xml", gw, certs, _routes(certs, limit))
        work = prepare(sender, size, clients, 1, "busy")
        idle = probe.now()
        with probe.peak() as peak_now:
            outcomes = run_clients(sender, work)
            peak = peak_now()
        refused = [o for o in outcomes if o.status != 200]
        reasons = _busy_faults(gw)
        print(f"\nOver budget: 1 worker with a body budget of {budget_mb} MiB ({budget_mb * MIB // size} bodies of "
              f"{size / 1e6:.1f} MB), {clients} clients at once")  # fmt: skip
        print(f"  answered 200 and verified: {sum(o.verified for o in outcomes)}")
        for status, fault in sorted({(o.status, o.fault) for o in refused}):
            n = sum(1 for o in refused if (o.status, o.fault) == (status, fault))
            print(f"  refused: {n} x HTTP {status} SOAP fault {fault!r}")
        print(f'  worker metrics: wsgate_faults_total{{reason="busy"}} {reasons:g}')
        print(f"  peak: envoy {peak.envoy:.0f} MiB (idle {idle.envoy:.0f}), worker {peak.workers:.0f} MiB "
              f"(idle {idle.workers:.0f})")  # fmt: skip


def _busy_faults(gw: Gateway) -> float:
    total = 0.0
    for url in gw.metrics_urls():
        with urllib.request.urlopen(url, timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("wsgate_faults_total{") and 'reason="busy"' in line:
                    total += float(line.rsplit(" ", 1)[1])
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.large", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=10.0, help="request size in MB (10^6 bytes)")
    ap.add_argument("--clients", default="1,2,4,8", help="concurrent clients per row, comma-separated")
    ap.add_argument("--messages", type=int, default=8, help="messages per row (at least one per client)")
    ap.add_argument("--profiles", default=",".join(PROFILE_NAMES))
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--body-budget-mb", type=int, help="per worker (default: room for every client's body, so that "
                    f"the rows measure memory, not refusals; at least {DEFAULT_BODY_BUDGET_MB})")  # fmt: skip
    ap.add_argument("--busy-clients", type=int, default=6, help="clients at once in the over-budget run (0: skip)")
    ap.add_argument("--certs", type=Path, default=pki.DEFAULT_DIR)
    ap.add_argument("--run-dir", type=Path, default=Path("loadtest/out/large"))
    args = ap.parse_args(argv)
    profiles = [p for p in args.profiles.split(",") if p]
    if not set(profiles) <= set(PROFILE_NAMES):
        ap.error(f"--profiles: choose from {', '.join(PROFILE_NAMES)}")
    size = int(args.size_mb * 1e6)
    pki.init(args.certs)
    clients = [int(c) for c in args.clients.split(",")]
    budget_mb = args.body_budget_mb or max(DEFAULT_BODY_BUDGET_MB, math.ceil(max(clients) * (size + 64 * 1024) / MIB))
    measure(profiles, size, clients, args.messages, args.workers, budget_mb, args.certs, args.run_dir)
    if args.busy_clients:
        over_budget(size, args.busy_clients, args.certs, args.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
