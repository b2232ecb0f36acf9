"""WS-SecureConversation at scale: establish many contexts through the gateway, one after another, as in
Shirasuna et al.'s Figure 7 (whose server ran out of memory after 1,680 contexts), and print every Nth
establishment's and message's latency and the filter worker's resident memory. Then time a message in an
established context against the same message on an `rsa` route, side by side.

    python -m loadtest.contexts --store sealed --contexts 100000
    python -m loadtest.contexts --store redis --contexts 20000      # also prints Redis memory per context

Contexts are never cancelled here: they pile up, which is the point."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import redis
import yaml

from certs import pki
from gateway.policy import REDIS_URL_ENV, Route
from gateway.tools.client import Client, ClientConfig, Post, http_post
from loadtest.bench_gateway import bench_gateway

T = TypeVar("T")
ECHO = (
    b'<soap:Envelope xmlns:soap="http://schemas.xmlsoap.org/soap/envelope/"><soap:Body>'
    b'<d:echo xmlns:d="urn:wsgate:demo"><d:text>context benchmark</d:text></d:echo></soap:Body></soap:Envelope>'
)


def _routes(store: str, certs: Path, max_contexts: int) -> list[dict]:
    common = {
        "upstream": {"address": "${BACKEND_ADDR:-127.0.0.1:8081}"},
        "rsa": {"trust_anchors": [str(certs / "ca.pem")], "key": str(certs / "gateway-sign.key"),
                "certificate": str(certs / "gateway-sign.pem"), "decryption_key": str(certs / "gateway-enc.key")},
        # The replay store is the one thing that grows with traffic (bounded, expiring): cap it low here so the
        # run shows contexts themselves cost the gateway nothing (sealed) or a bounded table (memory).
        "replay": {"store": "memory", "max_entries": 20_000},
    }  # fmt: skip
    return [
        {"name": "sc", "match": {"path_prefix": "/sc/"}, "profile": "secureconversation", **common,
         "secureconversation": {"store": store, "max_contexts": max_contexts, "lifetime_s": 86400,
                                "master_keys_file": str(certs / "sct-master-keys.yaml")}},
        {"name": "rsa", "match": {"path_prefix": "/rsa/"}, "profile": "rsa", **common},
    ]  # fmt: skip


def _rss_kib(pid: int) -> tuple[int, int]:
    """(current, peak) resident set size of a process, KiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _timed(fn: Callable[..., T], *args: object) -> tuple[T, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, (time.perf_counter() - start) * 1000


def run(store: str, contexts: int, every: int, certs: Path, run_dir: Path, side_by_side: int) -> None:
    pki.init(certs)
    policies = run_dir / "policies"
    policies.mkdir(parents=True, exist_ok=True)
    routes = _routes(store, certs, contexts + 1)  # room for the side-by-side context
    (policies / "contexts.yaml").write_text(yaml.safe_dump({"routes": routes}, sort_keys=False))
    with bench_gateway(policies, certs, run_dir, workers=1) as gw:
        base = f"http://127.0.0.1:{gw.opts.http_port}"
        route = {r["name"]: Route.model_validate({**r, "upstream": {"address": "127.0.0.1:1"}}) for r in routes}
        post_sc = http_post(f"{base}/sc/demo")
        worker = gw.workers[0].pid
        rdb = redis.Redis.from_url(gw.env[REDIS_URL_ENV]) if store == "redis" else None
        redis_base = rdb.info("memory")["used_memory"] if rdb else 0
        print(f"store={store} contexts={contexts} (one after another; every {every}th printed)")
        print(f"{'contexts':>9} {'establish ms':>13} {'message ms':>11} {'worker RSS MiB':>15} {'peak MiB':>9}"
              + (f" {'redis B/context':>16}" if rdb else ""))  # fmt: skip
        client = Client(route["sc"], ClientConfig(certs=certs))
        start = time.monotonic()
        for n in range(1, contexts + 1):
            _, est_ms = _timed(client.establish, post_sc)
            if n % every == 0 or n == 1:
                secured, pending = client.secure(ECHO)
                _, msg_ms = _timed(lambda s=secured, p=pending: client.open(post_sc(s, p.content_type), p))
                rss, peak = _rss_kib(worker)
                line = f"{n:>9} {est_ms:>13.2f} {msg_ms:>11.2f} {rss / 1024:>15.1f} {peak / 1024:>9.1f}"
                if rdb:
                    line += f" {(rdb.info('memory')['used_memory'] - redis_base) / n:>16.0f}"
                print(line, flush=True)
        elapsed = time.monotonic() - start
        print(f"{contexts} contexts in {elapsed:.0f} s ({contexts / elapsed:.0f}/s including the client's RSA work)")
        _side_by_side(client, route["rsa"], certs, base, post_sc, side_by_side)


def _side_by_side(sc_client: Client, rsa_route: Route, certs: Path, base: str, post_sc: Post, n: int) -> None:
    """Round-trip time of one message: in an established context vs. signed with RSA, same message, same gateway."""
    rsa_client = Client(rsa_route, ClientConfig(certs=certs))
    post_rsa = http_post(f"{base}/rsa/demo")
    sc_client.establish(post_sc)
    results = {}
    for name, client, post in (("secureconversation", sc_client, post_sc), ("rsa", rsa_client, post_rsa)):
        times = []
        for _ in range(n):
            secured, pending = client.secure(ECHO)
            start = time.perf_counter()
            reply = post(secured, pending.content_type)
            times.append((time.perf_counter() - start) * 1000)
            client.open(reply, pending)
        results[name] = times
    print(f"\nper message, {n} sequential round trips (gateway side: verify request + sign response; ms):")
    for name, times in results.items():
        q = statistics.quantiles(times, n=100)
        print(f"  {name:20} median {statistics.median(times):6.2f}   p99 {q[98]:6.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.contexts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", choices=["sealed", "memory", "redis"], default="sealed")
    ap.add_argument("--contexts", type=int, default=100_000)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--side-by-side", type=int, default=500, help="messages per profile in the comparison")
    ap.add_argument("--certs", type=Path, default=pki.DEFAULT_DIR)
    ap.add_argument("--run-dir", type=Path, default=Path("loadtest/out/contexts"))
    args = ap.parse_args(argv)
    run(args.store, args.contexts, args.every, args.certs, args.run_dir / args.store, args.side_by_side)
    return 0


if __name__ == "__main__":
    sys.exit(main())
