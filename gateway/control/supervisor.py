"""Process supervision for `wsgate up`: filter workers, Envoy and the demo backend on one machine.

Start order: backend, filter workers, Envoy (so Envoy never sees a missing filter). A worker that dies is
restarted; Envoy dying stops the gateway. Policy files are watched: a valid change is loaded by the workers
(SIGHUP, waited for) and then delivered to Envoy step by step, clusters before the routes that name them and
removed after them (gateway/control/envoy_delivery.py), without dropping in-flight requests; an invalid change is
logged and the running policies stay."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from certs import pki
from filters.engine import faults
from filters.engine.outbound import OutboundPipeline
from filters.engine.requester import RequesterError
from filters.stores import replay
from filters.stores.factory import RouteStores
from gateway.control import envoy_config, envoy_delivery, ports, rate_limit
from gateway.control.documents import load_checked
from gateway.control.ports import PortInUse
from gateway.policy import DEFAULT_BODY_BUDGET_MB, REDIS_URL_ENV, PolicyError, PolicySet, check_body_budget

log = logging.getLogger("wsgate.up")


@dataclass
class Options:
    policies: Path = Path("policies")
    certs: Path = pki.DEFAULT_DIR
    run_dir: Path = Path("run")
    workers: int = field(default_factory=lambda: default_workers())
    bind: str = "127.0.0.1"
    http_port: int = 8080
    https_port: int = 8443
    admin_port: int = 9901
    # Worker i listens on filter_port + i, or on filter_port + workers + i while it replaces its predecessor.
    filter_port: int = 9100
    metrics_port: int | None = 9200  # worker i exports metrics on metrics_port + i (+ workers while replacing)
    ratelimit_port: int = 8089  # the Envoy rate-limit service's gRPC, on loopback (started for routes with quotas)
    backend: str | None = "127.0.0.1:8081"  # None: do not start the demo backend
    envoy_concurrency: int = 1  # measured: on 2 cores one Envoy thread keeps throughput and cuts p99
    # A worker over this resident size is replaced (new one first, then the old one drains). libxml2 keeps every
    # id a worker ever registered for signature checks in a dictionary it never frees: clients choose the ids,
    # so only replacing the process bounds that memory.
    worker_max_rss_mb: int = 512
    # Memory per request is bounded by bounding the requests: each worker admits this many body bytes in flight
    # (filters/frame/src/budget.rs), Envoy refuses new requests when its heap nears envoy_max_heap_mb. Beyond: 503.
    body_budget_mb: int = DEFAULT_BODY_BUDGET_MB
    envoy_max_heap_mb: int = 1024
    log_level: str = "warning"

    # The ports on_free_ports reserved in this process (gateway/control/ports.py); release_ports hands them back.
    reserved: tuple[int, ...] = ()

    @classmethod
    def on_free_ports(cls, workers: int, **fields: object) -> Options:
        """Options whose every port is free on loopback, distinct, and reserved in this process until
        `release_ports` (tests, benchmarks, side-by-side runs; gateway/control/ports.py)."""
        span = 2 * workers  # a port pair per worker, for replacing it
        filter_base = ports.free_consecutive_ports(span)
        metrics = ports.free_consecutive_ports(span)
        http, https, admin, backend, ratelimit = singles = ports.free_ports(5)
        defaults: dict[str, object] = {
            "workers": workers, "http_port": http, "https_port": https, "admin_port": admin,
            "filter_port": filter_base, "metrics_port": metrics, "backend": f"127.0.0.1:{backend}",
            "ratelimit_port": ratelimit,
            "reserved": (*range(filter_base, filter_base + span), *range(metrics, metrics + span), *singles),
        }  # fmt: skip
        return cls(**{**defaults, **fields})  # type: ignore[arg-type]

    def release_ports(self) -> None:
        """Once the gateway has stopped: on_free_ports's ports may be handed out again in this process."""
        ports.release(self.reserved)
        self.reserved = ()

    def ports(self) -> list[tuple[str, int, str]]:
        """Every (host, port, role) `start` binds, a replaced worker's ports included."""
        bind = self.bind.strip("[]")
        admin_host = "127.0.0.1" if bind == "127.0.0.1" else "0.0.0.0"
        out = [
            (bind, self.http_port, "Envoy's HTTP listener"),
            (bind, self.https_port, "Envoy's HTTPS listener"),
            (admin_host, self.admin_port, "Envoy's admin interface"),
        ]
        for slot in range(2 * self.workers):
            who = f"filter worker {slot % self.workers}'s" + (" replacement's" if slot >= self.workers else "")
            out.append(("127.0.0.1", self.filter_port + slot, f"{who} gRPC"))
            if self.metrics_port:
                out.append(("127.0.0.1", self.metrics_port + slot, f"{who} metrics"))
        if self.backend:
            host, port = self.backend.rsplit(":", 1)
            out.append((host.strip("[]"), int(port), "the demo backend"))
        return out

    def topology(self, worker_ports: list[int] | None = None) -> envoy_config.Topology:
        ports = worker_ports or [self.filter_port + i for i in range(self.workers)]
        return envoy_config.Topology(
            filter_endpoints=tuple(f"127.0.0.1:{p}" for p in ports),
            bind=self.bind,
            http_port=self.http_port,
            https_port=self.https_port,
            admin_port=self.admin_port,
            certs_dir=str(self.certs.resolve()),
            config_dir=str((self.run_dir / "envoy").resolve()),
            max_heap_mb=self.envoy_max_heap_mb,
            ratelimit=f"127.0.0.1:{self.ratelimit_port}",
        )


def default_workers() -> int:
    """One filter worker per core. Measured on 2 cores (`make bench`, 1 KB): a second worker adds nothing on
    xml and hmac (1,268 vs 1,275 and 455 vs 451 req/s) but 30-60% on the RSA profiles (rsa 306-337 -> 427-465,
    rsa-encrypted 210-257 -> 336-361, secureconversation 305-366 -> 371-396 req/s): the work that holds a
    worker's thread longest, queueing the others' exchanges behind it, is what a second one takes."""
    return os.cpu_count() or 1


def _wait_listening(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 30) -> None:
    """Until `proc` listens on `port` (itself: another process may have taken the port)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} while starting")
        if ports.listens(proc.pid, port):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout:.0f}s")


def _can_bind(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As the servers bind (SO_REUSEADDR): a port left in TIME_WAIT by a previous run is free, a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def check_ports(opts: Options) -> None:
    """Refuse to start when a port the gateway will bind is in use, naming each such port and its role."""
    taken = [
        f"port {port} ({role}) is taken on {host}" for host, port, role in opts.ports() if not _can_bind(host, port)
    ]
    if taken:
        raise PortInUse("; ".join(taken) + "; nothing was started")


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _start_epoch(url: str, timeout: float = 10) -> None:
    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                replay.set_epoch(client)
                return
            except redis.RedisError:  # still loading
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        client.close()


def _policy_signature(directory: Path) -> tuple[tuple[str, int, int], ...]:
    return tuple(
        (p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(directory.glob("*.y*ml")) if p.is_file()
    )


class Gateway:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.workers: list[subprocess.Popen[bytes]] = []
        self.envoy: subprocess.Popen[bytes] | None = None
        self.backend: subprocess.Popen[bytes] | None = None
        self.redis: subprocess.Popen[bytes] | None = None
        self.ratelimit: subprocess.Popen[bytes] | None = None
        self.retiring: list[subprocess.Popen[bytes]] = []  # recycled workers finishing their exchanges
        self.worker_ports: list[int] = []
        self.env = dict(os.environ)
        self.policies: PolicySet | None = None
        self._signature: tuple[tuple[str, int, int], ...] = ()
        self.logs = opts.run_dir / "logs"
        self._log_start: dict[str, int] = {}  # where each process's log was when it was last spawned

    # -- start ---------------------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        self.logs.mkdir(parents=True, exist_ok=True)
        out = open(self.logs / f"{name}.log", "ab")
        self._log_start[name] = out.tell()
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env or self.env)

    @contextmanager
    def _binding(self, name: str) -> Iterator[None]:
        """Around the wait for process `name` to start: when it failed because a port it binds is taken (its log
        since it was spawned says so), PortInUse instead of RuntimeError."""
        try:
            yield
        except PortInUse:
            raise
        except RuntimeError as exc:
            with open(self.logs / f"{name}.log", "rb") as f:
                f.seek(self._log_start.get(name, 0))
                if ports.bind_failed(f.read()):
                    raise PortInUse(f"{exc}: a port it binds is taken (address already in use)") from exc
            raise

    def _spawn_worker(self, i: int, port: int, timeout: float = 30) -> subprocess.Popen[bytes]:
        """Start worker i on `port` and return once it accepts exchanges."""
        o = self.opts
        ready = (o.run_dir / f"filter-{i}.ready").resolve()
        ready.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "filters.worker", "--policies", str(o.policies),
                "--listen", f"127.0.0.1:{port}", "--log-level", o.log_level.upper(),
                "--ready-file", str(ready), "--body-budget-mb", str(o.body_budget_mb)]  # fmt: skip
        if o.metrics_port:  # metrics ports pair up like the workers' ports
            argv += ["--metrics-port", str(o.metrics_port + port - o.filter_port)]
        proc = self._spawn(f"filter-{i}", argv)
        deadline = time.monotonic() + timeout
        with self._binding(f"filter-{i}"):
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"filter worker {i} did not start; see {self.logs}/filter-{i}.log")
                time.sleep(0.02)
        return proc

    def _recycle_worker(self, i: int) -> None:
        """Replace worker i without dropping an exchange: the new one starts on the other port of its pair,
        Envoy's cluster is rewritten to it (in-flight exchanges finish on the old one, new ones go to the new),
        and once Envoy no longer lists the old endpoint, the old worker drains and stops."""
        o = self.opts
        old, old_port = self.workers[i], self.worker_ports[i]
        pair = (o.filter_port + i, o.filter_port + o.workers + i)
        new_port = pair[1] if old_port == pair[0] else pair[0]
        self.workers[i] = self._spawn_worker(i, new_port)
        self.worker_ports[i] = new_port
        try:
            self.render()
        except (envoy_delivery.DeliveryError, OSError) as exc:
            log.error("envoy did not take the moved worker endpoint: %s", exc)  # the wait below bounds the rest
        self._wait_endpoint_gone(old_port)
        old.terminate()
        self.retiring.append(old)

    def _wait_endpoint_gone(self, port: int, timeout: float = 10) -> None:
        url = f"http://127.0.0.1:{self.opts.admin_port}/clusters"
        needle = f"{envoy_config.FILTER_CLUSTER}::127.0.0.1:{port}::"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with urllib.request.urlopen(url, timeout=2) as r:
                if needle not in r.read().decode():
                    return
            time.sleep(0.05)
        log.warning("envoy still lists filter endpoint %d after %.0fs; stopping that worker anyway", port, timeout)

    def render(self) -> None:
        """Envoy's files for the current policies and workers: written, or delivered step by step to a running
        Envoy (gateway/control/envoy_delivery.py)."""
        assert self.policies is not None
        files = envoy_config.render(self.policies, self.opts.topology(self.worker_ports))
        if self.envoy is None or self.envoy.poll() is not None:
            envoy_config.write(files, self.opts.run_dir / "envoy")
        else:
            envoy_delivery.deliver(files, self.opts.run_dir / "envoy", self.opts.admin_port)

    def _reloads(self, i: int) -> int:
        """How many reloads worker i has finished (its ready file: pid, reloads)."""
        return int((self.opts.run_dir / f"filter-{i}.ready").read_text().split()[1])

    def _reload_workers(self, timeout: float = 30) -> None:
        """SIGHUP every worker; return once each has finished its reload (taken, or refused and logged)."""
        wanted = [self._reloads(i) + 1 for i in range(len(self.workers))]
        for w in self.workers:
            w.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while any(self._reloads(i) < n for i, n in enumerate(wanted)):
            if time.monotonic() > deadline:
                log.error("a filter worker did not finish its reload within %.0fs; see %s", timeout, self.logs)
                return
            time.sleep(0.02)

    def start(self) -> None:
        o = self.opts
        check_ports(o)  # before anything starts: a clear message instead of a worker that did not start
        pki.init(o.certs)
        self.policies = check_body_budget(load_checked(o.policies), o.body_budget_mb * 1024 * 1024)
        self._signature = _policy_signature(o.policies)
        self.render()
        self._start_shared_store()
        self._check_per_process_stores()
        self._start_rate_limit()
        if o.backend:
            self.backend = self._spawn(
                "backend", [sys.executable, "-m", "gateway.tools.demo_backend", "--listen", o.backend]
            )
            with self._binding("backend"):
                _wait_listening(int(o.backend.rsplit(":", 1)[1]), self.backend, "demo backend")
        self.worker_ports = [o.filter_port + i for i in range(o.workers)]
        for i, port in enumerate(self.worker_ports):
            self.workers.append(self._spawn_worker(i, port))  # one by one: a failed start still stops the others
        envoy_bin = str(Path(sys.executable).with_name("envoy"))
        self.envoy = self._spawn("envoy", [
            envoy_bin, "-c", str(o.run_dir / "envoy" / "envoy.yaml"), "--concurrency", str(o.envoy_concurrency),
            "--log-level", o.log_level, "--drain-time-s", "5", "--file-flush-interval-msec", "1000",
            # Several gateways (tests, side-by-side benchmarks) may share a machine: no fixed shared-memory id.
            "--use-dynamic-base-id"])  # fmt: skip
        with self._binding("envoy"):
            self._wait_envoy_ready()

    def _start_shared_store(self) -> None:
        """Several workers must see each other's replay entries (and contexts): give them one Redis; so do routes
        that ask for a Redis store without naming one, and one worker detecting replays: it may be replaced
        (recycled, restarted after a crash), and a fresh process must not forget what the old one saw."""
        o = self.opts
        assert self.policies is not None
        replay_auto = any(r.detects_replays and r.replay.store == "auto" for r in self.policies.routes)
        wants_redis = rate_limit.enabled(self.policies) or any(
            (r.replay.store == "redis" and not r.replay.redis_url)
            or (r.profile == "secureconversation" and r.secureconversation.store == "redis"
                and "redis_url" not in r.secureconversation.model_fields_set)
            for r in self.policies.routes
        )  # fmt: skip
        if (o.workers < 2 and not wants_redis and not replay_auto) or REDIS_URL_ENV in self.env:
            return
        redis_bin = shutil.which("redis-server")
        if redis_bin is None:
            if wants_redis:
                raise RuntimeError("a route needs a Redis store and redis-server is not installed")
            log.warning("redis-server not found: 1 filter worker, replay entries kept in it (lost if it is replaced)")
            o.workers = 1
            self.render()
            return
        self._spawn_redis(redis_bin)

    def _spawn_redis(self, redis_bin: str) -> None:
        sock = (self.opts.run_dir / "redis.sock").resolve()
        sock.unlink(missing_ok=True)
        self.redis = self._spawn("redis", [
            redis_bin, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700", "--save", "",
            "--appendonly", "no", "--maxmemory", "512mb", "--maxmemory-policy", "noeviction"])  # fmt: skip
        # noeviction: a full store refuses writes (requests fail closed) rather than forget a replay entry.
        deadline = time.monotonic() + 10
        while not sock.exists():
            if self.redis.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start; see {self.logs}/redis.log")
            time.sleep(0.05)
        self.env[REDIS_URL_ENV] = f"unix://{sock}"
        # Empty (no persistence): nothing accepted before now is remembered. Its replay epoch starts here, before
        # a worker's first check would start it at that message's arrival (filters/engine/wss/replay.py).
        _start_epoch(self.env[REDIS_URL_ENV])

    def _start_rate_limit(self) -> None:
        """The Envoy rate-limit service, for routes with quotas: its configuration from the policies, its counts
        in the shared Redis (so gateways sharing a Redis share the limits). Stateless: a policy change restarts it."""
        assert self.policies is not None
        if not rate_limit.enabled(self.policies):
            return
        o = self.opts
        binary = rate_limit.binary()
        if not binary.exists():
            raise RuntimeError(
                f"routes have quotas and the rate-limit service is not built at {binary}: make ratelimit"
            )
        if not _can_bind("127.0.0.1", o.ratelimit_port):
            raise PortInUse(f"port {o.ratelimit_port} (the rate-limit service) is taken on 127.0.0.1")
        root = (o.run_dir / "ratelimit").resolve()
        rate_limit.write(self.policies, root)
        env = rate_limit.environment(f"127.0.0.1:{o.ratelimit_port}", root, self.env[REDIS_URL_ENV])
        self.ratelimit = self._spawn("ratelimit", [str(binary)], {**self.env, **env})
        with self._binding("ratelimit"):
            _wait_listening(o.ratelimit_port, self.ratelimit, "the rate-limit service")

    def _stop_rate_limit(self) -> None:
        if self.ratelimit is not None and self.ratelimit.poll() is None:
            self.ratelimit.terminate()
            self.ratelimit.wait(10)
        self.ratelimit = None

    def _check_per_process_stores(self) -> None:
        """A per-process store (replay `memory`, contexts `memory`) only works when one worker sees all traffic."""
        assert self.policies is not None
        if self.opts.workers < 2:
            return
        for r in self.policies.routes:
            if r.detects_replays and r.replay.store == "memory":
                raise PolicyError(f"route {r.name}: replay store memory needs --workers 1 (use auto or redis)")
            if r.profile == "secureconversation" and r.secureconversation.store == "memory":
                raise PolicyError(f"route {r.name}: context store memory needs --workers 1 (use sealed or redis)")

    def _wait_envoy_ready(self, timeout: float = 30) -> None:
        assert self.envoy is not None
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.opts.admin_port}/ready"
        while time.monotonic() < deadline:
            if self.envoy.poll() is not None:
                raise RuntimeError(f"envoy exited with status {self.envoy.returncode}; see {self.logs}/envoy.log")
            try:
                with urllib.request.urlopen(url, timeout=0.5) as r:
                    if r.status == 200:
                        envoy_delivery.check_listeners(self.opts.run_dir / "envoy", self.opts.admin_port)
                        _wait_listening(self.opts.http_port, self.envoy, "envoy")
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"envoy not ready within {timeout:.0f}s; see {self.logs}/envoy.log")

    def metrics_urls(self) -> list[str]:
        """Each worker's Prometheus endpoint, where it is now (a replaced worker moves to the other port)."""
        o = self.opts
        if not o.metrics_port:
            return []
        return [f"http://127.0.0.1:{o.metrics_port + p - o.filter_port}/metrics" for p in self.worker_ports]

    def urls(self) -> dict[str, str]:
        o = self.opts
        return {
            "http": f"http://{o.bind}:{o.http_port}",
            "https": f"https://{o.bind}:{o.https_port}",
            "envoy admin": f"http://127.0.0.1:{o.admin_port}",
            **({"metrics": f"http://127.0.0.1:{o.metrics_port}/metrics (worker 0)"} if o.metrics_port else {}),
            **({"backend": f"http://{o.backend}"} if o.backend else {}),
        }

    # -- run -----------------------------------------------------------------------------------------------
    def reload_if_changed(self) -> bool:
        """Apply changed policy files; returns True when new policies went live."""
        sig = _policy_signature(self.opts.policies)
        if sig == self._signature:
            return False
        self._signature = sig
        try:
            policies = check_body_budget(load_checked(self.opts.policies), self.opts.body_budget_mb * 1024 * 1024)
        except PolicyError as exc:
            log.error("policy change refused, the running policies stay:\n%s", exc)
            return False
        limits_before = rate_limit.service_config(self.policies) if self.policies else ""
        self.policies = policies
        if rate_limit.service_config(policies) != limits_before:
            self._stop_rate_limit()  # new limits: the counts stay in Redis
            try:
                self._start_rate_limit()
            except (RuntimeError, KeyError) as exc:  # KeyError: no shared Redis was started for the first quotas
                log.error("the rate-limit service did not start; quota-checked requests are refused: %r", exc)
        # Workers first: Envoy sends a new route's requests only once they know it (they keep a dropped route
        # until the next reload, for Envoy's draining listeners).
        self._reload_workers()
        try:
            self.render()
        except (envoy_delivery.DeliveryError, OSError) as exc:
            log.error("envoy did not take the new configuration; it keeps the last step it took: %s", exc)
            return False
        log.info("policies reloaded: %d routes", len(policies.routes))
        return True

    def supervise_once(self) -> None:
        if self.redis is not None and self.redis.poll() is not None:
            # Workers fail closed while it is gone (replay checks refuse); a new one brings them back.
            log.error("redis-server exited (status %s); restarting it", self.redis.returncode)
            self._spawn_redis(self.redis.args[0])
        if self.ratelimit is not None and self.ratelimit.poll() is not None:
            # Quota-checked requests fail closed (503) while it is gone.
            log.error("the rate-limit service exited (status %s); restarting it", self.ratelimit.returncode)
            self._start_rate_limit()
        for i, w in enumerate(self.workers):
            if w.poll() is not None:
                log.error("filter worker %d exited (status %s); restarting it", i, w.returncode)
                self.workers[i] = self._spawn_worker(i, self.worker_ports[i])
            elif _rss_mb(w.pid) > self.opts.worker_max_rss_mb:
                log.warning("filter worker %d over %d MiB resident; replacing it", i, self.opts.worker_max_rss_mb)
                self._recycle_worker(i)
        self.retiring = [p for p in self.retiring if p.poll() is None]
        if self.envoy is not None and self.envoy.poll() is not None:
            raise RuntimeError(f"envoy exited with status {self.envoy.returncode}; see {self.logs}/envoy.log")
        self.reload_if_changed()

    def run_forever(self, interval: float = 1.0) -> None:
        stop = False

        def on_signal(signum: int, frame: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            while not stop:
                self.supervise_once()
                time.sleep(interval)
        finally:
            self.stop()

    def stop(self) -> None:
        # Envoy first so no new request reaches a stopping worker; then the workers finish in-flight exchanges;
        # then the contexts outbound routes hold with partners are cancelled, while Redis still has them.
        _terminate([self.envoy, *self.workers, *self.retiring])
        self._cancel_partner_contexts()
        _terminate([self.backend, self.ratelimit, self.redis])

    def _cancel_partner_contexts(self) -> None:
        """Each outbound secureconversation route's shared context (in Redis) is cancelled with its partner, once."""
        routes = [r for r in (self.policies.routes if self.policies else []) if r.is_outbound and r.touches_xml]
        routes = [r for r in routes if r.profile == "secureconversation"]
        url = self.env.get(REDIS_URL_ENV)
        if not routes or not url or (self.redis is not None and self.redis.poll() is not None):
            return
        stores = RouteStores(redis_url=url)
        for r in routes:
            try:
                if OutboundPipeline(r, stores).cancel_context():
                    log.info("route %s: the context with the partner is cancelled", r.name)
            except (RequesterError, faults.Fault, OSError) as exc:
                log.warning("route %s: the context with the partner was not cancelled: %s", r.name, exc)

    def __enter__(self) -> Gateway:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _terminate(procs: list[subprocess.Popen[bytes] | None]) -> None:
    running = [p for p in procs if p is not None and p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + 10
    for p in running:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
