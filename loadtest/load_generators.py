"""The benchmark's load generators (loadtest/bench.py): wrk at saturation (through loadtest/bench.lua) and an
open-loop paced client for latency at a fixed rate."""

from __future__ import annotations

import asyncio
import collections
import math
import shutil
import ssl
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

LUA = Path(__file__).resolve().parent / "bench.lua"


@dataclass
class WrkResult:
    requests: int
    duration_s: float
    bytes: int
    errors: int
    p50_ms: float
    p99_ms: float
    exhausted: bool
    raw: str

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


def run_wrk(url: str, path: str, content_type: str, bodies: Path, once: bool, threads: int, connections: int,
            duration: float) -> WrkResult:  # fmt: skip
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk not found: apt-get install wrk (Debian's package)")
    argv = [wrk, f"-t{threads}", f"-c{connections}", f"-d{max(1, round(duration))}s", "--timeout", "30s",
            "-s", str(LUA), url, "--", path, content_type, str(bodies), "once" if once else "cycle"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 120)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("WSGATE ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stdout}\n{proc.stderr}")
    v = {k: int(x) for k, x in (kv.split("=") for kv in line.split()[1:])}
    return WrkResult(
        requests=v["requests"], duration_s=v["duration_us"] / 1e6, bytes=v["bytes"],
        errors=v["connect"] + v["read"] + v["write"] + v["status"] + v["timeout"],
        p50_ms=v["p50_us"] / 1000, p99_ms=v["p99_us"] / 1000, exhausted=v["exhausted_threads"] > 0,
        raw=proc.stdout,
    )  # fmt: skip


# ---- the paced client


@dataclass
class PacedResult:
    sent: int
    latencies_ms: list[float]
    statuses: collections.Counter[int]
    errors: list[str]
    replies: dict[int, tuple[int, bytes]]  # sampled: index -> (status, body)
    duration_s: float


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        k, sep, v = line.partition(":")
        if sep:
            headers[k.strip().lower()] = v.strip()
    keep_alive = headers.get("connection", "").lower() != "close"
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass
                break
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        body = b"".join(parts)
    else:
        body, keep_alive = await reader.read(), False
    return status, body, keep_alive


async def _paced(host: str, port: int, tls: ssl.SSLContext | None, path: str, content_type: str,
                 bodies: list[bytes], rate: float, connections: int, sample: set[int],
                 timeout: float) -> PacedResult:  # fmt: skip
    queue: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()
    latencies: list[float] = []
    statuses: collections.Counter[int] = collections.Counter()
    errors: list[str] = []
    replies: dict[int, tuple[int, bytes]] = {}
    head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(host, port, ssl=tls, limit=1 << 20)

    async def worker(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None) -> None:
        while (item := await queue.get()) is not None:
            i, due = item
            body = bodies[i]
            try:
                if conn is None:
                    conn = await connect()
                reader, writer = conn
                writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
                status, reply, keep_alive = await asyncio.wait_for(_read_response(reader), timeout)
                latencies.append((time.perf_counter() - due) * 1000)
                statuses[status] += 1
                if i in sample or (status != 200 and len(replies) < len(sample) + 5):
                    replies[i] = (status, reply)
                if not keep_alive:
                    writer.close()
                    conn = None
            except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError) as exc:
                errors.append(f"request {i}: {type(exc).__name__}: {exc}")
                if conn is not None:
                    conn[1].close()
                conn = None
        if conn is not None:
            conn[1].close()

    conns = [await connect() for _ in range(connections)]
    tasks = [asyncio.create_task(worker(c)) for c in conns]
    # perf_counter, not loop.time(): uvloop's clock has millisecond steps.
    start = time.perf_counter() + 0.05
    for i in range(len(bodies)):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        queue.put_nowait((i, due))
    for _ in tasks:
        queue.put_nowait(None)
    await asyncio.gather(*tasks)
    return PacedResult(len(bodies), latencies, statuses, errors, replies, time.perf_counter() - start)


def run_paced(url: str, path: str, content_type: str, bodies: list[bytes], rate: float, connections: int = 16,
              sample: Iterable[int] = (), ca: Path | None = None, timeout: float = 30) -> PacedResult:  # fmt: skip
    """Send `bodies` at `rate` per second (open loop) over `connections` keep-alive connections."""
    scheme, _, hostport = url.partition("://")
    host, _, port = hostport.rstrip("/").rpartition(":")
    tls = ssl.create_default_context(cafile=str(ca) if ca else None) if scheme == "https" else None
    coro = _paced(host, int(port), tls, path, content_type, bodies, rate, connections, set(sample), timeout)
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
