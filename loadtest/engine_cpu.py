"""The engine's CPU per exchange, in process, for every secured profile and size, beside Apache WSS4J's figures.

The measure of `loadtest.optimizations`: no Envoy, no network, no frame; the route's real pipeline (the policies'
optimizations as configured) takes fresh secured requests from loadtest.messages.Factory, the demo backend
answers, the pipeline secures the answer. One exchange = request + response, CPU time of this process, median.
secureconversation establishes its context through the same pipeline first. The reference is WSS4J 4.0.1's
"secure + verify" on the same machine kind (shared notes, wss4j-reference.md): one message secured and one
verified, the closest to one gateway exchange (verify the request, secure the response). `make bench` prints it
after the gateway's tables; alone: `python -m loadtest.engine_cpu`."""

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
from loadtest.messages import PROFILES, SIZE_LABELS, SIZES, Factory
from loadtest.optimizations import bench_policies, exchange

# WSS4J 4.0.1, secure + verify, us per op (1 KB and 30 KB Bodies; no 1 MB figure).
WSS4J_US: dict[tuple[str, str], float] = {
    ("hmac", "small"): 437, ("hmac", "large"): 3935,
    ("rsa", "small"): 2908, ("rsa", "large"): 5280,
    ("rsa-encrypted", "small"): 5617, ("rsa-encrypted", "large"): 8703,
    ("secureconversation", "small"): 425, ("secureconversation", "large"): 3002,
}  # fmt: skip
COUNTS = {"small": 200, "large": 60, "huge": 6}  # exchanges per point: about a minute for every profile and size


@dataclass
class EngineRow:
    profile: str
    size: str
    exchanges: int
    us: float  # median CPU per exchange
    wss4j_us: float | None

    @property
    def ratio(self) -> float | None:
        return self.us / self.wss4j_us if self.wss4j_us else None


def measure(profile: str, size: str, policies: PolicySet, certs: Path, count: int) -> EngineRow:
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
    return EngineRow(profile, size, count, statistics.median(samples) * 1e6, WSS4J_US.get((profile, size)))


def _answer(pl: SecuredPipeline, body: bytes, ctype: str) -> bytes:
    """The gateway's own answer to a WS-Trust request (an Issue RST), as the route's pipeline gives it."""
    out = pl.request(body, {"content-type": ctype}, Exchange(route=pl.route))
    assert out.answer and out.body is not None
    return out.body


def secured(profiles: Sequence[str]) -> list[str]:
    return [p for p in profiles if PROFILES[p].secured]


def run(
    profiles: Sequence[str], sizes: Sequence[str], policies: PolicySet, certs: Path, scale: float = 1.0
) -> list[EngineRow]:
    counts = {s: max(2, round(COUNTS[s] * scale)) for s in sizes}
    return [measure(p, s, policies, certs, counts[s]) for p in secured(profiles) for s in sizes]


def report(rows: Sequence[EngineRow], out: TextIO) -> None:
    print(
        "\nThe engine's CPU per exchange, in process (request + response, no Envoy, no frame; median us), beside "
        "Apache WSS4J 4.0.1's secure + verify on this machine kind (engine / WSS4J in brackets)",
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
            ref = f" vs {r.wss4j_us:,.0f} ({r.ratio:.1f}x)" if r.wss4j_us and r.ratio else " (no WSS4J figure)"
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
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the exchange counts")
    ap.add_argument("--certs", type=Path, help="a PKI folder (default: a temporary one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = pki.init(args.certs or Path(tmp) / "pki")
        rows = run(args.profiles.split(","), args.sizes.split(","), bench_policies(folder), folder, args.scale)
        report(rows, sys.stdout)


if __name__ == "__main__":
    main()
