"""Deleting the delivery topics of consumers that are gone (issue 16 item 5).

A delivery topic is created on a valid Subscribe (protocol 5) and, before this, was never
deleted: every `qlayer consume` and every SDK consumer without a ``consumer_id`` (a fresh id
per process) left one behind. The owner of shard 0 sweeps them for the whole installation:

- it lists the topics named ``<prefix>delivery.*`` (the names the SDK and the CLI use) and the
  delivery topics of every consumer row in PostgreSQL (all shards' live sessions);
- a listed topic no session uses is *orphaned*; the sweep remembers since when, and deletes it
  once it has been orphaned for ``retention`` seconds. A topic a session uses again (the same
  consumer id back) is no longer orphaned and its clock starts afresh when it is next left.

Why a listing rather than a record of ended sessions: it needs no new table, it also finds the
topics left before this existed (and by coordinators that crashed), and it can never delete a
topic a live session names, whichever shard serves that session. The clock is kept in memory:
after a restart (or when shard 0 moves) it starts again, so a topic is deleted late, never
early. Topics named otherwise (a consumer of another language may pick any name) are never
deleted: the coordinator cannot tell them from an application's own topics.

`OrphanClock` is the pure part (``now`` passed in); `DeliveryTopicSweep` the service a shard
loop runs between iterations.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

from layer.coordinator.core import ShardCore
from layer.coordinator.logformat import fields
from layer.coordinator.ports import TopicAdmin
from layer.domain.errors import QlayerError

log = logging.getLogger(__name__)

__all__ = ["DeliveryTopicSweep", "OrphanClock", "sweep_interval"]


def sweep_interval(retention: float) -> float:
    """How often the topics are listed: often enough that a topic goes within half its
    retention past it, at most once a minute (a listing is a metadata request over every topic
    of the cluster), and never more than once a second."""
    return min(max(retention / 2, 1.0), 60.0)


class OrphanClock:
    """Since when each delivery topic has had no session; which have had none for long enough."""

    def __init__(self, retention: float) -> None:
        if retention <= 0:
            raise ValueError(f"retention must be positive, got {retention}")
        self.retention = retention
        self.orphaned_since: dict[str, float] = {}

    def due(self, listed: Iterable[str], in_use: set[str], now: float) -> list[str]:
        """The listed topics that no session has used for ``retention`` seconds, in name
        order. Topics in use, or no longer listed, are forgotten."""
        orphans = {t for t in listed if t not in in_use}
        self.orphaned_since = {t: self.orphaned_since.get(t, now) for t in orphans}
        return sorted(t for t, since in self.orphaned_since.items()
                      if now - since >= self.retention)

    def forget(self, topics: Iterable[str]) -> None:
        for topic in topics:
            self.orphaned_since.pop(topic, None)


class DeliveryTopicSweep:
    """Deletes the delivery topics no session has used for the retention (run by shard 0)."""

    def __init__(self, core: ShardCore, admin: TopicAdmin,
                 topics_in_use: Callable[[], set[str]], retention: float) -> None:
        self.core = core
        self.admin = admin
        self.topics_in_use = topics_in_use
        self.clock = OrphanClock(retention)
        self.interval = sweep_interval(retention)
        self.pattern = re.compile(re.escape(core.topics.prefix + "delivery.") + ".+")
        self.next_at = 0.0

    def run_once(self, now: float) -> list[str]:
        """List, compare, delete what is due; returns the topics deleted. Failures are logged
        and retried at the next sweep: nothing but disk space depends on it."""
        if now < self.next_at:
            return []
        self.next_at = now + self.interval
        try:
            listed = self.admin.matching_topics(self.pattern)
            # Read after the listing: a topic made by a Subscribe between the two is in use.
            in_use = self.topics_in_use()
        except QlayerError as exc:
            log.warning("listing delivery topics failed: %s", exc)
            return []
        # This shard's own sessions too: one subscribed in this very iteration is not stored yet.
        in_use |= {s.delivery_topic for s in self.core.sessions.values()}
        due = self.clock.due(listed, in_use, now)
        if not due:
            return []
        try:
            self.admin.delete_topics(due)
        except QlayerError as exc:
            log.warning("deleting delivery topics %s failed: %s", due, exc)
            return []
        self.clock.forget(due)
        # A reply to one of them must find it gone (`Output.answerable` lists topics again).
        self.core.known_topics.difference_update(due)
        self.core.counters["delivery_topics_deleted"] += len(due)
        for topic in due:
            log.info("deleted delivery topic %s: no session used it for %gs", topic,
                     self.clock.retention, extra=fields(shard=self.core.shard,
                                                        reason="delivery topic retention"))
        return due
