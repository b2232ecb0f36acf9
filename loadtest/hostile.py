"""The gateway's CPU on hostile message shapes against plain messages of the same size: `python -m loadtest.hostile`.

In-process, like loadtest/optimizations.py: the real pipelines (an `hmac` route taking the symmetric binding,
where a sender needs no credential, an `xml` route, and an `xml-schema` route validating both ways against
loadtest/hostile-schema.xsd, whose shapes aim at backtracking matching) with the default limits. The secured shapes are signed by
a client whose own limits are lifted (an attacker's), so a shape the gateway refuses is refused by the gateway, at
its cost. Each shape is measured twice: sent by a client (the demo backend echoes it) and, "from the backend", as
a backend's answer to a small plain request.

What is measured: the gateway's CPU (time.process_time, plus the schema validator's child process) on the
request and on the response, not the backend's.
The reference is the gateway's CPU on a plain request of the same size as the request plus a plain answer of the
same size as the response (the bytes the backend returned), so each direction is set against plain traffic of
its own size; a refused request is set against the plain request alone. Each row: route, shape, sizes (request +
response), the gateway's CPU per exchange (the median of --count), the ratio to plain, and whether the gateway
refused the request or the response. Issue #10 class 6: every shape should stay within a small factor of plain."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TextIO

from filters.engine import faults
from filters.engine.engine import Exchange, RoutePipeline, build_pipeline
from filters.stores.factory import RouteStores
from filters.stores.replay import MemoryReplayCache
from gateway.policy import Limits, Route
from gateway.tools import demo_backend
from gateway.tools.client import Client, ClientConfig

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
# The `xml-schema` route (loadtest/hostile-schema.xsd): a value or element every 100 bytes or so that makes
# libxml2's matching backtrack, each up to its own limit without the CPU budget (filters/engine/cpu_budget.py).
SCHEMA_SHAPES: dict[str, Shape] = {
    "plain": SHAPES["plain"],
    "ambiguous alternation pattern (aa or a, repeated), a value per 100 bytes": lambda size: (
        "", "".join(f"<d:id>{'a' * 80}b</d:id>" for _ in range(max(1, size // 96)))),
    "nested counters pattern (a counted word, repeated), a value per 100 bytes": lambda size: (
        "", "".join(f"<d:words>{'a' * 75}!</d:words>" for _ in range(max(1, size // 96)))),
    "repeated sequence of a repeated element, 40 per content": lambda size: (
        "", "".join(f"<d:runs>{'<d:n/>' * 40}<d:z/></d:runs>" for _ in range(max(1, size // 260)))),
}  # fmt: skip
SCHEMA_XSD = Path(__file__).with_name("hostile-schema.xsd")


def envelope(shape: str, size: int) -> bytes:
    attributes, content = {**SHAPES, **SCHEMA_SHAPES}[shape](size)
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
    schema = Route.model_validate(
        {"name": "xml-schema", "match": {"path_prefix": "/xml-schema/"}, "upstream": {"address": "127.0.0.1:1"},
         "profile": "xml", "schema_validation": {"requests": True, "responses": True, "xsd_files": [str(SCHEMA_XSD)]}}
    )  # fmt: skip
    return {"hmac": hmac, "xml": xml, "xml-schema": schema}


def _cpu(pipeline: RoutePipeline) -> float:
    """The gateway's CPU: this process's, and its schema validator's (a child process: filters/engine/cpu_budget.py)."""
    return time.process_time() + (
        pipeline.schema.bounded.cpu_seconds() if pipeline.schema and pipeline.schema.bounded else 0.0
    )


class Cost(NamedTuple):
    """The gateway's CPU seconds on one exchange, per direction, and the bytes it handled."""

    request: float
    response: float  # 0 when the request was refused
    request_bytes: int
    response_bytes: int  # what the backend returned; 0 when the request was refused
    accepted: bool  # False when the gateway refused the request or the response


def exchange(pipeline: RoutePipeline, body: bytes, answer: bytes | None = None) -> Cost:
    """One exchange, the demo backend answering (or `answer`: a backend sending that body); only the gateway's
    request and response processing is timed, not the backend's."""
    ex = Exchange(route=pipeline.route)
    t0 = _cpu(pipeline)
    try:
        forwarded = pipeline.request(body, {}, ex).body
    except faults.Fault:
        return Cost(_cpu(pipeline) - t0, 0.0, len(body), 0, False)
    request = _cpu(pipeline) - t0
    if answer is None:
        _, _, answer = demo_backend.handle_soap(body if forwarded is None else forwarded, "text/xml")
    t0 = _cpu(pipeline)
    try:
        pipeline.response(answer, ex)
    except faults.Fault:
        return Cost(request, _cpu(pipeline) - t0, len(body), len(answer), False)
    return Cost(request, _cpu(pipeline) - t0, len(body), len(answer), True)


def measure(pipeline: RoutePipeline, messages: list[bytes], answer: bytes | None = None) -> Cost:
    """The median exchange (by the gateway's CPU) of `messages`."""
    costs = sorted((exchange(pipeline, body, answer) for body in messages), key=lambda c: c.request + c.response)
    return costs[len(costs) // 2]


Row = tuple[str, str, Cost, float]  # (route, shape, the gateway's cost, ratio to plain of the same sizes)


def rows(certs: Path, size: int, count: int, only: list[str] | None = None) -> list[Row]:
    out = []
    for profile, route in routes(certs).items():
        if only and profile not in only:
            continue
        pipeline = build_pipeline(route, RouteStores())
        if route.profile == "xml":
            secure: Callable[[bytes], bytes] = lambda body: body  # noqa: E731
        else:
            pipeline.credentials.replay = MemoryReplayCache(epoch_ms=0)  # type: ignore[attr-defined]
            attacker = Client(route.model_copy(update={"limits": LIFTED, "response_limits": LIFTED}),
                              ClientConfig(certs=certs))  # fmt: skip
            secure = lambda body, client=attacker: client.secure(body)[0]  # noqa: E731
        exchange(pipeline, secure(envelope("plain", 1000)))  # warm-up
        shapes = SCHEMA_SHAPES if profile == "xml-schema" else SHAPES
        for shape in shapes:
            messages = [secure(envelope(shape, size)) for _ in range(count)]
            if shape in TAMPERED:
                messages = [m.replace(b"</d:echo>", b"<d:x/></d:echo>") for m in messages]
            cost = measure(pipeline, messages)
            out.append((profile, shape, cost, (cost.request + cost.response) / plain(pipeline, secure, count, cost)))
        for shape in [s for s in shapes if s not in TAMPERED]:
            small = [secure(envelope("plain", 1000)) for _ in range(count)]
            cost = measure(pipeline, small, answer_to(envelope(shape, size)))
            ratio = (cost.request + cost.response) / plain(pipeline, secure, count, cost)
            out.append((profile, f"{shape}, from the backend", cost, ratio))
    return out


def plain(pipeline: RoutePipeline, secure: Callable[[bytes], bytes], count: int, like: Cost) -> float:
    """The gateway's CPU on a plain request of `like`'s request size, and on a plain answer of its response size
    (when it had one)."""
    empty = envelope("plain", 0)
    overhead = len(empty) - 96  # an envelope's bytes around its text rows
    secured = overhead + len(secure(empty)) - len(empty)  # and, on a secured route, the security header's
    messages = [secure(envelope("plain", like.request_bytes - secured)) for _ in range(count)]
    request = measure(pipeline, messages).request
    if not like.response_bytes:
        return request
    answer = answer_to(envelope("plain", like.response_bytes - overhead))
    small = [secure(envelope("plain", 1000)) for _ in range(count)]
    return request + measure(pipeline, small, answer).response


def answer_to(request: bytes) -> bytes:
    """What an echo answers, without the backend's copy: the same envelope, the operation renamed."""
    return request.replace(b"<d:echo ", b"<d:echoResponse ").replace(b"</d:echo>", b"</d:echoResponse>")


def print_table(table: list[Row], out: TextIO) -> None:
    out.write("| route | shape | size | CPU per exchange | vs plain of the same size | gateway |\n")
    out.write("|---|---|---:|---:|---:|---|\n")
    for profile, shape, cost, ratio in table:
        verdict = "accepted" if cost.accepted else "refused"
        size = f"{cost.request_bytes / 1024:.0f} KB" + (
            f" + {cost.response_bytes / 1024:.0f} KB" if cost.response_bytes else ""
        )
        cpu = (cost.request + cost.response) * 1000
        out.write(f"| {profile} | {shape} | {size} | {cpu:.2f} ms | {ratio:.2f}x | {verdict} |\n")


def main(argv: list[str] | None = None, out: TextIO = sys.stdout) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.hostile", description=__doc__.splitlines()[0])
    parser.add_argument("--certs", type=Path, default=Path("certs/out"), help="the demo PKI (wsgate certs init)")
    parser.add_argument("--size", type=int, default=250_000, help="bytes per message (about)")
    parser.add_argument("--count", type=int, default=5, help="messages per shape (the median is kept)")
    parser.add_argument("--routes", help="comma-separated: hmac, xml, xml-schema (default: all)")
    args = parser.parse_args(argv)
    print_table(rows(args.certs, args.size, args.count, args.routes.split(",") if args.routes else None), out)


if __name__ == "__main__":
    main()
