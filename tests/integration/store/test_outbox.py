"""The events outbox (DESIGN §2): an iteration's events are committed with its state changes,
or not at all; published batches are deleted by the next transaction; a new owner finds the
rest."""

from __future__ import annotations

import pytest

from layer.store.batch import WriteBatch
from layer.store.errors import FencedError
from layer.store.rows import EntryRow
from layer.store.store import Store

pytestmark = pytest.mark.integration

T0 = 1_700_000_000.0


def _leased(offset: int) -> EntryRow:
    return EntryRow("Work", "orders", 0, offset, "LEASED", delivery_count=1,
                    lease_consumer="c", lease_token=f"t{offset}", lease_deadline=T0 + 30)


def test_events_are_committed_with_the_state_and_found_by_the_next_owner(store: Store) -> None:
    epoch = store.take_shard("3", "a", T0)
    first = WriteBatch()
    first.put_entry(_leased(1))
    first.put_events([b"one", b"two"])
    ids = store.commit(first, "3", "a", epoch, T0).outbox_batch_ids
    assert len(ids) == 2 and ids[0] < ids[1]
    second = WriteBatch()
    second.put_events([b"three"])
    (third,) = store.commit(second, "3", "a", epoch, T0).outbox_batch_ids
    assert third > ids[1]
    assert store.load_outbox("3") == [(ids[0], b"one"), (ids[1], b"two"), (third, b"three")]
    assert store.load_outbox("4") == []

    # The first two were published: the next transaction forgets them.
    trim = WriteBatch()
    trim.published(ids[1])
    store.commit(trim, "3", "a", epoch, T0)
    assert store.load_outbox("3") == [(third, b"three")]

    # A fenced owner's events are not committed, with its state.
    successor = store.take_shard("3", "b", T0 + 1)
    late = WriteBatch()
    late.put_entry(_leased(2))
    late.put_events([b"zombie"])
    with pytest.raises(FencedError):
        store.commit(late, "3", "a", epoch, T0 + 1)
    assert store.load_outbox("3") == [(third, b"three")]
    assert [r.offset for r in store.load_entries("Work")] == [1]
    assert successor > epoch

    # The new owner published what it found; forgetting it needs no epoch.
    store.forget_published("3", third)
    assert store.load_outbox("3") == []
