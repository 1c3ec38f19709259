"""Bookmarks: where a message lives, ``topic/partition/offset``, the identity of an entry.

Kafka topic names may only contain ``[a-zA-Z0-9._-]``, so ``/`` can never appear in the topic
part and a bookmark always splits into exactly three parts. Numbers are canonical decimal (no
sign, no leading zeros, ASCII digits only): one entry has exactly one bookmark string, so
bookmarks can be compared and used as keys as strings too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Self

from layer.protocol.errors import ProtocolError, ProtocolErrorKind
from layer.protocol.topics import topic_name_problem

__all__ = ["Bookmark", "partition_of"]

# Python's int() also accepts "+1", " 1", "1_000" and non-ASCII digits; a bookmark must not.
_CANONICAL_NUMBER = re.compile(r"0|[1-9][0-9]{0,18}")
_MAX_PARTITION = 2**31 - 1
_MAX_OFFSET = 2**63 - 1


@dataclass(frozen=True, slots=True, order=True)
class Bookmark:
    """``topic/partition/offset`` of one journal record. Orders by topic, partition, offset."""

    topic: str
    partition: int
    offset: int

    def __post_init__(self) -> None:
        problem = topic_name_problem(self.topic)
        if problem is not None:
            raise ProtocolError(
                f"bookmark topic {self.topic!r}: {problem}", kind=ProtocolErrorKind.BAD_BOOKMARK
            )
        # Kafka partitions are int32 and offsets int64; anything else is not a real record.
        if not 0 <= self.partition <= _MAX_PARTITION or not 0 <= self.offset <= _MAX_OFFSET:
            raise ProtocolError(
                f"bookmark {self.topic}/{self.partition}/{self.offset}: partition must be in "
                f"0..{_MAX_PARTITION} and offset in 0..{_MAX_OFFSET}",
                kind=ProtocolErrorKind.BAD_BOOKMARK,
            )

    @classmethod
    def parse(cls, text: str) -> Self:
        """Parse ``topic/partition/offset``; raise ``ProtocolError`` naming what is wrong."""
        parts = text.split("/")
        if len(parts) != 3:
            raise ProtocolError(
                f"bookmark {text!r} is not topic/partition/offset",
                kind=ProtocolErrorKind.BAD_BOOKMARK,
            )
        topic, partition, offset = parts
        for label, number in (("partition", partition), ("offset", offset)):
            if _CANONICAL_NUMBER.fullmatch(number) is None:
                raise ProtocolError(
                    f"bookmark {text!r}: {label} {number!r} is not a canonical decimal number",
                    kind=ProtocolErrorKind.BAD_BOOKMARK,
                )
        return cls(topic, int(partition), int(offset))

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}/{self.offset}"

    def format(self) -> str:
        """The wire form, ``topic/partition/offset`` (same as ``str()``)."""
        return f"{self.topic}/{self.partition}/{self.offset}"


def partition_of(text: str) -> int | None:
    """The partition of a bookmark's text, without parsing the rest (a queue of several
    parts routes each ack by it); None when it has none: the item is answered where it is
    settled, as the full parse says."""
    parts = text.split("/")
    if len(parts) != 3 or _CANONICAL_NUMBER.fullmatch(parts[1]) is None:
        return None
    return int(parts[1])
