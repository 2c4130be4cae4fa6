"""Fixtures of the service tests beyond those of tests/conftest.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.tap_standin import StandIn


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    """A server that records the tap's requests (`tests.helpers.tap_standin.StandIn`)."""
    s = StandIn()
    yield s
    s.close()
