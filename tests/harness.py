"""Start the real gateway (Envoy, filter workers, demo backend) on free loopback ports for a test."""

from __future__ import annotations

import http.server
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
import requests
import yaml
from lxml import etree

from filters.stores import replay
from gateway.control.supervisor import Gateway, Options, free_ports


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
    """`routes` may use the placeholder BACKEND for the demo backend's address; `edge`: the policy's edge section."""
    opts = Options.on_free_ports(workers, policies=tmp / "policies", certs=pki, run_dir=tmp / "run", **options)
    if not metrics:
        opts.metrics_port = None
    backend_addr = opts.backend or ""
    routes = yaml.safe_load(yaml.safe_dump(routes).replace("BACKEND", backend_addr))
    write_policies(opts.policies, routes, edge)
    if not backend:
        opts.backend = None
    with Gateway(opts) as gw:
        gw.backend_addr = backend_addr  # type: ignore[attr-defined]
        yield gw


def received(gw: Gateway) -> list[dict]:
    """What the demo backend received (method, path, headers, body) since the last `clear`."""
    return requests.get(f"http://{gw.backend_addr}/_received", timeout=5).json()  # type: ignore[attr-defined]


def clear(gw: Gateway) -> None:
    requests.delete(f"http://{gw.backend_addr}/_received", timeout=5)  # type: ignore[attr-defined]


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


def content_type(version: str) -> str:
    return "application/soap+xml; charset=utf-8" if version == "1.2" else "text/xml; charset=utf-8"


# Loopback only, and nothing written to disk.
REDIS_FLAGS = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A throwaway redis-server on a free loopback port; a few tries, as another process may take the port."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is needed: apt-get install -y redis-server"
    for _ in range(5):
        port = free_ports(1)[0]
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--dir", str(tmp), *REDIS_FLAGS],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"redis://127.0.0.1:{port}/0"
        probe = redis.Redis.from_url(url)
        deadline = time.monotonic() + 10
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    # Ours, not some other server that took the port first.
                    if probe.info("server")["process_id"] == proc.pid:
                        replay.set_epoch(probe)  # as the supervisor does for its own Redis
                        return proc, url
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
        finally:
            probe.close()
        stop(proc)
    raise RuntimeError("redis-server did not start")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(timeout=10)


class LoopbackHttp:
    """A real HTTP server on a loopback port for tests: `answer(body) -> (content type, body)` serves every GET
    and POST with 200; `paths` records each request's path (proof of what was, or was not, fetched)."""

    def __init__(self, answer: Callable[[bytes], tuple[str, bytes]]) -> None:
        self.paths: list[str] = []
        paths = self.paths

        class Handler(http.server.BaseHTTPRequestHandler):
            def _serve(self) -> None:
                paths.append(self.path)
                content_type, body = answer(self.rfile.read(int(self.headers.get("content-length") or 0)))
                self.send_response(200)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _serve

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
