"""Publishing, debug consuming, dead letters and redrive: the services behind `qlayer publish`,
`qlayer consume` and `qlayer dlq`.

Redrive moves every dead letter exactly once, even when run twice or interrupted: it reads the
dead-letter topic in the consumer group ``<prefix>redrive.<queue>`` and writes the re-published
records *and* that group's read position in one Kafka transaction (``send_offsets_to_transaction``).
A batch is either published with its position committed, or neither; a second run starts after
the last committed batch. The transactional id is per queue, so two redrives of one queue at
the same time fence each other instead of both moving the same records.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from layer.domain.definitions import QueueDefinition
from layer.domain.durations import parse_duration
from layer.domain.errors import QlayerError, QueueConfigError
from layer.domain.expressions import Expression, compile_expression, parse_document
from layer.kafka import JournalReader, JournalRecord, KafkaAdapterError, KafkaAdmin
from layer.kafka.scan import RangeScanner
from layer.kafka.transactions import TransactionalRelay
from layer.protocol.bookmark import Bookmark
from layer.protocol.errors import ProtocolError
from layer.protocol.headers import (
    DLQ_HEADER_KEYS,
    DLQ_VALUE_OMITTED,
    DeadLetterInfo,
    header_value,
    parse_dead_letter_headers,
)
from layer.protocol.topics import TopicNames
from layer.sdk import Message, QueueConsumer, QueuePublisher
from layer.sdk.publisher import expiration_ms
from layer.services.views import queue_definition
from layer.settings import Settings
from layer.store.store import Store

__all__ = [
    "CARRIED_FROM",
    "REDRIVEN_FROM",
    "ConsumedMessage",
    "DeadLetter",
    "DeadLetterList",
    "InvalidOptionError",
    "PublishResult",
    "RedriveResult",
    "Settle",
    "consume",
    "dead_letter_topic",
    "list_dead_letters",
    "parse_bookmark_options",
    "parse_deliver_at_option",
    "parse_expiration_option",
    "parse_header_options",
    "publish_lines",
    "queue_definition",
    "redrive",
    "redrive_group",
]

#: Header a redriven record carries: the bookmark the dead letter was made from.
REDRIVEN_FROM = "qlayer.redriven-from"
#: Header of a dead letter carried forward by a selective redrive: the position it was
#: copied from (`TOPIC/PARTITION/OFFSET` of the dead-letter topic).
CARRIED_FROM = "qlayer.dlq.carried-from"
#: Records per redrive transaction at most (one transaction is also closed every second).
REDRIVE_BATCH = 500

Settle = Literal["ack", "release", "reject"]


class InvalidOptionError(QlayerError, ValueError):
    """A command-line value that cannot be used; the message says what is expected."""


# --- shared ------------------------------------------------------------------------------------


def dead_letter_topic(definition: QueueDefinition, prefix: str) -> str:
    """Where the coordinator writes the queue's dead letters (as `Coordinator` derives it)."""
    return definition.dead_letter_topic or TopicNames(prefix).dead_letter(definition.name)


def redrive_group(prefix: str, queue: str) -> str:
    """The consumer group whose committed offsets say how far redrive has moved."""
    return prefix + "redrive." + queue


def _filter(text: str | None) -> Expression | None:
    return None if text is None else compile_expression(text)


# --- publish -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PublishResult:
    topic: str
    count: int


def parse_header_options(pairs: Sequence[str]) -> list[tuple[str, str]]:
    """``k=v`` strings as header pairs, in order (a name may repeat, as Kafka allows)."""
    headers = []
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise InvalidOptionError(f"header {pair!r} is not name=value; write e.g. source=web")
        headers.append((name, value))
    return headers


def parse_deliver_at_option(text: str, now: datetime) -> datetime:
    """``+30s`` / ``+5m`` (from ``now``) or an ISO-8601 time with a zone (``Z`` allowed)."""
    if text.startswith("+"):
        try:
            return now + timedelta(seconds=parse_duration(text[1:]))
        except (QlayerError, ValueError) as exc:
            raise InvalidOptionError(f"--deliver-at {text!r}: {exc}") from exc
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as exc:
        raise InvalidOptionError(
            f"--deliver-at {text!r} is neither +DURATION (e.g. +30s) nor an ISO-8601 time "
            "(e.g. 2030-01-01T09:00:00Z)") from exc
    if moment.tzinfo is None:
        raise InvalidOptionError(
            f"--deliver-at {text!r} has no time zone; add Z or +02:00, or use +DURATION")
    return moment


def parse_expiration_option(text: str) -> timedelta:
    """``30s`` / ``5m`` / ``1h``: a message's own expiration, 1 ms to 366 days."""
    try:
        seconds = parse_duration(text)
        expiration_ms(seconds)
    except (QlayerError, ValueError, TypeError) as exc:
        raise InvalidOptionError(f"--expiration {text!r}: {exc}") from exc
    return timedelta(seconds=seconds)


def publish_lines(
    settings: Settings,
    queue_or_topic: str,
    lines: Iterable[str],
    *,
    key: str | None = None,
    headers: Sequence[tuple[str, str]] = (),
    deliver_at: datetime | None = None,
    expiration: timedelta | None = None,
) -> PublishResult:
    """Publish one record per line (without its line break; empty lines are skipped)."""
    count = 0
    with QueuePublisher(settings.bootstrap_servers, topic_prefix=settings.topic_prefix,
                        kafka_config=settings.kafka) as publisher:
        topic = publisher.target(queue_or_topic)
        for line in lines:
            value = line.rstrip("\r\n")
            if not value:
                continue
            publisher.publish(queue_or_topic, value, key=key, headers=list(headers) or None,
                              deliver_at=deliver_at, expiration=expiration)
            count += 1
    return PublishResult(topic, count)


# --- consume -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConsumedMessage:
    """One message as the debug consumer saw it, after settling it."""

    queue: str
    bookmark: str
    delivery_count: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    timestamp: datetime | None
    settled: str


def _settle(message: Message, how: Settle, reason: str | None) -> None:
    if message.is_barrier:
        return  # barriers need no settling
    if how == "release":
        message.release()
    elif how == "reject":
        message.reject(reason=reason)
    else:
        message.ack()


def consume(
    settings: Settings,
    queue: str,
    on_message: Callable[[ConsumedMessage], None],
    *,
    max_backlog: int = 1,
    count: int | None = None,
    filter: str | None = None,
    settle: Settle = "ack",
    reason: str | None = None,
    idle_timeout: float | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Receive, settle and hand each message to ``on_message`` until ``count`` messages,
    ``idle_timeout`` seconds without one, or ``stop``; returns how many were settled. The
    consumer is closed on the way out (also on Ctrl-C), so what it still holds goes back at once.

    With ``count``, the consumer never holds more leases than messages it is still to show:
    it subscribes with ``max_backlog`` at most ``count``, and before settling a message that
    would free room it does not need, it lowers its backlog (a replace the coordinator
    confirms) to what is left to show, 0 before the last. Otherwise settling the last message
    let the coordinator lease the next one to it, and closing broke that lease: a delivery
    the operator never saw, counted against ``max_deliveries`` (issue 16 item 6). Barrier
    messages hold no lease and need no settling: they are shown and not counted.
    """
    handled = 0
    limit = max_backlog if count is None else min(max_backlog, count)
    with QueueConsumer(queue, settings.bootstrap_servers, topic_prefix=settings.topic_prefix,
                       kafka_config=settings.kafka, max_backlog=limit,
                       filter=filter, client_name="qlayer-cli") as consumer:
        idle_since = time.monotonic()
        while count is None or handled < count:
            if stop is not None and stop.is_set():
                break
            message = consumer.receive(timeout=0.5)
            if message is None:
                if idle_timeout is not None and time.monotonic() - idle_since >= idle_timeout:
                    break
                continue
            idle_since = time.monotonic()
            if not message.is_barrier:
                if count is not None and count - handled - 1 < limit:
                    # Before the settlement frees room: once the replace is answered the
                    # coordinator leases no more than what is left to show.
                    limit = count - handled - 1
                    consumer.replace(max_backlog=limit)
                _settle(message, settle, reason)
                handled += 1
            on_message(ConsumedMessage(
                queue=message.queue, bookmark=str(message.bookmark),
                delivery_count=message.delivery_count, key=message.key, value=message.value,
                headers=list(message.headers), timestamp=message.timestamp,
                settled="barrier" if message.is_barrier else settle))
    return handled


# --- dead letters ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One record of a dead-letter topic; ``info`` is None when its headers are not qlayer's."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    headers: list[tuple[str, bytes | None]]
    info: DeadLetterInfo | None

    @property
    def position(self) -> str:
        return f"{self.topic}/{self.partition}/{self.offset}"


def _dead_letter(record: JournalRecord) -> DeadLetter:
    try:
        info: DeadLetterInfo | None = parse_dead_letter_headers(record.headers)
    except ProtocolError:
        info = None
    return DeadLetter(record.topic, record.partition, record.offset, record.key, record.value,
                      record.timestamp_ms, list(record.headers or ()), info)


def _belongs(letter: DeadLetter, queue: str) -> bool:
    # A dead-letter topic may be shared by several queues; each sees only its own letters.
    return letter.info is not None and letter.info.queue == queue


def _partitions(admin: KafkaAdmin, topic: str) -> list[tuple[str, int]]:
    count = admin.topics().get(topic, 0)
    return [(topic, p) for p in range(count)]


@dataclass(frozen=True, slots=True)
class DeadLetterList:
    """The queue's dead letters still waiting (the first ``limit`` shown) and their totals."""

    dead_letter_topic: str
    letters: list[DeadLetter]
    total: int
    by_reason: dict[str, int]


def list_dead_letters(settings: Settings, queue: str, *, limit: int | None = 100
                      ) -> DeadLetterList:
    """The queue's dead letters a redrive has not dealt with yet (moved or deleted): the
    oldest ``limit`` by when they were dead-lettered, and how many there are by reason."""
    with Store(settings.database_url) as store:
        definition = queue_definition(store, queue)
    topic = dead_letter_topic(definition, settings.topic_prefix)
    admin = KafkaAdmin(settings.kafka_config())
    pairs = _partitions(admin, topic)
    if not pairs:
        return DeadLetterList(topic, [], 0, {})
    log_starts = admin.log_start_offsets(pairs)
    ends = admin.end_offsets(pairs)
    # Below the redrive group's position every letter was moved, deleted or carried forward
    # (copied past the position, where it is read again); see `redrive`.
    committed = _committed_positions(settings, queue, pairs)
    starts = {tp: max(committed.get(tp) or 0, log_starts.get(tp, 0)) for tp in pairs}
    reader = RangeScanner(settings.kafka_config(), settings.topic_prefix + "cli")
    by_reason: Counter[str] = Counter()

    def waiting() -> Iterator[DeadLetter]:
        for record in reader.read(starts, ends):
            letter = _dead_letter(record)
            if _belongs(letter, queue):
                assert letter.info is not None
                by_reason[letter.info.reason] += 1
                yield letter

    def oldest_first(d: DeadLetter) -> tuple[int, int, int]:
        return (d.info.dead_lettered_at_ms if d.info else d.timestamp_ms, d.partition, d.offset)

    try:
        # Every waiting letter is read (for the totals); only the oldest ``limit`` are kept.
        letters = (sorted(waiting(), key=oldest_first) if limit is None
                   else heapq.nsmallest(limit, waiting(), key=oldest_first))
    finally:
        reader.close()
    return DeadLetterList(topic, letters, sum(by_reason.values()), dict(by_reason))


# --- redrive -----------------------------------------------------------------------------------


@dataclass(slots=True)
class RedriveResult:
    """What one redrive (or delete) run did, or with ``dry_run`` would do."""

    dead_letter_topic: str
    scanned: int = 0
    moved: int = 0
    deleted: int = 0
    carried: int = 0
    """Letters of this queue not selected (``filter``, ``bookmarks``): copied past the
    position, so a later redrive sees them again."""
    skipped_other: int = 0
    skipped_duplicate: int = 0
    value_omitted: int = 0
    """Letters selected but not moved because they carry no value (``qlayer.dlq.value-
    omitted``: the record was too large to deliver, issue 15): carried forward like the letters
    not selected, so they stay listed until `qlayer dlq delete` drops them; the record is at
    its original bookmark in the journal until retention removes it."""
    dry_run: bool = False
    targets: dict[str, int] = field(default_factory=dict)

    @property
    def skipped_filter(self) -> int:
        """The letters passed over by the selection (kept for the redrive, carried)."""
        return self.carried


def _redrive_target(definition: QueueDefinition, letter: DeadLetter) -> str:
    if definition.default_publish_target is not None:
        return definition.default_publish_target
    assert letter.info is not None
    original = header_value(letter.headers, "qlayer.dlq.original-topic")
    return original.decode() if original else letter.info.original_topic


def _redriven_headers(letter: DeadLetter) -> list[tuple[str, bytes | None]]:
    assert letter.info is not None
    kept = [(k, v) for k, v in letter.headers
            if k not in DLQ_HEADER_KEYS and k not in (REDRIVEN_FROM, CARRIED_FROM)]
    kept.append((REDRIVEN_FROM, letter.info.bookmark.format().encode()))
    return kept


def _carried_headers(letter: DeadLetter) -> list[tuple[str, bytes | None]]:
    kept = [(k, v) for k, v in letter.headers if k != CARRIED_FROM]
    kept.append((CARRIED_FROM, letter.position.encode()))
    return kept


def parse_bookmark_options(texts: Sequence[str]) -> frozenset[Bookmark]:
    """``TOPIC/PARTITION/OFFSET`` strings (the original bookmarks `qlayer dlq list` shows)."""
    found = set()
    for text in texts:
        try:
            found.add(Bookmark.parse(text))
        except (QlayerError, ValueError) as exc:
            raise InvalidOptionError(
                f"--bookmark {text!r} is not TOPIC/PARTITION/OFFSET (as `qlayer dlq list` "
                f"shows it): {exc}") from None
    return frozenset(found)


def redrive(
    settings: Settings,
    queue: str,
    *,
    rate: float | None = None,
    filter: str | None = None,
    bookmarks: Sequence[str] = (),
    delete: bool = False,
    dry_run: bool = False,
    progress: Callable[[int, int], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> RedriveResult:
    """Re-publish the queue's dead letters to its journal, each exactly once; or, with
    ``delete``, drop them for good.

    Reads from where the last redrive of this queue stopped up to the end the topic has now
    (letters that fail again meanwhile wait for the next run). With ``filter`` and/or
    ``bookmarks`` (original bookmarks, ``TOPIC/PARTITION/OFFSET``) only the letters selected
    are moved (or deleted); the queue's other letters are *carried forward*: copied to the end
    of the dead-letter topic in the same transaction that moves the position past them, so the
    next redrive (and `list_dead_letters`) sees them again. Kafka cannot delete one record
    from a topic: a deleted letter stays in the topic until retention removes it, behind the
    position and never copied, so no redrive moves it and no list shows it. Records of other
    queues are passed over (their own queue's position covers them). ``progress(done,
    total)`` is called as records are read; ``rate`` caps records moved per second.
    """
    expression = _filter(filter)
    selected = parse_bookmark_options(bookmarks)
    if delete and expression is None and not selected:
        raise InvalidOptionError("delete needs --filter EXPR or --bookmark TOPIC/PARTITION/"
                                 "OFFSET: which dead letters to delete")
    with Store(settings.database_url) as store:
        definition = queue_definition(store, queue)
    if (not delete and definition.default_publish_target is None
            and definition.is_regex_topic):
        raise QueueConfigError([(f"{queue}.default_publish_target",
                                 "redrive needs a journal to write to; this queue reads a "
                                 "regular expression, so set default_publish_target")])
    topic = dead_letter_topic(definition, settings.topic_prefix)
    result = RedriveResult(topic, dry_run=dry_run)
    admin = KafkaAdmin(settings.kafka_config())
    pairs = _partitions(admin, topic)
    if not pairs:
        return result
    try:
        tx = (TransactionalRelay(settings.kafka_config(),
                                 redrive_group(settings.topic_prefix, queue))
              if not dry_run else None)
    except KafkaAdapterError as exc:
        raise KafkaAdapterError(f"cannot start the redrive transaction: {exc}") from exc
    reader = RangeScanner(settings.kafka_config(), settings.topic_prefix + "cli")
    try:
        log_starts = admin.log_start_offsets(pairs)
        ends = admin.end_offsets(pairs)
        committed = (tx.committed(pairs) if tx is not None
                     else _committed_positions(settings, queue, pairs))
        starts = {tp: max(committed.get(tp) or 0, log_starts.get(tp, 0)) for tp in pairs}
        total = sum(max(0, ends[tp] - starts[tp]) for tp in pairs)
        if progress is not None:
            progress(0, total)
        positions: dict[tuple[str, int], int] = {}
        began = batch_started = time.monotonic()
        seen: set[Bookmark] = set()
        in_batch = 0
        for record in reader.read(starts, ends):
            result.scanned += 1
            letter = _dead_letter(record)
            positions[(record.topic, record.partition)] = record.offset + 1
            if not _belongs(letter, queue):
                result.skipped_other += 1
            elif letter.info is not None and letter.info.bookmark in seen:
                # The coordinator writes a dead letter twice when it crashes between writing
                # it and recording it (docs/coordinator.md); the entry comes back once.
                result.skipped_duplicate += 1
            elif ((expression is not None
                   and not expression.matches(parse_document(letter.value)))
                  or (selected and letter.info is not None
                      and letter.info.bookmark not in selected)):
                result.carried += 1
                if tx is not None:
                    if in_batch == 0:
                        batch_started = time.monotonic()
                    tx.send(topic, letter.value, letter.key, _carried_headers(letter))
                    in_batch += 1
            elif not delete and header_value(letter.headers, DLQ_VALUE_OMITTED) is not None:
                # Written without its value (too large to deliver): republishing it would
                # publish an empty record under the original's bookmark. It is kept, carried
                # past the position as an unselected letter is, for an operator to look at
                # (its record is in the journal at its original bookmark) and delete.
                result.value_omitted += 1
                if tx is not None:
                    if in_batch == 0:
                        batch_started = time.monotonic()
                    tx.send(topic, letter.value, letter.key, _carried_headers(letter))
                    in_batch += 1
            elif delete:
                assert letter.info is not None
                seen.add(letter.info.bookmark)
                result.deleted += 1
                if tx is not None:  # nothing to write: the position moving past it is all
                    if in_batch == 0:
                        batch_started = time.monotonic()
                    in_batch += 1
            else:
                assert letter.info is not None
                seen.add(letter.info.bookmark)
                target = _redrive_target(definition, letter)
                if rate is not None and rate > 0:
                    # The n-th record goes no earlier than n / rate seconds after the start.
                    wait = began + result.moved / rate - time.monotonic()
                    if wait > 0:
                        sleep(wait)
                if tx is not None:
                    if in_batch == 0:
                        batch_started = time.monotonic()
                    tx.send(target, letter.value, letter.key, _redriven_headers(letter))
                    in_batch += 1
                result.moved += 1
                result.targets[target] = result.targets.get(target, 0) + 1
            if tx is not None and in_batch and (
                    in_batch >= REDRIVE_BATCH or time.monotonic() - batch_started >= 1.0):
                tx.commit(positions)
                positions, in_batch = {}, 0
            if progress is not None:
                progress(result.scanned, total)
        if tx is not None:
            tx.commit(positions)
    except KafkaAdapterError as exc:
        what = "delete" if delete else "redrive"
        raise KafkaAdapterError(f"{what} of {queue!r} failed (nothing of the open batch was "
                                f"moved; run it again to continue): {exc}") from exc
    finally:
        reader.close()
        if tx is not None:
            tx.close()
    return result


def _committed_positions(settings: Settings, queue: str, pairs: list[tuple[str, int]]
                         ) -> dict[tuple[str, int], int | None]:
    reader = JournalReader(settings.kafka_config(), group_id=redrive_group(
        settings.topic_prefix, queue))
    try:
        return reader.committed(pairs)
    finally:
        reader.close()

