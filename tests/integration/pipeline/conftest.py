from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from layer.settings import Settings


@pytest.fixture
def settings(bootstrap_servers: str, database_url: str) -> Settings:
    """Its own database and internal-topic prefix (so its own events topic)."""
    return Settings(bootstrap_servers=bootstrap_servers, database_url=database_url,
                    topic_prefix=f"qt{uuid.uuid4().hex[:8]}.")


@pytest.fixture
def journal(unique_name: Callable[[str], str], create_topic: Callable[..., str]
            ) -> Callable[..., str]:
    def make(stem: str = "journal", partitions: int = 3) -> str:
        return create_topic(unique_name(stem), partitions)

    return make
