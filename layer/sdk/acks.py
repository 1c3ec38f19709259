"""Ack batching policy: when buffered acknowledgement items go out as one AckRecord. Pure.

One AckRecord per message would double the records on the ack topic and the coordinator's
work, so items are buffered and sent together when

- ``max_items`` are waiting (a full batch), or
- the oldest has waited ``max_delay`` seconds (settlement is never held up for long), or
- the consumer is about to wait for new messages (nothing more will be acknowledged until
  one comes; with ``max_backlog=1`` waiting any longer would stall the queue), or
- the consumer closes, or a RENEW needs its answer now.

The last three are decided by the consumer, which calls :meth:`AckBatcher.drain`; the first
two are decided here, with ``now`` (monotonic seconds) passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layer.protocol.records import AckItem, AckType

__all__ = ["DEFAULT_ACK_BATCH_SIZE", "DEFAULT_ACK_INTERVAL", "Accept", "AckBatcher"]

#: An ACCEPT that may travel in an AcceptRecord, as plain values: (queue, topic, partition,
#: offset, lease). A consumer acks every message; an `AckItem` and its bookmark string each
#: time were most of what acking cost it.
Accept = tuple[str, str, int, int, str]

DEFAULT_ACK_BATCH_SIZE = 500
DEFAULT_ACK_INTERVAL = 0.1


@dataclass(slots=True)
class AckBatcher:
    """Buffered acknowledgement items of one session, in the order they were given."""

    max_items: int = DEFAULT_ACK_BATCH_SIZE
    max_delay: float = DEFAULT_ACK_INTERVAL
    _items: list[AckItem] = field(default_factory=list)
    #: Per item: whether it may travel in an AcceptRecord (an ACCEPT of a message that came in
    #: a delivery batch, whose coordinator reads them).
    _acceptable: list[bool] = field(default_factory=list)
    #: ACCEPTs given as values (`add_accept`): they travel in an AcceptRecord.
    _accepts: list[Accept] = field(default_factory=list)
    _oldest_at: float | None = None

    def __post_init__(self) -> None:
        if self.max_items < 1:
            raise ValueError(f"ack batch size must be at least 1, got {self.max_items}")
        if self.max_delay < 0:
            raise ValueError(f"ack interval must not be negative, got {self.max_delay}")

    def __len__(self) -> int:
        return len(self._items) + len(self._accepts)

    def add(self, item: AckItem, now: float, acceptable: bool = False) -> bool:
        """Buffer ``item``; True when the batch should be sent now. ``acceptable``: the item
        may go in an AcceptRecord (see `split`)."""
        if not self._items and not self._accepts:
            self._oldest_at = now
        self._items.append(item)
        self._acceptable.append(acceptable)
        return self.is_due(now)

    def add_accept(self, accept: Accept, now: float) -> bool:
        """Buffer the ACCEPT of a batch-delivered message (it goes in an AcceptRecord); True
        when the batch should be sent now."""
        accepts = self._accepts
        if not accepts and not self._items:
            self._oldest_at = now
        accepts.append(accept)
        return len(accepts) + len(self._items) >= self.max_items or (
            now >= self._oldest_at + self.max_delay)  # type: ignore[operator]

    def is_due(self, now: float) -> bool:
        """True when the buffered items should be sent (full, or the oldest waited enough)."""
        if not self._items and not self._accepts:
            return False
        if len(self) >= self.max_items:
            return True
        # Same arithmetic as due_at(), so a wake-up at due_at() finds the batch due.
        return self._oldest_at is not None and now >= self._oldest_at + self.max_delay

    def due_at(self) -> float | None:
        """When the buffered items become due by age (None when nothing is buffered)."""
        if self._oldest_at is None or not len(self):
            return None
        return self._oldest_at + self.max_delay

    def drain(self) -> list[AckItem]:
        """Take every buffered item, leaving the batcher empty: the items in the order they
        were given, then the accepts given as values (as items)."""
        items, self._items = self._items, []
        accepts, self._accepts = self._accepts, []
        self._acceptable = []
        self._oldest_at = None
        items.extend(AckItem(queue=q, bookmark=f"{t}/{p}/{o}", lease=lease, type=AckType.ACCEPT)
                     for q, t, p, o, lease in accepts)
        return items

    def split(self) -> tuple[list[list[AckItem]], list[Accept]]:
        """Take every buffered item: AckRecord batches (of at most ``max_items``) and the
        ACCEPTs that may go as one AcceptRecord (as values). The AckRecords go first; an entry
        is settled once, so the order between the two matters only for a RENEW, which is never
        in the second list."""
        acceptable = self._acceptable
        items, self._items = self._items, []
        accepts, self._accepts = self._accepts, []
        self._acceptable = []
        self._oldest_at = None
        if any(acceptable):
            rest = []
            for item, ok in zip(items, acceptable, strict=True):
                if not ok:
                    rest.append(item)
                    continue
                topic, partition, offset = item.bookmark.rsplit("/", 2)
                accepts.append((item.queue, topic, int(partition), int(offset), item.lease))
            items = rest
        return [items[i : i + self.max_items]
                for i in range(0, len(items), self.max_items)], accepts

    def batches(self) -> list[list[AckItem]]:
        """Take every buffered item split into batches of at most ``max_items``."""
        items = self.drain()
        return [items[i : i + self.max_items] for i in range(0, len(items), self.max_items)]
