"""The schema itself refuses impossible entry, consumer and ownership states.

Each case writes through the store (so the refusal surfaces as the qlayer error a coordinator
would see) and then checks the row did not land.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine

from layer.domain.states import EntryState
from layer.store.batch import WriteBatch
from layer.store.errors import StoreError
from layer.store.rows import ConsumerRow, EntryRow, stored_state
from layer.store.store import Store
from layer.store.tables import ENTRY_STATES, entries

pytestmark = pytest.mark.integration

NOW = 1_700_000_000.0
SHARD = "orders"


@pytest.fixture
def epoch(store: Store) -> int:
    taken = store.take_shard(SHARD, "coordinator-a", NOW)
    assert taken is not None
    return taken


def _entry(**changes: object) -> EntryRow:
    fields: dict[str, object] = {
        "queue": "Work",
        "topic": "orders",
        "partition": 0,
        "offset": 7,
        "state": "LEASED",
        "delivery_count": 1,
        "lease_consumer": "c1",
        "lease_token": "tok",
        "lease_deadline": NOW + 30,
    }
    fields.update(changes)
    return EntryRow(**fields)  # type: ignore[arg-type]


VALID = [
    _entry(),
    _entry(state="AVAILABLE", lease_consumer=None, lease_token=None, lease_deadline=None,
           available_at=NOW + 5),
    _entry(state="ACKED", lease_consumer=None, lease_token=None, lease_deadline=None),
    _entry(state="EXPIRED", lease_consumer=None, lease_token=None, lease_deadline=None,
           reason="max-deliveries"),
]

INVALID = {
    "unknown state": _entry(state="DONE"),
    "lowercase state": _entry(state="leased"),
    "negative delivery count": _entry(delivery_count=-1),
    "negative cancel count": _entry(cancel_count=-1),
    "negative offset": _entry(offset=-1),
    "negative partition": _entry(partition=-1),
    "LEASED without token": _entry(lease_token=None),
    "LEASED without deadline": _entry(lease_deadline=None),
    "LEASED without consumer": _entry(lease_consumer=None),
    "AVAILABLE with a lease": _entry(state="AVAILABLE"),
    "ACKED with a leftover deadline": _entry(
        state="ACKED", lease_consumer=None, lease_token=None
    ),
    "reason on a non-EXPIRED entry": _entry(reason="why"),
}


def _stored_entries(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(entries)).scalar_one()


@pytest.mark.parametrize("row", VALID, ids=lambda row: row.state)
def test_valid_entry_states_are_accepted(store: Store, epoch: int, row: EntryRow) -> None:
    batch = WriteBatch()
    batch.put_entry(row)
    store.commit(batch, SHARD, "coordinator-a", epoch, NOW)
    assert store.load_entries("Work") == [row]


@pytest.mark.parametrize("row", INVALID.values(), ids=list(INVALID))
def test_invalid_entry_states_are_refused(
    store: Store, engine: Engine, epoch: int, row: EntryRow
) -> None:
    batch = WriteBatch()
    batch.put_entry(row)
    batch.set_recovery_point("Work", "orders", 1, 100)  # must not land either: one transaction
    with pytest.raises(StoreError, match="violates check constraint") as raised:
        store.commit(batch, SHARD, "coordinator-a", epoch, NOW)
    assert raised.value.retryable is False
    assert _stored_entries(engine) == 0
    assert store.load_recovery_points() == {}


def test_invalid_update_leaves_the_previous_row(store: Store, epoch: int) -> None:
    good = _entry()
    first = WriteBatch()
    first.put_entry(good)
    store.commit(first, SHARD, "coordinator-a", epoch, NOW)

    bad = WriteBatch()
    bad.put_entry(_entry(state="AVAILABLE"))  # forgot to clear the lease
    with pytest.raises(StoreError):
        store.commit(bad, SHARD, "coordinator-a", epoch, NOW + 1)
    assert store.load_entries("Work") == [good]


@pytest.mark.parametrize(
    ("max_backlog", "session_timeout_ms"), [(-1, 1000), (-3, 1000), (5, 0)]
)
def test_consumer_limits_are_checked(
    store: Store, epoch: int, max_backlog: int, session_timeout_ms: int
) -> None:
    batch = WriteBatch()
    batch.put_consumer(
        ConsumerRow(
            consumer_id="c1", session_id="s1", queue="Work", is_regex=False,
            delivery_topic="qlayer.deliver.c1", session_timeout_ms=session_timeout_ms,
            subscribed_at=NOW, last_heartbeat_at=NOW, max_backlog=max_backlog,
        )
    )
    with pytest.raises(StoreError, match="violates check constraint"):
        store.commit(batch, SHARD, "coordinator-a", epoch, NOW)
    assert store.load_consumers() == []


def test_a_consumer_may_have_backlog_zero(store: Store, epoch: int) -> None:
    """Backlog 0: a session that takes only barrier messages (docs/protocol.md §4.1)."""
    batch = WriteBatch()
    batch.put_consumer(
        ConsumerRow(
            consumer_id="c0", session_id="s0", queue="Work", is_regex=False,
            delivery_topic="qlayer.deliver.c0", session_timeout_ms=1000,
            subscribed_at=NOW, last_heartbeat_at=NOW, max_backlog=0,
        )
    )
    store.commit(batch, SHARD, "coordinator-a", epoch, NOW)
    assert [c.max_backlog for c in store.load_consumers()] == [0]


@pytest.mark.parametrize("state", list(EntryState), ids=lambda state: state.name)
def test_every_engine_state_has_a_storable_name(
    store: Store, epoch: int, state: EntryState
) -> None:
    name = stored_state(state)
    leased = name == "LEASED"
    row = EntryRow(
        queue="Work", topic="orders", partition=0, offset=1, state=name,
        lease_consumer="c1" if leased else None, lease_token="t" if leased else None,
        lease_deadline=NOW + 30 if leased else None,
        available_at=NOW + 5 if state is EntryState.DELAYED else None,
        reason="rejected" if name == "EXPIRED" else None,
    )
    batch = WriteBatch()
    batch.put_entry(row)
    store.commit(batch, SHARD, "coordinator-a", epoch, NOW)
    assert store.load_entries("Work") == [row]
    assert name == (state.name if state.name in ENTRY_STATES else "AVAILABLE")
