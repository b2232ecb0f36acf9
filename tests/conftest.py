"""Shared fixtures: one demo PKI per test session (real keys, made with certs.pki), its gateway keys in a SoftHSM2
token, Redis, the client's clock."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from certs import hsm as hsm_mod
from certs import pki as pki_mod
from tests.harness import start_redis, stop


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
