"""The native queue engine: `layer/domain/engine.py` ported to Rust (`native/`, the
``qlayer_native`` extension), behind the same interface as `QueueEngine`.

The Python engine is the reference. The native one is a line-by-line port of it (the same
transitions, in the same order, with the same events), so the engine tests run against both
and a differential test drives both with the same inputs and compares every answer
(`tests/unit/domain/test_native_engine.py`). What stays Python is what the reference's
callers hand in: expressions (filters, priority, barrier) are compiled Python objects the
native engine calls, and so are the redelivery back-off and a test's token source.

`native_available()` says whether the extension is installed (``make install`` builds it);
`new_engine` picks an implementation. docs/native-core.md says what is native and why.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping
from typing import Any, Final

from layer.domain import engine as _engine
from layer.domain import events as _events
from layer.domain.consumers import BacklogShare
from layer.domain.definitions import QueueDefinition
from layer.domain.engine import (
    DEFAULT_SESSION_TIMEOUT,
    ConsumerInfo,
    EntryAck,
    QueueEngine,
    QueueStats,
    RecordsWanted,
    TokenSource,
    ViewEntry,
)
from layer.domain.entries import DELETE, EntryRecord, OfferedRecord, priority_rank
from layer.domain.errors import UnknownConsumerError
from layer.domain.expressions import Expression, PartialDocument, RawDocument, document_of
from layer.domain.states import (
    AckOutcome,
    AckSource,
    Bookmark,
    EntryState,
    ExpiryReason,
    LeaveReason,
)

try:  # the extension is built by `make install` (native/); the Python engine works without it
    import qlayer_native as _native
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _native = None

__all__ = ["API", "AnyEngine", "NativeQueueEngine", "native_available", "new_engine"]

#: What the native engine builds its Python answers from (the reference's own types).
API: Final = types.SimpleNamespace(
    Bookmark=Bookmark,
    EntryRecord=EntryRecord,
    Outbox=_events.Outbox,
    ViewEntry=ViewEntry,
    ConsumerInfo=ConsumerInfo,
    QueueStats=QueueStats,
    Recipient=_events.Recipient,
    EntriesEnqueued=_events.EntriesEnqueued,
    EntryDelayed=_events.EntryDelayed,
    EntryLeased=_events.EntryLeased,
    EntryAcked=_events.EntryAcked,
    EntryReleased=_events.EntryReleased,
    LeaseRenewed=_events.LeaseRenewed,
    LeaseExpired=_events.LeaseExpired,
    LeaseBroken=_events.LeaseBroken,
    EntryExpired=_events.EntryExpired,
    BarrierDelivered=_events.BarrierDelivered,
    BacklogFreed=_events.BacklogFreed,
    ConsumerSubscribed=_events.ConsumerSubscribed,
    ConsumerReplaced=_events.ConsumerReplaced,
    ConsumerLeft=_events.ConsumerLeft,
    EntryState=EntryState,
    AckSource=AckSource,
    ExpiryReason=ExpiryReason,
    LeaveReason=LeaveReason,
    AckOutcome=AckOutcome,
    UnknownConsumerError=UnknownConsumerError,
    DELETE=DELETE,
    RawDocument=RawDocument,
    PartialDocument=PartialDocument,
    priority_rank=priority_rank,
    document_of=document_of,
)


def native_available() -> bool:
    """Whether the ``qlayer_native`` extension is installed."""
    return _native is not None


def _share(share: BacklogShare | None) -> Any:
    return None if share is None else share.native_share()


def _filter(filter: str | Expression | None) -> tuple[Expression | None, str | None]:
    expression = _engine._compiled(filter)
    return expression, (expression.text if expression is not None else None)


class NativeQueueEngine:
    """`QueueEngine`'s interface over the native engine (see the module docstring)."""

    __slots__ = ("_core", "definition")

    def __init__(self, definition: QueueDefinition, *, tokens: TokenSource,
                 session_timeout: float = DEFAULT_SESSION_TIMEOUT) -> None:
        if _native is None:
            raise RuntimeError("the qlayer_native extension is not installed (make install)")
        self.definition = definition
        policy = _engine._Policy(definition)
        # OS-random tokens are drawn natively (as `LeaseTokens` draws them); any other source
        # (a test's seeded one) is called.
        native_tokens = bool(getattr(tokens, "os_random", False))
        self._core = _native.NativeEngine(policy, API, tokens, session_timeout, native_tokens)

    @property
    def name(self) -> str:
        return str(self._core.name)

    @property
    def core(self) -> Any:
        """The extension's engine, for the coordinator's batch paths."""
        return self._core

    # ------------------------------------------------------------------ reading
    def recovery_points(self) -> dict[tuple[str, int], int]:
        return dict(self._core.recovery_points())

    def restoring(self, bookmark: Bookmark) -> bool:
        return bool(self._core.restoring(bookmark))

    def entry(self, bookmark: Bookmark) -> EntryRecord | None:
        found: EntryRecord | None = self._core.entry(bookmark)
        return found

    def view(self, filter: str | Expression | None = None, limit: int = 100) -> list[ViewEntry]:
        return list(self._core.view(_engine._compiled(filter), limit))

    def stats(self) -> QueueStats:
        stats: QueueStats = self._core.stats()
        return stats

    def consumers(self) -> list[ConsumerInfo]:
        return list(self._core.consumers())

    def serve_parts(self, parts: int, served: frozenset[int]) -> None:
        self._core.serve_parts(parts, sorted(served))

    def serves(self, partition: int) -> bool:
        return bool(self._core.serves(partition))

    def set_transactional(self, consumer_id: str) -> bool:
        return bool(self._core.set_transactional(consumer_id))

    def take_fences(self) -> list[str]:
        return list(self._core.take_fences())

    def fenced(self, consumer_id: str, now: float) -> bool:
        return bool(self._core.fenced(consumer_id, now))

    def credit_view(self, consumer_id: str) -> tuple[int, int]:
        held, waiting = self._core.credit_view(consumer_id)
        return int(held), int(waiting)

    def fields_needed(self) -> frozenset[str]:
        fields = set(self.definition.expression_fields)
        for expression in self._core.consumer_filters():
            fields |= expression.fields()
        return frozenset(fields)

    def next_deadline(self) -> float | None:
        deadline: float | None = self._core.next_deadline()
        return deadline

    def take_unparseable(self) -> tuple[int, Bookmark | None]:
        count, first = self._core.take_unparseable()
        return int(count), first

    def documents_wanted(self) -> list[Bookmark]:
        return list(self._core.documents_wanted())

    def refresh_documents(self, docs: Mapping[Bookmark, object], fields: frozenset[str]) -> int:
        return int(self._core.refresh_documents(dict(docs), fields))

    def records_wanted(self) -> list[RecordsWanted]:
        return [RecordsWanted(*w) for w in self._core.records_wanted()]

    def deferred(self) -> dict[tuple[str, int], int]:
        return dict(self._core.deferred())

    def expect_rereads(self, through: Mapping[tuple[str, int], int]) -> None:
        self._core.expect_rereads(dict(through))

    def finish_rereads(self) -> None:
        self._core.finish_rereads()

    def purge_deferred(self) -> int:
        return int(self._core.purge_deferred())

    def readmit(self, records: Iterable[OfferedRecord], through: Mapping[tuple[str, int], int],
                now: float, projected: frozenset[str] | None = None) -> int:
        self.expect_rereads(through)
        try:
            return self.enqueue(records, now, projected)
        finally:
            self.finish_rereads()

    # ------------------------------------------------------------------ outbox, restart
    def drain(self) -> _events.Outbox:
        outbox: _events.Outbox = self._core.drain()
        return outbox

    def restore(self, entries: Iterable[EntryRecord],
                recovery_points: Mapping[tuple[str, int], int]) -> None:
        self._core.restore(list(entries), dict(recovery_points))

    def expire_before(self, topic: str, partition: int, offset: int, now: float,
                      reason: ExpiryReason = ExpiryReason.RETENTION) -> int:
        return int(self._core.expire_before(topic, partition, offset, now, str(reason)))

    def expire_entries(self, bookmarks: Iterable[Bookmark], reason: ExpiryReason, now: float,
                       detail: str | None = None) -> int:
        return int(self._core.expire_entries(
            [(b.topic, b.partition, b.offset) for b in bookmarks], str(reason), now, detail))

    def enqueue(self, records: Iterable[OfferedRecord], now: float,
                projected: frozenset[str] | None = None) -> int:
        return int(self._core.enqueue(records, now, projected))

    def resends(self, now: float) -> list[_events.EntryLeased]:
        return list(self._core.resends(now))

    # ------------------------------------------------------------------ consumers
    def subscribe(self, consumer_id: str, session_id: str, now: float, *, delivery_topic: str,
                  max_backlog: int | None = None, filter: str | Expression | None = None,
                  session_timeout: float | None = None, share: BacklogShare | None = None,
                  ) -> _events.ConsumerSubscribed | _events.ConsumerReplaced:
        expression, text = _filter(filter)
        event: _events.ConsumerSubscribed | _events.ConsumerReplaced = self._core.subscribe(
            consumer_id, session_id, now, delivery_topic, max_backlog, expression, text,
            session_timeout, _share(share))
        return event

    def replace(self, consumer_id: str, now: float, *, max_backlog: int | None = None,
                filter: str | Expression | None = None, delivery_topic: str | None = None,
                share: BacklogShare | None = None) -> _events.ConsumerReplaced:
        expression, text = _filter(filter)
        event: _events.ConsumerReplaced = self._core.replace(
            consumer_id, now, max_backlog, expression, text, delivery_topic, _share(share))
        return event

    def retire(self, consumer_id: str, now: float, share: BacklogShare | None = None) -> bool:
        return bool(self._core.retire(consumer_id, now, _share(share)))

    def heartbeat(self, consumer_id: str, now: float, session_id: str | None = None) -> bool:
        return bool(self._core.heartbeat(consumer_id, now, session_id))

    def unsubscribe(self, consumer_id: str, now: float,
                    reason: LeaveReason = LeaveReason.UNSUBSCRIBED) -> bool:
        return bool(self._core.unsubscribe(consumer_id, now, reason))

    # ------------------------------------------------------------------ acks, timers, dispatch
    def ack(self, items: Iterable[EntryAck], now: float, consumer: str | None = None
            ) -> list[AckOutcome]:
        return list(self._core.ack(items, now, consumer))

    def ack_matching(self, filter: str | Expression | None, now: float) -> int:
        return int(self._core.ack_matching(_engine._compiled(filter), now))

    def tick(self, now: float) -> None:
        self._core.tick(now)

    def dispatch(self, now: float) -> list[_events.Delivery]:
        return list(self._core.dispatch(now))

    def __repr__(self) -> str:
        return f"NativeQueueEngine({self.name!r})"


#: Either engine: the coordinator drives both through the same interface.
AnyEngine = QueueEngine | NativeQueueEngine


def new_engine(definition: QueueDefinition, *, tokens: TokenSource,
               session_timeout: float = DEFAULT_SESSION_TIMEOUT,
               native: bool = False) -> AnyEngine:
    """The reference engine, or the native one when ``native`` (and the extension is built)."""
    if native:
        return NativeQueueEngine(definition, tokens=tokens, session_timeout=session_timeout)
    return QueueEngine(definition, tokens=tokens, session_timeout=session_timeout)
