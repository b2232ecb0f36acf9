"""`make bench`'s attachment rows: the engine's CPU for SOAP with Attachments secured per the SwA profile, beside
the floor of the same bytes through OpenSSL on this machine.

A 1 KB envelope with one 100 KB or 10 MB attachment, X.509-signed (Body, Timestamp, the attachment with its
headers: Attachment-Complete-Signature-Transform), and signed and encrypted (AES-256-GCM, RSA-OAEP; the Body and
the attachment, Attachment-Complete), made with the engine's sending side as a client would. In process, on the
routes of loadtest/policies/bench.yaml (swa-signed, swa-encrypted): the request verified (and decrypted) by the
route's pipeline, the backend's echo of the package signed (and encrypted) by it. CPU time of this process per
message, median; MB/s per core is the attachment's bytes over that time. The floor: `openssl dgst -sha256` over a
file (CPU of the child), and `openssl speed -evp aes-256-gcm` (`openssl enc` takes no AEAD cipher). The target
(issue 21): signing or verifying costs at most 2x the raw SHA-256, encryption at most 2x raw AES-GCM.

Alone: `python -m loadtest.attachment_cpu [--scale 0.1]`."""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from certs import pki
from filters.engine import ns
from filters.engine.engine import Exchange, build_pipeline
from filters.engine.mime import package as mime
from filters.engine.profiles import SecuredPipeline
from filters.engine.wss import attachments, keys, signing
from filters.engine.wss import wssecurity_sending as sending
from filters.engine.xml.threat_protection import parse_envelope
from filters.stores.factory import RouteStores
from filters.stores.replay import MemoryReplayCache
from gateway.policy import PolicySet, Route
from loadtest.messages import plain_request
from loadtest.optimizations import bench_policies

SIZES = {"100 KB": 100 * 1024, "10 MB": 10 * 1024 * 1024}
ROWS = {"signed": "swa-signed", "signed+encrypted": "swa-encrypted"}
COUNTS = {"100 KB": 60, "10 MB": 6}  # messages per point
BOUNDARY = "bench-swa-7c1e"
FLOOR_BYTES = 64 * 1024 * 1024


@dataclass
class Row:
    kind: str
    size: str
    messages: int
    request_us: float  # verify (+ decrypt) one request, median CPU
    reply_us: float  # sign (+ encrypt) one reply

    def mbps(self, us: float) -> float:
        return SIZES[self.size] / us  # bytes per microsecond = MB/s


def _package(root: bytes, part: attachments.Attachment) -> tuple[str, bytes]:
    content_type = f'multipart/related; type="text/xml"; boundary={BOUNDARY}; start="<root@bench>"'
    head = mime.Part((("Content-Type", "text/xml; charset=utf-8"), ("Content-ID", "<root@bench>")), "root@bench",
                     "text/xml; charset=utf-8", root)  # fmt: skip
    attached = mime.Part(tuple(part.headers), part.content_id, part.content_type, bytes(part.body))
    return content_type, mime.serialize(mime.Package(head, (attached,), "root@bench", BOUNDARY, content_type))


def request(route: Route, certs: Path, data: bytes | None, encrypted: bool, tag: str = "swa") -> tuple[str, bytes]:
    """A 1 KB envelope (its echoed texts carry `tag`) and `data` as an attachment, secured as a client of the
    route would secure it; `data` None: the envelope alone, plain SOAP (loadtest/attachment_gateway.py's baseline)."""
    plain, _ = plain_request("small", tag)
    env = parse_envelope(plain, route.limits)
    headers = [("Content-ID", "<doc@bench>"), ("Content-Type", "application/pdf")]
    part = attachments.Attachment("doc@bench", headers, data or b"")
    cert = keys.load_certificate(str(certs / "client.pem"))
    signer = signing.Signer(keys.load_private_key(str(certs / "client.key")), "rsa-sha256", "sha256")
    bst_id = sending.new_id("X509")
    sign = sending.SignWith(signer, lambda: keys.str_reference(bst_id, ns.X509V3), cert)
    encrypt = None
    if encrypted:
        encrypt = sending.EncryptFor("aes256-gcm", certificate=keys.load_certificate(str(certs / "gateway-enc.pem")))
    attached = data is not None
    sending.secure(env, datetime.now(UTC), timestamp_ttl_s=300, sign=sign, encrypt=encrypt, unique_ids=True,
                   parts=attachments.Attachments([part] if attached else []), sign_parts_attached=attached,
                   encrypt_parts=encrypted and attached)  # fmt: skip
    if not attached:
        return "text/xml; charset=utf-8", env.serialize()
    return _package(env.serialize(), part)


def measure(kind: str, size: str, policies: PolicySet, certs: Path, count: int) -> Row:
    pl = build_pipeline(policies.route(ROWS[kind]), RouteStores())
    assert isinstance(pl, SecuredPipeline)
    pl.credentials.replay = MemoryReplayCache(epoch_ms=0)  # in process: no Redis
    data = os.urandom(SIZES[size])
    bodies = [request(pl.route, certs, data, kind != "signed") for _ in range(count + 1)]
    requests, replies = [], []
    for i, (content_type, body) in enumerate(bodies):
        ex = Exchange(route=pl.route)
        t0 = time.process_time()
        out = pl.request(body, {"content-type": content_type}, ex)
        t1 = time.process_time()
        assert out.body is not None
        # The backend echoes the package, as it got it: the segments the worker wrote to Envoy, joined.
        echo = out.body if isinstance(out.body, bytes) else b"".join(out.body)
        ex.response_type = out.set_headers["content-type"]
        t2 = time.process_time()
        pl.response(echo, ex)
        t3 = time.process_time()
        if i:  # the first is a warm-up: keys parsed, code paths taken once
            requests.append(t1 - t0)
            replies.append(t3 - t2)
    return Row(kind, size, count, statistics.median(requests) * 1e6, statistics.median(replies) * 1e6)


def _dgst_cpu_s(path: str) -> float:
    """The CPU seconds of `openssl dgst -sha256 path` (a child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(["openssl", "dgst", "-sha256", path], check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def floor_sha256_mbps(nbytes: int = FLOOR_BYTES) -> float:
    """`openssl dgst -sha256` over `nbytes` of random data: MB/s per core (the child's CPU time, less that of the
    same command over an empty file: its start, several ms, is no cost of the bytes)."""
    with tempfile.NamedTemporaryFile() as empty, tempfile.NamedTemporaryFile() as f:
        f.write(os.urandom(nbytes))
        f.flush()
        start = min(_dgst_cpu_s(empty.name) for _ in range(3))
        cpu = _dgst_cpu_s(f.name) - start
    return nbytes / max(cpu, 1e-3) / 1e6


def floor_gcm_mbps(seconds: int = 1) -> float:
    """`openssl speed -evp aes-256-gcm` on 16 KB blocks: MB/s (one core)."""
    out = subprocess.run(["openssl", "speed", "-evp", "aes-256-gcm", "-bytes", "16384", "-seconds", str(seconds)],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    found = re.findall(r"([\d.]+)k\s*$", out, re.MULTILINE)
    return float(found[-1]) * 1000 / 1e6


@dataclass
class Floors:
    """OpenSSL's MB/s on this machine, one core: SHA-256 and AES-256-GCM."""

    sha256: float
    gcm: float

    def mbps(self, kind: str) -> float:
        """The floor of a row's kind: the hash alone (signed), or hash and cipher over the same bytes."""
        return self.sha256 if kind == "signed" else 1 / (1 / self.sha256 + 1 / self.gcm)

    def text(self) -> str:
        return f"openssl dgst -sha256 {self.sha256:,.0f} MB/s, openssl speed -evp aes-256-gcm {self.gcm:,.0f} MB/s"


def measure_floors(scale: float = 1.0) -> Floors:
    return Floors(floor_sha256_mbps(max(16 << 20, int(FLOOR_BYTES * min(scale, 1.0)))), floor_gcm_mbps())


def run(policies: PolicySet, certs: Path, scale: float = 1.0) -> list[Row]:
    counts = {s: max(2, round(COUNTS[s] * scale)) for s in SIZES}
    return [measure(k, s, policies, certs, counts[s]) for k in ROWS for s in SIZES]


def report(rows: Sequence[Row], out: TextIO, floors: Floors) -> None:
    print(
        "\nAttachments (SwA profile), in process: a 1 KB envelope and one attachment; median CPU per message and the "
        f"attachment's MB/s per core (floor: {floors.text()})",
        file=out,
    )
    print(f"{'row':17} {'attachment':10} {'request: verify (+decrypt)':30} {'reply: sign (+encrypt)':30} floor MB/s",
          file=out)  # fmt: skip
    for r in rows:
        floor = floors.mbps(r.kind)
        cells = [f"{us / 1000:9.2f} ms {r.mbps(us):8.1f} MB/s ({floor / r.mbps(us):.1f}x)"
                 for us in (r.request_us, r.reply_us)]  # fmt: skip
        print(f"{r.kind:17} {r.size:10} {cells[0]:30} {cells[1]:30} {floor:,.0f}", file=out)
    print("(x: times the floor's cost for the same bytes; the target is at most 2x)", file=out, flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the message counts")
    ap.add_argument("--certs", type=Path, help="a PKI folder (default: a temporary one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = pki.init(args.certs or Path(tmp) / "pki")
        report(run(bench_policies(folder), folder, args.scale), sys.stdout, measure_floors(args.scale))


if __name__ == "__main__":
    main()
