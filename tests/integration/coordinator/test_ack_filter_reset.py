"""Operator requests against a running coordinator (issue 14 items 5 and 7): acknowledging by
filter (`qlayer queue ack --filter`), moving a queue's positions (`qlayer queue reset`), and a
changed ``recovery_point`` taking effect."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from layer.protocol import EventType
from layer.protocol.records import Event
from layer.services.queues import ConsumersAttachedError, QueueService
from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import (
    Consumers,
    Delivered,
    EventReader,
    counters,
    produce,
    put_queues,
    recovery_points,
    running_coordinator,
    wait_for_counters,
    wait_until,
)

pytestmark = pytest.mark.integration


@pytest.fixture(params=["python", "native"])
def core(request: pytest.FixtureRequest) -> str:
    """The shard core the coordinator runs (CoordinatorOptions.core): both close entries."""
    if request.param == "native":
        from layer.domain.native import native_available

        if not native_available():  # the native core is an optional build
            pytest.skip("the qlayer_native extension is not installed")
    return str(request.param)


def _service(settings: Settings) -> QueueService:
    return QueueService.from_settings(settings)


def _docs(*kinds: str) -> list[bytes]:
    return [json.dumps({"n": i, "kind": kind}).encode() for i, kind in enumerate(kinds)]


def _bookmarks(events: list[Event], kind: EventType, reason: str | None = None) -> list[str]:
    return sorted(e.bookmark.format() for e in events
                  if e.type is kind and e.bookmark is not None
                  and (reason is None or e.reason == reason))


def test_ack_by_filter_acknowledges_the_matching_entries_leased_or_not(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """Reference (amps-understanding-queues.txt): "AMPS allows an application to acknowledge
    messages by providing a filter on a sow_delete command. In this case, the sow_delete
    acknowledges all messages that match the filter, regardless of whether the application
    that sends the command has a current lease on a given message or not." """
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "60s"})
    kinds = ("keep", "drop", "keep", "drop", "keep", "drop", "keep", "drop")
    produce(settings.bootstrap_servers, work, _docs(*kinds), partition=0)
    events = EventReader(settings)
    with running_coordinator(settings, core=core), Consumers(settings) as consumers, \
            _service(settings) as service:
        holder = consumers.subscribe("Work", max_backlog=2)
        leased = holder.receive(2)  # offsets 0 (keep) and 1 (drop), leased
        assert [d.bookmark for d in leased] == [f"{work}/0/0", f"{work}/0/1"]

        preview = service.ack("Work", "/kind = 'drop'", dry_run=True)
        assert preview.matching is not None
        assert (preview.matching.total, preview.matching.leased) == (4, 1)
        assert counters(settings, "Work")["acked"] == 0  # a dry run acknowledges nothing

        done = service.ack("Work", "/kind = 'drop'", wait=20)
        assert done.acked == 4
        wait_for_counters(settings, "Work", acked=4)
        seen = events.read_until(
            lambda es: len(_bookmarks(es, EventType.ACKED, "admin")) >= 4)
        assert _bookmarks(seen, EventType.ACKED, "admin") == sorted(
            f"{work}/0/{o}" for o in (1, 3, 5, 7))
        # Audits balance: each acknowledged entry was enqueued before, and acked once.
        acked = _bookmarks(seen, EventType.ACKED)
        assert len(acked) == len(set(acked))
        assert set(acked) <= set(_bookmarks(seen, EventType.ENQUEUED))

        # The holder settles what it has; only entries that do not match come next.
        holder.ack(leased)
        rest = holder.receive(2)
        holder.ack(rest)
        rest += holder.receive(1)
        holder.ack(rest[2:])
        assert sorted(d.bookmark for d in rest) == [f"{work}/0/{o}" for o in (2, 4, 6)]
        assert holder.idle(1.0) == []
        wait_for_counters(settings, "Work", acked=8)
    events.close()
    with Store(settings.database_url) as store:
        record = store.get_queue("Work")
        assert record is not None and not record.purge_pending
        assert (record.purge_filter, record.purge_acked) == ("/kind = 'drop'", 4)


def test_reset_forward_drops_what_is_before_and_keeps_acks_after(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """Reference (amps-understanding-queues.txt): "To recover the state of the queue, AMPS
    proceeds through the journal file from the recovery point and restores the state of the
    queue based on the operations in the transaction log for that queue." Entries before the
    new position leave the queue (ACKED, reason admin); an entry after it that was acked stays
    acked."""
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work, "lease_period": "60s"})
    produce(settings.bootstrap_servers, work, [f"job {i}".encode() for i in range(8)],
            partition=0)
    events = EventReader(settings)
    with running_coordinator(settings, core=core), Consumers(settings) as consumers, \
            _service(settings) as service:
        holder = consumers.subscribe("Work", max_backlog=3)
        got = holder.receive(3)  # 0, 1, 2 leased
        holder.ack(got[1:])  # 1 and 2 acked; 0 keeps the recovery point at 0
        wait_for_counters(settings, "Work", acked=2)
        assert recovery_points(settings, "Work") == {(work, 0): 0}

        plan = service.reset("Work", "0:2", dry_run=True)
        assert [(p.before, p.after, p.passed) for p in plan.partitions] == [(0, 2, 2)]
        assert plan.consumers == [holder.consumer_id]
        with pytest.raises(ConsumersAttachedError, match="--force"):
            service.reset("Work", "0:2")

        service.reset("Work", "0:2", force=True, wait=20)
        # Offset 0 (leased) left the queue; 1 was acked before; 2 (acked, past the new
        # position) is not delivered again: the holder gets 3.. only. (3 and 4 were leased
        # to it before the reset; their leases stay and are sent again by the rebuild.)
        rest: dict[str, Delivered] = {}
        deadline = time.monotonic() + 20
        while len(rest) < 5 and time.monotonic() < deadline:
            fresh = holder.poll(0.2)
            holder.ack(fresh)
            rest.update((d.bookmark, d) for d in fresh)
        assert sorted(rest) == [f"{work}/0/{o}" for o in range(3, 8)]
        wait_until(lambda: recovery_points(settings, "Work") == {(work, 0): 8} or None,
                   what="every entry done")
        seen = events.read_until(lambda es: len(_bookmarks(es, EventType.ACKED)) >= 8)
        assert _bookmarks(seen, EventType.ACKED, "admin") == [f"{work}/0/0"]
        assert counters(settings, "Work")["acked"] == 8
    events.close()
    with Store(settings.database_url) as store:
        record = store.get_queue("Work")
        assert record is not None and not record.reset_pending and record.reset_to == "0:2"


def test_reset_back_replays_the_journal(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """Reference (amps-understanding-queues.txt): "begin queue recovery at the configured
    recovery point." Below a recovery point qlayer keeps no per-entry outcome (DESIGN §3), so
    moving back is a replay, as a Kafka consumer-group reset: the records enter the queue
    again, each announced by a new ENQUEUED event."""
    work = journal("Work", partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": work})
    produce(settings.bootstrap_servers, work, [f"job {i}".encode() for i in range(4)],
            partition=0)
    events = EventReader(settings)
    with running_coordinator(settings, core=core), Consumers(settings) as consumers, \
            _service(settings) as service:
        worker = consumers.subscribe("Work", max_backlog=4)
        first = worker.receive(4)
        worker.ack(first)
        wait_until(lambda: recovery_points(settings, "Work") == {(work, 0): 4} or None,
                   what="every entry done")
        plan = service.reset("Work", "beginning", dry_run=True)
        assert [(p.before, p.after, p.replayed) for p in plan.partitions] == [(4, 0, 4)]
        service.reset("Work", "beginning", force=True, wait=20)
        again = worker.receive(4)
        assert sorted(d.bookmark for d in again) == sorted(d.bookmark for d in first)
        worker.ack(again)
        wait_for_counters(settings, "Work", enqueued=8, acked=8)
        seen = events.read_until(lambda es: len(_bookmarks(es, EventType.ACKED)) >= 8)
        assert len(_bookmarks(seen, EventType.ENQUEUED)) == 8
        assert _bookmarks(seen, EventType.ACKED, "admin") == []  # nothing was open to close
    events.close()


def test_changed_recovery_point_moves_the_positions_once(
    core: str, settings: Settings, journal: Callable[..., str]
) -> None:
    """Reference (amps-understanding-queues.txt): "If this is a new queue, or the configured
    RecoveryPoint for the queue has changed since the last time AMPS started, begin queue
    recovery at the configured recovery point." """
    work = journal("Work", partitions=1)
    definition: dict[str, object] = {"name": "Work", "underlying_topic": work}
    put_queues(settings, definition)
    produce(settings.bootstrap_servers, work, [f"old {i}".encode() for i in range(5)],
            partition=0)
    events = EventReader(settings)
    with running_coordinator(settings, core=core), Consumers(settings) as consumers:
        wait_for_counters(settings, "Work", enqueued=5)
        put_queues(settings, {**definition, "recovery_point": "end"})
        with Store(settings.database_url) as store:
            record = store.get_queue("Work")
            assert record is not None and record.positions_from == "end"
            assert record.reset_to == "end"
            requested = record.reset_requested_at
        wait_until(lambda: recovery_points(settings, "Work") == {(work, 0): 5} or None,
                   what="positions at the end")
        wait_for_counters(settings, "Work", acked=5)
        seen = events.read_until(
            lambda es: len(_bookmarks(es, EventType.ACKED, "admin")) >= 5)
        assert _bookmarks(seen, EventType.ACKED, "admin") == [f"{work}/0/{o}"
                                                              for o in range(5)]
        # The same definition again is no change: nothing moves a second time.
        put_queues(settings, {**definition, "recovery_point": "end"})
        with Store(settings.database_url) as store:
            record = store.get_queue("Work")
            assert record is not None and record.reset_requested_at == requested
        produce(settings.bootstrap_servers, work, [b"new"], partition=0)
        worker = consumers.subscribe("Work", max_backlog=5)
        (fresh,) = worker.receive(1)
        assert fresh.value == b"new"
        assert worker.idle(1.0) == []
    events.close()
