"""One message of a queue, by its bookmark: the journal record (key, headers, a preview of the
value), the entry's stored state (delivery count, lease holder and deadline, why it expired)
and its events so far, read from the events topic. The console's message page.

Read-only, as `qlayer view`. The events are found by scanning the events topic forward from
a minute before the record's timestamp, at most ``event_scan_limit`` records (records that
cannot hold the message's events, by their bytes, are skipped without decoding); past that
the page says the list may be incomplete, and the Spark pipeline (`qlayer pipeline
lifecycle`) has every event of every message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from layer.domain.definitions import QueueDefinition
from layer.domain.errors import QlayerError, UnknownQueueError
from layer.kafka import KafkaAdmin
from layer.kafka.scan import RangeScanner
from layer.protocol import Bookmark, Codec, Event, ProtocolError, TopicNames
from layer.settings import Settings
from layer.store.rows import EntryRow
from layer.store.store import Store

__all__ = ["EVENT_SCAN_LIMIT", "PREVIEW_BYTES", "MessageDetails", "message_details"]

#: How much of a value the page shows.
PREVIEW_BYTES = 4096
#: How many records of the events topic one look-up reads at most.
EVENT_SCAN_LIMIT = 50_000
#: Events are looked for from this long before the record's timestamp (a producer's clock
#: may run ahead of the coordinator's).
_EVENTS_SLACK_MS = 60_000


class BadBookmarkError(QlayerError, ValueError):
    """A bookmark that is not ``topic/partition/offset`` or not of the queue's journals."""


@dataclass(frozen=True, slots=True)
class MessageDetails:
    queue: str
    bookmark: Bookmark
    state: str
    """LEASED, AVAILABLE, ACKED, EXPIRED, DONE (settled, its row pruned), or MISSING."""
    explanation: str
    record_found: bool
    key: bytes | None = None
    value_preview: bytes | None = None
    value_size: int = 0
    headers: list[tuple[str, bytes | None]] = field(default_factory=list)
    timestamp_ms: int | None = None
    entry: EntryRow | None = None
    recovery_point: int | None = None
    events: list[Event] = field(default_factory=list)
    events_scanned: int = 0
    events_complete: bool = True
    events_from_ms: int | None = None

    @property
    def value_truncated(self) -> bool:
        return self.value_preview is not None and len(self.value_preview) < self.value_size


def parse_bookmark(text: str, definition: QueueDefinition) -> Bookmark:
    try:
        bookmark = Bookmark.parse(text)
    except ProtocolError as exc:
        raise BadBookmarkError(str(exc)) from None
    if not definition.matches_topic(bookmark.topic):
        raise BadBookmarkError(f"bookmark {text}: topic {bookmark.topic!r} is not a journal of "
                               f"queue {definition.name!r}")
    return bookmark


def message_details(settings: Settings, queue: str, bookmark_text: str, *,
                    event_scan_limit: int = EVENT_SCAN_LIMIT) -> MessageDetails:
    """Everything known of one message; ``UnknownQueueError`` or ``BadBookmarkError``."""
    with Store(settings.database_url) as store:
        record = store.get_queue(queue)
        if record is None:
            raise UnknownQueueError(queue)
        definition = QueueDefinition.from_mapping(record.definition)
        bookmark = parse_bookmark(bookmark_text, definition)
        where = (bookmark.topic, bookmark.partition, bookmark.offset)
        entry = store.load_entry(queue, *where)
        points = store.load_recovery_points(queue)
    point = next((offset for key, offset in points.items()
                  if (key.topic, key.partition) == (bookmark.topic, bookmark.partition)), None)
    admin = KafkaAdmin(settings.kafka_config())
    tp = (bookmark.topic, bookmark.partition)
    listed = admin.topics()
    if listed.get(bookmark.topic, 0) <= bookmark.partition:
        return MessageDetails(queue, bookmark, "MISSING", f"the journal has no partition "
                              f"{bookmark.topic}/{bookmark.partition}", False, entry=entry,
                              recovery_point=point)
    start = admin.log_start_offsets([tp])[tp]
    end = admin.end_offsets([tp])[tp]
    if not start <= bookmark.offset < end:
        why = ("the journal's retention deleted it" if bookmark.offset < start
               else f"nothing is written there yet (the partition ends at {end})")
        return MessageDetails(queue, bookmark, _state(entry, point, bookmark)[0],
                              f"no record at this bookmark: {why}", False, entry=entry,
                              recovery_point=point)
    scanner = RangeScanner(settings.kafka_config(), settings.topic_prefix + "cli")
    try:
        found = next(iter(scanner.read({tp: bookmark.offset}, {tp: bookmark.offset + 1})), None)
    finally:
        scanner.close()
    state, explanation = _state(entry, point, bookmark)
    if found is None or found.offset != bookmark.offset:
        # A transaction's commit marker sits at an offset no record is read at.
        return MessageDetails(queue, bookmark, "MISSING", "no record at this bookmark (a "
                              "transaction marker, or an aborted record)", False, entry=entry,
                              recovery_point=point)
    value = found.value
    events, scanned, complete, since = _events(settings, admin, listed, queue, bookmark,
                                               found.timestamp_ms, event_scan_limit)
    return MessageDetails(
        queue, bookmark, state, explanation, True, key=found.key,
        value_preview=None if value is None else value[:PREVIEW_BYTES],
        value_size=0 if value is None else len(value),
        headers=list(found.headers or ()), timestamp_ms=found.timestamp_ms, entry=entry,
        recovery_point=point, events=events, events_scanned=scanned, events_complete=complete,
        events_from_ms=since)


def _state(entry: EntryRow | None, point: int | None, bookmark: Bookmark) -> tuple[str, str]:
    if entry is not None:
        explanations = {
            "LEASED": f"leased to {entry.lease_consumer}",
            "AVAILABLE": "available (released or back from an expired lease)",
            "ACKED": "acknowledged",
            "EXPIRED": f"left the queue: {entry.reason or 'expired'}",
        }
        return entry.state, explanations.get(entry.state, entry.state.lower())
    if point is not None and bookmark.offset < point:
        return "DONE", ("settled (acknowledged or expired) and below the recovery point, so "
                        "its row was pruned; its events say which")
    return "AVAILABLE", "available: no lease so far (or not read by the coordinator yet)"


def _events(settings: Settings, admin: KafkaAdmin, listed: dict[str, int], queue: str,
            bookmark: Bookmark, timestamp_ms: int | None, limit: int
            ) -> tuple[list[Event], int, bool, int | None]:
    """(the message's events, records read, whether the scan reached the end, from when)."""
    topic = TopicNames(settings.topic_prefix).events
    partitions = listed.get(topic, 0)
    if not partitions:
        return [], 0, True, None
    pairs = [(topic, p) for p in range(partitions)]
    since = max(0, (timestamp_ms or 0) - _EVENTS_SLACK_MS)
    starts = admin.offsets_for_time(pairs, since)
    ends = admin.end_offsets(pairs)
    # Avro writes strings as their bytes: a record holding none of the message's topic cannot
    # hold its events, and is skipped undecoded.
    needle = bookmark.topic.encode()
    codec = Codec()
    found: list[Event] = []
    scanned = 0
    complete = True
    scanner = RangeScanner(settings.kafka_config(), settings.topic_prefix + "cli")
    try:
        for r in scanner.read(starts, ends):
            scanned += 1
            if scanned > limit:
                complete = False
                break
            if r.value is None or needle not in r.value:
                continue
            try:
                events = codec.decode_events(r.value)
            except ProtocolError:
                continue  # counted by the pipeline; a page shows what it can read
            found.extend(e for e in events if e.queue == queue and e.bookmark == bookmark)
    finally:
        scanner.close()
    found.sort(key=lambda e: e.timestamp_ms)
    return found, min(scanned, limit), complete, since
