"""What a SAML assertion adds to an `rsa` exchange, in process: `python -m loadtest.saml_cost` (issue 22: at most 30%).

The bench routes rsa, saml-sv and saml-hok (loadtest/policies/bench.yaml) and the load test's 1 KB messages
(loadtest.messages.Factory: the saml ones carry the assertion the gateway's STS issued, reused as a client reuses
its token), as `loadtest.engine_cpu` measures them: request + response through the route's pipeline, the demo
backend answering. The three profiles take turns message by message, in a shuffled order, so that the load of
other processes falls on all of them alike; CPU time of this process per exchange, median, and its ratio to rsa.

For counts that no neighbour moves, run one profile's exchanges under callgrind: `--only PROFILE` makes the
messages first, then runs the exchanges inside one functools.reduce call, which callgrind's
`--collect-atstart=no --toggle-collect=functools_reduce` counts alone (instructions per exchange: the total over
--count):

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=functools_reduce \\
        .venv/bin/python -m loadtest.saml_cost --only saml-sender-vouches --count 30"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from certs import pki
from filters.engine.engine import build_pipeline
from filters.engine.profiles import SecuredPipeline
from filters.stores.factory import RouteStores
from filters.stores.replay import MemoryReplayCache
from gateway.policy import PolicySet
from loadtest.messages import PROFILES, Factory
from loadtest.optimizations import bench_policies, exchange

COMPARED = ("rsa", "saml-sender-vouches", "saml-holder-of-key")
TARGET_RATIO = 1.3
COUNT = 300  # exchanges per profile: fresh messages (their Timestamps are good for 5 minutes)


def _ready(profile: str, policies: PolicySet, certs: Path, count: int) -> tuple[SecuredPipeline, list[bytes]]:
    """The profile's pipeline, warmed up (keys parsed, code paths taken once), and `count` fresh requests."""
    pl = build_pipeline(policies.route(PROFILES[profile].route), RouteStores())
    assert isinstance(pl, SecuredPipeline), profile
    pl.credentials.replay = MemoryReplayCache(epoch_ms=0)  # in process: no Redis
    factory = Factory(profile, policies, certs=certs)
    bodies = [factory.make("small").body for _ in range(count + 2)]
    exchange(pl, bodies[0])
    exchange(pl, bodies[1])
    return pl, bodies[2:]


def interleaved(policies: PolicySet, certs: Path, count: int) -> dict[str, float]:
    """Median CPU us per exchange of each compared profile, the profiles taking turns in a shuffled order."""
    runs = {p: _ready(p, policies, certs, count) for p in COMPARED}
    samples: dict[str, list[float]] = {p: [] for p in COMPARED}
    order = list(COMPARED)
    shuffle = random.Random(count).shuffle
    for i in range(count):
        shuffle(order)
        for p in order:
            pl, bodies = runs[p]
            t0 = time.process_time()
            exchange(pl, bodies[i])
            samples[p].append(time.process_time() - t0)
    return {p: statistics.median(s) * 1e6 for p, s in samples.items()}


def report(us: dict[str, float]) -> str:
    rsa = us["rsa"]
    lines = [f"{p:20s} {v:8,.0f} us  {v / rsa:.2f}x rsa  (+{v - rsa:,.0f} us)" for p, v in us.items()]
    return "\n".join([*lines, f"target: <= {TARGET_RATIO}x rsa"])


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=COUNT, help="exchanges per profile")
    ap.add_argument("--only", choices=COMPARED, help="one profile's exchanges in one functools.reduce (callgrind)")
    ap.add_argument("--certs", type=Path, help="a PKI folder (default: a temporary one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = pki.init(args.certs or Path(tmp) / "pki")
        policies = bench_policies(folder)
        if args.only:
            pl, bodies = _ready(args.only, policies, folder, args.count)
            functools.reduce(lambda _, body: exchange(pl, body), bodies, None)
            return
        print(report(interleaved(policies, folder, args.count)), file=sys.stdout)


if __name__ == "__main__":
    main()
