"""Shard ownership by Kafka's consumer-group protocol (DESIGN §3, version 2).

Every coordinator process joins one consumer group, ``P`` + ``coordinators``, subscribed to
the topic ``P`` + ``shards``, which has one partition per shard. The partitions the group
assigns a process are the shards it runs; a process with none is a hot standby. Nothing is
ever written to or read from that topic: it exists so that Kafka's group coordinator does
the membership, failure detection (``session.timeout.ms``) and balancing
(cooperative-sticky: a rebalance moves only the shards it must).

:class:`ShardMembership` turns the rebalance callbacks, which librdkafka runs inside
``poll``, into a list of changes the caller applies after ``poll`` returns, except for
revocations: those are handed to the caller's ``on_revoke`` *inside* the callback, so the
process stops writing for a shard before Kafka lets another process take it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from layer.kafka.errors import DRIVER_ERRORS, KafkaAdapterError, driver_error, translated
from layer.kafka.logs import logged

log = logging.getLogger(__name__)


@dataclass
class MembershipChanges:
    """What rebalances decided since the last ``poll``: shards to start, shards already
    stopped (revoked cleanly) and shards lost (the group moved on without this process)."""

    assigned: list[int] = field(default_factory=list)
    revoked: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.assigned or self.revoked or self.lost)


class ShardMembership:
    """This process's membership of the coordinators' group."""

    def __init__(self, config: Mapping[str, Any], *, group_id: str, topic: str,
                 session_timeout: float, on_revoke: Callable[[list[int], bool], None],
                 instance_id: str, static_id: str | None = None) -> None:
        self.topic = topic
        self._on_revoke = on_revoke
        self._changes = MembershipChanges()
        self._shards: set[int] = set()
        self._last_error: int | None = None
        static = {} if static_id is None else {
            # Static membership (KIP-345): a process that comes back under the same id
            # within the session timeout gets its shards back at once, without a rebalance
            # and without waiting for Kafka to notice the old one is gone. The price: a
            # clean stop does not leave the group either, so *other* processes take its
            # shards only after the session timeout.
            "group.instance.id": static_id}
        with translated("cannot create the coordinators' group consumer"):
            self._consumer = self._join(config, static, group_id, instance_id, session_timeout,
                                        topic)

    def _join(self, config: Mapping[str, Any], static: Mapping[str, str], group_id: str,
              instance_id: str, session_timeout: float, topic: str) -> Consumer:
        consumer = Consumer(logged({
            **config,
            **static,
            "group.id": group_id,
            "client.id": instance_id,
            "partition.assignment.strategy": "cooperative-sticky",
            "session.timeout.ms": int(session_timeout * 1000),
            "heartbeat.interval.ms": max(int(session_timeout * 1000 / 5), 100),
            # No records are ever read here; the loop polls between iterations, and an
            # iteration of a busy shard never takes minutes.
            "max.poll.interval.ms": 300_000,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "latest",
            "enable.partition.eof": False,
        }))
        consumer.subscribe([topic], on_assign=self._assigned, on_revoke=self._revoked,
                           on_lost=self._lost)
        return consumer

    #: Whether the group has given this process an assignment (perhaps empty: a standby).
    joined = False

    @property
    def shards(self) -> frozenset[int]:
        """The shards the group has assigned this process (and it has not given up)."""
        return frozenset(self._shards)

    def poll(self, timeout: float = 0.0) -> MembershipChanges:
        """Serve the group protocol (heartbeats run in the background; rebalances here)."""
        with translated(f"coordinator group on {self.topic}"):
            message = self._consumer.poll(timeout)
        error = message.error() if message is not None else None
        if error is not None:
            if error.fatal():
                raise KafkaAdapterError(f"coordinator group on {self.topic}: {error}",
                                        code=error.name(), fatal=True)
            if error.code() != KafkaError._PARTITION_EOF and error.code() != self._last_error:
                # A broker away makes the same error come again and again: said once, and
                # again when another comes or after the group assigned shards again.
                log.warning("coordinator group on %s: %s", self.topic, error)
            self._last_error = error.code()
        changes, self._changes = self._changes, MembershipChanges()
        return changes

    def close(self) -> None:
        """Leave the group: the remaining processes are given this one's shards at once
        (the revocation callback runs first, so the caller stops them cleanly)."""
        try:
            self._consumer.close()
        except DRIVER_ERRORS as exc:
            log.warning("leaving the coordinator group failed: %s",
                        driver_error("closing", exc))

    # --- rebalance callbacks (run inside poll / close) --------------------------------------

    def _assigned(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        shards = sorted(p.partition for p in partitions)
        self._last_error = None
        self.joined = True
        if shards:
            # At debug: the process says which shards it took, and why, once it runs them.
            log.debug("coordinator group assigned shards %s", shards)
        self._shards.update(shards)
        self._changes.assigned.extend(shards)

    def _revoked(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        self._give_up(sorted(p.partition for p in partitions), lost=False)

    def _lost(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        self._give_up(sorted(p.partition for p in partitions), lost=True)

    def _give_up(self, shards: list[int], *, lost: bool) -> None:
        if not shards:
            return
        log.info("coordinator group %s shards %s", "lost" if lost else "revoked", shards)
        self._shards.difference_update(shards)
        pending = set(self._changes.assigned)
        # Assigned and revoked before the caller saw the assignment: nothing to stop.
        self._changes.assigned = [s for s in self._changes.assigned if s not in shards]
        started = [s for s in shards if s not in pending]
        (self._changes.lost if lost else self._changes.revoked).extend(started)
        try:
            self._on_revoke(started, lost)
        except Exception:  # a callback exception would be swallowed by librdkafka
            log.exception("stopping revoked shards %s failed", started)
