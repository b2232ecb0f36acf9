"""Shared fixtures: one demo PKI per test session (real keys, made with certs.pki), Redis, the client's clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from certs import pki as pki_mod
from tests.harness import start_redis, stop


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--compose",
        action="store_true",
        help="run the Compose stack tests (marked compose; `make test-compose`): a Docker engine, minutes of builds",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "compose: builds the images and runs the Compose stack (pytest --compose)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without --compose the stack tests are deselected (counted in the summary), not skipped one by one."""
    if config.getoption("--compose"):
        return
    deselected = [i for i in items if i.get_closest_marker("compose")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [i for i in items if not i.get_closest_marker("compose")]


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly generated demo PKI folder (see certs/pki.py for its files)."""
    return pki_mod.init(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port (Debian's redis-server), for the whole session."""
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    stop(proc)


@pytest.fixture
def client_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[timedelta], None]:
    """Move the client's clock (what it writes in Timestamp and UsernameToken Created); the gateway's stays."""

    def shift(delta: timedelta) -> None:
        class Shifted(datetime):
            @classmethod
            def now(cls, tz: Any = None) -> Any:
                return datetime.now(tz) + delta

        monkeypatch.setattr("gateway.tools.client.datetime", Shifted)

    return shift
