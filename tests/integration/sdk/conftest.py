"""Fixtures for the SDK tests: a topic prefix per test and a coordinator peer on real Kafka."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from layer.protocol import Subscribe
from layer.sdk import QueueConsumer
from tests.integration.sdk.peer import CoordinatorPeer

Connect = Callable[..., tuple[QueueConsumer, Subscribe]]


@pytest.fixture
def prefix(unique_name: Callable[[str], str]) -> str:
    """A topic prefix of this test's own, so its control, ack and delivery topics are too."""
    return unique_name("sdk")[:80] + "."


@pytest.fixture
def peer(bootstrap_servers: str, prefix: str) -> Iterator[CoordinatorPeer]:
    peer = CoordinatorPeer(bootstrap_servers, prefix)
    yield peer
    peer.close()


@pytest.fixture
def connect(bootstrap_servers: str, prefix: str, peer: CoordinatorPeer) -> Iterator[Connect]:
    """connect(queue, reply={...}, **consumer options) -> (consumer, the Subscribe it sent),
    with the peer answering the Subscribe as told by ``reply``."""
    made: list[QueueConsumer] = []

    def make(queue: Any = "WorkToDo", *, reply: dict[str, Any] | None = None,
             **options: Any) -> tuple[QueueConsumer, Subscribe]:
        answered = peer.answer_subscribe(**(reply or {}))
        consumer = QueueConsumer(queue, bootstrap_servers, topic_prefix=prefix, **options)
        made.append(consumer)
        return consumer, answered.result(timeout=30)

    yield make
    for consumer in made:
        consumer.close()
