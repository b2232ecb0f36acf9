"""Issue 24's bench row, finer: outbound SecureConversation beside outbound hmac in one run (docs/outbound-cost.md).
The bench's outbound rows are measured one after another, and whole rows on a shared machine spread by +-10%, more
than the difference being asked about. Here one gateway holds both routes of
each pair and their partner (loadtest/outbound.py), and the load (wrk at saturation, plain 1 KB SOAP to the outbound
listener, each body sent once) alternates between the two routes in short slices, the order reversed every other
pair (ABBA: drift cancels). Each slice's CPU per request is the utime+stime of Envoy, the filter workers and Redis
from /proc over the slice (both sides: the outbound route and its partner, as the bench's rows), divided by the
requests wrk completed; the ratio is taken per pair of neighbouring slices and reported as the median with its
spread, beside the #24 target (at most 1x).

    .venv/bin/python -m loadtest.outbound_ab [--pairs outbound-sc-signed:outbound-hmac,...] [--slices 20]"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import IO

from certs import pki
from gateway.control.supervisor import default_workers
from gateway.policy import load_dir
from loadtest import outbound
from loadtest.bench import DEFAULT_OUT, DEFAULT_POLICIES, _init_generator, _make_messages
from loadtest.bench_gateway import bench_gateway
from loadtest.bench_report import BENCH_PROFILES
from loadtest.messages import HMAC_KEY_NAME
from loadtest.tracing_ab import COUNTED, _bodies, role_cpu, slice_cost, spread

TARGET = 1.0  # issue 24: outbound SecureConversation at steady state costs no more than outbound hmac
PAIRS = tuple((sc, hmac) for sc, hmac, _ in outbound.SC_TARGETS)


def run(
    pairs: tuple[tuple[str, str], ...] = PAIRS,
    slices: int = 20,
    slice_s: float = 3.0,
    threads: int = 2,
    connections: int = 16,
    workers: int | None = None,
    out: Path = DEFAULT_OUT,
    policies: Path = DEFAULT_POLICIES,
    certs: Path = pki.DEFAULT_DIR,
    log: IO[str] = sys.stdout,
) -> dict[tuple[str, str], list[float]]:
    """Per pair (sc row, hmac row), the ratios of gateway CPU per request, one per pair of neighbouring slices."""
    out = Path(out).resolve() / "outbound-ab"
    certs = pki.init(Path(certs)).resolve()
    policies = outbound.policy_dir(Path(policies).resolve(), out / "policies")
    workers = workers or default_workers()
    ratios: dict[tuple[str, str], list[float]] = {}
    print(f"\nOutbound SecureConversation beside outbound hmac, one gateway ({workers} filter workers; both sides: "
          f"the outbound route and its partner), wrk {threads} threads {connections} connections, {slices} pairs "
          f"of {slice_s:g} s slices per pair of rows, alternating ABBA; gateway CPU (Envoy + workers + Redis) per "
          "1 KB call", file=log, flush=True)  # fmt: skip
    with ExitStack() as stack:
        gw = stack.enter_context(bench_gateway(policies, certs, out / "run", workers))
        policy_set = load_dir(policies)
        pool = stack.enter_context(multiprocessing.get_context("fork").Pool(threads, _init_generator,
                                                                            (policies, certs, HMAC_KEY_NAME)))  # fmt: skip
        _init_generator(policies, certs, HMAC_KEY_NAME)
        for pair in pairs:
            where = {}
            for row in pair:
                route = policy_set.route(BENCH_PROFILES[row].route)
                assert route.outbound is not None, f"{row} is no outbound row"
                where[row] = (f"http://{route.outbound.listen}", f"{route.match.path_prefix}demo")
                # One call first: a secureconversation route gets its context now, not under load.
                url, path = where[row]
                body = _make_messages(row, "small", 1)[0].body
                call = urllib.request.Request(url + path, data=body, headers={"content-type": "text/xml"})
                with urllib.request.urlopen(call, timeout=30) as reply:
                    reply.read()
            # A first slice on each warms both up and tells the rate the slices' pools are made for.
            rate = 0.0
            for row in pair:
                warm = _bodies(pool, out / "bodies" / f"{row}-warm", row, math.ceil(3000 * slice_s / threads), threads)
                _, n = slice_cost(gw, where[row][1], warm, threads, connections, slice_s, where[row][0])
                rate = max(rate, n / slice_s)
            per_thread = math.ceil(rate * slice_s * 1.5 / threads) + connections
            made = time.monotonic()
            prefixes = [
                {row: _bodies(pool, out / "bodies" / f"{row}-{i}", row, per_thread, threads) for row in pair}
                for i in range(slices)
            ]
            made = time.monotonic() - made
            ratios[pair] = []
            # Each row's CPU by process role over all its slices, and its requests: where a difference sits.
            roles = {row: dict.fromkeys(COUNTED, 0.0) for row in pair}
            served = dict.fromkeys(pair, 0)
            for i, prefix in enumerate(prefixes):
                cost = {}
                for row in pair if i % 2 == 0 else pair[::-1]:
                    url, path = where[row]
                    before = role_cpu(gw)
                    seconds, requests = slice_cost(gw, path, prefix[row], threads, connections, slice_s, url)
                    for role, spent in role_cpu(gw).items():
                        roles[row][role] += spent - before[role]
                    served[row] += requests
                    cost[row] = seconds / requests
                ratios[pair].append(cost[pair[0]] / cost[pair[1]])
            for f in (out / "bodies").glob("*"):
                f.unlink()
            print(f"  {pair[0]:19} / {pair[1]:24} {spread(ratios[pair])}  (~{rate:.0f} req/s; bodies made in "
                  f"{made:.0f} s)", file=log, flush=True)  # fmt: skip
            for row in pair:
                split = ", ".join(f"{role} {roles[row][role] / served[row] * 1e6:,.0f}" for role in COUNTED)
                print(f"    {row:24} us per call over its slices: {split}", file=log, flush=True)
    for (sc, hmac), rs in ratios.items():
        median = statistics.median(rs)
        print(f"#24 target: {sc} <= {hmac}: {median:.3f}x -> {'met' if median <= TARGET else 'MISSED'}", file=log)
    return ratios


def _pair(text: str) -> tuple[str, str]:
    sc, sep, hmac = text.partition(":")
    if not sep or sc not in outbound.PROFILES or hmac not in outbound.PROFILES:
        raise argparse.ArgumentTypeError(f"{text!r}: ROW:ROW, both of {', '.join(outbound.PROFILES)}")
    return sc, hmac


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=lambda t: tuple(_pair(x) for x in t.split(",") if x), default=PAIRS,
                   help="comma-separated ROW:ROW (default: issue 24's three)")  # fmt: skip
    p.add_argument("--slices", type=int, default=20, help="pairs of slices per pair of rows")
    p.add_argument("--slice", type=float, default=3.0, help="seconds per slice")
    p.add_argument("--workers", type=int, default=None, help="filter workers (default: one per core)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--policies", type=Path, default=DEFAULT_POLICIES)
    p.add_argument("--certs", type=Path, default=pki.DEFAULT_DIR)
    args = p.parse_args(argv)
    run(args.pairs, args.slices, args.slice, workers=args.workers, out=args.out, policies=args.policies,
        certs=args.certs)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
