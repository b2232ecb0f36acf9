"""The interop lane's shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.metro import Metro


@pytest.fixture(scope="session")
def metro(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Metro]:
    """One Metro JVM for the session (tests/support/metro.py)."""
    log = (tmp_path_factory.mktemp("metro") / "metro.log").open("wb")
    client = Metro(log)
    yield client
    client.close()
    log.close()
