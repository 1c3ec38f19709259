"""Where the catalog says the parts of a queue of several parts are (docs/coordinator.md,
"Partitioned queues")."""

from __future__ import annotations

from layer.coordinator.catalog import Catalog
from layer.store.rows import QueueRecord


def _queue(name: str, shard: int, parts: int | None = None) -> QueueRecord:
    definition: dict[str, object] = {"name": name}
    if parts is not None:
        definition["parts"] = parts
    return QueueRecord(name, definition, 1, 0.0, 0.0, shard=shard)


CATALOG = Catalog.of(4, [_queue("Split", 3, 3), _queue("Whole", 1), _queue("Odd", 2, True)],
                     [], 0.0)


def test_each_part_is_on_the_shard_after_the_previous_ones() -> None:
    split = CATALOG.queues["Split"]
    assert CATALOG.shards_of(split) == (3, 0, 1)
    assert [CATALOG.shard_of("Split", p) for p in range(6)] == [3, 0, 1, 3, 0, 1]
    assert CATALOG.shard_of("Split") == 3  # the first part's
    assert CATALOG.shard_of("Whole", 5) == 1
    assert CATALOG.shard_of("Nothing", 1) is None


def test_a_shard_serves_the_queues_it_has_a_part_of_and_knows_which_parts() -> None:
    assert sorted(CATALOG.on_shard(0)) == ["Split"]
    assert sorted(CATALOG.on_shard(1)) == ["Split", "Whole"]
    assert sorted(CATALOG.on_shard(2)) == ["Odd"]  # a stored parts that is not a count: one
    assert CATALOG.parts_on(CATALOG.queues["Split"], 1) == frozenset({2})
    assert CATALOG.parts_on(CATALOG.queues["Split"], 2) == frozenset()
    assert CATALOG.parts_on(CATALOG.queues["Whole"], 1) is None


def test_a_subscription_by_name_or_regex_spans_every_parts_shard() -> None:
    assert CATALOG.shards_matching("Split", False) == {3, 0, 1}
    assert CATALOG.shards_matching("Whole", False) == {1}
    assert CATALOG.shards_matching("(Split|Whole)", True) == {0, 1, 3}
