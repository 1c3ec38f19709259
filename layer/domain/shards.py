"""Shards: how queues are spread over coordinator processes (DESIGN §3, version 2).

An installation has a fixed number of shards, chosen when its database is created
(`qlayer db upgrade --shards N`). Every queue lives on exactly one shard; a coordinator
process runs the shards Kafka's group protocol assigns it. Pure functions only: the store
keeps the queue → shard map, this module says where a new queue goes.
"""

from __future__ import annotations

import zlib
from typing import Final

__all__ = [
    "DEFAULT_SHARD_COUNT",
    "MAX_SHARD_COUNT",
    "part_of",
    "part_shards",
    "shard_count_problem",
    "shard_for",
    "shard_key",
]

#: 16 shards let up to 16 coordinator processes share the work, at one idle consumer of a
#: partition each for every shard a process holds (docs/coordinator.md, "How many shards").
DEFAULT_SHARD_COUNT: Final = 16
#: Each shard is a partition of `<prefix>shards`, `<prefix>control` and `<prefix>ack`.
MAX_SHARD_COUNT: Final = 1024


def shard_count_problem(count: object) -> str | None:
    """Why ``count`` cannot be an installation's shard count, or None."""
    if isinstance(count, bool) or not isinstance(count, int):
        return f"the shard count must be a whole number, got {count!r}"
    if not 1 <= count <= MAX_SHARD_COUNT:
        return f"the shard count must be between 1 and {MAX_SHARD_COUNT}, got {count}"
    return None


def shard_key(shard: int) -> str:
    """The shard's name in PostgreSQL (ownership and input positions are keyed by text)."""
    return str(shard)


def shard_for(name: str, *, shard: int | None, shard_group: str | None,
              shard_count: int) -> int:
    """The shard a queue is placed on: its explicit ``shard``, else a hash of its
    ``shard_group`` (queues of one group land together), else a hash of its name.

    CRC-32 rather than Python's ``hash``: placement must be the same in every process and
    every release."""
    if shard is not None:
        if not 0 <= shard < shard_count:
            raise ValueError(f"shard {shard} does not exist: this installation has shards "
                             f"0..{shard_count - 1}")
        return shard
    return zlib.crc32((shard_group or name).encode()) % shard_count


def part_of(partition: int, parts: int) -> int:
    """The part of a queue of ``parts`` parts that a journal partition belongs to: partition
    p is part p mod parts, so a partition keeps its part when the journal gains partitions
    (docs/coordinator.md, "Partitioned queues")."""
    return partition % parts if parts > 1 else 0


def part_shards(first: int, parts: int, shard_count: int) -> tuple[int, ...]:
    """The shard of each part of a queue whose first part is on shard ``first``: part k on
    shard (first + k) mod shard_count, so the parts of one queue are on as many shards as
    there are parts (up to the shard count) and one process per shard can serve them."""
    return tuple((first + k) % shard_count for k in range(max(parts, 1)))
