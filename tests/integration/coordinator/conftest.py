from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from layer.settings import Settings
from tests.support.processes import ConsumerWorker, CoordinatorSubprocess


@pytest.fixture
def settings(bootstrap_servers: str, database_url: str) -> Settings:
    """Settings for one test: its own database and its own internal-topic prefix."""
    return Settings(bootstrap_servers=bootstrap_servers, database_url=database_url,
                    topic_prefix=f"qt{uuid.uuid4().hex[:8]}.")


@pytest.fixture
def journal(unique_name: Callable[[str], str], create_topic: Callable[..., str]
            ) -> Callable[..., str]:
    def make(stem: str = "journal", partitions: int = 3) -> str:
        return create_topic(unique_name(stem), partitions)

    return make


@pytest.fixture
def processes() -> Iterator[list[CoordinatorSubprocess | ConsumerWorker]]:
    """Coordinator and consumer processes a test starts: stopped when it ends."""
    procs: list[CoordinatorSubprocess | ConsumerWorker] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()
