"""`make bench`'s attachment rows through the running gateway: the rows of loadtest/attachment_cpu.py (a 1 KB
envelope with a 100 KB or 10 MB attachment, signed; signed and encrypted), sent to the gateway as a client sends
them (real Envoy, filter workers and Redis; the demo backend echoes the package, whose reply the gateway signs and
encrypts in turn), each request once (the replay store sees distinct traffic), one at a time.

The gateway's CPU per request: the on-CPU time of Envoy, the filter workers and Redis from /proc around the run
(every thread's schedstat, in ns), divided by the requests (the processes of loadtest/bench.py's rows, whose
utime+stime in 10 ms ticks is too coarse here; the backend and this process are not counted). MB/s per core:
the attachment's bytes over that CPU. The attachment's share: the CPU per request minus that of the same route's
baseline row, the same 1 KB envelope secured the same way with no attachment (plain SOAP: so the share also holds
the MIME parsing and writing, and the attachment's signature reference), measured in the same run. The floor: the
OpenSSL cost of the bytes one exchange must process, both ways (the request's attachment verified, the reply's
signed: twice the attachment through SHA-256; encrypted rows also decrypt and encrypt it once each: twice through
AES-256-GCM too). `x floor` = the share / the floor; the target (issue 21) is at most 2x.

The pass-through rows, one per size: the signed row's very package (the same secured request bytes, the same
echo) sent to the `swa-floor` route, an `xml` route: the same Envoy streaming it both ways through the same ext_proc
body phases (FULL_DUPLEX_STREAMED on every route taking attachments), the worker parsing the package and checking
its root, and no WS-Security (the Security header passes as text, the package goes on unchanged). In that mode a
body goes on only as the filter sends it back, so the pass-through takes the package back from the worker as a
secured route does: the same transport, which makes it Envoy's own ext_proc cost of the hop (the floor the
developers' guide names). The encrypted rows take the same one: their
encrypted Body is no operation the demo backend can answer, and their package is the signed one's size to a few
hundred bytes. It is as near as a route comes to Envoy's own cost of
moving those bytes through ext_proc (a route with no ext_proc would not be the same hop; an `xml` route without
attachments refuses a package). `WS-Security` = the row's CPU per request minus its pass-through's: what securing
the exchange costs beyond carrying it (the envelope's signature both ways included, and the package written anew
each way), and that over the OpenSSL floor. The pass-through has its own baseline (the signed row's envelope alone
as plain SOAP on `swa-floor`), and the target's measure is the attachment's own WS-Security cost: (the row - its
route's baseline) - (the pass-through - its baseline), what the attachment's bytes add to a secured exchange
beyond carrying them, over the floor for those bytes (docs/attachment-cost.md says why).

Every reply is checked as it arrives (this process's CPU is not counted): HTTP 200, the gateway's signature verified (and the reply decrypted) over
the envelope and the attachment, the echoed texts and the attachment's bytes as sent.

Part of `make bench` (loadtest/bench.py imports this module, so it has no command of its own). With little else:
`make bench BENCH_ARGS="--profiles rsa --sizes small --duration 1 --paced-duration 1"`."""

from __future__ import annotations

import csv
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import requests

from filters.engine import faults
from filters.engine.mime import package as mime
from filters.engine.wss import attachments, wssecurity
from filters.engine.xml.threat_protection import parse_envelope
from gateway.control.supervisor import Gateway
from gateway.policy import PolicySet, Route
from gateway.tools.client import Client, ClientConfig, ClientError, unpack
from loadtest import attachment_cpu
from loadtest.attachment_cpu import PASS_THROUGH, ROWS, SIZES, TARGET, Floors, measure_floors, request, verdict
from loadtest.attachment_cpu import Row as InProcessRow
from loadtest.messages import CheckFailed, check_operation, plain_request

BASELINE = "none"  # the size of the baseline rows: the envelope alone
PASS_THROUGH_KIND = "signed"  # the kind whose package they carry (the backend answers no encrypted Body)
WARM_UP = 2  # requests per row before the measure, not counted: keys parsed, code paths taken first
ROLES = ("envoy", "filter", "redis")  # the gateway's processes; the backend is not counted
# Requests per row through the gateway at scale 1 (the in-process rows keep attachment_cpu.COUNTS): a 100 KB
# attachment's own cost is a difference of four rows of a few ms each, tenths of a ms against a floor of 0.13 ms;
# a round's difference spreads by +-0.3 ms on a shared machine, so 40 rounds put their median within ~0.05 ms.
GATEWAY_COUNTS = {"100 KB": 800, "10 MB": 6}
BLOCK = 20  # requests per block of a row measured in blocks (run)


@dataclass
class Row:
    kind: str  # a key of ROWS
    size: str  # a key of SIZES, or BASELINE
    requests: int
    cpu_us: dict[str, float]  # per request, by role (ROLES)
    verified: int = 0
    failures: list[str] = field(default_factory=list)
    pass_through: bool = False  # the same package on PASS_THROUGH, no WS-Security
    warm_ups: int = WARM_UP  # requests sent before the measure (each block's, for a row measured in blocks)
    block_us: list[float] = field(default_factory=list)  # CPU per request of each block, in the order measured

    @property
    def label(self) -> str:
        return f"{self.kind}, xml route" if self.pass_through else self.kind

    @property
    def total_us(self) -> float:
        return sum(self.cpu_us.values())


@dataclass
class Derived:
    """A row beside its baseline, the in-process figure and the floor (what the report and the CSV print)."""

    row: Row
    share_us: float  # the attachment's share of the CPU per request
    mbps: float  # the attachment's bytes / the CPU per request
    in_process_us: float  # attachment_cpu's request + reply for the same row
    floor_us: float  # OpenSSL's cost of the bytes the exchange processes, both ways
    pass_through_us: float  # the same package's CPU per request on PASS_THROUGH
    pass_through_share_us: float  # that minus the same envelope alone on PASS_THROUGH: carrying the attachment
    # The attachment's WS-Security of each round of blocks: the four rows' blocks measured one after another
    # (seconds apart), differenced within the round, so a burst or drift elsewhere on the machine cancels.
    rounds_us: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.share_us / self.floor_us

    @property
    def security_us(self) -> float:
        return self.row.total_us - self.pass_through_us

    @property
    def security_ratio(self) -> float:
        return self.security_us / self.floor_us

    @property
    def attachment_security_us(self) -> float:
        """What the attachment's bytes add to a secured exchange beyond what carrying them costs: the row's share
        (minus its route's envelope alone) less the pass-through's share (minus the same envelope alone there);
        the median of the rounds' where the four rows were measured in blocks."""
        if self.rounds_us:
            return statistics.median(self.rounds_us)
        return self.share_us - self.pass_through_share_us

    @property
    def attachment_security_ratio(self) -> float:
        return self.attachment_security_us / self.floor_us


def check(client: Client, status: int, content_type: str, body: bytes, tag: str, data: bytes | None) -> None:
    """Raise CheckFailed unless `body` is the gateway's verified echo of the request: the envelope's texts, and
    the attachment signed (with its headers), decrypted where the route encrypts, byte for byte as sent."""
    if status != 200:
        raise CheckFailed(f"HTTP {status}: {body[:300]!r}")
    route = client.route
    try:
        root, parts = unpack(content_type, body, route)
        env = parse_envelope(root, route.response_limits)
        found = attachments.from_parts(parts)
        creds = wssecurity.Credentials(trust=client.trust, decryption_key=client.decryption_key)
        wssecurity.process(env, client.reply_requirements, creds, datetime.now(UTC), found)
    except ClientError as exc:
        raise CheckFailed(str(exc)) from None
    except faults.Fault as f:
        raise CheckFailed(f"reply refused: {f.reason}") from None
    check_operation(next((c for c in env.body if isinstance(c.tag, str)), None), plain_request("small", tag)[1])
    if data is None:
        if len(found):
            raise CheckFailed(f"{len(found)} attachments back for none sent")
        return
    encrypted = route.attachment_security.encrypt_response
    if len(found) != 1 or (part := found.parts[0]).signed != "complete" or part.decrypted != encrypted:
        raise CheckFailed(f"the reply's attachments are not as the route secures them: {list(found)!r:.300}")
    if bytes(part.body) != data:
        raise CheckFailed("the attachment came back changed")


def check_pass_through(
    route: Route, status: int, content_type: str, body: bytes, sent_type: str, sent: bytes, tag: str
) -> None:
    """Raise CheckFailed unless `body` is the backend's echo of the package `sent`, passed on `route` untouched:
    the attachment's bytes as sent (for an encrypted row, the ciphertext); `sent` plain SOAP (the baseline): the
    echoed envelope's texts, and no package."""
    if status != 200:
        raise CheckFailed(f"HTTP {status}: {body[:300]!r}")
    if not mime.is_multipart(sent_type):
        if mime.is_multipart(content_type):
            raise CheckFailed("a package back for plain SOAP sent")
        try:
            env = parse_envelope(body, route.response_limits)
        except faults.Fault as f:
            raise CheckFailed(f"reply refused: {f.reason}") from None
        check_operation(next((c for c in env.body if isinstance(c.tag, str)), None), plain_request("small", tag)[1])
        return
    limits = route.attachments
    try:
        got = mime.parse(content_type, body, limits).attachments
        want = mime.parse(sent_type, sent, limits).attachments
    except faults.Fault as f:
        raise CheckFailed(f"not a valid package: {f.reason}") from None
    if [bytes(p.body) for p in got] != [bytes(p.body) for p in want]:
        raise CheckFailed("the attachment came back changed")


def _cpu_s(pid: int) -> float:
    """On-CPU seconds of the process's threads (/proc/<pid>/task/*/schedstat, in ns: /proc/<pid>/stat counts in
    ticks of 10 ms, too coarse for a 100 KB attachment's share of a request). A thread that ended takes its time
    with it: the gateway's threads live as long as their process."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended just now
    return total / 1e9


def gateway_cpu(gw: Gateway) -> dict[str, float]:
    """On-CPU seconds so far of the gateway's processes, by role (ROLES)."""
    pids = {"envoy": [gw.envoy], "filter": gw.workers, "redis": [gw.redis]}
    return {role: sum(_cpu_s(p.pid) for p in procs if p is not None) for role, procs in pids.items()}


def measure(gw: Gateway, route: Route, certs: Path, kind: str, size: str, count: int, via: Route | None = None) -> Row:
    """`count` requests of the row, after WARM_UP more, sent one at a time, each reply checked on arrival (this
    process's CPU is not the gateway's). `via`: the same requests, secured for `route`, sent to that route instead
    (the pass-through row)."""
    data = os.urandom(SIZES[size]) if size != BASELINE else None
    tags = [f"swa-{kind}-{size}-{i}".replace(" ", "") for i in range(WARM_UP + count)]
    bodies = [request(route, certs, data, kind != "signed", tag) for tag in tags]
    url = f"http://127.0.0.1:{gw.opts.http_port}{(via or route).match.path_prefix}demo"
    client = Client(route, ClientConfig(certs=certs))
    row = Row(kind, size, count, {}, pass_through=via is not None)
    before: dict[str, float] = {}
    with requests.Session() as session:
        for i, (tag, (content_type, body)) in enumerate(zip(tags, bodies, strict=True)):
            if i == WARM_UP:
                before = gateway_cpu(gw)
            r = session.post(url, data=body, headers={"content-type": content_type}, timeout=300)
            reply_type = r.headers.get("content-type", "")
            try:
                if via is None:
                    check(client, r.status_code, reply_type, r.content, tag, data)
                else:
                    check_pass_through(via, r.status_code, reply_type, r.content, content_type, body, tag)
                row.verified += 1
            except CheckFailed as exc:
                row.failures.append(f"{tag}: {exc}")
        after = gateway_cpu(gw)
    row.cpu_us = {role: (after[role] - before[role]) / count * 1e6 for role in ROLES}
    return row


def run(
    gw: Gateway, policies: PolicySet, certs: Path, scale: float = 1.0, sizes: Sequence[str] = tuple(SIZES)
) -> list[Row]:
    """Each kind: its baseline (as many requests as the smallest size's row), then each size; then the
    pass-through's baseline (the signed row's envelope alone, on PASS_THROUGH) and each size's pass-through row.
    Rows of BLOCK requests or more are measured in blocks, every such row's block in turn (a burst elsewhere on
    the machine lands on one block, not on one row), each role's CPU the median of its blocks."""
    counts = {s: max(2, round(GATEWAY_COUNTS[s] * scale)) for s in sizes}
    counts = {BASELINE: counts[min(sizes, key=SIZES.__getitem__)], **counts}
    route, via = policies.route(ROWS[PASS_THROUGH_KIND]), policies.route(PASS_THROUGH)
    specs: list[tuple[Route, str, str, int, Route | None]]
    specs = [(policies.route(ROWS[k]), k, s, n, None) for k in ROWS for s, n in counts.items()]
    specs += [(route, PASS_THROUGH_KIND, s, n, via) for s, n in counts.items()]
    blocks: dict[int, list[Row]] = {i: [] for i, spec in enumerate(specs) if spec[3] >= 2 * BLOCK}
    for _ in range(max((specs[i][3] // BLOCK for i in blocks), default=0)):
        for i in blocks:
            r, kind, size, n, v = specs[i]
            blocks[i].append(measure(gw, r, certs, kind, size, n // (n // BLOCK), v))
    return [_combined(blocks[i]) if i in blocks else measure(gw, r, certs, k, s, n, v)
            for i, (r, k, s, n, v) in enumerate(specs)]  # fmt: skip


def _combined(blocks: Sequence[Row]) -> Row:
    """One row from its blocks: the requests and checks summed, each role's CPU per request the blocks' median."""
    first = blocks[0]
    return Row(first.kind, first.size, sum(b.requests for b in blocks),
               {role: statistics.median(b.cpu_us[role] for b in blocks) for role in ROLES},
               sum(b.verified for b in blocks), [f for b in blocks for f in b.failures], first.pass_through,
               sum(b.warm_ups for b in blocks), [b.total_us for b in blocks])  # fmt: skip


def derive(rows: Sequence[Row], in_process: Sequence[InProcessRow], floors: Floors) -> list[Derived]:
    base_rows = {r.kind: r for r in rows if r.size == BASELINE and not r.pass_through}
    base = {k: r.total_us for k, r in base_rows.items()}
    local = {(r.kind, r.size): r.request_us + r.reply_us for r in in_process}
    passed_rows = {r.size: r for r in rows if r.pass_through}
    passed = {s: r.total_us for s, r in passed_rows.items()}
    passed_base = passed.get(BASELINE, math.nan)
    out = []
    for r in rows:
        if r.size == BASELINE or r.pass_through:
            continue
        nbytes = SIZES[r.size]
        share = r.total_us - base.get(r.kind, math.nan)
        floor_us = 2 * nbytes / floors.mbps(r.kind)  # MB/s = bytes per us
        mbps = nbytes / r.total_us if r.total_us > 0 else math.nan
        in_process_us = local.get((r.kind, r.size), math.nan)
        passed_us = passed.get(r.size, math.nan)
        four = [r, base_rows.get(r.kind), passed_rows.get(r.size), passed_rows.get(BASELINE)]
        blocks = [x.block_us if x is not None else [] for x in four]
        rounds = []
        if blocks[0] and all(len(b) == len(blocks[0]) for b in blocks):
            rounds = [(a - b) - (p - q) for a, b, p, q in zip(*blocks, strict=True)]
        out.append(Derived(r, share, mbps, in_process_us, floor_us, passed_us, passed_us - passed_base, rounds))
    return out


def _ms(us: float) -> str:
    return "-" if math.isnan(us) else f"{us / 1000:,.2f} ms"


def report(rows: Sequence[Row], in_process: Sequence[InProcessRow], floors: Floors, out: TextIO) -> None:
    print(
        "\nAttachments (SwA profile) through the gateway: each request once, one at a time; the gateway's CPU per "
        "request (Envoy + filter workers + Redis, /proc), the attachment's share (minus the same route's 1 KB "
        f"envelope alone), beside the engine in process and OpenSSL's floor ({floors.text()}); each row's "
        "pass-through (the same package on an `xml` route) and its WS-Security cost (the row minus its pass-through)",
        file=out,
    )
    head = ["row", "attachment", "requests", "verified", "CPU/request", "of it Envoy", "attachment's share",
            "MB/s per core", "in process", "floor", "x floor", "pass-through", "WS-Security", "x floor",
            "attachment's WS-Security", "x floor"]  # fmt: skip
    lines = [head]
    derived = {(d.row.kind, d.row.size): d for d in derive(rows, in_process, floors)}
    for r in rows:
        cells = [r.label, r.size, str(r.requests), f"{r.verified}/{r.requests + r.warm_ups}", _ms(r.total_us),
                 _ms(r.cpu_us["envoy"])]  # fmt: skip
        if not r.pass_through and (d := derived.get((r.kind, r.size))):
            cells += [_ms(d.share_us), f"{d.mbps:,.1f}", _ms(d.in_process_us), _ms(d.floor_us), f"{d.ratio:.1f}x",
                      _ms(d.pass_through_us), _ms(d.security_us), f"{d.security_ratio:.1f}x",
                      _ms(d.attachment_security_us), f"{d.attachment_security_ratio:.1f}x"]  # fmt: skip
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines if i < len(line)) for i in range(len(head))]
    for line in lines:
        text = "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths[: len(line)], strict=True))
        )
        print(text, file=out)
    print(
        "(verified: the replies checked, warm-ups included. MB/s per core: the attachment's bytes / CPU per "
        "request. in process: loadtest/attachment_cpu.py's request + reply. floor: OpenSSL's CPU for the bytes an "
        "exchange processes, the attachment hashed both ways (and ciphered both ways when encrypted). x floor: the "
        "share / the floor; the target is at most 2x. pass-through: the `signed, xml route` row's CPU/request for the "
        "size, the signed package through the same Envoy and ext_proc phases with no WS-Security (parsed, and sent "
        "back unchanged: the same transport). WS-Security: CPU/request - pass-through, the envelope's signature both "
        "ways included; its x floor: that / the floor. attachment's WS-Security: the attachment's share - the "
        "pass-through's (its row - the same envelope alone on the `xml` route), what the attachment's bytes add to "
        "a secured exchange beyond carrying them; its x floor: that / the floor, the target's measure; for rows "
        "measured in blocks, the median of the rounds' own difference, each round the four rows' blocks in turn)",
        file=out,
    )
    for d in derived.values():
        spread = ""
        if len(d.rounds_us) >= 4:
            q1, _, q3 = statistics.quantiles(d.rounds_us, n=4)
            spread = f" (median of {len(d.rounds_us)} rounds, quartiles {_ms(q1)} to {_ms(q3)})"
        print(f"  target (issue 21): {d.row.kind}, {d.row.size}: the attachment's WS-Security "
              f"{_ms(d.attachment_security_us)}{spread} = {d.attachment_security_ratio:.2f}x the OpenSSL floor "
              f"({_ms(d.floor_us)}), at most {TARGET:g}x: {verdict(d.attachment_security_ratio)} (the whole exchange's WS-Security "
              f"{_ms(d.security_us)} = {d.security_ratio:.2f}x)", file=out)  # fmt: skip
    for r in rows:
        for failure in r.failures[:3]:
            print(f"  {r.kind} {r.size}: reply failed its check: {failure}", file=out)
    out.flush()


def write_csv(rows: Sequence[Row], in_process: Sequence[InProcessRow], floors: Floors, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    derived = {(d.row.kind, d.row.size): d for d in derive(rows, in_process, floors)}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "attachment", "attachment_bytes", "requests", "verified", *(f"{r}_cpu_us" for r in ROLES),
                    "cpu_us", "share_us", "mbps_per_core", "in_process_us", "floor_us", "floor_ratio",
                    "pass_through_us", "security_us", "security_floor_ratio", "pass_through_share_us",
                    "attachment_security_us", "attachment_security_floor_ratio", "in_process_own_us",
                    "in_process_own_floor_ratio"])  # fmt: skip
        local = {(r.kind, r.size): r for r in in_process if r.own_us}
        for r in rows:
            d = None if r.pass_through else derived.get((r.kind, r.size))
            own = local.get((r.kind, r.size)) if d else None
            extra = [d.share_us, d.mbps, d.in_process_us, d.floor_us, d.ratio, d.pass_through_us, d.security_us,
                     d.security_ratio, d.pass_through_share_us, d.attachment_security_us,
                     d.attachment_security_ratio] if d else [""] * 11  # fmt: skip
            extra += [statistics.median(own.own_us), own.own_ratio] if own else ["", ""]
            w.writerow([r.label, r.size, SIZES.get(r.size, 0), r.requests, r.verified,
                        *(round(r.cpu_us[x], 1) for x in ROLES), round(r.total_us, 1),
                        *(round(v, 3) if isinstance(v, float) else v for v in extra)])  # fmt: skip


def report_all(rows: Sequence[Row], policies: PolicySet, certs: Path, scale: float, out: TextIO, path: Path) -> Path:
    """`make bench`, the gateway down: the in-process rows (loadtest/attachment_cpu.py), these beside them, the
    CSV written to `path`."""
    floors, in_process = measure_floors(scale), attachment_cpu.run(policies, certs, scale)
    attachment_cpu.report(in_process, out, floors)
    report(rows, in_process, floors, out)
    write_csv(rows, in_process, floors, path)
    return path
