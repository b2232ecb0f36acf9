"""CPU per exchange of hostile message shapes against a plain message of the same size: `python -m loadtest.hostile`.

In-process, like loadtest/optimizations.py: the real pipelines (an `hmac` route taking the symmetric binding,
where a sender needs no credential, and an `xml` route) with the default limits, the demo backend's answer, one
exchange = request + response in time.process_time. The secured shapes are signed by a client whose own limits
are lifted (an attacker's), so a shape the gateway refuses is refused by the gateway, at its cost. Each row:
shape, size, CPU (median), ratio to a plain echo of the same size, and whether the gateway refused it.
Issue #10 class 6: every shape should stay within a small factor of plain."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from filters import faults
from filters.engine import Exchange, RoutePipeline, build_pipeline
from filters.replay import MemoryReplayCache
from gateway import demo_backend
from gateway.client import Client, ClientConfig
from gateway.policy import Limits, Route

DEMO = "urn:wsgate:demo"
SOAP11 = "http://schemas.xmlsoap.org/soap/envelope/"
# An attacker's client: no limits (past what a policy may set, so not validated).
LIFTED = Limits.model_construct(max_body_bytes=10**9, max_depth=256, max_elements=10**9, max_attributes=10**9,
                                max_text_length=10**9, max_namespace_declarations=10**9, max_namespaces_in_scope=10**9)  # fmt: skip


def _texts(size: int) -> str:
    return "".join(f"<d:text>{i:08d}{'x' * 70}</d:text>" for i in range(max(1, size // 96)))


def _nested(levels: int, open_tag: Callable[[int], str], inner: str) -> str:
    return "".join(open_tag(i) for i in range(levels)) + inner + "</d:n>" * levels


def _declarations(n: int, start: int = 0, uri: str = "urn:ns:") -> str:
    return "".join(f' xmlns:p{i}="{uri}{i}"' for i in range(start, start + n))


# Shape -> (attributes of the Envelope, content of d:echo), for a message of about `size` bytes.
Shape = Callable[[int], tuple[str, str]]
SHAPES: dict[str, Shape] = {
    "plain": lambda size: ("", _texts(size)),
    "namespace flood on the Envelope": lambda size: (_declarations(size // 26), "<d:text>x</d:text>"),
    "20 namespaces on the Envelope, plain content": lambda size: (_declarations(20), _texts(size)),
    "60 prefixes, one per level, then content": lambda size: (
        "",
        _nested(60, lambda i: f'<d:n xmlns:q{i}="urn:ns:{i}">', _texts(size)),
    ),
    "20 prefixes, one per level, then content": lambda size: (
        "",
        _nested(20, lambda i: f'<d:n xmlns:q{i}="urn:ns:{i}">', _texts(size)),
    ),
    "one prefix redeclared at 60 levels": lambda size: (
        "",
        _nested(60, lambda i: f'<d:n xmlns:q="urn:ns:{i}">', _texts(size)),
    ),
    "namespace flood on every element": lambda size: (
        "",
        "".join(f"<d:n{_declarations(25)}/>" for _ in range(size // 630)),
    ),
    "attributes in 30 namespaces on every element": lambda size: (
        _declarations(30),
        "".join("<d:n " + " ".join(f'p{i}:a="{i}"' for i in range(30)) + "/>" for _ in range(size // 240)),
    ),
    "long namespace names": lambda size: (
        "",
        "".join(f'<d:n xmlns:q="urn:{"u" * 1000}{i}"/>' for i in range(size // 1030)),
    ),
    "one huge attribute value": lambda size: ("", f'<d:n v="{"v" * size}"/>'),
    "deep nesting at the depth limit, repeated": lambda size: (
        "",
        "".join(_nested(58, lambda i: "<d:n>", "") for _ in range(size // 700)),
    ),
    "the same, with 20 namespaces in scope": lambda size: (
        _declarations(20),
        "".join(_nested(58, lambda i: "<d:n>", "") for _ in range(size // 700)),
    ),
    "30 prefixes on the Envelope, each element using another": lambda size: (
        _declarations(30),
        "".join(f"<p{i % 30}:n/>" for i in range(size // 8)),
    ),
    "the same as deep with 20 namespaces, a listed prefix rebound below": lambda size: (
        _declarations(20),
        "".join(_nested(58, lambda i: "<d:n>", "") for _ in range(size // 700)) + '<d:r xmlns:p0="urn:other"/>',
    ),
    "the same as deep with 20 namespaces, Body changed after signing": lambda size: (
        _declarations(20),
        "".join(_nested(58, lambda i: "<d:n>", "") for _ in range(size // 700)),
    ),
}
# Shapes whose Body is changed after signing: the direct digest fails and xmlsec's verification runs.
TAMPERED = {"the same as deep with 20 namespaces, Body changed after signing"}


def envelope(shape: str, size: int) -> bytes:
    attributes, content = SHAPES[shape](size)
    return (f'<soap:Envelope xmlns:soap="{SOAP11}"{attributes}><soap:Body><d:echo xmlns:d="{DEMO}">{content}'
            "</d:echo></soap:Body></soap:Envelope>").encode()  # fmt: skip


def routes(certs: Path) -> dict[str, Route]:
    hmac = Route.model_validate({
        "name": "hmac", "match": {"path_prefix": "/hmac/"}, "upstream": {"address": "127.0.0.1:1"}, "profile": "hmac",
        "signature": {"algorithms": ["hmac-sha256"], "digests": ["sha256"], "parts": ["body", "timestamp"]},
        "hmac": {"keys_file": str(certs / "hmac-keys.yaml"), "allow_anonymous": True,
                 "decryption_key": str(certs / "gateway-enc.key")},
        "replay": {"store": "memory"},
    })  # fmt: skip
    xml = Route.model_validate(
        {"name": "xml", "match": {"path_prefix": "/xml/"}, "upstream": {"address": "127.0.0.1:1"}, "profile": "xml"}
    )
    return {"hmac": hmac, "xml": xml}


def exchange(pipeline: RoutePipeline, body: bytes) -> bool:
    """One exchange; False when the gateway refused the request (or the response)."""
    ex = Exchange(route=pipeline.route)
    try:
        forwarded = pipeline.request(body, {}, ex).body
        _, _, answer = demo_backend.handle_soap(body if forwarded is None else forwarded, "text/xml")
        pipeline.response(answer, ex)
    except faults.Fault:
        return False
    return True


def measure(pipeline: RoutePipeline, messages: list[bytes]) -> tuple[float, bool]:
    """Median CPU seconds per exchange, and whether the gateway accepted the messages."""
    samples, accepted = [], True
    for body in messages:
        t0 = time.process_time()
        accepted = exchange(pipeline, body)
        samples.append(time.process_time() - t0)
    return statistics.median(samples), accepted


def rows(certs: Path, size: int, count: int) -> list[tuple[str, str, int, float, float, bool]]:
    """(profile, shape, bytes, CPU us, ratio to plain of the same size, accepted)."""
    out = []
    for profile, route in routes(certs).items():
        pipeline = build_pipeline(route)
        if profile == "xml":
            secure: Callable[[bytes], bytes] = lambda body: body  # noqa: E731
        else:
            pipeline.credentials.replay = MemoryReplayCache()  # type: ignore[attr-defined]
            attacker = Client(route.model_copy(update={"limits": LIFTED, "response_limits": LIFTED}),
                              ClientConfig(certs=certs))  # fmt: skip
            secure = lambda body, client=attacker: client.secure(body)[0]  # noqa: E731
        exchange(pipeline, secure(envelope("plain", 1000)))  # warm-up
        for shape in SHAPES:
            messages = [secure(envelope(shape, size)) for _ in range(count)]
            if shape in TAMPERED:
                messages = [m.replace(b"</d:echo>", b"<d:x/></d:echo>") for m in messages]
            length = len(messages[0])
            plain = [secure(envelope("plain", length - (len(envelope("plain", 0)) - 96))) for _ in range(count)]
            plain_cpu, _ = measure(pipeline, plain)
            cpu, accepted = measure(pipeline, messages)
            out.append((profile, shape, length, cpu * 1e6, cpu / plain_cpu, accepted))
    return out


def print_table(table: list[tuple[str, str, int, float, float, bool]], out: TextIO) -> None:
    out.write("| route | shape | size | CPU per exchange | vs plain of the same size | gateway |\n")
    out.write("|---|---|---:|---:|---:|---|\n")
    for profile, shape, length, us, ratio, accepted in table:
        verdict = "accepted" if accepted else "refused"
        out.write(f"| {profile} | {shape} | {length / 1024:.0f} KB | {us / 1000:.2f} ms | {ratio:.2f}x | {verdict} |\n")


def main(argv: list[str] | None = None, out: TextIO = sys.stdout) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.hostile", description=__doc__.splitlines()[0])
    parser.add_argument("--certs", type=Path, default=Path("certs/out"), help="the demo PKI (wsgate certs init)")
    parser.add_argument("--size", type=int, default=250_000, help="bytes per message (about)")
    parser.add_argument("--count", type=int, default=5, help="messages per shape (the median is kept)")
    args = parser.parse_args(argv)
    print_table(rows(args.certs, args.size, args.count), out)


if __name__ == "__main__":
    main()
