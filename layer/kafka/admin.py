"""Kafka administration for qlayer: internal, delivery and dead-letter topics; offsets."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaError, KafkaException
from confluent_kafka import TopicPartition as KTP
from confluent_kafka.admin import (  # type: ignore[attr-defined]  # exported, not re-declared
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
    OffsetSpec,
    ResourceType,
)

from layer.kafka.errors import (
    DRIVER_ERRORS,
    KafkaAdapterError,
    LoginWatch,
    driver_error,
    translated,
)
from layer.kafka.logs import logged
from layer.kafka.offsets import LEADER_MOVING


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int = 1
    config: Mapping[str, str] | None = None


#: How long (s) `KafkaAdmin.commit_group_offsets` leaves alone a Kafka that did not answer.
UNREACHABLE_FOR = 5.0


class KafkaAdmin:
    def __init__(self, config: Mapping[str, Any]) -> None:
        settings = {
            # After all brokers were down for a moment, librdkafka 2.16's default strategy
            # ("rebootstrap") drops the brokers it knew and learns them again; its group
            # coordinator requests (`commit_group_offsets`) keep waiting on a dropped broker
            # and time out for good, while every other request works (measured: a broker
            # SIGKILLed for 10 s, then every AlterConsumerGroupOffsets timed out for minutes;
            # with "none", the first one after the restart succeeded). A deployment's `kafka:`
            # settings may still choose otherwise.
            "metadata.recovery.strategy": "none",
            **config,
            # A question about a topic (`ping`, a metadata request naming it) must never make
            # it: the admin client is a producer to librdkafka, whose default is to ask the
            # broker to create a topic it names (with the broker's auto.create.topics.enable).
            # The lag-offset commit's ping made a journal deleted a moment before again, in
            # the fault soak; the topics qlayer needs are made by `ensure_topics`.
            "allow.auto.create.topics": False,
        }
        self._config = settings
        # Keeps a refused login's reason for the error a failed call raises (LoginWatch).
        self._login = LoginWatch()
        if "error_cb" not in settings:
            settings["error_cb"] = self._login
        with translated("cannot create a Kafka admin client"):
            self._admin = AdminClient(logged(settings))
        self._unreachable_until = 0.0

    @contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        """`translated`, saying a refused login or a missing ACL as one line (who, where, fix)."""
        try:
            yield
        except KafkaAdapterError:
            raise
        except DRIVER_ERRORS as exc:
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: BaseException) -> KafkaAdapterError:
        with suppress(*DRIVER_ERRORS):
            self._admin.poll(0)  # serves error_cb: the reason of a refused login
        return driver_error(what, exc, config=self._config, login=self._login)

    def ensure_topics(self, specs: Iterable[TopicSpec], timeout: float = 30.0) -> list[str]:
        """Create the topics that do not exist yet; returns the names created."""
        wanted = {s.name: s for s in specs}
        if not wanted:
            return []
        existing = set(self.topics(timeout))
        missing = [s for n, s in wanted.items() if n not in existing]
        if not missing:
            return []
        with self._translated(f"cannot create topics {[s.name for s in missing]}"):
            futures = self._admin.create_topics(
                [NewTopic(s.name, num_partitions=s.partitions, replication_factor=-1,
                          config=dict(s.config or {})) for s in missing],
                operation_timeout=timeout)
        created = []
        for name, future in futures.items():
            try:
                future.result(timeout=timeout)
                created.append(name)
            except DRIVER_ERRORS as exc:
                if _code(exc) != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise self._error(f"cannot create topic {name}", exc) from exc
        self._wait_for_leaders([s.name for s in missing], timeout)
        return created

    def ensure_topic_config(self, topic: str, config: Mapping[str, str],
                            timeout: float = 30.0) -> bool:
        """Set ``config`` on an existing topic where it differs (an incremental alter, so the
        topic's other settings stay); True when something was changed."""
        resource = ConfigResource(ResourceType.TOPIC, topic)
        with self._translated(f"cannot read the configuration of {topic}"):
            described = self._admin.describe_configs([resource])[resource].result(timeout)
        wanted = {k: v for k, v in config.items()
                  if k not in described or str(described[k].value) != str(v)}
        if not wanted:
            return False
        change = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[
            ConfigEntry(k, str(v), incremental_operation=AlterConfigOpType.SET)
            for k, v in wanted.items()])
        with self._translated(f"cannot change the configuration of {topic}"):
            for future in self._admin.incremental_alter_configs([change]).values():
                future.result(timeout)
        return True

    def ensure_partitions(self, topic: str, count: int, timeout: float = 30.0) -> bool:
        """Give an existing topic at least ``count`` partitions; True when it grew."""
        have = self.topics(timeout).get(topic)
        if have is None:
            raise KafkaAdapterError(f"cannot add partitions to {topic}: no such topic")
        if have >= count:
            return False
        with self._translated(f"cannot grow {topic} to {count} partitions"):
            futures = self._admin.create_partitions([NewPartitions(topic, count)],
                                                    operation_timeout=timeout)
        for future in futures.values():
            try:
                future.result(timeout=timeout)
            except DRIVER_ERRORS as exc:
                # Another process grew it first: fine if it has enough now. The broker says
                # so (INVALID_PARTITIONS, "already has N") before this client's metadata
                # shows it: two coordinators starting together hit that (seen in the soak).
                if _code(exc) == KafkaError.INVALID_PARTITIONS \
                        and _already_has(exc, count):
                    return False
                if self.topics(timeout).get(topic, 0) < count:
                    raise self._error(f"cannot grow {topic} to {count} partitions",
                                       exc) from exc
        self._wait_for_leaders([topic], timeout)
        return True

    def _wait_for_leaders(self, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = set(names)
        while pending and time.monotonic() < deadline:
            with self._translated(f"waiting for leaders of {sorted(pending)}"):
                md = self._admin.list_topics(timeout=timeout)
            for name in list(pending):
                t = md.topics.get(name)
                if t is not None and t.error is None and t.partitions and all(
                        p.leader >= 0 for p in t.partitions.values()):
                    pending.discard(name)
            if pending:
                time.sleep(0.05)
        if pending:
            raise KafkaAdapterError(f"topics without leaders after {timeout}s: {sorted(pending)}")

    def ping(self, topic: str, timeout: float = 2.0) -> None:
        """Raise KafkaAdapterError unless a broker answers a metadata request for ``topic``
        (an existing one: it is not created) within ``timeout``; a cheap check that Kafka is
        back, one small request whatever the size of the cluster."""
        with self._translated("Kafka does not answer"):
            self._admin.poll(0)  # the client's log lines, with a `logger` (layer.kafka.logs)
            md = self._admin.list_topics(topic=topic, timeout=timeout)
        found = md.topics.get(topic)
        if not md.brokers or found is None or found.error is not None:
            error = found.error if found is not None else None
            raise KafkaAdapterError(
                f"Kafka does not serve {topic}: {error.str() if error else 'no metadata'}",
                code=error.name() if error else None, retriable=True)

    def topics(self, timeout: float = 10.0) -> dict[str, int]:
        """Every topic with its partition count."""
        with self._translated("cannot list topics"):
            self._admin.poll(0)  # the client's log lines, with a `logger` (layer.kafka.logs)
            md = self._admin.list_topics(timeout=timeout)
        return {name: len(t.partitions) for name, t in md.topics.items() if t.error is None}

    def topics_soon(self, timeout: float = 10.0) -> TopicListing:
        """`topics`, asked now and read later: see `TopicListing`."""
        return TopicListing(self, timeout)

    def matching_topics(self, pattern: re.Pattern[str], timeout: float = 10.0) -> dict[str, int]:
        return {n: p for n, p in self.topics(timeout).items() if pattern.fullmatch(n)}

    def delete_topics(self, names: Iterable[str], timeout: float = 30.0) -> None:
        names = list(names)
        if not names:
            return
        with self._translated(f"cannot delete topics {names}"):
            futures = self._admin.delete_topics(names, operation_timeout=timeout)
        for name, future in futures.items():
            try:
                future.result(timeout=timeout)
            except DRIVER_ERRORS as exc:
                if _code(exc) != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    raise self._error(f"cannot delete topic {name}", exc) from exc

    def _offsets(self, pairs: Iterable[tuple[str, int]], spec: OffsetSpec,
                 timeout: float, known_only: bool = False) -> dict[tuple[str, int], int]:
        request = {KTP(t, p): spec for t, p in pairs}
        if not request:
            return {}
        out: dict[tuple[str, int], int] = {}
        # A partition whose leader is being elected (a topic made a moment ago, a broker just
        # back) answers NOT_LEADER / LEADER_NOT_AVAILABLE / UNKNOWN_LEADER_EPOCH for a few
        # hundred ms: asked again within the timeout rather than failing a shard's start-up
        # over it.
        deadline = time.monotonic() + timeout
        while request:
            again: dict[Any, Any] = {}
            with self._translated("cannot list offsets"):
                for tp, future in self._admin.list_offsets(request,
                                                           request_timeout=timeout).items():
                    try:
                        out[(tp.topic, tp.partition)] = future.result(timeout=timeout).offset
                    except DRIVER_ERRORS as exc:
                        if known_only and _code(exc) == KafkaError.UNKNOWN_TOPIC_OR_PART:
                            continue
                        if _code(exc) not in LEADER_MOVING or time.monotonic() > deadline:
                            raise
                        again[tp] = request[tp]
            request = again
            if request:
                time.sleep(0.2)
        return out

    def log_start_offsets(self, pairs: Iterable[tuple[str, int]], timeout: float = 10.0, *,
                          known_only: bool = False) -> dict[tuple[str, int], int]:
        """The first offset still on the broker (retention may have deleted earlier ones).

        With ``known_only``, a partition the broker answers UNKNOWN_TOPIC_OR_PART for (a topic
        being deleted, still in a listing made a moment before) is left out of the answer
        rather than failing the whole question."""
        return self._offsets(pairs, OffsetSpec.earliest(),  # type: ignore[no-untyped-call]
                             timeout, known_only)

    def end_offsets(self, pairs: Iterable[tuple[str, int]], timeout: float = 10.0, *,
                    known_only: bool = False) -> dict[tuple[str, int], int]:
        """Each partition's log end; ``known_only`` as in `log_start_offsets`."""
        return self._offsets(pairs, OffsetSpec.latest(),  # type: ignore[no-untyped-call]
                             timeout, known_only)

    def offsets_for_time(self, pairs: Iterable[tuple[str, int]], timestamp_ms: int,
                         timeout: float = 10.0) -> dict[tuple[str, int], int]:
        """First offset at or after timestamp_ms per partition (the end when none is)."""
        found = self._offsets(pairs, OffsetSpec.for_timestamp(timestamp_ms), timeout)
        ends = self.end_offsets([tp for tp, o in found.items() if o < 0], timeout)
        return {tp: (o if o >= 0 else ends[tp]) for tp, o in found.items()}

    def commit_group_offsets(self, group: str, offsets: Mapping[tuple[str, int], int],
                             timeout: float = 10.0) -> None:
        """Record a queue's recovery points as a consumer group's offsets, for lag tools.

        Asked only of a Kafka that answered a metadata request just before: librdkafka
        (2.16 and earlier; confluentinc/librdkafka#4605, PR #5397) aborts the whole process
        with ``rd_kafka_enq_once_del_source_return: Assertion `eonce->refcnt > 0'`` when a
        request to a group coordinator (this one) meets a connection going down. A broker
        that did not answer is not asked again for `UNREACHABLE_FOR` seconds."""
        if not offsets:
            return
        now = time.monotonic()
        if now < self._unreachable_until:
            raise KafkaAdapterError(f"cannot commit offsets of group {group}: Kafka did not "
                                    "answer a moment ago", retriable=True)
        try:
            self.ping(next(iter(offsets))[0], timeout=min(timeout, 2.0))
        except KafkaAdapterError as exc:
            # No broker answered (librdkafka's local codes start with "_"); a broker that
            # answered about the topic (deleted, say) is still asked for the other groups.
            if exc.code is None or exc.code.startswith("_"):
                self._unreachable_until = now + UNREACHABLE_FOR
            raise
        request = ConsumerGroupTopicPartitions(
            group, [KTP(t, p, o) for (t, p), o in offsets.items()])
        with self._translated(f"cannot commit offsets of group {group}"):
            for future in self._admin.alter_consumer_group_offsets([request]).values():
                future.result(timeout=timeout)




def _code(exc: BaseException) -> int | None:
    """librdkafka's error code inside a driver exception, if it carries one."""
    error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    return error.code() if isinstance(error, KafkaError) else None


_ALREADY_HAS = re.compile(r"already has (\d+) partition")


def _already_has(exc: BaseException, count: int) -> bool:
    """True when the broker refused to grow a topic because it has ``count`` or more
    partitions already (its message: "Topic already has N partition(s)")."""
    found = _ALREADY_HAS.search(str(exc))
    return found is not None and int(found.group(1)) >= count


class TopicListing:
    """The broker's topics with their partition counts (`KafkaAdmin.topics`), asked for in a
    thread at once and read with `result`: the request waits on the broker while the caller
    does other work (`qlayer stats` imports SQLAlchemy and reads PostgreSQL meanwhile, ~0.1 s
    of a one-second command, issue 33). A plain thread, not concurrent.futures: its import
    costs as much as the wait it would hide."""

    def __init__(self, admin: KafkaAdmin, timeout: float) -> None:
        self.admin = admin
        self._topics: dict[str, int] = {}
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._list, args=(timeout,), daemon=True,
                                        name="qlayer-topic-listing")
        self._thread.start()

    def _list(self, timeout: float) -> None:
        try:
            self._topics = self.admin.topics(timeout)
        except Exception as exc:  # raised where the listing is read, not lost
            self._error = exc

    def result(self) -> dict[str, int]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._topics
