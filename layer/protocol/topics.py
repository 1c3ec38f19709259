"""Names of qlayer's internal Kafka topics, all under one configurable prefix.

Kafka's rules for a topic name: 1 to 249 characters from ``[a-zA-Z0-9._-]``, and not ``.`` or
``..``. Every name built here is checked against them, so a bad prefix, consumer id or queue
name fails at once with a message naming it, not later inside the broker.
"""

from __future__ import annotations

import re
from functools import lru_cache

from layer.protocol.errors import ProtocolError, ProtocolErrorKind

__all__ = [
    "DEFAULT_TOPIC_PREFIX",
    "MAX_TOPIC_NAME_LENGTH",
    "TopicNames",
    "topic_name_problem",
    "validate_topic_name",
]

DEFAULT_TOPIC_PREFIX = "qlayer."
MAX_TOPIC_NAME_LENGTH = 249
_LEGAL = re.compile(r"[a-zA-Z0-9._-]+")


@lru_cache(maxsize=4096)
def topic_name_problem(name: str) -> str | None:
    """What makes ``name`` an illegal Kafka topic name, or ``None`` when it is legal.

    Cached: every bookmark the coordinator writes checks its topic, and journals are few.
    """
    if not name:
        return "a topic name cannot be empty"
    if len(name) > MAX_TOPIC_NAME_LENGTH:
        return (
            f"a topic name is at most {MAX_TOPIC_NAME_LENGTH} characters, this one has {len(name)}"
        )
    if name in (".", ".."):
        return f"{name!r} is not allowed as a topic name"
    if _LEGAL.fullmatch(name) is None:
        bad = sorted({c for c in name if _LEGAL.fullmatch(c) is None})
        return f"a topic name may only contain a-z A-Z 0-9 . _ - (found {''.join(bad)!r})"
    return None


def validate_topic_name(name: str, *, what: str = "topic name") -> str:
    """Return ``name`` if Kafka accepts it as a topic name, else raise ``ProtocolError``."""
    problem = topic_name_problem(name)
    if problem is not None:
        raise ProtocolError(f"{what} {name!r}: {problem}", kind=ProtocolErrorKind.BAD_TOPIC_NAME)
    return name


class TopicNames:
    """Internal topic names (and the per-queue consumer group) under one prefix.

    ``TopicNames()`` gives ``qlayer.control``, ``qlayer.ack``, ``qlayer.events``,
    ``qlayer.delivery.<consumer id>`` and ``qlayer.dlq.<queue>``.
    """

    __slots__ = ("_prefix",)

    def __init__(self, prefix: str = DEFAULT_TOPIC_PREFIX) -> None:
        # The longest fixed name must fit too, so check the prefix as part of one.
        validate_topic_name(prefix, what="topic prefix")
        validate_topic_name(prefix + "delivery.x", what="topic prefix")
        self._prefix = prefix

    def __repr__(self) -> str:
        return f"TopicNames({self._prefix!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TopicNames) and other._prefix == self._prefix

    def __hash__(self) -> int:
        return hash(self._prefix)

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def control(self) -> str:
        """Consumers write Subscribe / Replace / Heartbeat / Unsubscribe here."""
        return self._prefix + "control"

    @property
    def ack(self) -> str:
        """Consumers write AckRecords here."""
        return self._prefix + "ack"

    @property
    def events(self) -> str:
        """The coordinator writes every state change here."""
        return self._prefix + "events"

    @property
    def queues(self) -> str:
        """Compacted directory of queue definitions, for clients without Postgres: key = queue
        name (UTF-8), value = the definition as JSON, a tombstone when the queue is deleted.
        Publishers read it to route a publish to a queue's name (``layer.sdk.directory``)."""
        return self._prefix + "queues"

    @property
    def shards(self) -> str:
        """One partition per shard; never written: the coordinators' group subscribes to it
        and Kafka assigns each process its shards (DESIGN §3)."""
        return self._prefix + "shards"

    @property
    def coordinators_group(self) -> str:
        """The consumer group every coordinator process joins."""
        return self._prefix + "coordinators"

    def delivery(self, consumer_id: str) -> str:
        """The per-consumer topic leased messages and replies are written to."""
        return validate_topic_name(
            self._prefix + "delivery." + consumer_id,
            what=f"delivery topic of consumer {consumer_id!r}",
        )

    def dead_letter(self, queue: str) -> str:
        """The queue's default dead-letter topic."""
        return validate_topic_name(
            self._prefix + "dlq." + queue, what=f"dead-letter topic of queue {queue!r}"
        )

    def queue_group(self, queue: str) -> str:
        """Kafka consumer group whose committed offsets mirror the queue's recovery points.

        Group ids have no character rules, but the same prefix keeps qlayer's groups together.
        """
        return self._prefix + "queue." + queue

    def is_internal(self, topic: str) -> bool:
        """True for qlayer's own topics, which a queue's regex must never treat as a journal."""
        return topic.startswith(self._prefix)
