"""Shared fixtures: one demo PKI per test session (real keys, made with certs.pki)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from certs import pki as pki_mod
from tests.harness import start_redis, stop


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
