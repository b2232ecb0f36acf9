"""Start the real gateway (Envoy, filter workers, demo backend) on free loopback ports for a test: the `gateway` and
`module_gateway` fixtures (tests/conftest.py) hand out GatewayFactory, whose gateways are LiveGateway."""

from __future__ import annotations

import http.server
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import yaml
from lxml import etree

from filters.engine.faults import content_type
from filters.stores import replay
from gateway.control.ports import PortInUse, bind_failed, free_ports, retried_if_taken
from gateway.control.supervisor import Gateway, Options
from gateway.policy import Route
from gateway.tools.client import Client, ClientConfig
from tests.support.wss_helpers import route_doc


def write_policies(directory: Path, routes: list[dict], edge: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    doc = {"routes": routes, **({"edge": edge} if edge else {})}
    (directory / "routes.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return directory


@contextmanager
def running_gateway(
    tmp: Path,
    routes: list[dict],
    pki: Path,
    workers: int = 1,
    backend: bool = True,
    metrics: bool = False,
    edge: dict | None = None,
    **options: object,
) -> Iterator[Gateway]:
    """`routes` may use the placeholder BACKEND for the demo backend's address; `edge`: the policy's edge section.
    A start that lost a port to another process is made once more on other ports (gateway/control/ports.py)."""

    def start() -> Gateway:
        opts = Options.on_free_ports(workers, policies=tmp / "policies", certs=pki, run_dir=tmp / "run", **options)
        if not metrics:
            opts.metrics_port = None
        backend_addr = opts.backend or ""
        write_policies(opts.policies, yaml.safe_load(yaml.safe_dump(routes).replace("BACKEND", backend_addr)), edge)
        if not backend:
            opts.backend = None
        gw = Gateway(opts)
        gw.backend_addr = backend_addr  # type: ignore[attr-defined]
        try:
            return gw.__enter__()
        except BaseException:
            opts.release_ports()
            raise

    gw = retried_if_taken(start, "the test's gateway")
    try:
        yield gw
    finally:
        gw.stop()
        gw.opts.release_ports()


def received(gw: Gateway) -> list[dict]:
    """What the demo backend received (method, path, headers, body) since the last `clear`."""
    return requests.get(f"http://{gw.backend_addr}/_received", timeout=5).json()  # type: ignore[attr-defined]


def clear(gw: Gateway) -> None:
    requests.delete(f"http://{gw.backend_addr}/_received", timeout=5)  # type: ignore[attr-defined]


class LiveGateway:
    """A running gateway as a test talks to it: `post("rsa", body)` to the route named rsa, what the backend got,
    a Client for a route. Everything else (opts, redis, workers, logs...) is the supervisor's Gateway's. Stopped
    with its fixture, or at the end of `with gateway(routes) as gw:`."""

    def __init__(self, gw: Gateway, pki: Path, stop: Callable[[], None]) -> None:
        self.gw = gw
        self.pki = pki
        self.stop = stop

    def __getattr__(self, name: str) -> Any:
        return getattr(self.gw, name)

    def __enter__(self) -> LiveGateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def route(self, name: str) -> Route:
        """The route as the gateway loaded it (BACKEND replaced by the demo backend's address)."""
        assert self.gw.policies is not None
        return self.gw.policies.route(name)

    def url(self, route: str, path: str = "demo", *, tls: bool = False) -> str:
        """`path` under the named route's prefix, or `route` itself when it is a path ("/x/../rsa/demo")."""
        target = route if route.startswith("/") else f"{self.route(route).match.path_prefix.rstrip('/')}/{path}"
        port = self.gw.opts.https_port if tls else self.gw.opts.http_port
        return f"{'https' if tls else 'http'}://127.0.0.1:{port}{target}"

    def post(
        self, route: str, body: bytes, version: str = "1.1", *, path: str = "demo", tls: bool = False,
        headers: dict[str, str] | None = None, **kw: Any,
    ) -> requests.Response:  # fmt: skip
        """POST `body` as SOAP `version` to the route; `kw` goes to requests (verify, cert, timeout...)."""
        kw.setdefault("timeout", 10)
        headers = {"content-type": content_type(version), **(headers or {})}
        return requests.post(self.url(route, path, tls=tls), data=body, headers=headers, **kw)

    def client(self, route: str, **cfg: Any) -> Client:
        """A WS-Security client for the route on the gateway's PKI (`cfg`: ClientConfig's fields)."""
        return Client(self.route(route), ClientConfig(certs=self.pki, **cfg))

    def received(self) -> list[dict]:
        return received(self.gw)

    def clear(self) -> None:
        clear(self.gw)


Routes = list[dict] | list[str] | str


def route_docs(routes: Routes, pki: Path) -> list[dict]:
    """Policy dicts as given, or profile names ("rsa" or ["rsa", "hmac"]): route_doc's demo route per profile,
    named after it (so at /rsa/)."""
    names = [routes] if isinstance(routes, str) else routes
    return [route_doc(pki, r, name=r) if isinstance(r, str) else r for r in names]


class GatewayFactory:
    """`gateway(routes, workers=2, metrics=True, ...)` starts a gateway (running_gateway's options) and returns
    its LiveGateway; every gateway started is stopped when the fixture ends."""

    def __init__(self, tmp: pytest.TempPathFactory, pki: Path) -> None:
        self.tmp = tmp
        self.pki = pki
        self.stack = ExitStack()

    def __call__(self, routes: Routes, pki: Path | None = None, **options: Any) -> LiveGateway:
        """`pki`: another PKI than the session's (the gateway's keys and its clients' both come from it)."""
        pki = pki or self.pki
        own = ExitStack()  # closing twice (a `with` block, then the fixture) stops it once
        gw = own.enter_context(running_gateway(self.tmp.mktemp("gateway"), route_docs(routes, pki), pki, **options))
        self.stack.callback(own.close)
        return LiveGateway(gw, pki, own.close)

    def __enter__(self) -> GatewayFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()


def fault_code(resp: requests.Response) -> str:
    """The fault's code local name: a SOAP 1.1 faultcode or the SOAP 1.2 Subcode (e.g. FailedCheck)."""
    root = etree.fromstring(resp.content)
    return (root.findtext(".//faultcode") or root.findtext(".//{*}Subcode/{*}Value") or "").split(":")[-1]


def envelope(body_xml: str, version: str = "1.1", header_xml: str = "") -> bytes:
    soap = (
        "http://www.w3.org/2003/05/soap-envelope" if version == "1.2" else "http://schemas.xmlsoap.org/soap/envelope/"
    )
    header = f"<soap:Header>{header_xml}</soap:Header>" if header_xml else ""
    return (f'<soap:Envelope xmlns:soap="{soap}">{header}<soap:Body>{body_xml}</soap:Body></soap:Envelope>').encode()


# Loopback only, and nothing written to disk.
REDIS_FLAGS = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A throwaway redis-server on a free loopback port; started once more, on another, if it lost the port."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is needed: apt-get install -y redis-server"

    def start() -> tuple[subprocess.Popen[bytes], str]:
        port = free_ports(1)[0]
        log = tmp / f"redis-{port}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([binary, "--port", str(port), "--dir", str(tmp), *REDIS_FLAGS], stdout=out)
        url = f"redis://127.0.0.1:{port}/0"
        probe = redis.Redis.from_url(url)
        deadline = time.monotonic() + 10
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    pid = probe.info("server")["process_id"]
                except redis.ConnectionError:
                    time.sleep(0.05)
                    continue
                if pid != proc.pid:
                    stop(proc)
                    raise PortInUse(f"another redis-server answers on port {port}")
                replay.set_epoch(probe)  # as the supervisor does for its own Redis
                return proc, url
        finally:
            probe.close()
        stop(proc)
        if bind_failed(log.read_bytes()):
            raise PortInUse(f"redis-server could not bind port {port}; see {log}")
        raise RuntimeError(f"redis-server did not start; see {log}")

    return retried_if_taken(start, "redis-server")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(timeout=10)


def redis_again(url: str, tmp: Path) -> subprocess.Popen[bytes]:
    """redis-server started again, empty, on the port of the stopped one at `url` (clients reconnect to it)."""
    tmp.mkdir()
    binary = shutil.which("redis-server")
    assert binary
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    proc = subprocess.Popen([binary, "--port", str(port), "--dir", str(tmp), *REDIS_FLAGS],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    probe = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            probe.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    stop(proc)
    raise AssertionError("redis-server did not start again")


class LoopbackHttp:
    """A real HTTP server on a loopback port for tests: `answer(body) -> (content type, body)` serves every GET
    and POST with 200; `paths` records each request's path (proof of what was, or was not, fetched). A subclass
    may answer otherwise (`respond`) and keep connections open (`protocol_version`)."""

    protocol_version = "HTTP/1.0"

    def __init__(
        self, answer: Callable[[bytes], tuple[str, bytes]] | None = None, tls: ssl.SSLContext | None = None
    ) -> None:
        """`tls`: serve HTTPS with this server context."""
        self.answer = answer
        self.paths: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = outer.protocol_version

            def _serve(self) -> None:
                outer.paths.append(self.path)
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                status, content_type, reply = outer.respond(self.path, dict(self.headers.items()), body)
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            do_GET = do_POST = _serve

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.url = f"{'https' if tls else 'http'}://{self.address}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def respond(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
        """(status, content type, body) for one request."""
        assert self.answer is not None, "LoopbackHttp needs `answer` unless a subclass responds"
        return (200, *self.answer(body))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
