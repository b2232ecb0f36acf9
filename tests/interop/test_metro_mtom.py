"""An MTOM client we did not write: Eclipse Metro 4.0.4's JAX-WS with MTOMFeature (tests/interop/metro,
Mtom.java) sends the demo echo with its octets as an XOP attachment, SOAP 1.1 and 1.2, through the gateway to the
demo backend (an MTOM service: it answers the root part and sends the attachment back), on an `xml` route (the
root part checked, the package passed on) and on a `tls` route; Metro reads the reply's package itself."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.harness import clear, received, running_gateway
from tests.support.metro import Metro

DATA = os.urandom(300_000) + b"\r\n--uuid:not-a-boundary\r\n"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[Any]:
    routes = [
        {"name": "mtom", "match": {"path_prefix": "/mtom/"}, "upstream": {"address": "BACKEND"}, "profile": "xml",
         "attachments": {"accept": True}},
        {"name": "tls", "match": {"path_prefix": "/tls/"}, "upstream": {"address": "BACKEND"}, "profile": "tls"},
    ]  # fmt: skip
    with running_gateway(tmp_path_factory.mktemp("metro-mtom"), routes, pki) as g:
        yield g


@pytest.mark.parametrize("soap12", [False, True], ids=["soap11", "soap12"])
def test_metro_sends_mtom_through_an_xml_route_and_reads_the_mtom_reply(metro: Metro, gw: Any, soap12: bool) -> None:
    clear(gw)
    assert metro.mtom_echo(f"http://127.0.0.1:{gw.opts.http_port}/mtom/demo", DATA, soap12=soap12) == DATA
    (got,) = received(gw)
    content_type = got["headers"]["content-type"]
    # Metro sent MTOM indeed (not base64 in the Body), and the backend got its package as Metro wrote it.
    assert content_type.startswith("multipart/related") and 'type="application/xop+xml"' in content_type
    assert "http://www.w3.org/2004/08/xop/include" in got["body"] and len(DATA) < got["length"] < len(DATA) + 4096


def test_metro_sends_mtom_through_a_tls_route(metro: Metro, gw: Any, pki: Path) -> None:
    clear(gw)
    url = f"https://127.0.0.1:{gw.opts.https_port}/tls/demo"
    assert metro.mtom_echo(url, DATA, tls_trust=[str(pki / "ca.pem")]) == DATA
    assert received(gw)[0]["headers"]["content-type"].startswith("multipart/related")
