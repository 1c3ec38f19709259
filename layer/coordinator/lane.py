"""The native batch paths of a shard core (`native/src/lane.rs`): what `ShardCore` runs instead
of its per-message Python when its engines are native (`CoordinatorOptions.core`).

A step's journal records go to the engines without an `OfferedRecord` each; the engines'
decisions come out as the store's rows (already grouped into runs), the EventBatch's items
(with the same runs `Output.event_records` forms) and delivery batches, without an event, an
entry record or a row object per message. The Python reference remains what every rule is
defined by: each function here names the Python code it stands for, the engine tests and a
differential machine run both engines (tests/unit/domain/test_native_engine.py), and the
core's tests run both cores (tests/unit/coordinator).
"""

from __future__ import annotations

import logging
import types
from typing import TYPE_CHECKING, Any

from layer.coordinator.translate import event_fields
from layer.domain import events as ev
from layer.domain.native import API, NativeQueueEngine
from layer.domain.states import Bookmark
from layer.kafka import JournalRecord, OutgoingRecord
from layer.protocol import EventType
from layer.protocol.batch import DEFAULT_MAX_BATCH_BYTES
from layer.protocol.headers import DELIVERY_HEADER_KEYS
from layer.store.rows import EntryRow
from layer.store.store import EntryRun

if TYPE_CHECKING:
    from layer.coordinator.core import Plan, ShardCore

log = logging.getLogger(__name__)

__all__ = ["NativeLane"]

_LANE_API = types.SimpleNamespace(**vars(API), EntryRun=EntryRun, EntryRow=EntryRow,
                                  OutgoingRecord=OutgoingRecord)


class NativeLane:
    """One shard core's native lane (payloads, this step's records and decisions)."""

    def __init__(self, core: ShardCore) -> None:
        import qlayer_native

        self.core = core
        self._native = qlayer_native
        self.payloads: Any = qlayer_native.Payloads(core.options.payload_budget, core.memory)
        type_index = core.codec.event_encoder.type_index
        self.lane: Any = qlayer_native.Lane(
            self.payloads, {t.value: type_index[t] for t in EventType},
            sorted(DELIVERY_HEADER_KEYS), _LANE_API)
        self._coordinator: tuple[str, int] | None = None
        self._engines_by_topic: dict[str, list[Any]] = {}
        self._fields: dict[str, frozenset[str]] = {}

    def forget_topics(self) -> None:
        """Queues or their journals changed: the engines of each topic are looked up again."""
        self._engines_by_topic.clear()

    # ------------------------------------------------------------------ journal records
    def _engines_for(self, topic: str) -> list[Any]:
        only = self.core.rereading_for
        if only is not None:  # records read again for one queue go to it alone
            return [only.core] if isinstance(only, NativeQueueEngine) else []
        found = self._engines_by_topic.get(topic)
        if found is None:
            found = [e.core for e in self.core._engines_for(topic)
                     if isinstance(e, NativeQueueEngine)]
            self._engines_by_topic[topic] = found
        return found

    def _project(self, topic: str, value: bytes) -> tuple[object, frozenset[str]]:
        """A document past the memory window: the fields the topic's queues read now."""
        fields = self._fields.get(topic)
        if fields is None:
            fields = self._fields[topic] = frozenset().union(
                *(e.fields_needed() for e in self.core._engines_for(topic)))
        self.core.counters["documents_projected"] += 1
        return (self.core.project_value(topic, value, fields) if fields else None), fields

    def enqueue(self, records: list[JournalRecord], now: float) -> None:
        """`ShardCore._enqueue`: offer journal records to the queues of their topics."""
        core = self.core
        self._fields = {}
        room = core.payloads.budget - core.payloads.bytes
        deletes, _projected, lasts = self._native.enqueue(
            self.lane, records, self._engines_for, now, room, self._project,
            core._timing, API.DELETE)
        for topic, n in deletes:
            if core.rereading_for is not None:
                break  # counted when they were first read
            core.counters["deletes_passed_over"] += n
            core.input_faults[topic]["deletes"] += n
        admitted = core._admitted_to
        from layer.store.rows import PartitionKey

        for topic, partition, offset in lasts:
            for engine in core._engines_for(topic):
                key = PartitionKey(engine.name, topic, partition)
                if offset >= admitted.get(key, 0):
                    admitted[key] = offset + 1

    # ------------------------------------------------------------------ decisions
    def decide(self, plan: Plan, now: float) -> None:
        """`ShardCore._decide`: timers, matching, and each queue's decisions into the batch,
        the lane's rows, event items and deliveries."""
        core = self.core
        owner = (core.owner_id, core.epoch)
        if owner != self._coordinator:
            self.lane.set_coordinator(*owner)
            self._coordinator = owner
        batch, lane = plan.batch, self.lane
        native: list[tuple[str, Any]] = []
        for name, engine in core.engines.items():
            engine.tick(now)
            resent = engine.resends(now)
            if resent:
                core.counters["deliveries_resent"] += len(resent)
                plan.deliveries.extend(resent)
            assert isinstance(engine, NativeQueueEngine)
            engine.core.dispatch_into(lane, now)
            wanted = engine.documents_wanted()
            if wanted:
                plan.wanted_documents.extend(wanted)
            engine.core.drain_pending()
            native.append((name, engine.core))
        sessions = {cid: s.session_id for cid, s in core.sessions.items()}
        points = batch.recovery_points
        encode = core.codec.event_encoder.encode_fields
        event_item = core.codec.event_item
        for name, engine_core in native:
            counted_from = core._counted_from.get(name)
            core._recovery_points(name, batch)
            passed = {(k.topic, k.partition): offset for k, offset in points.items()
                      if k.queue == name}
            lost = core._lost.pop(name, None)
            if lost:
                # Entries retention took before the queue was rebuilt, and at-most-once
                # deliveries refused as too large: their events first.
                lane.push_items([event_item(encode(core.owner_id, core.epoch, *f))
                                 for f in event_fields(lost)])
                refused = [e for e in lost if type(e) is ev.DeliveryRefused]
                if refused:
                    batch.count(name, "dead_lettered", len(refused))
                    plan.expired.extend(refused)
                if len(refused) < len(lost):
                    batch.count(name, "expired", len(lost) - len(refused))
                plan.done.extend(e.bookmark for e in lost if type(e) is ev.EntryExpired)
            counts, specials = engine_core.absorb_into(lane, counted_from or None, passed or None,
                                                      sessions)
            for counter, n in counts:
                batch.count(name, counter, n)
            for e in specials:
                if type(e) is ev.EntryExpired:
                    plan.expired.append(e)
                else:
                    core.control.on_consumer_left(e, batch, plan.replies, now)
        runs, singles = lane.take_rows()
        batch.put_runs(runs, singles)

    # ------------------------------------------------------------------ output
    def event_items(self) -> list[bytes]:
        """This step's event items (`Output.event_records` for the native engines)."""
        items: list[bytes] = self.lane.take_items()
        return items

    def missing(self) -> list[Bookmark]:
        """Bookmarks of this step's deliveries whose records are not in memory."""
        found: list[Bookmark] = self.lane.missing()
        return found

    def deliveries(self, reread: dict[Bookmark, JournalRecord],
                   max_bytes: int = DEFAULT_MAX_BATCH_BYTES
                   ) -> tuple[list[OutgoingRecord], list[ev.Delivery], int]:
        """`Output.deliveries` for the native engines' deliveries: the batch records of
        sessions that read batches, the deliveries the Python path sends (to sessions that
        read records, and barriers with such a recipient), and how many messages the batches
        carry."""
        core = self.core
        sessions = {cid: (s.session_id, s.delivery_format == "batch")
                    for cid, s in core.sessions.items()}
        records, python, packed, missing = self.lane.encode_deliveries(sessions, reread,
                                                                      max_bytes)
        for queue, bookmark in missing:
            core.counters["delivery_without_payload"] += 1
            log.error("no payload for %s in queue %s", bookmark, queue)
        return list(records), list(python), int(packed)

    def settle(self) -> None:
        self.lane.settle()

    def reset(self) -> None:
        self.lane.reset()
        self.payloads.clear()
        self._engines_by_topic.clear()
        self._coordinator = None
