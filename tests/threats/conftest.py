"""The threats lane's shared fixtures: the SAML route (tests/support/saml.py) and its pipeline, in process, for the
SAML and STR-Transform threat modules. A module about another route defines its own `route` (which overrides this)."""

from __future__ import annotations

from pathlib import Path

import pytest

from filters.engine.profiles import SamlPipeline
from filters.stores.factory import RouteStores
from gateway.policy import Route
from tests.support import saml as S


@pytest.fixture(scope="module")
def route(pki: Path) -> Route:
    return S.saml_route(pki)


@pytest.fixture(scope="module")
def pipeline(route: Route) -> SamlPipeline:
    return SamlPipeline(route, RouteStores())
