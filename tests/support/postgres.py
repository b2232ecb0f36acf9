"""A throwaway PostgreSQL server (Debian's `postgresql`: initdb and postgres) on a free loopback port, with a
password, for the archive's tests: started as Redis is (tests/support/harness.py), never a mock. As root (CI, this
machine) the server runs as the `postgres` user, which initdb requires."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from gateway.control.ports import PortInUse, bind_failed, free_ports, retried_if_taken

USER = "wsgate"


def _binary(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))), None)
    assert found, f"{name} is needed: apt-get install -y postgresql"
    return str(found)


def _as_server_user() -> dict[str, str]:
    return {"user": "postgres", "group": "postgres"} if os.geteuid() == 0 else {}


@dataclass
class Postgres:
    data: Path
    port: int
    password: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} dbname=postgres user={USER} password={self.password}"

    def start(self) -> None:
        path = self.data.parent / "postgres.log"
        log = open(path, "ab")
        since = log.tell()
        self.proc = subprocess.Popen(
            [_binary("postgres"), "-D", str(self.data), "-p", str(self.port),
             "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.data.parent}"],
            stdout=log, stderr=log, **_as_server_user(),
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said = path.read_bytes()[since:]
                raise (PortInUse if bind_failed(said) else RuntimeError)(f"postgres exited: {said[-2000:].decode()}")
            try:
                psycopg.connect(self.dsn, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                time.sleep(0.1)
        raise RuntimeError("postgres did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown
            self.proc.wait(timeout=30)
        self.proc = None

    def query(self, sql: str, *args: object) -> list[tuple]:
        with psycopg.connect(self.dsn) as conn:
            cur = conn.execute(sql, args or None)
            return cur.fetchall() if cur.description else []


def start_postgres() -> Postgres:
    """initdb in a new directory (its own, so that the server's user can own it), then the server."""
    top = Path(tempfile.mkdtemp(prefix="wsgate-pg-"))
    data = top / "data"
    password = secrets.token_urlsafe(18)
    pwfile = top / "pw"
    pwfile.write_text(password)
    if os.geteuid() == 0:
        shutil.chown(top, "postgres")
        shutil.chown(pwfile, "postgres")
    subprocess.run(
        [_binary("initdb"), "-D", str(data), "-U", USER, f"--pwfile={pwfile}",
         "--auth=scram-sha-256", "--no-sync", "-E", "UTF8"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **_as_server_user(),
    )  # fmt: skip
    pwfile.unlink()

    def start() -> Postgres:
        pg = Postgres(data, free_ports(1)[0], password)
        try:
            pg.start()
        except BaseException:
            pg.stop()
            raise
        return pg

    return retried_if_taken(start, "postgres")


def remove(pg: Postgres) -> None:
    pg.stop()
    shutil.rmtree(pg.data.parent, ignore_errors=True)
