"""A filter worker's peak memory for one large attachment (issue 21 item 5): a 50 MB MTOM request through the
gateway (real Envoy, one worker, the demo backend, which sends the package back) on an `xml` route (the package
passes untouched both ways) and an `rsa` route (the root part verified, the reply's root signed, the package
serialized anew both ways). The `rsa` request is SwA (its root names the part by a `cid:` text): a signature over
MTOM covers the XOP infoset, which the gateway expands as base64 into the tree (docs/attachments.md), a cost of
signed MTOM content, not of passing a package through. Prints the worker's resident memory when idle and at its peak, and the peak's growth
as a multiple of the attachment.

    python -m loadtest.attachment_memory                 # 50 MB
    python -m loadtest.attachment_memory --size-mb 20"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import requests
import yaml

from certs import pki
from gateway.policy import Route
from gateway.tools.client import Client, ClientConfig
from loadtest.bench_gateway import bench_gateway
from loadtest.large import MIB, Probe

XOP = "http://www.w3.org/2004/08/xop/include"
BOUNDARY = "uuid:attachment-memory"
ENVELOPE = (
    '<soap:Envelope xmlns:soap="http://schemas.xmlsoap.org/soap/envelope/"><soap:Body><d:echo xmlns:d="urn:wsgate:demo">'
    "<d:text>{}</d:text></d:echo></soap:Body></soap:Envelope>"
)
ROOT = ENVELOPE.format(f'<xop:Include xmlns:xop="{XOP}" href="cid:doc@memory"/>').encode()
SWA_ROOT = ENVELOPE.format("cid:doc@memory").encode()


def _routes(certs: Path, limit: int) -> list[dict]:
    common = {
        "upstream": {"address": "${BACKEND_ADDR:-127.0.0.1:8081}"},
        "limits": {"max_body_bytes": limit},
        "response_limits": {"max_body_bytes": limit},
        "attachments": {"accept": True, "max_part_bytes": limit},
    }
    rsa = {"trust_anchors": [str(certs / "ca.pem")], "key": str(certs / "gateway-sign.key"),
           "certificate": str(certs / "gateway-sign.pem"), "decryption_key": str(certs / "gateway-enc.key")}  # fmt: skip
    return [
        {"name": "xml", "match": {"path_prefix": "/xml/"}, "profile": "xml", **common},
        {"name": "rsa", "match": {"path_prefix": "/rsa/"}, "profile": "rsa", "rsa": rsa,
         "replay": {"store": "auto"}, **common},
    ]  # fmt: skip


def mtom(root: bytes, attachment: bytes, xop: bool = True) -> tuple[str, bytes]:
    dash = f"--{BOUNDARY}".encode()
    root_type = b'application/xop+xml; charset=UTF-8; type="text/xml"' if xop else b"text/xml; charset=UTF-8"
    body = b"".join([
        dash, b"\r\nContent-Type: " + root_type + b"\r\nContent-ID: <root@memory>\r\n\r\n",
        root, b"\r\n", dash, b"\r\nContent-Type: application/octet-stream\r\nContent-Transfer-Encoding: binary\r\n"
        b"Content-ID: <doc@memory>\r\n\r\n", attachment, b"\r\n", dash, b"--\r\n",
    ])  # fmt: skip
    if not xop:
        return f'multipart/related; type="text/xml"; boundary="{BOUNDARY}"; start="<root@memory>"', body
    content_type = f'multipart/related; type="application/xop+xml"; boundary="{BOUNDARY}"; start="<root@memory>"; start-info="text/xml"'
    return content_type, body


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.attachment_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=50.0)
    ap.add_argument("--certs", type=Path, default=pki.DEFAULT_DIR)
    args = ap.parse_args(argv)
    size = int(args.size_mb * 1_000_000)
    limit = 64 * MIB  # gateway/policy.py MAX_BODY_BYTES: the most a route may take
    certs = pki.init(args.certs)
    attachment = os.urandom(size)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        policies = run / "policies"
        policies.mkdir()
        routes = _routes(certs, limit)
        (policies / "attachments.yaml").write_text(yaml.safe_dump({"routes": routes}))
        print(f"{'route':>5} {'attachment MB':>14} {'idle MiB':>9} {'peak MiB':>9} {'growth MiB':>11} {'x size':>7}")
        rsa_route = Route.model_validate({**routes[1], "upstream": {"address": "127.0.0.1:1"}})
        rsa_client = Client(rsa_route, ClientConfig(certs=certs))
        with bench_gateway(policies, certs, run / "run", 1, body_budget_mb=2 * limit // MIB) as gw:
            for name in ("xml", "rsa"):

                def root() -> bytes:  # a fresh signature each time: the second would be a replay
                    return rsa_client.secure(SWA_ROOT)[0] if name == "rsa" else ROOT  # noqa: B023

                url = f"http://127.0.0.1:{gw.opts.http_port}/{name}/demo"
                content_type, warm_up = mtom(root(), b"warm-up", xop=name == "xml")
                requests.post(url, data=warm_up, headers={"content-type": content_type}, timeout=60).raise_for_status()
                content_type, body = mtom(root(), attachment, xop=name == "xml")
                probe = Probe(gw)
                time.sleep(0.5)
                idle = probe.now().workers
                with probe.peak() as peak_now:
                    r = requests.post(url, data=body, headers={"content-type": content_type}, timeout=300)
                    peak = peak_now().workers
                if r.status_code != 200 or attachment not in r.content:
                    print(f"{name}: HTTP {r.status_code}: {r.content[:300]!r}")
                    return 1
                growth = peak - idle
                print(
                    f"{name:>5} {size / 1e6:>14.0f} {idle:>9.0f} {peak:>9.0f} {growth:>11.0f} {growth * MIB / size:>7.2f}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
