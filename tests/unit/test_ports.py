"""The ports handed to servers we start (gateway/control/ports.py) cannot be taken between their choice and the
server's bind: not by an outgoing connection (they are outside the kernel's ephemeral range), not by another
process of the run (each reserves its own blocks), not by this process's next caller (leased until released)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from contextlib import ExitStack

from gateway.control import ports

# A process of the run: takes ports as a gateway does (consecutive runs, then singles), more than one block's
# worth, and prints them; then, as its servers would, listens on every one (real sockets) and holds them.
CHILD = textwrap.dedent("""
    import json, socket, sys
    from gateway.control import ports

    taken = []
    for _ in range(40):
        first = ports.free_consecutive_ports(4)
        taken += range(first, first + 4)
        taken += ports.free_ports(5)
    print(json.dumps(taken), flush=True)
    sys.stdin.readline()
    held = []
    for port in taken:
        s = socket.socket()
        s.bind(("127.0.0.1", port))
        s.listen()
        held.append(s)
    print("listening", flush=True)
    sys.stdin.read()
""")


def _outside_ephemeral(port: int) -> bool:
    low, high = ports.ephemeral_range()
    return not low <= port <= high


def test_outgoing_connection_cannot_take_a_chosen_port() -> None:
    low, high = ports.ephemeral_range()
    assert (low, high) == tuple(int(v) for v in ports.EPHEMERAL_RANGE.read_text().split())
    first = ports.free_consecutive_ports(8)
    chosen = [*range(first, first + 8), *ports.free_ports(20)]
    assert all(map(_outside_ephemeral, chosen)), chosen
    # What an outgoing connection gets: a port of the ephemeral range, so never one of those.
    with socket.create_server(("127.0.0.1", chosen[0])) as server, socket.create_connection(server.getsockname()) as c:
        assert low <= c.getsockname()[1] <= high
    ports.release(chosen)


def test_no_port_handed_out_twice_across_processes() -> None:
    children = [
        subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    try:
        mine = ports.free_ports(50)
        # Every process chose before any listens: as servers that have not started yet.
        theirs = [json.loads(child.stdout.readline()) for child in children]  # type: ignore[union-attr]
        flat = [p for taken in [mine, *theirs] for p in taken]
        assert all(len(taken) == 360 for taken in theirs)  # more than a block each: a second block was reserved
        assert len(set(flat)) == len(flat), "a port was handed out twice"
        assert all(map(_outside_ephemeral, flat))
        with ExitStack() as held:
            for port in mine:
                held.enter_context(socket.create_server(("127.0.0.1", port)))
            for child in children:
                child.stdin.write("bind\n")  # type: ignore[union-attr]
                child.stdin.flush()  # type: ignore[union-attr]
            assert [child.stdout.readline() for child in children] == ["listening\n"] * 3  # type: ignore[union-attr]
    finally:
        for child in children:
            child.communicate("")
    assert [child.returncode for child in children] == [0, 0, 0]
    ports.release(mine)


def test_no_port_handed_out_twice_until_released() -> None:
    first = ports.free_ports(ports.BLOCK)
    second = ports.free_ports(ports.BLOCK)  # more than one block: reserves another
    assert len(set(first) | set(second)) == 2 * ports.BLOCK
    ports.release(first)
    again = ports.free_ports(10)
    assert not set(again) & set(second)  # the second lot is still leased
    ports.release([*again, *second])


def test_a_listening_port_is_never_handed_out() -> None:
    taken = ports.free_ports(1)[0]
    ports.release([taken])
    with socket.create_server(("127.0.0.1", taken)):
        chosen = ports.free_ports(ports.BLOCK)
        assert taken not in chosen
    ports.release(chosen)


def test_bind_failures_are_told_from_other_failures() -> None:
    assert ports.bind_failed(b"[critical] cannot bind '127.0.0.1:8080': Address already in use\n")
    assert ports.bind_failed(b"Error: cannot listen on 127.0.0.1:9100: Address already in use (os error 98)")
    assert ports.bind_failed(b"listen tcp 127.0.0.1:4318: bind: address already in use")
    assert not ports.bind_failed(b"Permission denied\nconnection refused")


def test_a_forked_child_never_hands_out_its_parents_ports() -> None:
    mine = ports.free_ports(10)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own blocks, not a copy of the parent's
        try:
            os.write(write, json.dumps(ports.free_ports(10)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        childs = json.loads(pipe.read())
    os.waitpid(pid, 0)
    after = ports.free_ports(10)  # what this process hands out next
    assert not set(childs) & {*mine, *after}
    ports.release([*mine, *after])
