"""The `hmac` exchange part by part, in process: `python -m loadtest.engine_parts` (issue 28's breakdown).

The route's real pipeline (loadtest/policies/bench.yaml) and the load test's messages (loadtest.messages.Factory),
as `loadtest.engine_cpu` measures them; then each part of the exchange timed alone, repeated on the same message in
the same process, CPU time, medians: parse, the Security header's walk and its parts (the signature's shape checks,
the id index, each reference's C14N and digest, the SignedInfo's C14N), strip and serialize, the response's parse,
securing and serialization, the stage timing, the demo backend. A part that changes its message (the header walk
strips it, securing adds a header) runs on a deep copy, whose cost has its own line to subtract. The whole exchange
costs more than its parts timed one by one: a part repeated alone keeps its code and data in the CPU's caches.
Compare trees by running this in each, interleaved, several times: the machine's load moves every figure."""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from certs import pki
from filters.engine import metrics
from filters.engine.engine import Exchange, build_pipeline
from filters.engine.profiles import SecuredPipeline
from filters.engine.wss import signature, signing, wssecurity
from filters.engine.xml import c14n
from filters.engine.xml.threat_protection import parse_envelope
from filters.stores.factory import RouteStores
from filters.stores.replay import MemoryReplayCache
from loadtest.messages import PROFILES, Factory
from loadtest.optimizations import backend, bench_policies, exchange

REPEATS = 300


def cpu_us(fn: Callable[[], object], repeats: int) -> float:
    """The median CPU time of one call, in us."""
    samples = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        samples.append(time.process_time() - t0)
    return statistics.median(samples) * 1e6


def parts(certs: Path, size: str = "small", repeats: int = REPEATS) -> dict[str, float]:
    """Each part's CPU us per call (indented names: inside the part above)."""
    policies = bench_policies(certs)
    route = policies.route(PROFILES["hmac"].route)
    pl = build_pipeline(route, RouteStores())
    assert isinstance(pl, SecuredPipeline)
    pl.credentials.replay = MemoryReplayCache(epoch_ms=0)
    factory = Factory("hmac", policies, certs=certs)
    fresh = iter([factory.make(size).body for _ in range(repeats + 2)])
    exchange(pl, next(fresh))  # warm-up: keys parsed, code paths taken once
    out = {"the whole exchange (fresh messages)": cpu_us(lambda: exchange(pl, next(fresh)), repeats)}

    request = factory.make(size).body
    ex = Exchange(route=route)
    forwarded = pl.request(factory.make(size).body, {}, ex).body
    assert forwarded is not None and isinstance(ex.security, wssecurity.Verified)
    answer = backend(forwarded)
    out["request: parse and threat checks"] = cpu_us(lambda: parse_envelope(request, route.limits), repeats)
    env = parse_envelope(request, route.limits)
    security = wssecurity.find_security(env)
    assert security is not None
    sig = security.find(signature.SIGNATURE)
    ts = security.find(wssecurity.TIMESTAMP)
    assert sig is not None and ts is not None and ex.security.symmetric_key is not None
    key, policy, opts = ex.security.symmetric_key, route.signature, pl.optimizations
    creds = wssecurity.Credentials(psk=pl.credentials.psk, optimizations=opts)  # no replay store: repeatable
    out["request: the Security header (walk, verify, strip; on a copy)"] = cpu_us(
        lambda: wssecurity.process(copy.deepcopy(env), pl.requirements, creds, datetime.now(UTC)), repeats
    )
    out["  its copy (to subtract)"] = cpu_us(lambda: copy.deepcopy(env), repeats)
    out["  signature.verify"] = cpu_us(lambda: signature.verify(sig, env, key, policy, opts), repeats)
    out["    shape checks (algorithms, references, BSP)"] = cpu_us(
        lambda: signature._check_signature(sig, key, policy), repeats
    )
    out["    id index (the whole document)"] = cpu_us(lambda: signature.id_index(env.root), repeats)
    prefixes = signing._inclusive_prefixes(ts, exclude_visible=True)
    out["    Body: C14N and digest"] = cpu_us(lambda: c14n.digest(env.body, [], "sha256"), repeats)
    out[f"    Timestamp: C14N (PrefixList {' '.join(prefixes)}) and digest"] = cpu_us(
        lambda: c14n.digest(ts, prefixes, "sha256"), repeats
    )
    info_prefixes = signing._inclusive_prefixes(security, exclude_visible=False)
    out[f"    SignedInfo: C14N (PrefixList {' '.join(info_prefixes)})"] = cpu_us(
        lambda: c14n.canonical(sig[0], info_prefixes), repeats
    )
    stripped = copy.deepcopy(env)
    wssecurity.process(stripped, pl.requirements, creds, datetime.now(UTC))
    out["request: serialize"] = cpu_us(stripped.serialize, repeats)

    out["response: parse and threat checks"] = cpu_us(lambda: parse_envelope(answer, route.response_limits), repeats)
    reply = parse_envelope(answer, route.response_limits)
    sign, encrypt, tokens = pl.response_security(ex.security)
    out["response: secure (Timestamp, ids, signature; on a copy)"] = cpu_us(
        lambda: pl.secure(copy.deepcopy(reply), datetime.now(UTC), sign, encrypt, tokens), repeats
    )
    out["  the reply's copy (to subtract)"] = cpu_us(lambda: copy.deepcopy(reply), repeats)
    secured = copy.deepcopy(reply)
    pl.secure(secured, datetime.now(UTC), sign, encrypt, tokens)
    out["response: serialize"] = cpu_us(secured.serialize, repeats)

    def stages() -> None:  # what a pipeline stage with one inner stage costs to time and observe
        with metrics.stage(route, "parse"), metrics.stage(None, "c14n"):
            pass

    out["stage timing: a stage with an inner one (2 entries, exits, observations)"] = cpu_us(stages, repeats * 10)
    out["the demo backend (not the engine)"] = cpu_us(lambda: backend(forwarded), repeats)
    return out


def report(rows: dict[str, float], out: TextIO = sys.stdout) -> None:
    width = max(map(len, rows))
    for name, us in rows.items():
        print(f"{name:{width}}  {us:8.1f}", file=out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--certs", type=Path, help="a PKI folder (default: a temporary one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        report(parts(pki.init(args.certs or Path(tmp) / "pki"), args.size, args.repeats))


if __name__ == "__main__":
    main()
