"""When the archive cannot keep a record (docs/audit.md): a PostgreSQL archive that goes down refuses the
exchanges of a fail_closed route with a 503 fault and lets an alarm route's pass (counted); a full queue refuses
or drops as the route says; a message over the archive's limit is refused or kept without its body; nothing that
was accepted is lost when the database comes back; the database password and the keys never reach a log."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from filters.stores.archive.segments import SegmentStore
from filters.stores.archive.spool import Spool
from filters.stores.archive.writer import Writer
from gateway.policy import ArchivePolicy
from tests.support.archive import archived_route, audit, metric, pending, with_message_id
from tests.support.harness import GatewayFactory, LiveGateway, fault_code
from tests.support.postgres import Postgres, remove, start_postgres


@pytest.fixture
def own_postgres() -> Iterator[Postgres]:
    """A server of this test's own: it is stopped and started again."""
    pg = start_postgres()
    yield pg
    remove(pg)


def routes(pki: Path) -> list[dict]:
    pg = {"store": "postgres", "dsn": "${WSGATE_TEST_ARCHIVE_DSN}"}
    return [
        archived_route(pki, "closed", {**pg, "stream": "closed", "on_failure": "fail_closed"}),
        archived_route(pki, "alarm", {**pg, "stream": "alarm", "on_failure": "alarm", "queue_size": 1}),
        archived_route(
            pki, "dropping", {**pg, "stream": "dropping", "on_failure": "alarm", "queue_size": 1, "when_full": "drop"}
        ),
        archived_route(pki, "oversize", {**pg, "stream": "oversize", "max_record_bytes": 6000, "oversize": "refuse"}),
        archived_route(pki, "trimmed", {**pg, "stream": "trimmed", "max_record_bytes": 6000}),
    ]


def send(gw: LiveGateway, route: str, text: str = "order") -> tuple[str, int, str]:
    mid = f"urn:uuid:{uuid.uuid4()}"
    secured, _ = gw.client(route).secure(with_message_id(mid, text))
    resp = gw.post(route, secured)
    return mid, resp.status_code, fault_code(resp) if resp.status_code != 200 else ""


def archived(pg: Postgres, stream: str) -> set[str]:
    try:
        return {r[0] for r in pg.query("SELECT message_id FROM audit_records WHERE stream = %s", stream)}
    except psycopg.errors.UndefinedTable:  # no writer has written yet
        return set()


def until(check, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def test_archive_down_fail_closed_refuses_alarm_passes_and_nothing_accepted_is_lost(
    gateway: GatewayFactory, pki: Path, own_postgres: Postgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    pg = own_postgres
    monkeypatch.setenv("WSGATE_TEST_ARCHIVE_DSN", pg.dsn)
    gw = gateway(routes(pki), metrics=True)
    accepted: dict[str, set[str]] = {name: set() for name in ("closed", "alarm", "dropping")}
    for name in accepted:
        mid, status, _ = send(gw, name)
        assert status == 200
        accepted[name].add(mid)
    assert until(lambda: all(accepted[n] <= archived(pg, n) for n in accepted))

    pg.stop()
    # The writers learn it with their next write: until then exchanges pass and their records wait in the queue.
    for name in accepted:
        mid, status, _ = send(gw, name)
        assert status == 200
        accepted[name].add(mid)
    assert until(lambda: all(metric(gw, "wsgate_archive_available", stream=n) == 0 for n in accepted))
    mid, status, _ = send(gw, "closed")
    assert status == 503  # fail closed: the client gets a fault, not an exchange nobody can prove
    assert metric(gw, "wsgate_archive_records_total", route="closed", outcome="refused_unavailable") >= 1

    # Alarm: passes and is counted; its queue (1) then fills: refused (when_full refuse) or dropped (drop).
    mid, status, _ = send(gw, "alarm")
    assert status == 200
    accepted["alarm"].add(mid)
    assert metric(gw, "wsgate_archive_records_total", route="alarm", outcome="passed_unavailable") >= 1
    assert send(gw, "alarm")[1] == 503
    assert metric(gw, "wsgate_archive_records_total", route="alarm", outcome="refused_full") == 1
    mid, status, _ = send(gw, "dropping")
    assert status == 200
    accepted["dropping"].add(mid)
    dropped, status, _ = send(gw, "dropping")
    assert status == 200  # passed, its record dropped and counted
    assert metric(gw, "wsgate_archive_records_total", route="dropping", outcome="dropped_full") == 1

    # The operator's tools fail without telling the password either.
    down = audit(gw, "search", "--stream", "closed", check=False)
    assert down.returncode == 2 and "cannot reach the archive database" in down.stderr
    assert pg.password not in down.stderr + down.stdout

    pg.start()
    assert until(lambda: all(accepted[n] <= archived(pg, n) for n in accepted), timeout=30), {
        n: accepted[n] - archived(pg, n) for n in accepted
    }
    assert dropped not in archived(pg, "dropping")
    assert until(lambda: send(gw, "closed")[1] == 200)
    assert "intact" in audit(gw, "verify-chain", "--stream", "closed").stdout

    logs = b"".join(p.read_bytes() for p in Path(gw.logs).glob("*.log"))
    assert b"unavailable" in logs  # the workers did log the outage...
    assert pg.password.encode() not in logs  # ...never with the DSN's password
    for key in ("gateway-sign.key", "gateway-enc.key"):
        secret_line = (pki / key).read_text().splitlines()[2]  # a line of the key's base64
        assert secret_line.encode() not in logs


def test_message_over_archive_limit_refused_or_kept_without_body(
    gateway: GatewayFactory, pki: Path, postgres: Postgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WSGATE_TEST_ARCHIVE_DSN", postgres.dsn)
    gw = gateway(routes(pki)[3:], metrics=True)
    big = "x" * 8000
    mid, status, _ = send(gw, "oversize", big)
    assert status == 413
    small, status, _ = send(gw, "oversize")
    assert status == 200
    assert until(lambda: small in archived(postgres, "oversize"))
    assert mid not in archived(postgres, "oversize")
    trimmed, status, _ = send(gw, "trimmed", big)
    assert status == 200
    assert until(lambda: trimmed in archived(postgres, "trimmed"))
    ((body, omitted),) = postgres.query(
        "SELECT body, meta::json->>'body_omitted' FROM audit_records WHERE message_id = %s", trimmed
    )
    assert (bytes(body), omitted) == (b"", "oversize")
    assert metric(gw, "wsgate_archive_records_total", route="trimmed", outcome="metadata_only") == 1


KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from gateway.policy import ArchivePolicy
from filters.stores.archive.writer import Writer
from filters.stores.archive.segments import SegmentStore
from filters.stores.archive.writer import Writer
from gateway.policy import ArchivePolicy
from tests.support.archive import pending
pki, directory = Path(sys.argv[1]), sys.argv[2]
writer = Writer(ArchivePolicy(directory=directory, signing_key=str(pki / "gateway-sign.key"), queue_size=5000))
for i in range(3000):
    assert writer.submit(pending(pki, i))
os.kill(os.getpid(), signal.SIGKILL)  # records still queued: only the spool has them
"""


def test_worker_killed_with_queued_records_loses_none(pki: Path, tmp_path: Path) -> None:
    got = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(pki), str(tmp_path)], timeout=120,
                         cwd=Path(__file__).parents[2])  # fmt: skip
    assert got.returncode == -signal.SIGKILL
    store = SegmentStore(tmp_path, "default")
    before = len(list(store.records()))
    assert before < 3000  # the kill did catch records in the queue
    survivor = Writer(ArchivePolicy(directory=str(tmp_path), signing_key=str(pki / "gateway-sign.key")))
    try:
        assert until(lambda: len(list(store.records())) >= 3000, timeout=60)
    finally:
        survivor.close(10)
    ids = [r.fields["id"] for r in store.records()]
    assert len(ids) == len(set(ids)) == 3000  # each once: what was archived before the kill is not again
    assert not list((tmp_path / "spool").glob("*.spool"))


def test_spool_under_steady_traffic_does_not_fill_the_disk(pki: Path, tmp_path: Path) -> None:
    # The writer is always a few records behind (never all archived at once): the spool must still shrink.
    spool = Spool(tmp_path, "s", rotate_bytes=16 << 10)
    positions, biggest = [], 0
    for i in range(400):
        positions.append(spool.append(pending(pki, i)))
        if i >= 3:
            spool.done(positions[i - 3])
        biggest = max(biggest, sum(p.stat().st_size for p in tmp_path.glob("*.spool")))
    assert positions[-1] > 30 * (16 << 10) and biggest < 2 * (16 << 10)  # the traffic, and what was kept at most
    assert len(list(tmp_path.glob("*.spool"))) <= 2


KILLED_ROTATING_WRITER = """
import os, signal, sys
from pathlib import Path
from filters.stores.archive.spool import Spool
from tests.support.archive import pending
pki, directory = Path(sys.argv[1]), sys.argv[2]
spool = Spool(directory, "s", rotate_bytes=4096)
positions = [spool.append(pending(pki, i)) for i in range(40)]
spool.done(positions[9])  # ten archived
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_killed_writers_rotated_spool_taken_over_whole_and_in_order(pki: Path, tmp_path: Path) -> None:
    got = subprocess.run([sys.executable, "-c", KILLED_ROTATING_WRITER, str(pki), str(tmp_path / "spool")],
                         timeout=120, cwd=Path(__file__).parents[2])  # fmt: skip
    assert got.returncode == -signal.SIGKILL
    left = list((tmp_path / "spool").glob("*.spool"))
    assert len(left) > 1  # rotated, the archived files removed
    (tmp_path / "spool" / "s.x.spool").write_bytes(b"")  # not a writer's spool of stream "s"
    (tmp_path / "spool" / "s.x.1.spool").write_bytes(b"")  # a writer's of stream "s.x"
    survivor = Spool(tmp_path / "spool", "s")
    found = survivor.orphans()
    assert [p.message_id for _, pending in found for p in pending] == [f"urn:uuid:m{i}" for i in range(10, 40)]
    assert {path for path, _ in found} == set(left)
    for path, _ in found:
        survivor.release(path)
    survivor.close()
    assert sorted(p.name for p in (tmp_path / "spool").glob("*.spool")) == ["s.x.1.spool", "s.x.spool"]
