"""Shared fixtures: one demo PKI per test session (real keys, made with certs.pki), its gateway keys in a SoftHSM2
token, Redis, the client's clock, the lanes (a marker per folder)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from certs import hsm as hsm_mod
from certs import pki as pki_mod
from gateway.control.ports import free_ports
from tests.support.harness import GatewayFactory, start_redis, stop
from tests.support.partner import Wss4jPartner
from tests.support.postgres import Postgres, remove, start_postgres
from tests.support.wss4j import Wss4j
from tests.support.wss_helpers import Keys, with_token_keys


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--compose",
        action="store_true",
        help="run the Compose stack tests (marked compose; `make test-compose`): a Docker engine, minutes of builds",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "compose: builds the images and runs the Compose stack (pytest --compose)")


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly generated demo PKI folder (see certs/pki.py for its files)."""
    return pki_mod.init(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def hsm(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A SoftHSM2 token (its own SOFTHSM2_CONF and token directory) holding the PKI's gateway-sign and gateway-enc
    keys; certs.hsm.uri(hsm, label) names them. The gateways the tests start inherit SOFTHSM2_CONF."""
    out = tmp_path_factory.mktemp("hsm")
    conf = hsm_mod.init(out, pki)
    before = os.environ.get("SOFTHSM2_CONF")
    os.environ["SOFTHSM2_CONF"] = str(conf)
    yield out
    if before is None:
        os.environ.pop("SOFTHSM2_CONF", None)
    else:
        os.environ["SOFTHSM2_CONF"] = before


@pytest.fixture(scope="module", params=["file-keys", "token-keys"])
def gateway_keys(request: pytest.FixtureRequest) -> Keys:
    """Where the gateway's private keys are: a module whose routes go through this (`gateway_keys(route_doc(...))`)
    runs its tests with the keys in PEM files, then with them in the session's SoftHSM2 token."""
    if request.param == "file-keys":
        return lambda doc: doc
    token_dir = request.getfixturevalue("hsm")
    return lambda doc: with_token_keys(doc, token_dir)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port (Debian's redis-server), for the whole session."""
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    stop(proc)


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    """A real PostgreSQL server (Debian's postgresql) on a free loopback port, with a password, for the session."""
    pg = start_postgres()
    yield pg
    remove(pg)


@pytest.fixture
def gateway(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[GatewayFactory]:
    """Start gateways for one test: `gw = gateway(["rsa", "hmac"]); gw.post("rsa", body)` (tests/support/harness.py)."""
    with GatewayFactory(tmp_path_factory, pki) as factory:
        yield factory


@pytest.fixture(scope="module")
def module_gateway(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[GatewayFactory]:
    """The same for a module's own fixture: a gateway its tests share, stopped after the module."""
    with GatewayFactory(tmp_path_factory, pki) as factory:
        yield factory


@pytest.fixture
def client_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[timedelta], None]:
    """Move the client's clock (what it writes in Timestamp and UsernameToken Created); the gateway's stays."""

    def shift(delta: timedelta) -> None:
        class Shifted(datetime):
            @classmethod
            def now(cls, tz: Any = None) -> Any:
                return datetime.now(tz) + delta

        monkeypatch.setattr("filters.engine.requester.datetime", Shifted)

    return shift


# Each folder is a lane (markers registered in pyproject.toml); a test file outside them would escape every lane.
LANES = {"unit": "unit", "threats": "threat", "e2e": "e2e", "interop": "interop"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    order = list(LANES)

    def folder(item: pytest.Item) -> str:
        name = item.path.relative_to(here).parts[0]
        if name not in LANES:
            raise pytest.UsageError(f"{item.nodeid}: a test file belongs in one of tests/{{{','.join(LANES)}}}/")
        return name

    ours = [item for item in items if item.path.is_relative_to(here)]
    for item in ours:
        item.add_marker(LANES[folder(item)])
    # The fast lane first (a broken engine fails in seconds, not after the gateways); a stable sort keeps each
    # file whole, so a module-scoped gateway still starts once.
    ours.sort(key=lambda item: order.index(folder(item)))
    items[:] = ours + [item for item in items if not item.path.is_relative_to(here)]
    # Without --compose the stack tests are deselected (counted in the summary), not skipped one by one.
    if not config.getoption("--compose"):
        deselected = [i for i in items if i.get_closest_marker("compose")]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [i for i in items if not i.get_closest_marker("compose")]


@pytest.fixture(scope="session")
def wss4j() -> Iterator[Wss4j]:
    """One Apache WSS4J harness JVM for the session (tests/support/wss4j.py)."""
    harness = Wss4j()
    yield harness
    harness.close()


@pytest.fixture(scope="module")
def partner(wss4j: Wss4j, pki: Path, request: pytest.FixtureRequest) -> Iterator[Wss4jPartner]:
    """WSS4J as the partner service of outbound routes, serving the module's SERVICES (tests/support/partner.py)."""
    server = Wss4jPartner(wss4j, pki, request.module.SERVICES)
    yield server
    server.close()


@pytest.fixture(scope="module")
def listen() -> str:
    """A free loopback address for an outbound route's listener."""
    return f"127.0.0.1:{free_ports(1)[0]}"
