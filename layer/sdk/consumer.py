"""QueueConsumer: subscribe to a queue, receive leased messages, settle them.

Everything goes through Kafka (``docs/protocol.md``): a Subscribe on the control topic, the
coordinator's answer and the deliveries on this consumer's delivery topic, acknowledgements on
the ack topic. Threads: the object is used from one thread of yours (``receive``, iteration,
``run``, ``replace``, ``renew``); ``ack``/``release``/``reject`` may also be called from other
threads. The SDK's own background thread sends heartbeats and flushes acknowledgements that
have waited long enough; every piece of state it shares is guarded by one lock.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

from layer import __version__
from layer.domain.authorization import CredentialError, parse_credential
from layer.domain.errors import ExpressionError, QlayerError
from layer.domain.expressions import compile_expression
from layer.domain.likepattern import name_matcher
from layer.kafka.acls import sdk_group
from layer.protocol.batch import (
    BATCH,
    DELIVERY_FORMAT,
    DeliveryFormat,
    decode_delivery_batch_fields,
)
from layer.protocol.bookmark import partition_of
from layer.protocol.codec import Codec
from layer.protocol.errors import ProtocolError
from layer.protocol.headers import (
    CREDENTIAL,
    FENCING,
    NOT_AUTHORIZED,
    REFUSAL,
    SESSION,
    SPANS_SHARDS,
    TRANSACTIONAL_ID,
    header_value,
    is_reply,
    new_session_secret,
    parse_credit_report,
    parse_shards,
    proof_headers,
    reply_shard,
    secret_headers,
)
from layer.protocol.records import (
    AcceptGroup,
    AcceptRecord,
    AckItem,
    AckItemResult,
    AckRecord,
    AckResult,
    AckStatus,
    AckType,
    ControlMessage,
    Heartbeat,
    QueueGrant,
    Replace,
    ReplyMessage,
    SessionEnded,
    SessionEndReason,
    Subscribe,
    SubscribeResult,
    SubscribeStatus,
    Unsubscribe,
)
from layer.sdk import spanning
from layer.sdk.acks import DEFAULT_ACK_BATCH_SIZE, DEFAULT_ACK_INTERVAL, Accept, AckBatcher
from layer.sdk.config import ClientConfig
from layer.sdk.directory import QueueDirectory
from layer.sdk.errors import (
    AckFailure,
    ConsumerClosedError,
    InvalidFilterError,
    InvalidSubscriptionError,
    LeaseLostError,
    NoCoordinatorError,
    NotAuthorizedError,
    SessionEndedError,
    TransactionAbortedError,
    UnknownQueueError,
)
from layer.sdk.identity import SecretStore, default_state_dir
from layer.sdk.leases import SeenLeases
from layer.sdk.message import Message, from_epoch_ms
from layer.sdk.message import delay_ms as release_delay_ms
from layer.sdk.spans import Spans
from layer.sdk.transaction import Transaction, TransactionalProducer, transactional_id_for
from layer.sdk.transport import DeliveryReader, SdkProducer

__all__ = ["ConsumerStats", "OnError", "QueueConsumer"]

log = logging.getLogger(__name__)

#: What ``run`` does with a message whose handler raised: ``"release"`` it for redelivery
#: (after ``release_delay``), ``"reject"`` it to the dead-letter topic, or release it and
#: ``"raise"`` the exception out of ``run``; or a function deciding per message.
OnError = Literal["release", "reject", "raise"] | Callable[[Message, Exception], None]

_MAX_POLL_WAIT = 0.5  # seconds; how often a blocked receive() notices close() from elsewhere
_MAX_THREAD_WAIT = 1.0  # seconds; how quickly the background thread notices a dropped consumer
_MAX_REASON = 2000  # characters of an exception kept as a REJECT reason

_RESUBSCRIBE_ON = frozenset({SessionEndReason.TIMED_OUT, SessionEndReason.UNKNOWN_SESSION})
_TOPIC_SAFE = re.compile(r"[^a-zA-Z0-9._-]+")


class _Unset(Enum):
    UNSET = "UNSET"


_UNSET = _Unset.UNSET


@dataclass(slots=True)
class ConsumerStats:
    """Counters since the consumer was created (``QueueConsumer.stats`` returns a copy)."""

    delivered: int = 0
    """Deliveries of this consumer's session received."""
    ignored: int = 0
    """Deliveries and replies for another session (an earlier run of the same consumer id)."""
    malformed: int = 0
    """Records on the delivery topic that could not be read (bad headers, undecodable reply)."""
    repeated: int = 0
    """Deliveries dropped because this consumer already had their lease: a restarted
    coordinator sends the deliveries of the leases it restored again (docs/sdk.md)."""
    ack_items_sent: int = 0
    ack_records_sent: int = 0
    ack_failures: int = 0
    """Acknowledgement items not applied (answered by the coordinator, or of an ended session)."""
    heartbeats_sent: int = 0
    resubscriptions: int = 0
    send_failures: int = 0
    """Control or ack records Kafka did not accept (after the producer's retries)."""
    credit_moves: int = 0
    """Grants sent to move credit between the shards of a subscription that spans several
    (protocol 8; always 0 for a subscription of one shard)."""


def _default_consumer_id(principal: str | None = None) -> str:
    """``HOST-RANDOM``; with a credential, ``PRINCIPAL-HOST-RANDOM``, which the default grant
    of `qlayer security principal add` (consumer ids ``PRINCIPAL-*``) covers."""
    host = _TOPIC_SAFE.sub("-", socket.gethostname()).strip("-.")[:40] or "consumer"
    made = f"{host}-{uuid.uuid4().hex[:12]}"
    return f"{principal}-{made}" if principal else made


def _now_ms() -> int:
    return int(time.time() * 1000)


def _check_filter(text: str | None) -> str | None:
    """Parse the filter here, so a typo fails at once with its position, before any I/O."""
    if text is None or not text.strip():
        return None
    try:
        compile_expression(text)
    except ExpressionError as exc:
        raise InvalidFilterError(
            f"invalid filter {text!r}: {exc.message}",
            text=text,
            position=exc.position,
            line=exc.line,
            column=exc.column,
        ) from None
    return text


def _check_queue(queue: str, regex: bool) -> str:
    if not queue:
        raise InvalidSubscriptionError("a queue name (or regular expression) is required")
    if regex:
        try:
            name_matcher(queue)  # what the coordinator runs it with (RE2, linear time)
        except re.error as exc:
            raise InvalidSubscriptionError(
                f"queue regular expression {queue!r} does not compile: {exc}"
            ) from None
    return queue


def _check_backlog(max_backlog: int) -> int:
    if isinstance(max_backlog, bool) or not isinstance(max_backlog, int) or max_backlog < 0:
        raise InvalidSubscriptionError(
            f"max_backlog must be a whole number of at least 0, got {max_backlog!r}"
        )
    return max_backlog


class QueueConsumer:
    """A subscription to one queue (or every queue whose name matches a regex).

    Creating it subscribes and waits for the coordinator's answer; it raises
    ``UnknownQueueError``, ``InvalidFilterError``, ``InvalidSubscriptionError`` or
    ``NoCoordinatorError`` (nothing answered within ``subscribe_timeout`` seconds).

    Settle every message with ``ack()``, ``release(delay=...)`` or ``reject(reason=...)``;
    acknowledgements are batched (``ack_batch_size`` items or ``ack_interval`` seconds, and
    whenever the consumer waits for new messages). Acknowledgements the coordinator refuses
    (the lease expired meanwhile, ...) go to ``on_ack_error`` when given, else the next
    ``receive`` raises ``LeaseLostError``. A session the coordinator timed out or forgot is
    resubscribed transparently (``resubscribe=True``); an eviction raises
    ``SessionEndedError``. ``close()`` flushes acknowledgements and unsubscribes, so the
    leases still held break at once.

    ``transactional=True`` (exactly-once processing, protocol 9): each session gets a Kafka
    producer of its own (``transactional.id`` ``<transactional_id_prefix><consumer id>.<session
    id>``, the prefix ``<topic prefix>qlayer-tx.`` by default), and ``transaction()`` commits
    the records produced in it with the messages settled in it (docs/sdk.md).
    """

    def __init__(
        self,
        queue: str | re.Pattern[str],
        bootstrap_servers: str | None = None,
        *,
        max_backlog: int = 1,
        filter: str | None = None,
        regex: bool = False,
        consumer_id: str | None = None,
        topic_prefix: str | None = None,
        kafka_config: Mapping[str, Any] | None = None,
        session_timeout: float = 30.0,
        subscribe_timeout: float = 10.0,
        ack_batch_size: int = DEFAULT_ACK_BATCH_SIZE,
        ack_interval: float = DEFAULT_ACK_INTERVAL,
        on_ack_error: Callable[[LeaseLostError], None] | None = None,
        resubscribe: bool = True,
        client_name: str = "qlayer-python",
        delivery_format: Literal["batch", "record"] = "batch",
        state_dir: str | os.PathLike[str] | None = None,
        credential: str | None = None,
        transactional: bool = False,
        transactional_id_prefix: str | None = None,
    ) -> None:
        if isinstance(queue, re.Pattern):
            queue, regex = queue.pattern, True
        self._queue = _check_queue(queue, regex)
        self._regex = regex
        self._filter = _check_filter(filter)
        self._max_backlog = _check_backlog(max_backlog)
        if delivery_format not in DeliveryFormat.ALL:
            raise ValueError(f"delivery_format must be 'batch' or 'record', "
                             f"got {delivery_format!r}")
        # Asked of the coordinator on every Subscribe and Replace; a coordinator older than
        # protocol 3 ignores it and delivers records, which this consumer reads as well.
        self._format_header = [(DELIVERY_FORMAT, delivery_format.encode())]
        self._seen = SeenLeases(self._max_backlog)
        if session_timeout <= 0 or subscribe_timeout <= 0:
            raise ValueError("session_timeout and subscribe_timeout must be positive seconds")
        self._config = ClientConfig.resolve(bootstrap_servers, topic_prefix, kafka_config)
        self._topics = self._config.topics
        # Protocol 7: the principal's credential, sent on every Subscribe (never on other
        # records: the session secret binds them to the session).
        given = credential if credential is not None else self._config.credential
        self._credential_header: list[tuple[str, bytes]] = []
        principal: str | None = None
        if given:
            try:
                principal = parse_credential(given).principal
            except CredentialError as exc:
                raise NotAuthorizedError(f"credential: {exc}") from None
            self._credential_header = [(CREDENTIAL, given.strip().encode())]
        self._consumer_id = consumer_id or _default_consumer_id(principal)
        self._key = self._consumer_id.encode()
        # The shard serving this consumer's queues, from the `qlayer.shard` header of the
        # coordinator's replies: control and ack records go to that partition (protocol 2).
        # None until the first reply: the Subscribe goes by key, and the coordinator that
        # reads it passes it on to the right shard.
        self._shard: int | None = None
        # Protocol 8: the parts of a regex subscription whose queues are on several shards,
        # and the credit they hold (`layer.sdk.spans`); None for a subscription of one shard.
        self._spans: Spans | None = None
        # A regex subscription follows the queue directory (`_follow_directory`): queues
        # created later on a shard it has no part on are joined.
        self._directory: QueueDirectory | None = None
        self._next_directory_check = time.monotonic() + spanning.DIRECTORY_INTERVAL
        self._delivery_topic = self._topics.delivery(self._consumer_id)  # validates the id
        # Protocol 5: the live session's secret, proved by every later record; kept on disk
        # for a restarted process of this consumer id (`layer.sdk.identity`). Not for an id
        # made up here: no later process has it, and a SIGKILLed one's file would stay forever.
        self._secrets = (SecretStore(Path(state_dir) if state_dir is not None
                                     else default_state_dir(), self._topics.prefix,
                                     self._consumer_id) if consumer_id else None)
        self._secret: bytes | None = None
        self._proof: list[tuple[str, bytes]] | None = None
        self._session_timeout = session_timeout
        self._subscribe_timeout = subscribe_timeout
        self._on_ack_error = on_ack_error
        self._resubscribe = resubscribe
        self._client_name = client_name
        self._codec = Codec()
        # Protocol 9: each session settles in Kafka transactions of its own producer, whose
        # transactional.id is <prefix><consumer id>.<session id> (`layer.sdk.transaction`).
        if transactional_id_prefix is not None and not transactional:
            raise ValueError("transactional_id_prefix is for a transactional consumer: "
                             "pass transactional=True too")
        self._tx_prefix = ((transactional_id_prefix if transactional_id_prefix is not None
                            else self._topics.prefix + "qlayer-tx.") if transactional else None)
        self._tx: TransactionalProducer | None = None
        #: When this session's producer was found fenced (`_after_fence`), None otherwise.
        self._fenced_at: float | None = None

        # Shared with the background thread: everything below, guarded by _cond's lock.
        # Re-entrant: close() may run in a signal handler while this thread holds the lock.
        self._cond = threading.Condition(threading.RLock())
        self._batcher = AckBatcher(ack_batch_size, ack_interval)
        self._session_id: str | None = None
        self._active = False
        self._closed = False
        self._heartbeat_interval = session_timeout / 3
        self._next_heartbeat = 0.0
        self._stats = ConsumerStats()
        self._failures: list[AckFailure] = []

        # Used by the receiving thread only.
        self._buffer: deque[Message] = deque()
        self._results: dict[str, SubscribeResult] = {}
        # request id -> the refusal's `qlayer.refusal` word (protocol 7)
        self._refused_why: dict[str, str] = {}
        # request id -> the shards a refused regex spans (protocol 8, ``spans_shards``)
        self._spans_refused: dict[str, list[int]] = {}
        # request id -> the shards an answer to a part says the subscription's queues are on
        self._answer_shards: dict[str, list[int]] = {}
        self._renewals: dict[tuple[str, str], AckItemResult | None] = {}
        self._grants: dict[str, QueueGrant] = {}
        self._effective_session_timeout = session_timeout
        self._ended: SessionEnded | None = None
        self._terminal: SessionEnded | None = None
        self._request_id = ""
        self._needs_subscribe = False

        client_id = f"qlayer-sdk-{self._consumer_id}"
        self._producer = SdkProducer(
            dataclasses.replace(
                self._config, kafka_config={"client.id": client_id, **self._config.kafka_config}
            )
        )
        self._reader = DeliveryReader(
            self._config,
            self._delivery_topic,
            group_id=sdk_group(self._topics, self._consumer_id),
        )
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        try:
            self._reader.start(timeout=subscribe_timeout)
            self._subscribe()
        except BaseException:
            self._abandon()
            raise
        self._thread = threading.Thread(
            target=_background_loop,
            args=(weakref.ref(self), self._cond, self._stop),
            name=f"qlayer-heartbeat-{self._consumer_id}",
            daemon=True,
        )
        self._thread.start()

    # --- what the consumer is ---------------------------------------------------------------

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"session {self._session_id}"
        return f"<QueueConsumer {self._consumer_id} on {self._queue!r} ({state})>"

    @property
    def consumer_id(self) -> str:
        return self._consumer_id

    @property
    def session_id(self) -> str | None:
        return self._session_id

    @property
    def delivery_topic(self) -> str:
        return self._delivery_topic

    @property
    def queue(self) -> str:
        """The queue name, or the regular expression, of the current subscription."""
        return self._queue

    @property
    def filter(self) -> str | None:
        return self._filter

    @property
    def max_backlog(self) -> int:
        """The backlog asked for; each queue's effective one is in ``grants``."""
        return self._max_backlog

    @property
    def grants(self) -> tuple[QueueGrant, ...]:
        """Per queue delivered from: effective backlog, lease period and semantics."""
        return tuple(self._grants.values())

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between heartbeats, as the coordinator asked."""
        with self._cond:
            return self._heartbeat_interval

    @property
    def session_timeout(self) -> float:
        """The effective session timeout in seconds, as the coordinator answered."""
        return self._effective_session_timeout

    @property
    def stats(self) -> ConsumerStats:
        with self._cond:
            return dataclasses.replace(self._stats)

    @property
    def closed(self) -> bool:
        return self._closed

    # --- receiving ------------------------------------------------------------------------

    def receive(self, timeout: float | None = None) -> Message | None:
        """The next message, waiting up to ``timeout`` seconds (forever when None).

        Returns None when nothing came in time. Raises ``LeaseLostError`` for acknowledgements
        refused since the last call (when there is no ``on_ack_error``) and
        ``SessionEndedError`` when the coordinator ended the session.
        """
        self._check_open()
        self._raise_failures()
        if self._tx is not None and not self._tx.usable:
            self._after_fence()
        self._subscribe_if_needed()
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            if self._buffer:
                return self._buffer.popleft()
            # Nothing left to hand out: the user will not acknowledge anything more until a
            # message comes, so waiting acks go now (with max_backlog=1 they are what lets the
            # next message come).
            self._flush_acks()
            wait = _MAX_POLL_WAIT
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            self._ingest(self._reader.poll(wait))
            self._handle_session_end()
            self._raise_failures()
            if self._regex:
                spanning.follow_directory(self)
            elif self._spans is not None:
                spanning.follow_parts(self)
            if self._buffer:
                continue
            if self._closed:  # by another thread, or a signal handler, meanwhile
                raise ConsumerClosedError(f"consumer {self._consumer_id} was closed")
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def __iter__(self) -> Iterator[Message]:
        """Messages as they come, until the consumer is closed (from anywhere)."""
        while not self._closed:
            try:
                message = self.receive(timeout=_MAX_POLL_WAIT)
            except ConsumerClosedError:
                return
            if message is not None:
                yield message

    def run(
        self,
        handler: Callable[[Message], object],
        *,
        on_error: OnError = "release",
        release_delay: float | timedelta | None = None,
        max_messages: int | None = None,
        idle_timeout: float | None = None,
        stop: threading.Event | None = None,
    ) -> int:
        """Call ``handler`` for each message; returns how many were handled.

        A message the handler returns from without settling is acknowledged. When the
        handler raises an ``Exception`` (not ``KeyboardInterrupt`` and the like), the message
        is settled by ``on_error`` (see :data:`OnError`) unless the handler settled it. A
        function given as ``on_error`` settles the message itself; one it leaves unsettled is
        released. Stops after ``max_messages``, after ``idle_timeout`` seconds without a
        message, when ``stop`` is set, or when the consumer is closed.
        """
        release_delay_ms(release_delay)  # a bad delay is refused now, not at the first failure
        handled = 0
        idle_since = time.monotonic()
        while max_messages is None or handled < max_messages:
            if (stop is not None and stop.is_set()) or self._closed:
                break
            try:
                message = self.receive(timeout=_MAX_POLL_WAIT)
            except ConsumerClosedError:
                break
            if message is None:
                if idle_timeout is not None and time.monotonic() - idle_since >= idle_timeout:
                    break
                continue
            handled += 1
            try:
                handler(message)
            except Exception as exc:
                self._handler_failed(message, exc, on_error, release_delay)
            else:
                if message.settled is None:
                    message.ack()
            idle_since = time.monotonic()
        return handled

    def _handler_failed(
        self,
        message: Message,
        exc: Exception,
        on_error: OnError,
        release_delay: float | timedelta | None,
    ) -> None:
        log.warning("handler failed for %r: %s: %s", message, type(exc).__name__, exc,
                    exc_info=exc)
        if message.settled is not None:
            if on_error == "raise":
                raise exc
            return
        if callable(on_error):
            on_error(message, exc)
            if message.settled is None:
                message.release(delay=release_delay)
        elif on_error == "reject":
            message.reject(reason=f"{type(exc).__name__}: {exc}"[:_MAX_REASON])
        elif on_error == "release":
            message.release(delay=release_delay)
        elif on_error == "raise":
            message.release(delay=release_delay)
            raise exc
        else:
            raise ValueError(f"on_error must be 'release', 'reject', 'raise' or a function, "
                             f"got {on_error!r}")

    # --- changing the subscription --------------------------------------------------------

    def replace(
        self,
        *,
        queue: str | re.Pattern[str] | _Unset = _UNSET,
        filter: str | _Unset | None = _UNSET,
        max_backlog: int | _Unset = _UNSET,
        regex: bool | _Unset = _UNSET,
        timeout: float | None = None,
    ) -> None:
        """Atomically replace the subscription; leases held are kept (and must be settled).

        Arguments not given keep their current value; ``filter=None`` removes the filter.
        Waits for the coordinator's answer; a refused replace raises and leaves the previous
        subscription in force.
        """
        self._check_open()
        new_regex = self._regex if isinstance(regex, _Unset) else regex
        new_queue = self._queue
        if isinstance(queue, re.Pattern):
            new_queue, new_regex = queue.pattern, True
        elif not isinstance(queue, _Unset):
            new_queue = queue
        new_queue = _check_queue(new_queue, new_regex)
        new_filter = self._filter if isinstance(filter, _Unset) else _check_filter(filter)
        new_backlog = (
            self._max_backlog if isinstance(max_backlog, _Unset) else _check_backlog(max_backlog)
        )
        if self._needs_subscribe:
            # No session to keep leases in (its resubscription failed): subscribe afresh.
            self._queue, self._regex = new_queue, new_regex
            self._filter, self._max_backlog = new_filter, new_backlog
            self._subscribe_if_needed()
            return
        wait = self._subscribe_timeout if timeout is None else timeout
        if self._spans is not None:
            spanning.replace_spanning(self, new_queue, new_regex, new_filter, new_backlog, wait)
            return
        previous = (self._queue, self._regex, self._filter, self._max_backlog)
        request_id = uuid.uuid4().hex
        session_id = self._session_id
        assert session_id is not None
        self._send_control(
            Replace(
                consumer_id=self._consumer_id,
                session_id=session_id,
                request_id=request_id,
                queue=new_queue,
                queue_is_regex=new_regex,
                max_backlog=new_backlog,
                filter=new_filter,
                delivery_topic=self._delivery_topic,
                sent_at_ms=_now_ms(),
            )
        )
        deadline = time.monotonic() + wait
        while request_id not in self._results:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoCoordinatorError(
                    f"no coordinator answered the Replace of consumer {self._consumer_id} "
                    f"within {wait:g}s; the previous subscription ({previous[0]!r}) may still "
                    "be in force. Is `qlayer coordinator run` still running?"
                )
            self._ingest(self._reader.poll(min(remaining, _MAX_POLL_WAIT)))
            if self._ended is not None:
                # The session is gone, so there are no leases to keep: subscribing again with
                # the new subscription is what the replace asked for.
                self._queue, self._regex = new_queue, new_regex
                self._filter, self._max_backlog = new_filter, new_backlog
                self._handle_session_end()
                return
        result = self._results.pop(request_id)
        if result.status is not SubscribeStatus.OK:
            if self._spans_refused.pop(request_id, None) and self._shard is not None:
                # The new queues are on other shards: the session spans them (protocol 8).
                spanning.replace_onto_shards(self, new_queue, new_regex, new_filter,
                                             new_backlog, wait)
                return
            raise self._refusal(result, new_queue, new_filter)
        self._queue, self._regex = new_queue, new_regex
        self._filter, self._max_backlog = new_filter, new_backlog
        self._grants = {grant.queue: grant for grant in result.queues}
        self._seen.remember_for(sum(g.max_backlog for g in self._grants.values()))
        self._request_id = request_id

    # --- closing ----------------------------------------------------------------------------

    def close(self, timeout: float = 10.0) -> None:
        """Flush acknowledgements, then unsubscribe: every lease still held breaks at once.

        Idempotent. Waits up to ``timeout`` seconds for Kafka to take the records.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            self._cond.notify_all()
        # No join: the background thread checks _closed under the lock before it sends
        # anything, so it can do nothing more; and joining here could wait on a lock this very
        # thread holds (close() called from a signal handler).
        try:
            if self._tx is not None:
                # Before the Unsubscribe breaks the leases: an open transaction is aborted
                # (nothing of it counts) and this producer commits nothing more.
                self._tx.close()
            with self._cond:
                active = self._active and self._terminal is None
                self._send_acks_locked()
            # Acks first and written, then the Unsubscribe: acks that lost a race with the
            # Unsubscribe would find their leases broken and the messages redelivered.
            self._producer.wait(timeout)
            if active:
                assert self._session_id is not None
                self._send_control(
                    Unsubscribe(
                        consumer_id=self._consumer_id,
                        session_id=self._session_id,
                        reason="closed",
                        sent_at_ms=_now_ms(),
                    )
                )
                self._producer.wait(timeout)
            if self._secret is not None and self._secrets is not None:
                # The session is over (unsubscribed, or ended by the coordinator): a later
                # process of this consumer id has nothing to prove.
                self._secrets.forget(self._secret)
        except QlayerError as exc:
            log.warning("closing consumer %s: %s", self._consumer_id, exc)
        finally:
            with self._cond:
                self._active = False
            self._buffer.clear()
            self._reader.close()
            if self._directory is not None:
                self._directory.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _abandon(self) -> None:
        """Clean up after a failed construction (nothing was subscribed)."""
        self._closed = True
        self._stop.set()
        try:
            self._producer.wait(5.0)
        except QlayerError as exc:
            log.debug("abandoning consumer %s: %s", self._consumer_id, exc)
        self._reader.close()

    # --- subscribing ------------------------------------------------------------------------

    def _subscribe(self, fencing_until: float | None = None) -> None:
        """Subscribe by key: the coordinator that reads it passes it on to the shard of its
        queues; a regex whose queues are on several shards is refused with their list
        (``spans_shards``), and the subscription is made again over them with credit. A
        refusal while this consumer id's previous transactional session is being fenced
        (``fencing``, protocol 9) is asked again until ``fencing_until``."""
        self._spans = None
        session_id = str(uuid.uuid4())
        request_id = uuid.uuid4().hex
        # A fresh secret for the new session; the proof of the one it replaces: this
        # process's own, or the one a previous process of this consumer id kept (a Subscribe
        # over a live session is refused without it).
        secret = new_session_secret()
        previous = self._secret or (self._secrets.load() if self._secrets is not None
                                    else None)
        with self._cond:
            self._session_id = session_id
            self._set_secret(secret)
            self._active = False
        self._results.clear()
        headers = (self._format_header + secret_headers(secret) + self._credential_header
                   + self._new_transactional_producer(session_id))
        if previous is not None:
            headers += proof_headers(previous)
        self._send_control(
            Subscribe(
                consumer_id=self._consumer_id,
                session_id=session_id,
                request_id=request_id,
                queue=self._queue,
                queue_is_regex=self._regex,
                max_backlog=self._max_backlog,
                filter=self._filter,
                delivery_topic=self._delivery_topic,
                session_timeout_ms=round(self._session_timeout * 1000),
                client_name=self._client_name,
                client_version=__version__,
                sent_at_ms=_now_ms(),
            ),
            headers,
        )
        deadline = time.monotonic() + self._subscribe_timeout
        while request_id not in self._results:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                # A coordinator that picks the Subscribe up later must not keep a session
                # (and leases) for a consumer that gave up; end it right away.
                self._send_control(
                    Unsubscribe(
                        consumer_id=self._consumer_id,
                        session_id=session_id,
                        reason="no answer to Subscribe",
                        sent_at_ms=_now_ms(),
                    )
                )
                raise NoCoordinatorError(
                    f"no coordinator answered the Subscribe to queue {self._queue!r} within "
                    f"{self._subscribe_timeout:g}s (control topic {self._topics.control} at "
                    f"{self._config.bootstrap_servers}). Start one with `qlayer coordinator "
                    f"run` using the same bootstrap servers and topic prefix "
                    f"{self._topics.prefix!r}, or raise subscribe_timeout. (A refusal is "
                    f"written to {self._delivery_topic}: where that topic does not exist and "
                    "this consumer may not create it, only a consumer with a credential gets "
                    "one made; docs/security.md)"
                )
            self._ingest(self._reader.poll(min(remaining, _MAX_POLL_WAIT)))
        result = self._results.pop(request_id)
        if result.status is not SubscribeStatus.OK:
            with self._cond:
                self._set_secret(previous)  # no session has the new secret
            if self._refused_why.get(request_id) == FENCING:
                until = fencing_until or time.monotonic() + self._subscribe_timeout
                if time.monotonic() < until:
                    # The previous session's producer is being fenced (protocol 9): that
                    # takes a moment, then the same consumer id may subscribe.
                    del self._refused_why[request_id]
                    time.sleep(spanning.FENCING_PAUSE)
                    self._subscribe(until)
                    return
            shards = self._spans_refused.pop(request_id, [])
            if len(shards) > 1:
                spanning.subscribe_spanning(self, shards)
                return
            raise self._refusal(result, self._queue, self._filter)
        if self._secrets is not None:
            self._secrets.save(secret)
        self._request_id = request_id
        self._grants = {grant.queue: grant for grant in result.queues}
        self._seen.remember_for(sum(g.max_backlog for g in self._grants.values()))
        if result.session_timeout_ms > 0:
            self._effective_session_timeout = result.session_timeout_ms / 1000
        interval = result.heartbeat_interval_ms / 1000
        if interval <= 0:
            # protocol §8: one third of the session timeout, so two may be lost.
            interval = self._effective_session_timeout / 3
        with self._cond:
            self._heartbeat_interval = interval
            self._next_heartbeat = time.monotonic() + interval
            self._active = True
            self._cond.notify_all()

    def _new_transactional_producer(self, session_id: str) -> list[tuple[str, bytes]]:
        """A transactional consumer's new session gets a producer of its own, initialised
        before the Subscribe is sent (any fence the coordinator makes comes after it), named
        on the Subscribe (protocol 9). Nothing for other consumers."""
        if self._tx_prefix is None:
            return []
        old, self._tx = self._tx, None
        self._fenced_at = None
        if old is not None:
            old.close()
        self._tx = TransactionalProducer(
            self._config, transactional_id_for(self._tx_prefix, self._consumer_id, session_id),
            self._subscribe_timeout)
        return [(TRANSACTIONAL_ID, self._tx.transactional_id.encode())]

    def _after_fence(self) -> None:
        """This session's producer was fenced (protocol 9): a coordinator is ending the session.
        Its messages are lost to it; the coordinator's `SessionEnded` says what comes next (a
        new session, or `SessionEndedError` for an eviction). Should none come within the
        session timeout, a new session is subscribed anyway (answered once the old one is
        fenced everywhere)."""
        now = time.monotonic()
        if self._fenced_at is None:
            self._fenced_at = now
            with self._cond:
                self._active = False
                pending = self._batcher.drain()
            self._buffer.clear()
            self._report_failures([AckFailure(i.queue, i.bookmark, i.type,
                                              AckStatus.LEASE_LOST,
                                              "its session's producer was fenced")
                                   for i in pending])
            log.warning("consumer %s: the producer of session %s was fenced; its session "
                        "ends", self._consumer_id, self._session_id)
        elif now - self._fenced_at > self._effective_session_timeout and not self._closed:
            self._fenced_at = None
            with self._cond:
                self._stats.resubscriptions += 1
            self._needs_subscribe = True

    def transactional_header(self) -> list[tuple[str, bytes]]:
        """The live session's ``qlayer.transactional-id`` header (a part subscribed later on
        another shard names the same producer); nothing for other consumers."""
        tx = self._tx
        return [] if tx is None else [(TRANSACTIONAL_ID, tx.transactional_id.encode())]

    def transaction(self) -> Transaction:
        """A Kafka transaction of this consumer's session: records produced in it and
        messages settled in it commit together or not at all (docs/sdk.md "Exactly-once
        processing")::

            with consumer.transaction() as tx:
                tx.produce("invoices", value, key=message.key)
                tx.ack(message)

        Needs ``transactional=True``. Raises `TransactionAbortedError` when it could not
        commit (nothing of it counts; a fenced one means the session ended and the consumer
        subscribes again), ``LeaseLostError`` when its session ended before the commit."""
        self._check_open()
        if self._tx is None or self._tx_prefix is None:
            raise ValueError("transaction() needs a transactional consumer: "
                             "QueueConsumer(..., transactional=True)")
        if self._tx.open:
            raise RuntimeError("a transaction of this consumer is open already: transactions "
                               "of one consumer do not nest")
        if not self._tx.usable:
            raise TransactionAbortedError(
                "this session's producer was fenced: the session ended and the consumer "
                "subscribes again on its next receive()", fenced=True)
        with self._cond:
            session_id = self._session_id or ""
        return Transaction(self._tx, session_id, self._settle_in_transaction,
                           self._transaction_lost)

    def _transaction_lost(self, session_id: str) -> str | None:
        """Why a transaction of ``session_id`` may not commit now (None: it may)."""
        with self._cond:
            if self._closed:
                return "the consumer is closed"
            if not self._active or self._session_id != session_id:
                return f"its session {session_id} has ended"
        return None

    def _settle_in_transaction(self, items: list[AckItem]) -> None:
        """The ack records of a transaction's settlements, produced in it (to each shard's
        ack partition, with the session's proof), just before it commits."""
        tx = self._tx
        assert tx is not None
        with self._cond:
            session_id = self._session_id
            spans, shard, proof = self._spans, self._shard, self._proof
        assert session_id is not None
        by_shard: dict[int | None, list[AckItem]] = {}
        for item in items:
            target = (spans.shard_of(item.queue, _partition(spans, item)) if spans is not None
                      else shard)
            by_shard.setdefault(target, []).append(item)
        size = self._batcher.max_items
        for target, some in by_shard.items():
            for start in range(0, len(some), size):
                record = AckRecord(consumer_id=self._consumer_id, session_id=session_id,
                                   sent_at_ms=_now_ms(), items=tuple(some[start:start + size]))
                tx.produce(self._topics.ack, self._codec.encode_ack(record), self._key, proof,
                           target)
        with self._cond:
            self._stats.ack_records_sent += sum(
                -(-len(some) // size) for some in by_shard.values())
            self._stats.ack_items_sent += len(items)

    def _subscribe_if_needed(self) -> None:
        if self._needs_subscribe:
            self._subscribe()
            self._needs_subscribe = False

    def _refusal(self, result: SubscribeResult, queue: str, filter: str | None) -> QlayerError:
        detail = result.message
        if self._refused_why.pop(result.request_id, None) == NOT_AUTHORIZED:
            return NotAuthorizedError(
                f"the coordinator refused the subscription to {queue!r} as consumer "
                f"{self._consumer_id!r}: {detail or 'not authorized'}")
        match result.status:
            case SubscribeStatus.UNKNOWN_QUEUE:
                return UnknownQueueError(queue, detail)
            case SubscribeStatus.INVALID_FILTER:
                return InvalidFilterError(
                    f"the coordinator refused filter {filter!r}: {detail or 'invalid filter'}",
                    text=filter or "",
                )
            case _:
                return InvalidSubscriptionError(
                    f"the coordinator refused the subscription to {queue!r}: "
                    f"{detail or result.status.value}"
                )

    def _handle_session_end(self) -> None:
        ended, self._ended = self._ended, None
        if ended is None:
            return
        lost_message = f"session ended: {ended.reason.value}"
        with self._cond:
            self._active = False
            pending = self._batcher.drain()
        self._buffer.clear()  # leases of the ended session are broken
        self._report_failures(
            [AckFailure(i.queue, i.bookmark, i.type, AckStatus.LEASE_LOST, lost_message)
             for i in pending]
        )
        if ended.reason in _RESUBSCRIBE_ON and self._resubscribe and not self._closed:
            log.warning("consumer %s: session %s ended (%s%s); subscribing again",
                        self._consumer_id, ended.session_id, ended.reason.value,
                        f": {ended.message}" if ended.message else "")
            with self._cond:
                self._stats.resubscriptions += 1
            # Should this Subscribe go unanswered too (the coordinator is restarting, say),
            # the error goes to the caller and the next receive() tries again.
            self._needs_subscribe = True
            self._subscribe_if_needed()
            return
        self._terminal = ended
        raise SessionEndedError(ended.reason, ended.message)

    # --- reading the delivery topic ---------------------------------------------------------

    def _ingest(self, records: list[Any]) -> None:
        """Sort records of the delivery topic into replies (handled) and deliveries (kept)."""
        if not records:
            return
        ignored = malformed = delivered = repeated = 0
        first_time = self._seen.first_time
        session = (self._session_id or "").encode()
        for record in records:
            headers = record.headers()
            if headers and headers[0][0] == BATCH:
                # A delivery batch (protocol 3): its first header says so.
                if header_value(headers, SESSION) != session:
                    ignored += 1
                    continue
                try:
                    entries = decode_delivery_batch_fields(record.value())
                except ProtocolError as exc:
                    malformed += 1
                    log.warning("unreadable delivery batch on %s at offset %s: %s",
                                self._delivery_topic, record.offset(), exc)
                    continue
                if self._spans is not None:
                    report = parse_credit_report(headers)
                    shard = reply_shard(headers)
                    if report is not None and shard is not None:
                        self._spans.reported(shard, report, 0)
                session_id = self._session_id or ""
                for entry in entries:
                    try:
                        message = Message.from_batch(entry, consumer_id=self._consumer_id,
                                                     session_id=session_id, settler=self)
                    except ProtocolError as exc:
                        malformed += 1
                        log.warning("unreadable message in a delivery batch on %s at offset "
                                    "%s: %s", self._delivery_topic, record.offset(), exc)
                        continue
                    token = message.lease
                    if token and not first_time(token):
                        repeated += 1
                        continue
                    delivered += 1
                    self._buffer.append(message)
                    if self._spans is not None:
                        self._spans.delivered(message.queue, message.bookmark.partition
                                              if message.queue in self._spans.parts else None)
                continue
            if is_reply(headers):
                try:
                    reply = self._codec.decode_reply(record.value())
                except ProtocolError as exc:
                    malformed += 1
                    log.warning("unreadable reply on %s at offset %s: %s",
                                self._delivery_topic, record.offset(), exc)
                    continue
                if reply.session_id != self._session_id:
                    ignored += 1
                    continue
                shard = reply_shard(headers)
                if self._spans is not None:
                    unawaited = reply.request_id in self._spans.unawaited if isinstance(
                        reply, SubscribeResult) else False
                    if isinstance(reply, SubscribeResult) and self._spans.answered(
                            reply.request_id, reply.status is SubscribeStatus.OK,
                            (g.queue for g in reply.queues),
                            parse_credit_report(headers)) is not None:
                        if reply.status is SubscribeStatus.OK:
                            self._grants.update({g.queue: g for g in reply.queues})
                            self._answer_shards[reply.request_id] = parse_shards(headers)
                        if unawaited:
                            self._spans.unawaited.discard(reply.request_id)
                            self._answer_shards.pop(reply.request_id, None)
                            self._next_directory_check = 0.0  # join what waits for it now
                        elif reply.request_id:
                            self._results[reply.request_id] = reply
                        continue
                    if (isinstance(reply, SessionEnded) and shard is not None
                            and shard != self._spans.home and shard in self._spans.ledger.shards
                            and self._tx is None):
                        # One part ended (its queues went, or it timed out): its leases are
                        # broken there and its credit is free; the session goes on.
                        log.info("consumer %s: the part of session %s on shard %d ended (%s)",
                                 self._consumer_id, reply.session_id, shard, reply.reason.value)
                        self._spans.drop(shard)
                        continue
                elif shard is not None:
                    self._shard = shard
                if isinstance(reply, SubscribeResult) and reply.status is not SubscribeStatus.OK:
                    why = header_value(headers, REFUSAL)
                    if why is not None:
                        self._refused_why[reply.request_id] = why.decode("utf-8", "replace")
                        if why == SPANS_SHARDS.encode():
                            self._spans_refused[reply.request_id] = parse_shards(headers)
                self._on_reply(reply)
                continue
            if header_value(headers, SESSION) != session:
                ignored += 1
                continue
            try:
                message = Message.from_record(
                    key=record.key(),
                    value=record.value(),
                    headers=headers,
                    timestamp_ms=record.timestamp()[1],
                    settler=self,
                )
            except ProtocolError as exc:
                malformed += 1
                log.warning("unreadable delivery on %s at offset %s: %s",
                            self._delivery_topic, record.offset(), exc)
                continue
            token = message.lease
            if token and not first_time(token):
                repeated += 1
                continue
            delivered += 1
            self._buffer.append(message)
        with self._cond:
            self._stats.ignored += ignored
            self._stats.malformed += malformed
            self._stats.delivered += delivered
            self._stats.repeated += repeated
        if self._spans is not None:
            spanning.move_credit(self)

    def _on_reply(self, reply: ReplyMessage) -> None:
        match reply:
            case SubscribeResult():
                if reply.request_id == self._request_id and reply.status is SubscribeStatus.OK:
                    # Another coordinator granting more queues of a regex subscription.
                    self._grants.update({grant.queue: grant for grant in reply.queues})
                    self._seen.remember_for(sum(g.max_backlog for g in self._grants.values()))
                else:
                    self._results.setdefault(reply.request_id, reply)
            case AckResult():
                failures: list[AckFailure] = []
                for item in reply.items:
                    key = (item.queue, item.bookmark)
                    if item.type is AckType.RENEW and key in self._renewals:
                        self._renewals[key] = item
                        continue
                    if item.status is not AckStatus.OK:
                        failures.append(AckFailure(item.queue, item.bookmark, item.type,
                                                   item.status, item.message))
                self._report_failures(failures)
            case SessionEnded():
                self._ended = reply

    # --- settling (Settler, called by Message) ----------------------------------------------

    def _settle(
        self, message: Message, ack_type: AckType, delay_ms: int | None, reason: str | None
    ) -> None:
        failure: AckFailure | None = None
        with self._cond:
            if self._closed:
                raise ConsumerClosedError(
                    f"consumer {self._consumer_id} is closed; its leases were broken and "
                    f"{message.bookmark} will be redelivered"
                )
            fields = message._lease_fields
            if fields[7]:
                return  # barrier deliveries need no acknowledgement (protocol §6)
            if not self._active or message._session_id != self._session_id:
                failure = AckFailure(message.queue, str(message.bookmark), ack_type,
                                     AckStatus.LEASE_LOST,
                                     f"its session {message.session_id} has ended")
            else:
                first = len(self._batcher) == 0
                if message._batched and ack_type is AckType.ACCEPT and "," not in fields[4]:
                    # The common case, as plain values: it travels in an AcceptRecord.
                    due = self._batcher.add_accept(fields[:5], time.monotonic())
                else:
                    item = AckItem(queue=message.queue, bookmark=str(message.bookmark),
                                   lease=message.lease, type=ack_type, delay_ms=delay_ms,
                                   reason=reason)
                    due = self._batcher.add(item, time.monotonic())
                if due:
                    self._send_acks_locked()
                elif first:
                    self._cond.notify_all()  # the background thread now has a deadline
        if failure is not None:
            self._report_failures([failure])

    def _renew(self, message: Message, timeout: float | None,
               extend_ms: int | None = None) -> datetime:
        self._check_open()
        wait = self._subscribe_timeout if timeout is None else timeout
        key = (message.queue, str(message.bookmark))
        with self._cond:
            if message.is_barrier or not self._active or message.session_id != self._session_id:
                raise LeaseLostError([AckFailure(
                    message.queue, key[1], AckType.RENEW, AckStatus.LEASE_LOST,
                    "a barrier message has no lease" if message.is_barrier
                    else f"its session {message.session_id} has ended")])
            self._batcher.add(AckItem(queue=message.queue, bookmark=key[1], lease=message.lease,
                                      type=AckType.RENEW, delay_ms=extend_ms),
                              time.monotonic())
            self._send_acks_locked()  # the caller is waiting for the answer
        self._renewals[key] = None
        try:
            deadline = time.monotonic() + wait
            while self._renewals[key] is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NoCoordinatorError(
                        f"no answer to the RENEW of {message.queue} {key[1]} within {wait:g}s; "
                        f"the lease ends at {message.lease_expires_at.isoformat()} unless it "
                        "was renewed. Is `qlayer coordinator run` still running?"
                    )
                self._ingest(self._reader.poll(min(remaining, _MAX_POLL_WAIT)))
                if self._ended is not None:
                    self._handle_session_end()
                    raise LeaseLostError([AckFailure(
                        message.queue, key[1], AckType.RENEW, AckStatus.LEASE_LOST,
                        "the session ended while renewing")])
            result = self._renewals[key]
        finally:
            del self._renewals[key]
        assert result is not None
        if result.status is not AckStatus.OK or result.lease_expires_ms is None:
            raise LeaseLostError([AckFailure(result.queue, result.bookmark, result.type,
                                             result.status, result.message)])
        return from_epoch_ms(result.lease_expires_ms)

    # --- sending ----------------------------------------------------------------------------

    def _set_secret(self, secret: bytes | None) -> None:
        """The session's secret, and the header proving it on every later record."""
        self._secret = secret
        self._proof = None if secret is None else proof_headers(secret)

    def _send_control(self, message: ControlMessage,
                      headers: list[tuple[str, bytes]] | None = None) -> None:
        """Send a control record; by default with the delivery format (Replace) and the proof
        of the session's secret (Replace, Heartbeat, Unsubscribe)."""
        if headers is None:
            headers = list(self._format_header) if isinstance(message, Replace) else []
            if self._proof is not None:
                headers += self._proof
        spans = self._spans
        if spans is not None and not isinstance(message, Subscribe):
            # Every part of the session hears its heartbeats, replaces and end (protocol 8).
            value = self._codec.encode_control(message)
            for shard in spans.shards:
                self._producer.send(self._topics.control, self._key, value, shard,
                                    [*headers, spans.header])
            return
        self._producer.send(self._topics.control, self._key, self._codec.encode_control(message),
                            self._shard, headers or None)

    def _flush_acks(self) -> None:
        with self._cond:
            self._send_acks_locked()

    def _send_acks_locked(self) -> None:
        """Send every buffered item (in batches of at most ack_batch_size). Holds the lock, so
        items leave in the order they were given, whichever thread sends them."""
        if not len(self._batcher):
            return
        session_id = self._session_id
        assert session_id is not None
        batches, accepts = self._batcher.split()
        spans = self._spans
        if spans is not None:
            # Each shard's items to its own partition (protocol 8).
            batches = [[i for i in batch if spans.shard_of(i.queue, _partition(spans, i)) == shard]
                       for batch in batches for shard in spans.shards]
            batches = [b for b in batches if b]
        for batch in batches:
            record = AckRecord(consumer_id=self._consumer_id, session_id=session_id,
                               sent_at_ms=_now_ms(), items=tuple(batch))
            self._producer.send(self._topics.ack, self._key, self._codec.encode_ack(record),
                                spans.shard_of(batch[0].queue, _partition(spans, batch[0]))
                                if spans is not None else self._shard, self._proof)
            self._stats.ack_records_sent += 1
            self._stats.ack_items_sent += len(batch)
        if accepts and spans is not None:
            by_shard: dict[int, list[Accept]] = {}
            for accept_item in accepts:
                by_shard.setdefault(spans.shard_of(accept_item[0], accept_item[2]),
                                    []).append(accept_item)
            for shard, some in by_shard.items():
                self._send_accepts(session_id, some, shard)
        elif accepts:
            self._send_accepts(session_id, accepts, self._shard)

    def _send_accepts(self, session_id: str, accepts: list[Accept], shard: int | None) -> None:
        if accepts:
            # One AcceptRecord for every ACCEPT of batch-delivered messages: per queue and
            # journal partition, the offsets and their tokens (protocol 3).
            groups: dict[tuple[str, str, int], tuple[list[int], list[str]]] = {}
            for queue, topic, partition, offset, lease in accepts:
                group = groups.get((queue, topic, partition))
                if group is None:
                    group = groups[(queue, topic, partition)] = ([], [])
                group[0].append(offset)
                group[1].append(lease)
            accept = AcceptRecord(
                consumer_id=self._consumer_id, session_id=session_id, sent_at_ms=_now_ms(),
                groups=tuple(AcceptGroup(queue=q, topic=t, partition=p, offsets=tuple(o),
                                         leases=tuple(ls))
                             for (q, t, p), (o, ls) in groups.items()))
            self._producer.send(self._topics.ack, self._key, self._codec.encode_accept(accept),
                                shard, self._proof)
            self._stats.ack_records_sent += 1
            self._stats.ack_items_sent += len(accepts)

    def _tick_locked(self, now: float) -> float:
        """The background thread's work (lock held): heartbeat and aged acks when due.
        Returns how long it may sleep."""
        if self._closed:
            return 0.0
        if self._active:
            if now >= self._next_heartbeat:
                assert self._session_id is not None
                self._send_control(Heartbeat(consumer_id=self._consumer_id,
                                             session_id=self._session_id, sent_at_ms=_now_ms()))
                self._stats.heartbeats_sent += 1
                self._next_heartbeat = now + self._heartbeat_interval
            if self._batcher.is_due(now):
                self._send_acks_locked()
        self._producer.poll()
        self._stats.send_failures = self._producer.failed
        wake = self._next_heartbeat if self._active else now + _MAX_THREAD_WAIT
        due = self._batcher.due_at()
        if due is not None:
            wake = min(wake, due)
        return min(max(wake - now, 0.001), _MAX_THREAD_WAIT)

    # --- failures ---------------------------------------------------------------------------

    def _report_failures(self, failures: list[AckFailure]) -> None:
        if not failures:
            return
        callback = self._on_ack_error
        with self._cond:
            self._stats.ack_failures += len(failures)
            if callback is None:
                self._failures.extend(failures)
        for failure in failures:
            log.info("consumer %s: %s", self._consumer_id, failure.describe())
        if callback is not None:
            for failure in failures:
                try:
                    callback(LeaseLostError([failure]))
                except Exception:
                    log.exception("on_ack_error callback failed")

    def _raise_failures(self) -> None:
        # Looked at without the lock first: receive() calls this for every message, and the
        # lock was 4 % of a consumer's CPU. A failure appended meanwhile is raised next time.
        if not self._failures:
            return
        with self._cond:
            failures, self._failures = self._failures, []
        if failures:
            raise LeaseLostError(failures)

    def _check_open(self) -> None:
        if self._closed:
            raise ConsumerClosedError(f"consumer {self._consumer_id} is closed")
        if self._terminal is not None:
            raise SessionEndedError(self._terminal.reason, self._terminal.message)


def _background_loop(
    ref: weakref.ReferenceType[QueueConsumer], cond: threading.Condition, stop: threading.Event
) -> None:
    """Heartbeats and aged acks, independent of message processing (a slow handler must not
    starve heartbeats). Holds only a weak reference: a consumer dropped without close() stops
    heartbeating, and its session times out on the coordinator."""
    while not stop.is_set():
        with cond:
            consumer = ref()
            if consumer is None or stop.is_set():
                return
            try:
                wait = consumer._tick_locked(time.monotonic())
            except Exception:
                log.exception("qlayer consumer background thread")
                wait = _MAX_THREAD_WAIT
            del consumer
            cond.wait(wait)


def _partition(spans: Spans, item: AckItem) -> int | None:
    """The journal partition of an ack item of a queue of several parts (its part's shard
    settles it); None for other queues, whose shard the queue says."""
    return partition_of(item.bookmark) if item.queue in spans.parts else None
