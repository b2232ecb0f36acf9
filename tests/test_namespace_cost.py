"""Namespace cost (issue #10 class 6): a PrefixList costs what a plain exclusive C14N costs where it can, and is
refused where the slow ways (libxml2's list lookups, xmlsec's node set) would cost several plain messages.

Real keys (session PKI), the gateway's hmac pipeline as loadtest/hostile.py builds it, an attacker's client with
no limits of its own."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from lxml import etree

from filters.engine import faults
from filters.engine.engine import build_pipeline
from filters.engine.xml import c14n
from filters.stores.factory import RouteStores
from filters.stores.replay import MemoryReplayCache
from gateway.tools.client import Client, ClientConfig
from loadtest import hostile


def _slow(el: etree._Element, prefixes: list[str]) -> bytes:
    alone = etree.fromstring(c14n.received_form(el))
    return etree.tostring(alone, method="c14n", exclusive=True, inclusive_ns_prefixes=prefixes)


def _random_document(rng: random.Random) -> tuple[str, list[str]]:
    prefixes = [f"p{i}" for i in range(6)]
    uris = [f"urn:u{i}" for i in range(4)]  # fewer than prefixes: some share a namespace

    def decls(n: int) -> str:
        return "".join(f' xmlns:{p}="{rng.choice(uris)}"' for p in rng.sample(prefixes, n))

    def element(depth: int, scope: set[str]) -> str:
        own = decls(rng.choice([0, 0, 0, 1, 2]))
        declared = {d.split("=")[0].split(":")[1] for d in own.split()}
        visible = scope | declared
        name = f"{rng.choice(sorted(visible))}:e" if visible and rng.random() < 0.7 else "s:e"
        attrs = "".join(f' {p}:a{i}="{i}"' for i, p in enumerate(sorted(visible)) if rng.random() < 0.2)
        kids = "".join(element(depth + 1, visible) for _ in range(rng.randint(0, 3))) if depth < 4 else "t"
        return f"<{name}{own}{attrs}>{kids}</{name}>"

    top = ' xmlns:s="urn:s"' + "".join(f' xmlns:{p}="{rng.choice(uris)}"' for p in prefixes if rng.random() < 0.6)
    scope = {d.split("=")[0].split(":")[1] for d in top.split()} - {"s"}
    listed = rng.sample([*prefixes, "s", "xml", "zz"], rng.randint(1, 5))
    return f"<s:Envelope{top}><s:Body>{element(0, scope)}</s:Body></s:Envelope>", listed


def test_prefix_list_canonical_form_is_libxml2s_byte_for_byte() -> None:
    """The marker way must give libxml2's exact bytes: shared namespaces, rebound prefixes, listed prefixes used
    below the apex, on attributes, undeclared or 'xml'."""
    rng = random.Random(10)
    for _ in range(400):
        doc, listed = _random_document(rng)
        body = etree.fromstring(doc)[0]
        assert c14n.canonical(body, listed) == _slow(body, listed), (doc, listed)


def test_a_long_prefix_list_never_reaches_libxml2s_per_element_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """30 listed prefixes in scope over 20,000 elements: libxml2 looks every listed prefix up again at every element
    (20 times a plain C14N; `python -m loadtest.hostile` measures it). The marker way canonicalizes without a list
    and gives the same bytes."""
    decls = "".join(f' xmlns:p{i}="urn:ns:{i}"' for i in range(30))
    body = etree.fromstring(f'<s:E xmlns:s="urn:s"{decls}><s:B xmlns:d="urn:d">{"<d:n/>" * 20000}</s:B></s:E>')[0]
    listed = [f"p{i}" for i in range(30)]
    expected = _slow(body, listed)
    lists: list[object] = []
    tostring = etree.tostring

    def watched(*args: object, **kwargs: object) -> bytes:
        lists.append(kwargs.get("inclusive_ns_prefixes"))
        return tostring(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(c14n.etree, "tostring", watched)
    assert c14n.canonical(body, listed) == expected
    assert lists and not any(lists)  # every canonicalization ran without a PrefixList


@pytest.fixture(scope="module")
def hmac_route(pki: Path):  # type: ignore[no-untyped-def]
    route = hostile.routes(pki)["hmac"]
    pipeline = build_pipeline(route, RouteStores())
    pipeline.credentials.replay = MemoryReplayCache()  # type: ignore[attr-defined]
    attacker = Client(route.model_copy(update={"limits": hostile.LIFTED, "response_limits": hostile.LIFTED}),
                      ClientConfig(certs=pki))  # fmt: skip
    return pipeline, attacker


def _request(hmac_route, body: bytes) -> None:  # type: ignore[no-untyped-def]
    from filters.engine.engine import Exchange

    pipeline, _ = hmac_route
    pipeline.request(body, {}, Exchange(route=pipeline.route))


@pytest.mark.parametrize(
    "shape", ["the same as deep with 20 namespaces, a listed prefix rebound below",
              "the same as deep with 20 namespaces, Body changed after signing"],
)  # fmt: skip
def test_an_element_dense_body_under_a_long_prefix_list_is_refused_on_the_slow_paths(hmac_route, shape: str) -> None:  # type: ignore[no-untyped-def]
    _, attacker = hmac_route
    signed = attacker.secure(hostile.envelope(shape, 60_000))[0]
    if shape in hostile.TAMPERED:
        signed = signed.replace(b"</d:echo>", b"<d:x/></d:echo>")
    with pytest.raises(faults.Fault) as refused:
        _request(hmac_route, signed)
    assert "PrefixList" in refused.value.reason


@pytest.mark.parametrize("rebound", [False, True])
def test_a_large_message_with_fifteen_namespaces_in_scope_still_passes(hmac_route, rebound: bool) -> None:  # type: ignore[no-untyped-def]
    """1 MB under 15 Envelope namespaces (the signer lists them all): element-dense rows the marker way; text
    rows (an element per 96 bytes, as loadtest/messages.py) where a listed prefix rebound below takes libxml2's."""
    _, attacker = hmac_route
    decls = "".join(f' xmlns:p{i}="urn:ns:{i}"' for i in range(15))
    if rebound:
        rows = hostile._texts(1_050_000) + '<d:r xmlns:p0="urn:other"/>'
    else:
        rows = "".join(f"<d:row><d:id>{i}</d:id><d:name>{'n' * 40}</d:name></d:row>" for i in range(12_000))
    plain = (f'<soap:Envelope xmlns:soap="{hostile.SOAP11}"{decls}><soap:Body><d:echo xmlns:d="{hostile.DEMO}">'
             f"{rows}</d:echo></soap:Body></soap:Envelope>").encode()  # fmt: skip
    assert len(plain) > 1_000_000
    _request(hmac_route, attacker.secure(plain)[0])
