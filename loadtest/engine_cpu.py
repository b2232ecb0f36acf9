"""The engine's CPU per exchange, in process, for every secured profile and size, beside Apache WSS4J's, measured
in the same run.

The measure of `loadtest.optimizations`: no Envoy, no network, no frame; the route's real pipeline (the policies'
optimizations as configured) takes fresh secured requests from loadtest.messages.Factory, the demo backend
answers, the pipeline secures the answer. One exchange = request + response, CPU time of this process, median.
secureconversation establishes its context through the same pipeline first. The reference is WSS4J 4.0.1's
"secure + verify" (the harness in tests/interop/wss4j, `bench` op: one message secured and one verified, the
closest to one gateway exchange, in the JVM thread's CPU time, JIT warmed first) of the same plain envelope with the
same algorithms, interleaved with the engine's rounds: machines of this kind differ 2x, so a figure from another
run is never a denominator. Without the harness's jar (`make wss4j`) the WSS4J column says so. `make bench` prints
it after the gateway's tables; alone: `python -m loadtest.engine_cpu`."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from certs import pki
from filters.engine.engine import Exchange, build_pipeline
from filters.engine.profiles import SecuredPipeline
from filters.stores.factory import RouteStores
from filters.stores.replay import MemoryReplayCache
from gateway.policy import PolicySet
from loadtest import wss4j
from loadtest.messages import PROFILES, SIZE_LABELS, SIZES, Factory
from loadtest.optimizations import bench_policies, exchange

TARGET_RATIO = 0.5  # issue 28: the engine per exchange at half of WSS4J's secure + verify
COUNTS = {"small": 200, "large": 60, "huge": 6}  # exchanges per point: about a minute for every profile and size
ROUNDS = 3  # engine and WSS4J interleaved, point by point; medians of the rounds
WSS4J_ROUND_S = 2.0  # WSS4J's secure + verify repeated for this long per point and round
WSS4J_WARMUP_S = 5.0  # per point, before its first round: the JIT compiles WSS4J's paths


@dataclass
class EngineRow:
    profile: str
    size: str
    exchanges: int
    us: float  # median of the rounds' medians: CPU per exchange
    wss4j_us: float | None  # WSS4J's secure + verify in the same run (median of the rounds), None without the jar
    spread: tuple[float, float] = (0.0, 0.0)  # lowest and highest round of the engine

    @property
    def ratio(self) -> float | None:
        return self.us / self.wss4j_us if self.wss4j_us else None


def measure(profile: str, size: str, policies: PolicySet, certs: Path, count: int) -> float:
    """One round: the median CPU us per exchange of `count` fresh exchanges."""
    route = policies.route(PROFILES[profile].route)
    pl = build_pipeline(route, RouteStores())
    assert isinstance(pl, SecuredPipeline), profile
    pl.credentials.replay = MemoryReplayCache(epoch_ms=0)  # in process: no Redis
    factory = Factory(profile, policies, certs=certs)
    if factory.needs_context:
        assert factory.client is not None
        factory.client.establish(lambda body, ctype: _answer(pl, body, ctype))
    bodies = [factory.make(size).body for _ in range(count + 1)]
    exchange(pl, bodies[0])  # warm-up: keys parsed, code paths taken once
    samples = []
    for body in bodies[1:]:
        t0 = time.process_time()
        exchange(pl, body)
        samples.append(time.process_time() - t0)
    return statistics.median(samples) * 1e6


def _answer(pl: SecuredPipeline, body: bytes, ctype: str) -> bytes:
    """The gateway's own answer to a WS-Trust request (an Issue RST), as the route's pipeline gives it."""
    out = pl.request(body, {"content-type": ctype}, Exchange(route=pl.route))
    assert out.answer and out.body is not None
    return out.body


def secured(profiles: Sequence[str]) -> list[str]:
    return [p for p in profiles if PROFILES[p].secured]


def run(
    profiles: Sequence[str],
    sizes: Sequence[str],
    policies: PolicySet,
    certs: Path,
    scale: float = 1.0,
    rounds: int = ROUNDS,
) -> list[EngineRow]:
    """`rounds` rounds; in each, every point measured by the engine and then by WSS4J (when its jar is built)."""
    counts = {s: max(2, round(COUNTS[s] * scale)) for s in sizes}
    points = [(p, s) for p in secured(profiles) for s in sizes]
    engine: dict[tuple[str, str], list[float]] = {pt: [] for pt in points}
    java: dict[tuple[str, str], list[float]] = {pt: [] for pt in points}
    harness = wss4j.Harness.start()
    try:
        for r in range(rounds):
            for p, s in points:
                engine[(p, s)].append(measure(p, s, policies, certs, counts[s]))
                if harness is not None and p in wss4j.PROFILES and s in wss4j.SIZES:
                    warmup = WSS4J_WARMUP_S * min(scale, 1.0) if r == 0 else 0.0
                    java[(p, s)].append(harness.bench(p, s, certs, WSS4J_ROUND_S * min(scale, 1.0), warmup))
    finally:
        if harness is not None:
            harness.close()
    return [
        EngineRow(
            p, s, counts[s], statistics.median(engine[(p, s)]),
            statistics.median(java[(p, s)]) if java[(p, s)] else None,
            (min(engine[(p, s)]), max(engine[(p, s)])),
        )
        for p, s in points
    ]  # fmt: skip


def report(rows: Sequence[EngineRow], out: TextIO) -> None:
    print(
        "\nThe engine's CPU per exchange, in process (request + response, no Envoy, no frame; median us), beside "
        f"Apache WSS4J 4.0.1's secure + verify measured in the same run, interleaved (medians of the rounds; engine / "
        f"WSS4J in brackets; target <= {TARGET_RATIO}x)",
        file=out,
    )
    sizes = [s for s in SIZES if any(r.size == s for r in rows)]
    profiles = list(dict.fromkeys(r.profile for r in rows))
    at = {(r.profile, r.size): r for r in rows}
    header = ["profile", *(f"{s} ({SIZE_LABELS[s]})" for s in sizes)]
    widths = [max(len(header[0]), *(len(p) for p in profiles))]
    lines = []
    for p in profiles:
        cells = [p]
        for s in sizes:
            r = at.get((p, s))
            if r is None:
                cells.append("-")
                continue
            ref = f" vs {r.wss4j_us:,.0f} ({r.ratio:.2f}x)" if r.wss4j_us and r.ratio else " (no WSS4J figure)"
            cells.append(f"{r.us:,.0f}{ref}")
        lines.append(cells)
    widths += [max(len(h), *(len(c[i + 1]) for c in lines)) for i, h in enumerate(header[1:])]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for cells in lines:
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)), file=out)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default=",".join(secured(list(PROFILES))))
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the exchange counts and WSS4J's times")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--certs", type=Path, help="a PKI folder (default: a temporary one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = pki.init(args.certs or Path(tmp) / "pki")
        profiles, sizes = args.profiles.split(","), args.sizes.split(",")
        rows = run(profiles, sizes, bench_policies(folder), folder, args.scale, args.rounds)
        report(rows, sys.stdout)


if __name__ == "__main__":
    main()
