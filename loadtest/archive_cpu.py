"""What archiving costs per exchange, in process, counted in instructions (docs/audit.md, "What it costs").

The worker's own code (`filters.worker.Worker.handle`, the archive's writer thread, its spool and segment store)
without Envoy, the frame or the network: N exchanges of one profile (request and signed reply, 1 KB; 20 messages
and their replies made first, taken in turn) through the bench policies, with every secured route archiving
(loadtest/archive.py) or none. The writer's batches are
made full (BATCH records) as under load, where a batch's 0.2 s gathers hundreds of records: run slowly (under
callgrind) its timer would cut batches of a few records and charge each record a batch's fixed cost. Run it
under callgrind twice per setting, with two counts, and take the difference per exchange (the set-up cancels):

    valgrind --tool=callgrind --callgrind-out-file=/dev/null python -m loadtest.archive_cpu hmac --archive -n 100
    ... -n 300: (Ir(300) - Ir(100)) / 200 = instructions per exchange, all threads counted

Alone it prints the process's CPU time per exchange, user and system, and its context switches (rough figures
on a shared machine; `--worker-timer`: the writer's own batch timer)."""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
from dataclasses import dataclass
from pathlib import Path

from wsgate_frame import Answer

from certs import pki
from filters.stores.archive import writer
from filters.worker import InFlight, Worker
from loadtest.archive import with_archive
from loadtest.messages import PROFILES, Factory
from loadtest.optimizations import BENCH_POLICIES, backend, bench_policies

MESSAGES = 20


@dataclass
class Cost:
    """Per exchange, over the exchanges and the writer's draining (not the set-up)."""

    user_s: float
    system_s: float
    voluntary: float  # context switches, every thread


def run(profile: str, archive: bool, count: int, certs: Path, work: Path, batch_wait_s: float = 3600.0) -> Cost:
    """The cost of `count` exchanges (messages made before the count). `batch_wait_s`: the writer's batch timer
    (an hour: full batches, see above; writer.BATCH_WAIT_S: as a worker runs it)."""
    os.environ["WSGATE_BENCH_CERTS"] = str(certs)
    os.environ.setdefault("WSGATE_REDIS_URL", "redis://127.0.0.1:1")  # deferred: the frame would ask it, not we
    policies = with_archive(BENCH_POLICIES, work / "policies", work / "archive") if archive else BENCH_POLICIES
    writer.BATCH_WAIT_S = batch_wait_s
    worker = Worker(policies, 64 << 20)
    route = PROFILES[profile].route
    factory = Factory(profile, bench_policies(certs), certs=certs)
    # MESSAGES messages, each with the backend's reply, made before the count and taken in turn: what differs
    # between two counts is the worker's work alone (no replay check here: the frame makes it, with Redis).
    bodies = [factory.make("small").body for _ in range(MESSAGES)]
    replies = [backend(_joined(_exchange(worker, route, body, None).body)) for body in bodies]
    before = resource.getrusage(resource.RUSAGE_SELF)
    for i in range(count):
        _exchange(worker, route, bodies[i % MESSAGES], replies[i % MESSAGES])
    worker.archives.close(60.0)  # the writer seals and stores what is queued: its work counts
    after = resource.getrusage(resource.RUSAGE_SELF)
    return Cost((after.ru_utime - before.ru_utime) / count, (after.ru_stime - before.ru_stime) / count,
                (after.ru_nvcsw - before.ru_nvcsw) / count)  # fmt: skip


def _exchange(worker: Worker, route: str, body: bytes, reply: bytes | None) -> Answer:
    """The request phase, and with `reply` the response phase; the request's answer."""
    headers = {"content-type": "text/xml", "x-request-id": "bench"}
    p = InFlight(dict(headers))
    answer = worker.handle(route, "request", body, headers, p)
    assert answer.status is None and answer.body is not None, answer.status
    if reply is not None:
        assert worker.handle(route, "response", reply, {"content-type": "text/xml"}, p).status is None
    return answer


def _joined(body: object) -> bytes:
    return b"".join(map(bytes, body)) if isinstance(body, list | tuple) else bytes(body)  # type: ignore[call-overload]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.archive_cpu", description=__doc__.split("\n")[0])
    parser.add_argument("profile", choices=["hmac", "rsa"])
    parser.add_argument("--archive", action="store_true", help="every secured route archives")
    parser.add_argument("-n", "--count", type=int, default=300, help="exchanges")
    parser.add_argument("--certs", type=Path, help="a PKI made before (certs.pki.init): none made in the count")
    parser.add_argument("--worker-timer", action="store_true",
                        help="the writer's batch timer as a worker runs it (context switches), not full batches")  # fmt: skip
    args = parser.parse_args()
    wait = writer.BATCH_WAIT_S if args.worker_timer else 3600.0
    with tempfile.TemporaryDirectory(prefix="wsgate-archive-cpu-") as tmp:
        certs = args.certs or pki.init(Path(tmp) / "certs")
        c = run(args.profile, args.archive, args.count, certs, Path(tmp), wait)
    print(f"{args.profile} archive={'on' if args.archive else 'off'}, per exchange: user {c.user_s * 1e6:.0f} us, "
          f"system {c.system_s * 1e6:.0f} us, {c.voluntary:.2f} voluntary context switches")  # fmt: skip


if __name__ == "__main__":
    main()
