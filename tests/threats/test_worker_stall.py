"""A slow partner must not stall the worker: while one exchange's engine call waits on the network (here an outbound
`secureconversation` route's Issue to a partner STS that accepts and never answers), the worker's other exchanges
are answered (filters/frame/src/threads.rs, filters/engine/turn.py). One worker, so both reach the same one.

The order is what is asserted, not a duration: the plain request is answered while the STS connection is still
held open by the gateway, i.e. before the gateway's STS timeout (2 s) ends the waiting call."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from gateway.control.supervisor import free_ports
from tests.support.harness import GatewayFactory
from tests.support.partner import post
from tests.support.wss_helpers import echo, route_doc


class SilentSts:
    """A TCP listener on loopback that takes the gateway's connection and never answers (not even TLS): `called`
    once a connection came, `gave_up` once the gateway closed it."""

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
def silent_sts() -> Iterator[SilentSts]:
    sts = SilentSts()
    yield sts
    sts.close()


def test_slow_partner_sts_stalls_no_other_exchange_of_the_worker(
    gateway: GatewayFactory, pki: Path, silent_sts: SilentSts
) -> None:
    listen = f"127.0.0.1:{free_ports(1)[0]}"
    outbound = route_doc(pki, "secureconversation", name="sc")
    outbound["direction"] = "outbound"
    outbound["upstream"] = {"address": f"127.0.0.1:{silent_sts.port}", "tls": True, "ca": str(pki / "ca.pem")}
    outbound["outbound"] = {"listen": listen, "partner_certificate": str(pki / "gateway-enc.pem")}
    gw = gateway([outbound, route_doc(pki, "xml", name="xml")], workers=1)
    assert gw.post("xml", echo("warm")).status_code == 200

    waiting: list[requests.Response] = []
    caller = threading.Thread(target=lambda: waiting.append(post(listen, "/sc/echo", echo("to the partner"))))
    caller.start()
    assert silent_sts.called.wait(10), "the outbound exchange never called the partner's STS"
    resp = gw.post("xml", echo("meanwhile"))
    # Answered while the engine call still waits on the STS (the connection is open, the caller has no answer).
    assert not silent_sts.gave_up.is_set() and not waiting, "the plain exchange waited for the STS to time out"
    assert resp.status_code == 200 and b"meanwhile" in resp.content
    caller.join(20)
    # The waiting exchange itself fails closed once the STS times out: no context, a generic fault.
    assert [r.status_code for r in waiting] == [500]
    assert silent_sts.gave_up.is_set()
