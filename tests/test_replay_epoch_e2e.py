"""Fail closed across a store's loss of memory, through the running gateway: the supervisor's Redis (no
persistence) killed and restarted must not reopen the replay window (filters/engine/wss/replay.py: the replay epoch), nor let
a cancelled SecureConversation context back in."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.tools.client import Client, ClientConfig, ClientError
from tests.harness import clear, fault_code, received, running_gateway
from tests.test_secure_conversation_e2e import call, client_of, sc_route
from tests.test_wssecurity_e2e import route_of, send
from tests.wss_helpers import echo, route_doc


def _restart_redis(g) -> None:
    assert g.redis is not None
    g.redis.kill()
    g.redis.wait()
    g.supervise_once()  # the supervisor starts a new, empty Redis


@pytest.mark.parametrize("profile", ["hmac", "rsa"])
def test_a_message_accepted_before_a_redis_loss_is_not_accepted_again_after_it(
    tmp_path: Path, pki: Path, profile: str
) -> None:
    routes = [route_doc(pki, profile, name=profile, replay={"store": "auto"})]
    with running_gateway(tmp_path, routes, pki, workers=2) as g:
        client = Client(route_of(g, profile), ClientConfig(certs=pki, key_name="demo-client"))
        accepted, _ = client.secure(echo("pay 10"))
        in_flight, _ = client.secure(echo("pay 20"))  # signed before the loss, never seen by the gateway
        assert send(g, profile, accepted).status_code == 200
        _restart_redis(g)
        clear(g)
        for body in (accepted, in_flight):  # what it saw, and what it may not have seen either
            resp = send(g, profile, body)
            assert resp.status_code == 500 and fault_code(resp) == "MessageExpired"
        assert send(g, profile, accepted).status_code == 500  # the other worker: a replay again, either way
        assert received(g) == []
        assert send(g, profile, client.secure(echo("pay 30"))[0]).status_code == 200  # signed after: passes


def test_a_cancelled_sealed_context_stays_cancelled_across_a_redis_loss(tmp_path: Path, pki: Path) -> None:
    # Sealed contexts carry themselves; only their cancellations are kept, in Redis. A new, empty Redis must not
    # let a cancelled context back in: contexts issued before its epoch are refused (clients issue new ones).
    route = {**sc_route(pki, "sealed", "sealed"), "replay": {"store": "auto"}}  # both in the supervisor's Redis
    with running_gateway(tmp_path, [route], pki, workers=2) as g:
        client, post = client_of(g, pki, "sealed")
        cancelled = client.establish(post)
        assert call(client, post, "in context") == "in context"
        client.cancel(post)
        client.context = cancelled
        with pytest.raises(ClientError, match="BadContextToken"):
            call(client, post, "after cancel")
        _restart_redis(g)
        for _ in range(2):  # either worker
            with pytest.raises(ClientError, match="BadContextToken"):
                call(client, post, "after cancel and a Redis loss")
        client.establish(post)
        assert call(client, post, "new context") == "new context"
