"""The benchmark's rows (loadtest/bench.py): one `Point` per profile and size, the report printed from them
(normalized to `none`, as Sosnoski's Figure 1; the stage breakdown, as van Engelen's Figure 3), bench.csv and
bench.png."""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from loadtest import outbound, targets
from loadtest.bench_gateway import EXTPROC_PHASES
from loadtest.messages import PROFILES, SIZE_LABELS, SIZES

BENCH_PROFILES = {**PROFILES, **outbound.PROFILES}  # the inbound rows, then the outbound ones (loadtest/outbound.py)


@dataclass
class Point:
    """One profile at one size: everything measured, as written to bench.csv."""

    profile: str
    size: str
    route: str
    request_bytes: float = 0.0  # average body sent (secured: as it went on the wire)
    response_bytes: float = 0.0  # average bytes read per response (wrk: headers included)
    duration_s: float = 0.0
    requests: int = 0
    rps: float = 0.0
    sat_p50_ms: float = 0.0
    sat_p99_ms: float = 0.0
    errors: int = 0  # wrk: non-2xx/3xx + socket errors + timeouts
    pool: int = 0  # bodies pre-generated for the saturation run
    pool_exhausted: bool = False  # still out of bodies after the retry: rps is a lower bound
    gen_s: float = 0.0  # time to pre-generate the saturation bodies (the gateway idle)
    gen_us_per_msg: float = 0.0
    paced_rate: float = 0.0
    paced_sent: int = 0
    paced_p50_ms: float = 0.0
    paced_p99_ms: float = 0.0
    paced_max_ms: float = 0.0
    paced_errors: int = 0
    verified: int = 0  # sampled paced replies opened and compared
    verify_failures: int = 0
    envoy_cpu_us: float = 0.0
    filter_cpu_us: float = 0.0
    gateway_cpu_us: float = 0.0  # Envoy + filter workers
    redis_cpu_us: float = 0.0  # the shared replay store (not in gateway_cpu_us)
    backend_cpu_us: float = 0.0  # the demo backend (not in gateway_cpu_us)
    wrk_cpu_us: float = 0.0  # the load generator
    other_cores: float = 0.0  # CPU used by unrelated processes during the run, in cores (noise)
    softirq_cores: float = 0.0  # the kernel's interrupt work (loopback networking, mostly), not per process
    time_ratio: float = 0.0  # time per request at saturation / none's, at this size (Sosnoski's Figure 1)
    cpu_ratio: float = 0.0  # gateway CPU per request / none's
    stages_ms: dict[str, float] = field(default_factory=dict)  # filter stage time per request
    # At the paced rate (no queueing): the worker's stages, and Envoy's account of each ext_proc phase (the time
    # from sending a phase's message to the filter's answer: the gRPC round trip plus the stages inside it).
    paced_stages_ms: dict[str, float] = field(default_factory=dict)
    extproc_ms: dict[str, float] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)  # wsgate_faults_total deltas by reason
    envoy_problems: dict[str, int] = field(default_factory=dict)
    quota_checks: dict[str, int] = field(default_factory=dict)  # at saturation, by stage: requests the service admitted
    notes: list[str] = field(default_factory=list)

    @property
    def stage_total_ms(self) -> float:
        return sum(self.stages_ms.values())

    @property
    def round_trip_ms(self) -> float:
        """The ext_proc exchange's own cost per request: Envoy's phase latencies less the worker's stages."""
        return max(0.0, sum(self.extproc_ms.values()) - sum(self.paced_stages_ms.values()))


def _fmt(value: float, digits: int = 0) -> str:
    if value != value:  # NaN
        return "-"
    return f"{value:,.{digits}f}"


def _ratio(value: float) -> str:
    return "-" if not value or value != value else f"{value:.1f}x"


def normalize(points: list[Point]) -> None:
    """time_ratio and cpu_ratio against `none` at the same size (Sosnoski's Figure 1 normalizes to plain)."""
    base = {p.size: p for p in points if p.profile == "none"}
    for p in points:
        b = base.get(p.size)
        if b is None:
            continue
        p.time_ratio = b.rps / p.rps if p.rps else 0.0
        p.cpu_ratio = p.gateway_cpu_us / b.gateway_cpu_us if b.gateway_cpu_us else 0.0


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True)))
    ]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        )
    return "\n".join(lines)


def report(points: list[Point], floors: targets.Floors, out: IO[str]) -> None:
    normalize(points)
    profiles = [p for p in BENCH_PROFILES if any(x.profile == p for x in points)]
    sizes = [s for s in SIZES if any(x.size == s for x in points)]
    at = {(p.profile, p.size): p for p in points}

    def grid(title: str, cell: Any) -> None:
        print(f"\n{title}", file=out)
        header = ["profile", *(f"{s} ({SIZE_LABELS[s]})" for s in sizes)]
        rows = [[prof, *(cell(at[(prof, s)]) if (prof, s) in at else "-" for s in sizes)] for prof in profiles]
        print(_table(header, rows), file=out)

    grid(
        "Throughput at saturation, req/s (wrk) -- in brackets: time per request relative to none, as Sosnoski's "
        "Figure 1",
        lambda p: f"{_fmt(p.rps)}{'+' if p.pool_exhausted else ''} ({_ratio(p.time_ratio)})",
    )
    grid(
        "Latency at a fixed moderate rate, p50 / p99 ms (open loop; rate in req/s in brackets)",
        lambda p: f"{_fmt(p.paced_p50_ms, 1)} / {_fmt(p.paced_p99_ms, 1)} ({_fmt(p.paced_rate)}/s)",
    )
    grid(
        "Gateway CPU per request at saturation, us: Envoy + filter workers = total (relative to none)",
        lambda p: (
            f"{_fmt(p.envoy_cpu_us)} + {_fmt(p.filter_cpu_us)} = {_fmt(p.gateway_cpu_us)} ({_ratio(p.cpu_ratio)})"
        ),
    )
    grid(
        "Demo backend CPU per request, us (the service behind the gateway, not counted above; it bounds none)",
        lambda p: _fmt(p.backend_cpu_us),
    )
    grid(
        "Message sizes on the wire, bytes: request / response (wrk's response bytes include HTTP headers)",
        lambda p: f"{_fmt(p.request_bytes)} / {_fmt(p.response_bytes)}",
    )

    staged = [p for p in points if p.stages_ms]
    if staged:
        seen = {s for p in staged for s in p.stages_ms}
        stages = [s for s in STAGES if s in seen] + sorted(seen - set(STAGES))
        print(
            "\nWhere the filter's time goes (workers' wsgate_stage_seconds sums, request and response sides "
            "together), % of the staged time -- as van Engelen's Figure 3",
            file=out,
        )
        header = ["profile/size", *stages, "staged ms/req", "filter CPU ms/req", "staged/CPU"]
        rows = []
        for p in sorted(staged, key=lambda x: (profiles.index(x.profile), sizes.index(x.size))):
            total = p.stage_total_ms
            rows.append([
                f"{p.profile} {p.size}",
                *(f"{100 * p.stages_ms.get(s, 0.0) / total:.0f}%" if total else "-" for s in stages),
                f"{total:.3f}", f"{p.filter_cpu_us / 1000:.3f}",
                f"{100 * total / (p.filter_cpu_us / 1000):.0f}%" if p.filter_cpu_us else "-",
            ])  # fmt: skip
        print(_table(header, rows), file=out)
        print(
            "  (stages are wall-clock time inside the worker; staged/CPU under 100%: the rest of the filter's CPU is "
            "the ext_proc exchange itself (the compiled frame, the call into Python); over 100%: the worker waited for a core)",
            file=out,
        )

    tripped = [p for p in points if p.extproc_ms]
    if tripped:
        print(
            "\nThe ext_proc hop at the paced rate, ms per request: Envoy's latency of each phase (message sent to the "
            "filter's answer), the worker's stages inside them, and the rest -- the gRPC round trips themselves",
            file=out,
        )
        header = ["profile/size", *EXTPROC_PHASES.values(), "stages", "round trips", "round trips %"]
        rows = []
        for p in sorted(tripped, key=lambda x: (profiles.index(x.profile), sizes.index(x.size))):
            hop = sum(p.extproc_ms.values())
            rows.append([
                f"{p.profile} {p.size}", *(f"{p.extproc_ms.get(k, 0.0):.3f}" for k in EXTPROC_PHASES),
                f"{sum(p.paced_stages_ms.values()):.3f}", f"{p.round_trip_ms:.3f}",
                f"{100 * p.round_trip_ms / hop:.0f}%" if hop else "-",
            ])  # fmt: skip
        print(_table(header, rows), file=out)

    quoted = [p for p in points if p.quota_checks]
    if quoted:
        print("\nQuotas (--quotas): requests the rate-limit service admitted at saturation, per stage, per request",
              file=out)  # fmt: skip
        stages = sorted({s for p in quoted for s in p.quota_checks})
        rows = [[f"{p.profile} {p.size}", *(f"{p.quota_checks.get(s, 0) / max(1, p.requests):.2f}" for s in stages)]
                for p in quoted]  # fmt: skip
        print(_table(["profile/size", *stages], rows), file=out)

    outbound.report(points, out)
    targets.report(lambda prof, size: at.get((prof, size)), floors, out)

    problems = [p for p in points if p.errors or p.paced_errors or p.verify_failures or p.faults or p.notes
                or p.envoy_problems]  # fmt: skip
    print("\nErrors and anomalies", file=out)
    if not problems:
        print("  none: every request answered 2xx, every sampled reply verified", file=out)
    for p in problems:
        bits = []
        if p.errors:
            bits.append(f"wrk errors {p.errors} of {p.requests}")
        if p.paced_errors:
            bits.append(f"paced errors {p.paced_errors} of {p.paced_sent}")
        if p.verify_failures:
            bits.append(f"{p.verify_failures} of {p.verified + p.verify_failures} sampled replies failed checks")
        if p.faults:
            bits.append("filter faults " + ", ".join(f"{k}={v}" for k, v in sorted(p.faults.items())))
        if p.envoy_problems:
            bits.append("envoy " + ", ".join(f"{k}=+{v}" for k, v in sorted(p.envoy_problems.items())))
        bits.extend(p.notes)
        print(f"  {p.profile} {p.size}: " + "; ".join(bits), file=out)
    noisy = [p for p in points if p.other_cores > 0.15]
    if noisy:
        print(
            "  noise: other processes on this machine used CPU during "
            + ", ".join(f"{p.profile} {p.size} ({p.other_cores:.2f} cores)" for p in noisy),
            file=out,
        )


_DICTS = ("stages_ms", "paced_stages_ms", "extproc_ms", "faults", "envoy_problems", "quota_checks", "notes")
CSV_FIELDS = [f for f in Point.__dataclass_fields__ if f not in _DICTS]
# Exclusive times (filters/engine/metrics.py): security_header and secure are what is left of the header's processing
# and building once the finer stages inside them are counted apart.
STAGES = ("parse", "decrypt", "c14n", "digest", "signature_check", "replay", "security_header", "schema",
          "signature_creation", "encryption", "secure", "serialize")  # fmt: skip


def write_csv(points: list[Point], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = sorted({s for p in points for s in p.stages_ms} - set(STAGES))
    stage_cols = [f"stage_{s}_ms" for s in (*STAGES, *extra)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        trip_cols = [f"extproc_{k}_ms" for k in EXTPROC_PHASES]
        w.writerow([*CSV_FIELDS, *stage_cols, *trip_cols, "round_trip_ms", "faults", "envoy_problems", "notes"])
        for p in points:
            d = asdict(p)
            w.writerow([
                *(round(d[k], 3) if isinstance(d[k], float) else d[k] for k in CSV_FIELDS),
                *(round(p.stages_ms.get(c[6:-3], 0.0), 4) for c in stage_cols),
                *(round(p.extproc_ms.get(k, 0.0), 4) for k in EXTPROC_PHASES), round(p.round_trip_ms, 4),
                ";".join(f"{k}={v}" for k, v in sorted(p.faults.items())),
                ";".join(f"{k}={v}" for k, v in sorted(p.envoy_problems.items())),
                " | ".join(p.notes),
            ])  # fmt: skip


def write_chart(points: list[Point], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = [p for p in BENCH_PROFILES if any(x.profile == p for x in points)]
    sizes = [s for s in SIZES if any(x.size == s for x in points)]
    at = {(p.profile, p.size): p for p in points}
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    width = 0.8 / len(sizes)
    xs = range(len(profiles))

    def bars(ax: Any, metric: str, title: str, log: bool = False) -> None:
        for j, s in enumerate(sizes):
            vals = [getattr(at[(p, s)], metric) if (p, s) in at else 0 for p in profiles]
            pos = [x + (j - (len(sizes) - 1) / 2) * width for x in xs]
            ax.bar(pos, vals, width, color=f"C{j}", label=f"{s} ({SIZE_LABELS[s]})")
        ax.set_xticks(list(xs), profiles, rotation=20)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)

    bars(axes[0][0], "rps", "throughput at saturation (req/s)", log=True)
    bars(axes[0][1], "time_ratio", "time per request relative to none (Sosnoski Fig. 1)")
    # CPU: the gateway's total per request, with Envoy's part hatched over it (log scale: sizes differ 1000x).
    ax = axes[1][0]
    for j, s in enumerate(sizes):
        pos = [x + (j - (len(sizes) - 1) / 2) * width for x in xs]
        total = [at[(p, s)].gateway_cpu_us if (p, s) in at else 0 for p in profiles]
        envoy = [at[(p, s)].envoy_cpu_us if (p, s) in at else 0 for p in profiles]
        ax.bar(pos, total, width, color=f"C{j}", label=f"{s} ({SIZE_LABELS[s]})")
        ax.bar(pos, envoy, width, fill=False, hatch="//", edgecolor="black", linewidth=0,
               label="of which Envoy" if j == len(sizes) - 1 else None)  # fmt: skip
    ax.set_xticks(list(xs), profiles, rotation=20)
    ax.set_yscale("log")
    ax.set_ylim(bottom=10)
    ax.set_title("gateway CPU per request (us): Envoy + filter workers; Envoy's part hatched")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    bars(axes[1][1], "paced_p99_ms", "p99 latency at a moderate fixed rate (ms)", log=True)
    fig.suptitle("WSGate benchmark (loadtest/bench.py)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
