"""Shared fixtures: one demo PKI per test session (real keys, made with certs.pki)."""

from __future__ import annotations

from pathlib import Path

import pytest

from certs import pki as pki_mod


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly generated demo PKI folder (see certs/pki.py for its files)."""
    return pki_mod.init(tmp_path_factory.mktemp("pki"))
