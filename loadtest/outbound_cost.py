"""What an outbound call costs the filter workers of both gateways, in instructions per call (docs/outbound-cost.md,
"What a steady-state SecureConversation call costs the worker"; issue 24: outbound SecureConversation at steady
state no dearer than outbound hmac).

Two gateways on loopback: the partner (the bench's inbound routes, loadtest/policies-outbound/outbound.yaml's
`sc-signed` among them) and the outbound gateway, each with one filter worker under valgrind's callgrind. Each
row's route gets `--warmup` calls (a secureconversation route's Issue among them), the workers' counters are
zeroed, `--calls` sequential 1 KB calls of plain SOAP go through, and the counters are dumped: instructions per
call, repeatable whatever else runs on the machine. `--dumps DIR` keeps the dumps for callgrind_annotate
(`filter-0.<pid>.<n>`; the report names each worker's pid).

    python -m loadtest.outbound_cost --rows outbound-hmac outbound-sc-signed --calls 100
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
import time
from pathlib import Path

from certs import pki
from gateway.control.ports import free_ports
from gateway.control.supervisor import Options
from gateway.policy import load_dir
from loadtest import outbound, tracing_cost
from loadtest.bench import DEFAULT_POLICIES
from loadtest.bench_gateway import _env
from loadtest.messages import Factory


class _CountedWorker(tracing_cost._Counted):
    counted = ("filter-0",)


def measure(rows: list[str], calls: int, warmup: int, work: Path) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """Instructions per call of the outbound gateway's worker and the partner's, by row (all rows' routes in one
    gateway each); and the workers' pids."""
    certs = pki.init(pki.DEFAULT_DIR).resolve()
    policies = outbound.policy_dir(DEFAULT_POLICIES, work / "policies")
    dumps = work / "callgrind"
    dumps.mkdir(parents=True, exist_ok=True)
    _CountedWorker.out = dumps
    partner_opts = Options.on_free_ports(1, policies=policies, certs=certs, run_dir=work / "partner")
    partner = f"127.0.0.1:{partner_opts.https_port}"
    common = {"BACKEND_ADDR": partner_opts.backend or "", "WSGATE_BENCH_CERTS": str(certs),
              "WSGATE_BENCH_PARTNER": partner}  # fmt: skip
    # The partner's own outbound listener goes unused; the outbound gateway's listener is the one called.
    with _env(**common, WSGATE_BENCH_OUTBOUND=f"127.0.0.1:{free_ports(1)[0]}"), _CountedWorker(partner_opts) as pgw:
        listen = f"127.0.0.1:{free_ports(1)[0]}"
        opts = Options.on_free_ports(1, policies=policies, certs=certs, run_dir=work / "outbound", backend=None)
        with _env(**common, WSGATE_BENCH_OUTBOUND=listen), _CountedWorker(opts) as gw:
            pids = {"outbound": gw.workers[0].pid, "partner": pgw.workers[0].pid}
            out = {}
            for row in rows:
                factory = Factory(outbound.PROFILES[row])
                path = f"{load_dir(policies).route(outbound.PROFILES[row].route).match.path_prefix}demo"
                tracing_cost._send_to(listen, factory, path, warmup)
                calls_ = functools.partial(tracing_cost._send_to, listen, factory, path, calls)
                out[row] = {name: n // calls for name, n in tracing_cost._window(pids, dumps, calls_)[0].items()}
            return out, pids


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=["outbound-hmac", "outbound-sc-signed", "outbound-sc-direct",
                                                 "outbound-hmac-encrypted", "outbound-sc"], choices=list(outbound.PROFILES))  # fmt: skip
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--dumps", type=Path, help="keep the callgrind dumps here (default: a temporary directory)")
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        sys.exit("valgrind not found (apt-get install valgrind)")
    with tempfile.TemporaryDirectory(prefix="wsgate-outcost-") as tmp:
        work = args.dumps.resolve() if args.dumps else Path(tmp)
        started = time.monotonic()
        rows, pids = measure(args.rows, args.calls, args.warmup, work)
        print(f"instructions per call: {'outbound':>12} {'partner':>12} {'both':>12}   (workers' pids {pids})")
        for row, n in rows.items():
            print(f"{row:24} {n['outbound']:>12,} {n['partner']:>12,} {n['outbound'] + n['partner']:>12,}")
        print(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
