"""The faults the soak (loadtest/soak.py) injects into a running gateway, and the hostile requests it sends.

Each fault runs on the soak's fault thread while load goes on, holding the gateway's lock (the supervisor thread
takes it too: one of them changes the processes at a time), and returns a short description for the log. The
processes the supervisor restarts (a killed worker, a killed Redis) come back through `supervise_once`, exactly as
`wsgate up` brings them back."""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from certs import pki, rotate
from gateway.control.supervisor import Gateway
from gateway.policy import load_dir
from loadtest.archive import ArchiveDb

DEMO = "urn:wsgate:demo"
SOAP11 = "http://schemas.xmlsoap.org/soap/envelope/"
BACKEND_DOWN_S = 3.0  # how long the backend stays stopped
ARCHIVE_DB_DOWN_S = 2.0
# After a fault, this long the replies it explains (503s, store-unavailable faults, ...) count as documented.
SETTLE_S = 5.0


@dataclass
class Faults:
    gw: Gateway
    lock: threading.Lock  # the gateway's processes: the supervisor thread or one fault at a time
    rng: random.Random
    policies: Path  # the soak's own copy of the policies, which `reload` and `rotation` change
    rotations: int = 0
    _generations: list[Path] = field(default_factory=list)  # the key folders `rotation` alternates between
    archive_db: ArchiveDb | None = None  # the archive's PostgreSQL server, which `archive_db_restart` restarts

    def worker_kill(self) -> str:
        with self.lock:
            i = self.rng.randrange(len(self.gw.workers))
            killed = self.gw.workers[i]
            os.kill(killed.pid, signal.SIGKILL)
        _until_replaced(lambda: self.gw.workers[i], killed)
        return f"SIGKILL filter worker {i}"

    def redis_kill(self) -> str:
        with self.lock:
            killed = self.gw.redis
            assert killed is not None, "the soak runs with the supervisor's Redis"
            os.kill(killed.pid, signal.SIGKILL)
        _until_replaced(lambda: self.gw.redis, killed)
        return "SIGKILL redis-server"

    def reload(self) -> str:
        """Change a route (the rsa route's Timestamp max age, 300 <-> 301 s): workers reload, then Envoy."""
        path = next(self.policies.glob("*.yaml"))
        doc = yaml.safe_load(path.read_text())
        route = next(r for r in doc["routes"] if r["name"] == "rsa")
        ts = route.setdefault("timestamp", {})
        ts["max_age_s"] = 601 - ts.get("max_age_s", 300)
        with self.lock:
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
            os.utime(path)
            changed = self.gw.reload_if_changed()
        return (
            f"policy reload (route rsa: timestamp.max_age_s {ts['max_age_s']}): {'applied' if changed else 'no change'}"
        )

    def rotation(self) -> str:
        """Rotate the gateway's keys as docs/keys.md says, under the load: the other generation's signing
        certificate published (`next_certificate`) and its decryption key made current, this one kept as previous
        (a reload); then signing switched to it and a new SecureConversation master key sealing (a reload).
        Generations alternate: the PKI's gateway keys and a pair the PKI's CA issues on the first strike. The
        clients keep encrypting to the PKI's certificate (current or previous throughout) and check response
        signatures against the CA, so nothing may be refused."""
        certs = self.gw.opts.certs
        if not self._generations:
            own = self.policies.parent / "rotation"
            own.mkdir(exist_ok=True)
            ca = pki.load_ca(certs)
            pki.write(own, "gateway-sign", pki.issue(ca, "WSGate Gateway Signing (rotated)"))
            pki.write(own, "gateway-enc", pki.issue(ca, "WSGate Gateway Encryption (rotated)"))
            self._generations += [certs.resolve(), own.resolve()]
        now, then = self._generations[self.rotations % 2], self._generations[(self.rotations + 1) % 2]
        self.rotations += 1
        path = next(self.policies.glob("*.yaml"))
        doc = yaml.safe_load(path.read_text())
        decrypting = {"decryption_key": str(then / "gateway-enc.key"),
                      "decryption_certificate": str(then / "gateway-enc.pem"),
                      "previous_decryption_keys": [{"key": str(now / "gateway-enc.key"),
                                                    "certificate": str(now / "gateway-enc.pem")}]}  # fmt: skip
        routes = doc["routes"]
        for route in routes:
            if route.get("profile") in ("rsa", "secureconversation"):
                route["rsa"] = {**route["rsa"], **decrypting, "next_certificate": str(then / "gateway-sign.pem")}
            elif route.get("profile") == "hmac":
                route["hmac"] = {**route["hmac"], **decrypting}
        self._apply(path, doc)
        for route in routes:
            if route.get("profile") in ("rsa", "secureconversation"):
                route["rsa"].pop("next_certificate")
                route["rsa"] |= {"key": str(then / "gateway-sign.key"), "certificate": str(then / "gateway-sign.pem")}
            if route.get("profile") == "secureconversation":
                master = self.policies.parent / "rotation" / f"{route['name']}-master-keys.yaml"
                if not master.exists():
                    loaded = load_dir(self.policies).route(route["name"]).secureconversation.master_keys_file
                    shutil.copy(loaded, master)
                    route["secureconversation"]["master_keys_file"] = str(master)
                rotate.master_keys(master)
        self._apply(path, doc)
        return f"key rotation to {'the rotated' if then != certs.resolve() else 'the PKI'} keys: published, switched"

    def _apply(self, path: Path, doc: dict) -> None:
        with self.lock:
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
            os.utime(path)
            assert self.gw.reload_if_changed(), "the rotation's policy change was not applied"

    def backend_stop(self) -> str:
        gw = self.gw
        assert gw.backend is not None and gw.opts.backend
        with self.lock:
            gw.backend.kill()
            gw.backend.wait()
        time.sleep(BACKEND_DOWN_S)
        with self.lock:
            gw.backend = gw._spawn(
                "backend", [sys.executable, "-m", "gateway.tools.demo_backend", "--listen", gw.opts.backend]
            )
        return f"backend stopped {BACKEND_DOWN_S:g} s, started again"

    def archive_db_restart(self) -> str:
        """The archive's database stopped and started again: fail-closed routes refuse (503) meanwhile, and every
        record of an accepted request is written once it is back."""
        assert self.archive_db is not None, "archive_db_restart needs the soak's archive database"
        self.archive_db.stop()
        time.sleep(ARCHIVE_DB_DOWN_S)
        self.archive_db.start()
        return f"archive database stopped {ARCHIVE_DB_DOWN_S:g} s, started again"

    def worker_replace(self) -> str:
        """Envoy's filter endpoints moved: a worker replaced by a new one on the other port of its pair."""
        with self.lock:
            i = self.rng.randrange(len(self.gw.workers))
            self.gw._recycle_worker(i)
        return f"filter worker {i} replaced (Envoy's endpoints moved)"


def _until_replaced(current: Callable[[], object], killed: object, timeout: float = 60) -> None:
    """Wait until the supervisor has replaced a killed process (it does so once the new one is ready): the
    outage until then is the fault's, however long a slow machine takes, and its refusals are documented."""
    deadline = time.monotonic() + timeout
    while current() is killed and time.monotonic() < deadline:
        time.sleep(0.05)


KINDS: dict[str, Callable[[Faults], str]] = {
    "worker_kill": Faults.worker_kill,
    "redis_kill": Faults.redis_kill,
    "reload": Faults.reload,
    "rotation": Faults.rotation,
    "backend_stop": Faults.backend_stop,
    "worker_replace": Faults.worker_replace,
}
HOSTILE = "hostile"  # the burst: the soak sends it (it needs the accepted messages to replay)
ALL = (*KINDS, HOSTILE)
# Only with a database to restart (run_soak's archive_db): not among ALL, the default.
ARCHIVE_DB_RESTART = "archive_db_restart"
OPTIONAL: dict[str, Callable[[Faults], str]] = {ARCHIVE_DB_RESTART: Faults.archive_db_restart}


def schedule(kinds: list[str], duration: float, rng: random.Random, lead: float = 2.0) -> list[tuple[float, str]]:
    """When each fault strikes: every kind at least once, more in a long run (about one fault per 20 s), at
    random moments in (lead, duration - SETTLE_S - backend downtime), never two within 4 s of each other."""
    end = duration - SETTLE_S - BACKEND_DOWN_S - 1
    if end <= lead:
        return []
    count = max(len(kinds), int(duration / 20))
    picks = list(kinds) + [rng.choice(kinds) for _ in range(count - len(kinds))]
    rng.shuffle(picks)
    gap = min(4.0, (end - lead) / len(picks))
    slots = sorted(rng.uniform(lead, end - gap * (len(picks) - 1)) for _ in picks)
    return [(t + i * gap, kind) for i, (t, kind) in enumerate(zip(slots, picks, strict=True))]


# ---- hostile requests: each must be refused, none may cost the gateway its other traffic


def _plain(body: str, head: str = "") -> bytes:
    return f'<soap:Envelope xmlns:soap="{SOAP11}"{head}><soap:Body>{body}</soap:Body></soap:Envelope>'.encode()


def plain_body() -> bytes:
    """A well-formed echo request: the flood's (loadtest/soak.py), refused for its rate, never its shape."""
    return _plain(f'<d:echo xmlns:d="{DEMO}"><d:text>flood</d:text></d:echo>')


def hostile_bodies(max_body_bytes: int) -> dict[str, bytes]:
    """One of each shape, for an `xml` route with the default limits (gateway/policy.py Limits)."""
    deep = "".join(f"<d:n{i}>" for i in range(2000)) + "".join(f"</d:n{i}>" for i in reversed(range(2000)))
    return {
        "oversized": _plain(f'<d:echo xmlns:d="{DEMO}"><d:text>{"x" * (max_body_bytes + 1024)}</d:text></d:echo>'),
        "deep": _plain(f'<d:echo xmlns:d="{DEMO}">{deep}</d:echo>'),
        "namespace flood": _plain(
            f'<d:echo xmlns:d="{DEMO}"><d:text>x</d:text></d:echo>',
            "".join(f' xmlns:n{i}="urn:flood:{i}"' for i in range(5000)),
        ),
    }
