"""Where the whole gateway's CPU goes under load, by component: `python -m loadtest.gateway_profile` (issue 28).

`make bench`'s gateway and load (loadtest.bench: its own gateway, wrk at saturation, then the paced run), with
`perf record -e cpu-clock` attached to Envoy, to the filter workers and to Redis for each point; each sample is
charged to the code it landed in (its shared object: the leaf of its stack) and summed by component: Envoy (the
binary is stripped, so its HTTP, ext_proc and gRPC work is one figure), the frame (wsgate_frame: tonic, tokio,
pyo3), the Python interpreter, lxml with the libxml2 it links, xmlsec, OpenSSL, the cryptography package, libc,
the kernel (loopback TCP, syscalls) and Redis. A sample is a CPU-clock tick, so shares of samples are shares of
the gateway's CPU; the absolute rows are `make bench`'s. Needs `perf` (linux-perf) and the rights to attach."""

from __future__ import annotations

import argparse
import multiprocessing
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TextIO

from certs import pki
from gateway.control.supervisor import default_workers
from gateway.policy import load_dir
from loadtest.bench import DEFAULT_POLICIES, Bench, _init_generator
from loadtest.bench_gateway import _pids, bench_gateway
from loadtest.messages import HMAC_KEY_NAME

# (component, what the sample's shared object matches); the first match wins, per role (the process it ran in).
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("kernel", r"kernel|vmlinux|\[vdso\]"),
    ("frame", r"wsgate_frame"),
    ("lxml + libxml2", r"^(etree|objectify|_elementpath)\.|libxml2"),  # lxml's wheel links libxml2 into etree
    ("xmlsec+OpenSSL", r"xmlsec"),
    ("libcrypto", r"libcrypto|libssl"),
    ("cryptography+OpenSSL", r"_rust\.abi3|cryptography"),
    ("Python", r"^python|^libpython|\.cpython-"),  # and the standard library's C modules
    ("libc", r"^libc[.-]|^libm[.-]|ld-linux"),
)
ROLES = ("envoy", "filter", "redis")
_DSO_LINE = re.compile(r"^\s*[\d.]+%\s+(\d+)\s+(\S.*?)\s*$")


def component(role: str, dso: str) -> str:
    name = next((c for c, pattern in COMPONENTS if re.search(pattern, dso)), "other")
    if role == "filter":
        return name
    return f"{role}: kernel" if name == "kernel" else role  # Envoy's own binary, libc and all: Envoy


def samples_by_dso(report: Iterable[str]) -> dict[str, int]:
    """`perf report --stdio --no-children -n --sort dso` lines: samples per shared object."""
    out: dict[str, int] = {}
    for line in report:
        m = _DSO_LINE.match(line)
        if m:
            out[m.group(2)] = out.get(m.group(2), 0) + int(m.group(1))
    return out


def profile_point(bench: Bench, profile: str, size: str, tmp: Path) -> dict[str, int]:
    """Samples by component for one bench point (its saturation and paced runs)."""
    pids = _pids(bench.gw)
    records = {role: tmp / f"{profile}-{size}-{role}.data" for role in ROLES if pids[role]}
    perfs = [subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", "999", "-o", str(path), "-p",
                               ",".join(map(str, pids[role]))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for role, path in records.items()]  # fmt: skip
    try:
        bench.measure(profile, size)
    finally:
        for p in perfs:
            p.send_signal(signal.SIGINT)
            p.wait(timeout=60)
    counts: dict[str, int] = {}
    for role, path in records.items():
        report = subprocess.run(["perf", "report", "--stdio", "--no-children", "-n", "--sort", "dso", "-i", str(path)],
                                capture_output=True, text=True, check=True).stdout  # fmt: skip
        for dso, n in samples_by_dso(report.splitlines()).items():
            key = component(role, dso)
            counts[key] = counts.get(key, 0) + n
    return counts


def report(rows: dict[tuple[str, str], dict[str, int]], out: TextIO) -> None:
    order = ["envoy", "envoy: kernel", "frame", "Python", "lxml + libxml2", "xmlsec+OpenSSL", "libcrypto", "cryptography+OpenSSL",
             "libc", "kernel", "other", "redis", "redis: kernel"]  # fmt: skip
    seen = [c for c in order if any(r.get(c) for r in rows.values())]
    seen += sorted({c for r in rows.values() for c in r} - set(seen))
    print("The gateway's CPU by component, % of its samples (perf cpu-clock; Envoy and Redis whole, the filter "
          "workers by shared object; kernel: the workers' syscalls and loopback TCP)", file=out)  # fmt: skip
    width = max(len(f"{p} {s}") for p, s in rows)
    print(f"{'profile/size':{width}}  " + "  ".join(f"{c:>{max(6, len(c))}}" for c in seen) + "  samples", file=out)
    for (profile, size), row in rows.items():
        total = sum(row.values()) or 1
        cells = "  ".join(f"{row.get(c, 0) / total:>{max(6, len(c))}.0%}" for c in seen)
        print(f"{f'{profile} {size}':{width}}  {cells}  {total:7,}", file=out)


def run(profiles: Sequence[str], sizes: Sequence[str], duration: float, out: TextIO) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        certs = pki.init(pki.DEFAULT_DIR).resolve()
        policies = DEFAULT_POLICIES.resolve()
        rows = {}
        with bench_gateway(policies, certs, work / "run", default_workers()) as gw:
            ctx = multiprocessing.get_context("fork")
            with ctx.Pool(2, _init_generator, (policies, certs, HMAC_KEY_NAME)) as pool:
                _init_generator(policies, certs, HMAC_KEY_NAME)
                bench = Bench(gw, load_dir(policies), work, pool, duration, duration, duration / 2, 200.0, 2, 16,
                              HMAC_KEY_NAME, sys.stderr)  # fmt: skip
                for profile in profiles:
                    for size in sizes:
                        rows[(profile, size)] = profile_point(bench, profile, size, work)
        report(rows, out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default="xml,hmac,hmac-encrypted,secureconversation,rsa,rsa-encrypted")
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of saturation per point")
    args = ap.parse_args(argv)
    run(args.profiles.split(","), args.sizes.split(","), args.duration, sys.stdout)


if __name__ == "__main__":
    main()
