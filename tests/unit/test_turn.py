"""The engine's turn (filters/engine/turn.py): engine calls from several threads compute one at a time; a call
gives the turn up only while it waits, and takes it back before it goes on."""

from __future__ import annotations

import threading

from filters.engine import turn


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
