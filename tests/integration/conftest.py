"""Fixtures shared by the integration tests of several directories."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.secured import SecuredKafka, secured_kafka


@pytest.fixture(scope="session")
def secured() -> Iterator[SecuredKafka]:
    """The session's SASL/SCRAM broker with ACLs enforced (`tests.support.secured`), started
    by the first test that needs it and shared by the security and authorization tests."""
    yield from secured_kafka()
