"""A slow partner must not stall the worker: while one exchange's engine call waits on the network (an outbound
`secureconversation` route's Issue to a partner STS, an `rsa` route's OCSP lookup, each to a listener that accepts
and never answers), the worker's other exchanges are answered (filters/frame/src/threads.rs,
filters/engine/turn.py). One worker, so both exchanges reach the same one.

The order is what is asserted, not a duration: the plain request is answered while the silent connection is still
held open by the gateway, i.e. before the gateway's timeout for that partner (2 s) ends the waiting call."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from gateway.control.ports import free_ports
from tests.support.harness import GatewayFactory, LiveGateway
from tests.support.partner import post
from tests.support.wss_helpers import echo, route_doc


class SilentPartner:
    """A TCP listener on loopback that takes the gateway's connection and never answers (not TLS, not HTTP):
    `called` once a connection came, `gave_up` once the gateway closed it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.called, self.gave_up = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        self.called.set()
        with conn:
            while conn.recv(4096):  # the ClientHello; b"" when the gateway closes
                pass
        self.gave_up.set()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def silent() -> Iterator[SilentPartner]:
    partner = SilentPartner()
    yield partner
    partner.close()


def answered_meanwhile(gw: LiveGateway, silent: SilentPartner, waiting_call: Callable[[], int]) -> list[int]:
    """Start `waiting_call` (an exchange whose engine call calls `silent`); once it waits there, a plain exchange on
    the worker's `xml` route must be answered while the silent connection is still open. The waiting exchange's
    status, once it ended."""
    assert gw.post("xml", echo("warm")).status_code == 200
    waiting: list[int] = []
    caller = threading.Thread(target=lambda: waiting.append(waiting_call()))
    caller.start()
    assert silent.called.wait(10), "the exchange never called the silent partner"
    resp = gw.post("xml", echo("meanwhile"))
    # Answered while the engine call still waits (the connection is open, the caller has no answer).
    assert not silent.gave_up.is_set() and not waiting, "the plain exchange waited for the partner's timeout"
    assert resp.status_code == 200 and b"meanwhile" in resp.content
    caller.join(20)
    assert silent.gave_up.is_set()
    return waiting


def test_slow_partner_sts_stalls_no_other_exchange_of_the_worker(
    gateway: GatewayFactory, pki: Path, silent: SilentPartner
) -> None:
    listen = f"127.0.0.1:{free_ports(1)[0]}"
    outbound = route_doc(pki, "secureconversation", name="sc")
    outbound["direction"] = "outbound"
    outbound["upstream"] = {"address": f"127.0.0.1:{silent.port}", "tls": True, "ca": str(pki / "ca.pem")}
    outbound["outbound"] = {"listen": listen, "partner_certificate": str(pki / "gateway-enc.pem")}
    gw = gateway([outbound, route_doc(pki, "xml", name="xml")], workers=1)
    waiting = answered_meanwhile(gw, silent, lambda: post(listen, "/sc/echo", echo("to the partner")).status_code)
    assert waiting == [500]  # no context from the partner: the exchange itself fails closed at the STS timeout


def test_slow_ocsp_responder_stalls_no_other_exchange_of_the_worker(
    gateway: GatewayFactory, pki: Path, silent: SilentPartner
) -> None:
    revocation = {"mode": "ocsp", "ocsp_responder": f"http://127.0.0.1:{silent.port}/", "timeout_s": 2}
    signed = route_doc(pki, "rsa", name="rsa", rsa={"revocation": revocation})
    gw = gateway([signed, route_doc(pki, "xml", name="xml")], workers=1)
    client = gw.client("rsa")

    def signed_call() -> int:
        secured, pending = client.secure(echo("signed"))
        return requests.post(gw.url("rsa"), data=secured, headers={"content-type": pending.content_type}).status_code

    assert answered_meanwhile(gw, silent, signed_call) == [500]  # no status for the signer: refused (fail closed)
