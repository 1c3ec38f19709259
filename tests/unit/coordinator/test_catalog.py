"""The process's catalog: which shard serves a queue, a subscription, a session."""

from __future__ import annotations

import re

import pytest

from layer.coordinator.catalog import Catalog
from layer.store.rows import ConsumerRow, QueueRecord


def _queue(name: str, shard: int) -> QueueRecord:
    return QueueRecord(name=name, definition={"name": name}, version=1, created_at=0.0,
                       updated_at=0.0, shard=shard)


def _consumer(consumer_id: str, queue: str, *, is_regex: bool = False) -> ConsumerRow:
    return ConsumerRow(consumer_id=consumer_id, session_id=f"s-{consumer_id}", queue=queue,
                       is_regex=is_regex, delivery_topic=f"d.{consumer_id}",
                       session_timeout_ms=10_000, subscribed_at=0.0, last_heartbeat_at=0.0)


CATALOG = Catalog.of(4, [_queue("Orders1", 2), _queue("Orders2", 2), _queue("Jobs", 0)],
                     [_consumer("c1", "Jobs"), _consumer("c2", "Orders.*", is_regex=True),
                      _consumer("c3", "J.*|O.*", is_regex=True)], now=5.0)


def test_queues_and_subscriptions_map_to_shards() -> None:
    assert CATALOG.shard_of("Jobs") == 0
    assert CATALOG.shard_of("Nope") is None
    assert set(CATALOG.on_shard(2)) == {"Orders1", "Orders2"}
    assert CATALOG.shards_matching("Jobs", False) == {0}
    assert CATALOG.shards_matching("Orders.*", True) == {2}
    assert CATALOG.shards_matching("Ord", True) == set()  # a regex matches whole names
    assert CATALOG.shards_matching(".*", True) == {0, 2}
    with pytest.raises(re.error):
        CATALOG.shards_matching("(", True)


def test_a_session_maps_to_the_shards_of_its_queues_only_when_it_is_the_stored_one() -> None:
    assert CATALOG.consumer_shards("c1", "s-c1") == {0}
    assert CATALOG.consumer_shards("c2", "s-c2") == {2}
    assert CATALOG.consumer_shards("c3", "s-c3") == {0, 2}
    assert CATALOG.consumer_shards("c1", "another-session") == set()
    assert CATALOG.consumer_shards("nobody", "s") == set()
