"""Where each exchange's time goes in the engine, in process: `python -m loadtest.exchange_profile` (issue 28).

Two tables per profile and size, of the route's real pipeline (loadtest/policies/bench.yaml) and the load test's
messages (loadtest.messages.Factory), as `loadtest.engine_cpu` runs them, the demo backend's work left out (every
request first, then the backend, then every response):

- by stage (`--stages`, the default): the engine's own stage histogram (filters/engine/metrics.py, exclusive times
  of parse, decrypt, c14n, digest, signature_check, security_header, signature_creation, encryption, secure,
  serialize) summed over the exchanges, and the glue: the exchange's CPU time outside any stage (the pipeline's
  dispatch, the Exchange record, the verdict and the answer). Time, so it moves with the machine's load; the
  shares move less.
- by component (`--callgrind`): instruction counts under valgrind's callgrind, which do not depend on the machine's
  load: one valgrind run executes every point, each side of a point inside its own `functools.reduce` call
  (callgrind collects only inside it and dumps at its exit), and each shared object's own instructions are summed
  by component: lxml with the libxml2 its wheel links in (parse, C14N, XPath, serialization), the xmlsec wheel
  with the libxmlsec1, libxml2 and OpenSSL it links in (RSA signing, AES both ways), the cryptography wheel with
  its OpenSSL (RSA key unwrap), the system's libcrypto (hashlib's SHA, hmac's HMAC), the Python interpreter with
  its C modules, libc (malloc, memcpy). Valgrind runs code about 50 times slower: a few exchanges per point
  (`--count`) are enough, instruction counts repeat.

Shares, not absolute times, are what this shows: the gateway's absolute figures come from `make bench`."""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from certs import pki
from filters.engine import metrics
from filters.engine.engine import Exchange, build_pipeline
from filters.engine.pipeline import RoutePipeline
from filters.engine.profiles import SecuredPipeline
from filters.stores.factory import RouteStores
from filters.stores.replay import MemoryReplayCache
from gateway.policy import PolicySet
from loadtest.engine_cpu import _answer
from loadtest.messages import PROFILES, Factory
from loadtest.optimizations import backend, bench_policies

DEFAULT_PROFILES = ("xml", "hmac", "hmac-encrypted", "secureconversation", "rsa", "rsa-encrypted")
DEFAULT_SIZES = ("small", "large")
STAGE_COUNTS = {"small": 300, "large": 100}
CALLGRIND_COUNTS = {"small": 20, "large": 6}
GLUE = "glue"  # the exchange's CPU outside every stage
MARKER = "functools_reduce"  # the C function callgrind collects inside (CPython's functools.reduce)


@dataclass
class Side:
    """The exchanges of one point, one side at a time: each runs in one call (`run`), given a function per body."""

    pipeline: RoutePipeline
    bodies: list[bytes]
    exchanges: list[Exchange] = field(default_factory=list)
    answers: list[bytes] = field(default_factory=list)

    def requests(self, clock: Callable[[], float]) -> float:
        spent = 0.0
        for body in self.bodies:
            ex = Exchange(route=self.pipeline.route)
            t0 = clock()
            out = self.pipeline.request(body, {}, ex)
            spent += clock() - t0
            assert not out.answer and not isinstance(out.body, list), "not a plain exchange"
            self.exchanges.append(ex)
            self.answers.append(body if out.body is None else bytes(out.body))  # None: passed on as received
        return spent

    def backend(self) -> None:
        self.answers = [backend(forwarded) for forwarded in self.answers]

    def responses(self, clock: Callable[[], float]) -> float:
        spent = 0.0
        for answer, ex in zip(self.answers, self.exchanges, strict=True):
            t0 = clock()
            self.pipeline.response(answer, ex)
            spent += clock() - t0
        return spent


def prepare(profile: str, size: str, policies: PolicySet, certs: Path, count: int) -> Side:
    """The route's pipeline, warmed by one exchange, and `count` fresh requests."""
    route = policies.route(PROFILES[profile].route)
    pl = build_pipeline(route, RouteStores())
    if isinstance(pl, SecuredPipeline):
        pl.credentials.replay = MemoryReplayCache(epoch_ms=0)  # in process: no Redis
    factory = Factory(profile, policies, certs=certs)
    if factory.needs_context:
        assert factory.client is not None and isinstance(pl, SecuredPipeline)
        factory.client.establish(lambda body, ctype: _answer(pl, body, ctype))
    warm = Side(pl, [factory.make(size).body])
    warm.requests(time.process_time), warm.backend(), warm.responses(time.process_time)
    return Side(pl, [factory.make(size).body for _ in range(count)])


def _stage_sums(route: str) -> dict[str, float]:
    return {labels[2]: series[-1] for labels, series in metrics.STAGE._series.items() if labels[0] == route}


class _CpuClock:
    """The stage histogram's clock made this process's CPU time: on a shared machine wall time counts the waits for
    a core, which exceeded the engine's whole CPU time here."""

    perf_counter = staticmethod(time.process_time)


def stage_row(side: Side) -> dict[str, float]:
    """us per exchange by stage, and the glue beside them (CPU time outside every stage)."""
    route = side.pipeline.route.name
    clock, metrics.time = metrics.time, _CpuClock  # type: ignore[assignment]
    try:
        before = _stage_sums(route)
        cpu = side.requests(time.process_time)
        side.backend()
        cpu += side.responses(time.process_time)
    finally:
        metrics.time = clock
    n = len(side.bodies)
    row = {k: (v - before.get(k, 0.0)) / n * 1e6 for k, v in _stage_sums(route).items()}
    row = {k: v for k, v in row.items() if v > 0}
    row[GLUE] = max(0.0, cpu / n * 1e6 - sum(row.values()))
    return row


STAGES = ("parse", "decrypt", "c14n", "digest", "signature_check", "replay", "security_header", "signature_creation",
          "encryption", "secure", "serialize", GLUE)  # fmt: skip


def report_stages(rows: dict[tuple[str, str], dict[str, float]], out: TextIO) -> None:
    print("By stage, % of the engine's CPU per exchange (request + response, in process; glue: outside every "
          "stage)", file=out)  # fmt: skip
    seen = [s for s in STAGES if any(s in r for r in rows.values())]
    seen += sorted({s for r in rows.values() for s in r} - set(seen))
    width = max(len(f"{p} {s}") for p, s in rows)
    print(f"{'profile/size':{width}}  " + "  ".join(f"{s:>{max(5, len(s))}}" for s in seen) + "  us/exchange", file=out)
    for (profile, size), row in rows.items():
        total = sum(row.values())
        cells = "  ".join(f"{row.get(s, 0.0) / total:>{max(5, len(s))}.0%}" for s in seen)
        print(f"{f'{profile} {size}':{width}}  {cells}  {total:11,.0f}", file=out)


# ---- callgrind: instruction counts by component

# (component, what the object's file name matches); the first match wins. By object: the wheels link their C
# libraries in and are stripped, as is the system's libcrypto, so their functions have no names here.
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("lxml + libxml2", r"lxml/"),
    ("xmlsec+OpenSSL", r"xmlsec"),
    ("libcrypto", r"libcrypto|libssl"),
    ("cryptography+OpenSSL", r"cryptography/|_rust\.abi3"),
    ("Python", r"python3|libpython|lib-dynload"),
    ("libc", r"/libc\.so|/libm\.so"),
)
OTHER = "other"
_NAMED = re.compile(r"\((\d+)\)(?: (.*))?")


def component(obj: str) -> str:
    return next((name for name, pattern in COMPONENTS if re.search(pattern, obj)), OTHER)


def self_counts(lines: Iterable[str]) -> dict[str, int]:
    """Each object's own instructions in a callgrind dump (its cost lines, less the calls' inclusive lines), by
    component. Names are compressed: `(id) name` the first time, `(id)` after; objects share ids with `cob=`."""
    objects: dict[str, str] = {}
    out: dict[str, int] = {}
    obj, skip = "", False
    for line in lines:
        head = line[:1]
        if head.isdigit() or head in "+-*":
            if skip:  # the line after calls=: the callee's inclusive cost, not this function's own
                skip = False
                continue
            parts = line.split()
            if len(parts) >= 2:
                name = component(obj)
                out[name] = out.get(name, 0) + int(parts[1])
        elif line.startswith(("ob=", "cob=")):
            key, _, rest = line.rstrip("\n").partition("=")
            m = _NAMED.match(rest)
            name = rest if m is None else (m.group(2) or objects.get(m.group(1), ""))
            if m is not None and m.group(2):
                objects[m.group(1)] = m.group(2)
            if key == "ob":
                obj = name
        elif line.startswith("calls="):
            skip = True
    return out


def under_valgrind(points: Sequence[tuple[str, str]], certs: Path, count: dict[str, int]) -> None:
    """Run inside valgrind: each side of each point in its own `functools.reduce` call (callgrind's marker)."""
    policies = bench_policies(certs)
    for profile, size in points:
        side = prepare(profile, size, policies, certs, count[size])
        functools.reduce(lambda _, clock: side.requests(clock), [time.process_time], None)
        side.backend()
        functools.reduce(lambda _, clock: side.responses(clock), [time.process_time], None)


def callgrind(points: Sequence[tuple[str, str]], certs: Path, count: dict[str, int], keep: Path | None
              ) -> dict[tuple[str, str, str], dict[str, int]]:  # fmt: skip
    """Instructions per exchange by component, for each point's request and response side."""
    with tempfile.TemporaryDirectory() as tmp:
        outdir = keep or Path(tmp)
        outdir.mkdir(parents=True, exist_ok=True)
        spec = ",".join(f"{p}:{s}" for p, s in points)
        counts = ",".join(f"{s}:{n}" for s, n in count.items())
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={MARKER}",
               f"--dump-after={MARKER}", f"--callgrind-out-file={outdir}/callgrind.out",
               sys.executable, "-m", "loadtest.exchange_profile", "--inside-valgrind", spec,
               "--certs", str(certs), "--count", counts]  # fmt: skip
        env = os.environ | {"PYTHONHASHSEED": "0"}  # the same dict layouts, run to run
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        dumps = sorted(outdir.glob("callgrind.out.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
        sides = [(p, s, side) for p, s in points for side in ("request", "response")]
        assert len(dumps) == len(sides), f"{len(dumps)} callgrind dumps for {len(sides)} sides"
        rows = {}
        for key, dump in zip(sides, dumps, strict=True):
            with dump.open() as f:
                rows[key] = {k: v // count[key[1]] for k, v in self_counts(f).items()}
        return rows


def report_components(rows: dict[tuple[str, str, str], dict[str, int]], out: TextIO) -> None:
    names = [c[0] for c in COMPONENTS] + [OTHER]
    exchanges: dict[tuple[str, str], dict[str, int]] = {}
    for (profile, size, _), row in rows.items():
        both = exchanges.setdefault((profile, size), {})
        for k, v in row.items():
            both[k] = both.get(k, 0) + v
    seen = [n for n in names if any(r.get(n) for r in exchanges.values())]
    print("\nBy component, % of the engine's instructions per exchange (callgrind, each object's own instructions; "
          "request + response)", file=out)  # fmt: skip
    width = max(len(f"{p} {s}") for p, s in exchanges)
    print(f"{'profile/size':{width}}  " + "  ".join(f"{n:>{max(6, len(n))}}" for n in seen)
          + "  Minstr/exchange  of which request", file=out)  # fmt: skip
    for (profile, size), row in exchanges.items():
        total = sum(row.values())
        request = sum(rows[(profile, size, "request")].values())
        cells = "  ".join(f"{row.get(n, 0) / total:>{max(6, len(n))}.1%}" for n in seen)
        print(f"{f'{profile} {size}':{width}}  {cells}  {total / 1e6:15.2f}  {request / total:15.0%}", file=out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default=",".join(DEFAULT_PROFILES))
    ap.add_argument("--sizes", default=",".join(DEFAULT_SIZES))
    ap.add_argument("--callgrind", action="store_true", help="instruction counts by component (needs valgrind)")
    ap.add_argument("--no-stages", action="store_true", help="skip the by-stage table")
    ap.add_argument("--count", help="exchanges per size, e.g. small:300,large:100")
    ap.add_argument("--keep", type=Path, help="keep callgrind's dumps in this folder")
    ap.add_argument("--certs", type=Path, help="a PKI folder (default: a temporary one)")
    ap.add_argument("--inside-valgrind", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    given = dict(kv.split(":") for kv in args.count.split(",")) if args.count else {}
    with tempfile.TemporaryDirectory() as tmp:
        certs = args.certs or pki.init(Path(tmp) / "pki")
        if args.inside_valgrind:
            points = [tuple(p.split(":")) for p in args.inside_valgrind.split(",")]
            under_valgrind(points, certs, {k: int(v) for k, v in given.items()})  # type: ignore[arg-type]
            return
        points = [(p, s) for p in args.profiles.split(",") for s in args.sizes.split(",")]
        if not args.no_stages:
            policies = bench_policies(certs)
            counts = STAGE_COUNTS | {k: int(v) for k, v in given.items()}
            rows = {(p, s): stage_row(prepare(p, s, policies, certs, counts[s])) for p, s in points}
            report_stages(rows, sys.stdout)
        if args.callgrind:
            counts = CALLGRIND_COUNTS | {k: int(v) for k, v in given.items()}
            report_components(callgrind(points, certs, counts, args.keep), sys.stdout)


if __name__ == "__main__":
    main()
