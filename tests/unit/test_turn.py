"""The engine's turn (filters/engine/turn.py): engine calls from several threads compute one at a time; a call
gives the turn up only while it waits, and takes it back before it goes on."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from filters.engine import turn
from filters.worker import waits_on_network
from gateway.policy import RevocationPolicy, load_dir
from loadtest import outbound
from loadtest.optimizations import BENCH_POLICIES


def test_calls_never_compute_at_once_whatever_threads_make_them() -> None:
    inside, overlaps = [0], []

    def call() -> None:
        for _ in range(200):
            with turn.held():
                inside[0] += 1
                overlaps.append(inside[0])
                threading.Event().wait(0.0001)  # a switch point: another thread would run here without the turn
                inside[0] -= 1

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(overlaps) == 800 and set(overlaps) == {1}


def test_a_call_waiting_on_the_network_lets_another_compute_then_goes_on_with_the_turn() -> None:
    waiting, answered, order = threading.Event(), threading.Event(), []

    def slow_call() -> None:
        with turn.held():
            with turn.released():
                waiting.set()
                assert answered.wait(10)  # the partner answers only once the other call is done
            order.append("slow call goes on")

    slow = threading.Thread(target=slow_call)
    slow.start()
    assert waiting.wait(10)
    with turn.held():  # would wait forever if the waiting call kept the turn
        order.append("other call")
        answered.set()
        slow.join(0.2)
        assert slow.is_alive()  # it waits for the turn this call holds
    slow.join(10)
    assert order == ["other call", "slow call goes on"]


def test_a_wait_outside_any_turn_gives_up_nothing() -> None:
    with turn.released():  # the client tool, a background refresh: no turn held, none released
        pass
    with turn.held():  # and the turn is still free
        pass


def test_a_call_that_may_not_wait_is_stopped_before_its_wait_and_leaves_the_turn_free() -> None:
    """On the frame's gRPC thread a wait would hold up every other exchange of the worker: the call is stopped
    before the wait (WouldWait, which the engine's `except Exception` handlers let through) and made again where
    it may wait."""
    waited = []
    with pytest.raises(turn.WouldWait), turn.held(may_wait=False):
        try:
            with turn.released():
                waited.append("waited")
        except Exception:  # the engine's handlers: a move is no error of theirs
            pytest.fail("WouldWait caught as an error")
    assert not waited
    assert turn._TURN.acquire(timeout=5)  # the turn is free again
    turn._TURN.release()


def test_a_call_that_may_wait_gives_the_turn_up_and_the_next_one_on_this_thread_is_held_to_its_own() -> None:
    with turn.held(may_wait=True), turn.released():
        pass
    with pytest.raises(turn.WouldWait), turn.held(may_wait=False), turn.released():
        pass
    with turn.held(), turn.released():  # may_wait is the call's own, not left over from the one before
        pass


def test_only_routes_whose_waits_come_after_claims_pay_for_a_thread_handoff_at_once(
    pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The frame makes a route's engine calls on its engine threads at once only where a wait on the network may
    come after what a second run could not redo (an OCSP lookup inside a Security header); every other route's
    calls, outbound secureconversation's too, are made on the gRPC thread (a handoff costs more than a cheap
    exchange's whole Python) and moved only when about to wait."""
    monkeypatch.setenv("WSGATE_BENCH_CERTS", str(pki))
    policies = load_dir(outbound.policy_dir(BENCH_POLICIES, tmp_path))
    at_once = {r.name for r in policies.routes if waits_on_network(r)}
    assert not {"sc", "hmac", "rsa", "outbound-hmac", "outbound-rsa", "outbound-sc", "outbound-sc-signed"} & at_once
    rsa = policies.route("rsa")
    for mode, waits in (("ocsp", True), ("both", True), ("crl", False), ("off", False)):
        revocation = RevocationPolicy(mode=mode, crl_files=[] if mode in ("ocsp", "off") else [str(tmp_path / "x")])
        changed = rsa.model_copy(update={"rsa": rsa.rsa.model_copy(update={"revocation": revocation})})
        assert waits_on_network(changed) is waits, mode
