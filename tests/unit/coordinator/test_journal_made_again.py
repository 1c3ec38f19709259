"""A journal deleted while its shard reads it and made again is read by a new Kafka consumer,
whichever way its partition comes back to the reader (the fault soak: the shard never read the
journal made again until it changed owner). Without Kafka: `FakeJournal` reads nothing, and
says nothing, from a partition whose topic was deleted while it read it, as librdkafka does
once the topic made again starts at a lower leader epoch (`JournalReader.renew`). Both cores."""

from __future__ import annotations

import json

import pytest

from layer.coordinator.catalog import Catalog
from layer.coordinator.core import ShardCore
from layer.coordinator.maintenance import PartitionCheck, QueueLoader
from layer.coordinator.options import CoordinatorOptions
from layer.coordinator.ports import FakeJournal, FakeTopicAdmin
from layer.domain.native import native_available
from layer.protocol import TopicNames
from layer.store.batch import WriteBatch
from layer.store.rows import EntryRow, PartitionKey, QueueRecord

JOURNAL = "work"
RECORD = QueueRecord(name="Work", definition={"name": "Work", "underlying_topic": JOURNAL},
                     version=1, created_at=0.0, updated_at=0.0, shard=0)
CORES = ["python", *(["native"] if native_available() else [])]


class _Nothing:
    """A queue nothing was stored of yet (`StateStore`, the reads a queue's load makes)."""

    def load_entries(self, queue: str) -> list[EntryRow]:
        return []

    def load_recovery_points(self, queue: str | None = None) -> dict[PartitionKey, int]:
        return {}

    def load_admitted(self, queue: str) -> dict[PartitionKey, int]:
        return {}


def _served(kind: str) -> tuple[ShardCore, QueueLoader, FakeTopicAdmin, FakeJournal]:
    """The queue served, its journal's 3 records read and admitted."""
    journal = FakeJournal()
    admin = FakeTopicAdmin({JOURNAL: 1}, journal=journal)
    catalog = Catalog.of(1, [RECORD], [], now=0.0)
    core = ShardCore(0, CoordinatorOptions(owner_id="test", core=kind),
                     topics=TopicNames("qt."), catalog=lambda: catalog, admin=admin,
                     tokens=lambda: "tok", owner_id="test")
    core.epoch = 1
    loader = QueueLoader(core, _Nothing(), admin, journal)  # type: ignore[arg-type]
    assert loader.add(RECORD, [], 1.0)
    _publish(journal, "old", 3)
    assert _enqueued(core, journal, 2.0) == 3
    return core, loader, admin, journal


def _publish(journal: FakeJournal, kind: str, count: int) -> None:
    for i in range(count):
        journal.append(JOURNAL, 0, json.dumps({kind: i}).encode())


def _enqueued(core: ShardCore, journal: FakeJournal, now: float,
              batch: WriteBatch | None = None) -> int:
    plan = core.step(journal.poll(100, 0.0), now, batch)
    return plan.batch.counters.get("Work", {}).get("enqueued", 0)


def _deleted(core: ShardCore, check: PartitionCheck, now: float) -> None:
    """The partition check finds the journal deleted; the step expires its entries."""
    batch = WriteBatch()
    check.run_once(now, batch, set())
    core.step([], now, batch)
    assert core.counters["journal_deleted"] == 3


@pytest.mark.parametrize("kind", CORES)
def test_a_journal_made_again_before_the_check_looks_is_read_by_a_new_consumer(
        kind: str) -> None:
    core, loader, admin, journal = _served(kind)
    check = PartitionCheck(core, loader, 5.0)
    admin.delete_topics([JOURNAL])
    admin.partitions[JOURNAL] = 1  # made again at once (a broker's auto-create), empty
    _deleted(core, check, 3.0)
    _publish(journal, "new", 2)
    assert _enqueued(core, journal, 4.0) == 2
    assert journal.renewals == core.counters["journal_readers_renewed"] == 1


@pytest.mark.parametrize("kind", CORES)
def test_a_journal_made_again_after_the_check_found_it_gone_is_read_by_a_new_consumer(
        kind: str) -> None:
    core, loader, admin, journal = _served(kind)
    check = PartitionCheck(core, loader, 5.0)
    admin.delete_topics([JOURNAL])
    _deleted(core, check, 3.0)
    assert journal.assignment == []
    admin.partitions[JOURNAL] = 1
    _publish(journal, "new", 2)
    check.run_once(8.0, WriteBatch(), set())  # finds the partition again
    assert _enqueued(core, journal, 8.0) == 2
    assert journal.renewals == 1


@pytest.mark.parametrize("kind", CORES)
def test_a_journal_made_again_and_read_by_a_rebuilt_queue_is_read_by_a_new_consumer(
        kind: str) -> None:
    # The queue changed (`Refresh`: a rebuild from what is stored) after the journal was found
    # gone and made again, before the partition check looked again: the rebuild reads the
    # partition, so the check has nothing left to add.
    core, loader, admin, journal = _served(kind)
    check = PartitionCheck(core, loader, 5.0)
    admin.delete_topics([JOURNAL])
    _deleted(core, check, 3.0)
    admin.partitions[JOURNAL] = 1
    _publish(journal, "new", 2)
    core.drop_queue("Work", keep_sessions=True)
    assert loader.add(RECORD, [], 4.0)
    check.run_once(8.0, WriteBatch(), set())
    assert _enqueued(core, journal, 8.0) == 2
    assert journal.renewals == 1


@pytest.mark.parametrize("kind", CORES)
def test_a_journal_never_deleted_keeps_its_consumer(kind: str) -> None:
    core, loader, _admin, journal = _served(kind)
    PartitionCheck(core, loader, 5.0).run_once(3.0, WriteBatch(), set())
    _publish(journal, "more", 2)
    assert _enqueued(core, journal, 4.0) == 2
    assert journal.renewals == 0
