"""The papers' optimizations, each measured off and on: `python -m loadtest.optimizations`.

In-process, no Envoy, no network: the gateway's real pipelines (filters.engine.engine.build_pipeline on the benchmark
routes, loadtest/policies/bench.yaml) take secured requests from loadtest.messages.Factory (fresh Timestamp,
ids, signature and nonce per message, as the load test sends), the demo backend answers (gateway.tools.demo_backend:
an echo of the request, or the same 1 MB query result every time), and the pipeline secures the answer.
One exchange = request + response, CPU time of this process (time.process_time); the configurations take turns
message by message (in a shuffled order) and each gets the median of its turns, so load from other processes
hits them alike. Each configuration has its own replay store, so the same pre-generated messages serve them all.

Rows: `direct_c14n` is measured against xmlsec's reference processing (everything off); each of the papers'
optimizations against direct_c14n alone, the configuration it builds on. Rows marked "(repeated body)" and
"(canonical sender)" are best cases on synthetic traffic: the same signed Body every time, and a sender that
writes its signed elements in canonical form. Then the on-demand re-canonicalization numbers (van Engelen 2.5:
cost_C14N, the break-even alpha, the measured alpha) and the differential parsing prototype
(loadtest/differential_parsing.py)."""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from lxml import etree

from certs import pki
from filters.engine import ns
from filters.engine.engine import Exchange, build_pipeline
from filters.engine.profiles import SecuredPipeline
from filters.engine.wss import signature
from filters.engine.xml import c14n, xmlsupport
from filters.engine.xml.threat_protection import parse_envelope
from filters.stores.factory import RouteStores
from filters.stores.replay import MemoryReplayCache
from gateway.policy import PolicySet, Route, load_dir
from gateway.tools import demo_backend
from loadtest import differential_parsing
from loadtest.messages import SIZE_LABELS, SIZES, Factory, plain_request

BENCH_POLICIES = Path(__file__).with_name("policies")
PROFILES = ("hmac", "rsa")
# Exchanges per configuration and size: a few seconds for the whole default run each.
COUNTS = {"small": 300, "large": 100, "huge": 9}
OPTIMIZATIONS = ("direct_c14n", "on_demand_c14n", "digest_cache", "prehash")
OFF = {"direct_c14n": False, "on_demand_c14n": False, "digest_cache": False, "prehash": False}
BASE = {**OFF, "direct_c14n": True}
_PARSER = xmlsupport.parser(huge_tree=True)
SIGNATURE = ns.q(ns.DS, "Signature")
REFERENCE = ns.q(ns.DS, "Reference")
WSU_ID = ns.q(ns.WSU, "Id")


@dataclass
class Traffic:
    """Secured requests of one profile and size, and the backend that answers them."""

    requests: list[bytes]
    label: str = ""  # "" for the load test's own traffic


@dataclass
class Row:
    profile: str
    size: str
    optimization: str
    off_us: float
    on_us: float
    hit_rate: float | None  # None: not a cache

    @property
    def speedup(self) -> float:
        return self.off_us / self.on_us if self.on_us else 0.0


@dataclass
class Config:
    pipeline: SecuredPipeline
    samples: list[float] = field(default_factory=list)  # CPU seconds per exchange


def backend(body: bytes) -> bytes:
    """The demo backend's answer to what the gateway forwarded."""
    status, _, answer = demo_backend.handle_soap(body, "text/xml")
    if status != 200:
        raise RuntimeError(f"demo backend answered {status}: {answer[:200]!r}")
    return answer


def pipeline_for(route: Route, **switches: bool) -> SecuredPipeline:
    opts = route.optimizations.model_copy(update=switches)
    pl = build_pipeline(route.model_copy(update={"optimizations": opts}), RouteStores())
    assert isinstance(pl, SecuredPipeline)
    pl.credentials.replay = MemoryReplayCache(epoch_ms=0)  # its own, so every configuration gets the same messages
    return pl


def exchange(pl: SecuredPipeline, body: bytes) -> None:
    ex = Exchange(route=pl.route)
    forwarded = pl.request(body, {}, ex).body
    assert forwarded is not None
    pl.response(backend(forwarded), ex)


def measure(configs: Sequence[Config], traffic: Traffic) -> None:
    """Every configuration handles every request once, the configurations taking turns message by message in a
    shuffled order (a fixed cyclic order made the one after xmlsec pay for what xmlsec left behind), so load
    from other processes on the machine falls on all of them alike."""
    for c in configs:  # warm-up: keys parsed, code paths taken once
        exchange(c.pipeline, traffic.requests[0])
    order = list(configs)
    shuffle = random.Random(len(traffic.requests)).shuffle
    for body in traffic.requests[1:]:
        shuffle(order)
        for c in order:
            t0 = time.process_time()
            exchange(c.pipeline, body)
            c.samples.append(time.process_time() - t0)


def us(c: Config) -> float:
    """The median exchange: robust against a garbage collection or a neighbour's burst landing on one sample."""
    return statistics.median(c.samples) * 1e6


def hit_rate(c: Config, optimization: str) -> float | None:
    opts = c.pipeline.optimizations
    assert opts is not None
    if optimization == "on_demand_c14n":
        return opts.counts.canonical / opts.counts.received if opts.counts.received else 0.0
    cache = opts.digest_cache if optimization == "digest_cache" else opts.prehash
    if cache is None:
        return None
    tried = cache.hits + cache.misses
    return cache.hits / tried if tried else 0.0


# --- traffic ------------------------------------------------------------------------------------------------


def load_traffic(factory: Factory, size: str, count: int) -> Traffic:
    return Traffic([factory.make(size).body for _ in range(count + 1)])


def repeated_body_traffic(factory: Factory, size: str, count: int) -> Traffic:
    """The same Body (content and wsu:Id) in every request; Timestamp, signature and nonce fresh."""
    plain, _ = plain_request(size, "repeated")
    plain = plain.replace(b"<soap:Body>", f'<soap:Body xmlns:wsu="{ns.WSU}" wsu:Id="body-1">'.encode(), 1)
    assert factory.client is not None
    return Traffic([factory.client.secure(plain)[0] for _ in range(count + 1)], "repeated body")


def references(root: etree._Element) -> list[tuple[etree._Element, list[str]]]:
    """The signed elements of a request, each with its reference's InclusiveNamespaces PrefixList."""
    sig = root.find(f".//{SIGNATURE}")
    assert sig is not None
    index = signature.id_index(root)
    out = []
    for ref in sig.iter(REFERENCE):
        inclusive = ref.find(f".//{ns.q(ns.EXC_C14N, 'InclusiveNamespaces')}")
        prefixes = (inclusive.get("PrefixList") or "").split() if inclusive is not None else []
        out.append((index[(ref.get("URI") or "#")[1:]], prefixes))
    return out


def canonical_sender(body: bytes) -> bytes:
    """The request as a sender that writes its signed elements in canonical form would have sent it (gSOAP's
    habit): each signed element's bytes replaced by its exclusive canonical form, which keeps the signature
    valid. Spliced as bytes: a tree would drop the declarations the ancestors already make."""
    root = etree.fromstring(body, _PARSER)
    spliced = []
    for i, (el, prefixes) in enumerate(references(root)):
        placeholder = etree.Element(f"wsgate-placeholder-{i}")
        placeholder.tail = el.tail
        spliced.append((etree.tostring(placeholder, with_tail=False), c14n.canonical(el, prefixes)))
        parent = el.getparent()
        assert parent is not None
        parent.replace(el, placeholder)
    data = etree.tostring(root)
    for placeholder_bytes, canonical in spliced:
        data = data.replace(placeholder_bytes, canonical, 1)
    return data


def reformatted(body: bytes) -> bytes:
    """Through an intermediary that normalizes namespace declarations (drops the ones its subtree does not
    use) and writes the message again: signatures stay valid, canonical layouts do not."""
    root = etree.fromstring(body, _PARSER)
    etree.cleanup_namespaces(root)
    return etree.tostring(root)


# --- the tables ---------------------------------------------------------------------------------------------


def optimization_rows(profile: str, size: str, route: Route, factory: Factory, count: int) -> list[Row]:
    configs = {
        "off": Config(pipeline_for(route, **OFF)),
        "direct_c14n": Config(pipeline_for(route, **BASE)),
        **{o: Config(pipeline_for(route, **{**BASE, o: True})) for o in OPTIMIZATIONS[1:]},
    }
    measure(list(configs.values()), load_traffic(factory, size, count))
    rows = [Row(profile, size, "direct_c14n", us(configs["off"]), us(configs["direct_c14n"]), None)]
    base = us(configs["direct_c14n"])
    for o in OPTIMIZATIONS[1:]:
        rows.append(Row(profile, size, o, base, us(configs[o]), hit_rate(configs[o], o)))
    if size == "huge":
        return rows  # a small query request: nothing repeated or canonical worth a row of its own
    # Best cases, on synthetic traffic.
    rows.append(pair_row(profile, size, route, "digest_cache", repeated_body_traffic(factory, size, count)))
    canonical = [canonical_sender(b) for b in load_traffic(factory, size, count).requests]
    rows.append(pair_row(profile, size, route, "on_demand_c14n", Traffic(canonical, "canonical sender")))
    return rows


def pair_row(profile: str, size: str, route: Route, optimization: str, traffic: Traffic) -> Row:
    """One optimization against direct_c14n alone, on `traffic`."""
    pair = [
        Config(pipeline_for(route, **BASE)),
        Config(pipeline_for(route, **{**BASE, optimization: True})),
    ]
    measure(pair, traffic)
    name = f"{optimization} ({traffic.label})"
    return Row(profile, size, name, us(pair[0]), us(pair[1]), hit_rate(pair[1], optimization))


def cpu_us(fn: Callable[[], object], n: int) -> float:
    fn()
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n * 1e6


@dataclass
class Alpha:
    size: str
    request_us: float  # the whole request, direct_c14n
    c14n_us: float  # canonicalization of the signed elements
    form_us: float  # their received form
    hash_us: float
    alphas: dict[str, float]

    @property
    def cost_c14n(self) -> float:
        return self.c14n_us / self.request_us

    @property
    def per_reference_break_even(self) -> float:
        return (self.form_us + self.hash_us) / (self.c14n_us + self.hash_us)


def alpha_of(requests: Sequence[bytes]) -> float:
    """The fraction of signed elements whose received form is their canonical form."""
    canonical = total = 0
    for body in requests:
        for el, prefixes in references(etree.fromstring(body, _PARSER)):
            total += 1
            canonical += c14n.received_form(el) == c14n.canonical(el, prefixes)
    return canonical / total if total else 0.0


def alpha_row(size: str, route: Route, factory: Factory, count: int) -> Alpha:
    traffic = load_traffic(factory, size, count)
    pl = pipeline_for(route, **BASE)
    t0 = time.process_time()
    for body in traffic.requests:
        pl.request(body, {}, Exchange(route=route))
    request_us = (time.process_time() - t0) / len(traffic.requests) * 1e6
    refs = references(parse_envelope(traffic.requests[0], route.limits).root)
    n = max(20, count)
    c14n_us = cpu_us(lambda: [c14n.canonical(el, prefixes) for el, prefixes in refs], n)
    form_us = cpu_us(lambda: [c14n.received_form(el) for el, _ in refs], n)
    forms = [c14n.received_form(el) for el, _ in refs]
    hash_us = cpu_us(lambda: [hashlib.sha256(f).digest() for f in forms], n)
    sample = traffic.requests[: min(len(traffic.requests), 30)]
    canonical = [canonical_sender(b) for b in sample]
    alphas = {
        "our client": alpha_of(sample),
        "canonical sender": alpha_of(canonical),
        "canonical sender, reformatted": alpha_of([reformatted(b) for b in canonical]),
    }
    return Alpha(size, request_us, c14n_us, form_us, hash_us, alphas)


def print_rows(rows: Sequence[Row], out: TextIO) -> None:
    print("Signature optimizations, CPU us per exchange (request + response), off -> on", file=out)
    print(f"{'profile':8} {'size':10} {'optimization':36} {'off us':>9} {'on us':>9} {'speed-up':>9} {'hit rate':>9}",
          file=out)  # fmt: skip
    for r in rows:
        hit = "" if r.hit_rate is None else f"{r.hit_rate:.0%}"
        print(f"{r.profile:8} {SIZE_LABELS[r.size]:10} {r.optimization:36} {r.off_us:9,.0f} {r.on_us:9,.0f} "
              f"{r.speedup:8.2f}x {hit:>9}", file=out)  # fmt: skip


def print_alpha(alphas: Sequence[Alpha], profile: str, out: TextIO) -> None:
    print(f"\nOn-demand re-canonicalization (van Engelen 2.5), {profile} requests", file=out)
    print(f"{'size':10} {'request us':>10} {'c14n us':>8} {'cost_C14N':>9} {'paper: alpha >=':>15} "
          f"{'form us':>8} {'per ref: alpha >=':>17}  measured alpha", file=out)  # fmt: skip
    for a in alphas:
        measured = ", ".join(f"{k} {v:.0%}" for k, v in a.alphas.items())
        print(f"{SIZE_LABELS[a.size]:10} {a.request_us:10,.0f} {a.c14n_us:8,.0f} {a.cost_c14n:9.1%} "
              f"{1 - a.cost_c14n:15.2f} {a.form_us:8,.0f} {a.per_reference_break_even:17.2f}  {measured}",
              file=out)  # fmt: skip


def bench_policies(certs: Path) -> PolicySet:
    """loadtest/policies/bench.yaml with its keys from `certs`."""
    saved = os.environ.get("WSGATE_BENCH_CERTS")
    os.environ["WSGATE_BENCH_CERTS"] = str(certs)
    try:
        return load_dir(BENCH_POLICIES)
    finally:
        if saved is None:
            del os.environ["WSGATE_BENCH_CERTS"]
        else:
            os.environ["WSGATE_BENCH_CERTS"] = saved


def run(
    profiles: Sequence[str] = PROFILES,
    sizes: Sequence[str] = SIZES,
    scale: float = 1.0,
    certs: Path | None = None,
    out: TextIO = sys.stdout,
) -> list[Row]:
    """Print the tables; `scale` multiplies the exchange counts (the smoke test runs a tiny fraction)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = certs or pki.init(Path(tmp) / "pki")
        policies = bench_policies(folder)
        rows: list[Row] = []
        counts = {s: max(2, round(COUNTS[s] * scale)) for s in sizes}
        for profile in profiles:
            route = policies.route(profile)
            factory = Factory(profile, policies, certs=folder)
            for size in sizes:
                rows.extend(optimization_rows(profile, size, route, factory, counts[size]))
        print_rows(rows, out)
        route = policies.route(profiles[0])
        factory = Factory(profiles[0], policies, certs=folder)
        print_alpha([alpha_row(s, route, factory, counts[s]) for s in sizes if s != "huge"], profiles[0], out)
        print(file=out)
        differential_parsing.report(factory, scale, out)
        print(
            "\nNot built: a cache of verified SignatureValues (same canonical SignedInfo, same key). Every request "
            "signs a fresh Timestamp, so its SignedInfo never repeats; one that did would carry the same signature "
            "value and be refused as a replay.",
            file=out,
        )
        return rows


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default=",".join(PROFILES), help="hmac, rsa, rsa-encrypted, username")
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the exchange counts (default run ~1 min)")
    ap.add_argument("--certs", type=Path, help="a PKI folder (default: a temporary one)")
    args = ap.parse_args(argv)
    run(args.profiles.split(","), args.sizes.split(","), args.scale, args.certs)


if __name__ == "__main__":
    main()
