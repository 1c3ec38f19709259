"""Where a queue's journal positions move: `qlayer queue reset --to ...` and a changed
``recovery_point`` (AMPS: "the configured RecoveryPoint for the queue has changed").

A target is ``beginning``, ``end``, an ISO-8601 timestamp, or explicit offsets
``PARTITION:OFFSET,...`` (``TOPIC:PARTITION:OFFSET`` when the queue reads several journals).
`parse_target` checks the text and gives it one canonical spelling (stored as
``queues.reset_to``); `resolve_target` turns it into an offset per journal partition with the
broker's help, identically for the CLI's dry run and for the coordinator.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Final, Literal, Protocol

from layer.domain.errors import QlayerError

__all__ = ["DEFAULT_RECOVERY_POINT", "OffsetsSource", "ResetTarget", "ResetTargetError", "moved",
           "parse_target", "resolve_target"]

TargetKind = Literal["beginning", "end", "timestamp", "offsets"]

_OFFSET_ITEM = re.compile(r"^(?:(?P<topic>[A-Za-z0-9._-]+):)?(?P<partition>\d+):(?P<offset>\d+)$")

#: Where a queue whose definition does not say starts ([RecoveryPoint]); here rather than only
#: in `definitions` so the store need not load pydantic to know it.
DEFAULT_RECOVERY_POINT: Final = "beginning"


class ResetTargetError(QlayerError):
    """A reset target that cannot be read, or names partitions the queue does not read."""


class OffsetsSource(Protocol):
    """The broker questions a target needs answered (`KafkaAdmin`, the coordinator's admin)."""

    def log_start_offsets(self, pairs: Iterable[tuple[str, int]],
                          timeout: float = 10.0) -> dict[tuple[str, int], int]: ...

    def end_offsets(self, pairs: Iterable[tuple[str, int]],
                    timeout: float = 10.0) -> dict[tuple[str, int], int]: ...

    def offsets_for_time(self, pairs: Iterable[tuple[str, int]], timestamp_ms: int,
                         timeout: float = 10.0) -> dict[tuple[str, int], int]: ...


@dataclass(frozen=True, slots=True)
class ResetTarget:
    kind: TargetKind
    moment: datetime | None = None
    #: (topic or None for "the queue's one journal", partition) -> offset
    offsets: tuple[tuple[str | None, int, int], ...] = ()

    @property
    def text(self) -> str:
        """The canonical spelling, as stored."""
        if self.kind == "timestamp":
            assert self.moment is not None
            return self.moment.isoformat()
        if self.kind == "offsets":
            return ",".join(f"{t}:{p}:{o}" if t is not None else f"{p}:{o}"
                            for t, p, o in self.offsets)
        return self.kind


def parse_target(text: str) -> ResetTarget:
    """Read ``beginning``, ``end``, an ISO-8601 timestamp with an offset, or offsets."""
    word = text.strip()
    if word.lower() in ("beginning", "end"):
        return ResetTarget(word.lower())  # type: ignore[arg-type]
    try:
        moment: datetime | None = datetime.fromisoformat(word)
    except ValueError:
        moment = None
    if moment is not None:
        if moment.tzinfo is None:
            raise ResetTargetError(f"the timestamp {text!r} has no UTC offset; add one, e.g. "
                                   "2024-05-01T00:00:00Z (the journal's times are absolute)")
        # The same spelling `recovery_point` stores, so a reset to the setting compares equal.
        return ResetTarget("timestamp", moment=moment)
    items: list[tuple[str | None, int, int]] = []
    seen: set[tuple[str | None, int]] = set()
    for part in word.split(","):
        found = _OFFSET_ITEM.match(part.strip())
        if found is None:
            raise ResetTargetError(
                "--to must be beginning, end, an ISO-8601 timestamp such as "
                "2024-05-01T00:00:00Z, or offsets PARTITION:OFFSET,... such as 0:120,1:88 "
                f"(TOPIC:PARTITION:OFFSET when the queue reads several journals); got {text!r}")
        key = (found["topic"], int(found["partition"]))
        if key in seen:
            raise ResetTargetError(f"{text!r} names partition "
                                   f"{part.strip().rsplit(':', 1)[0]} twice")
        seen.add(key)
        items.append((key[0], key[1], int(found["offset"])))
    return ResetTarget("offsets", offsets=tuple(sorted(
        items, key=lambda i: ("" if i[0] is None else i[0], i[1]))))


def resolve_target(target: ResetTarget, partitions: list[tuple[str, int]],
                   admin: OffsetsSource) -> dict[tuple[str, int], int]:
    """The offset each journal partition moves to; partitions explicit offsets leave out
    keep theirs (they are not in the answer). Offsets are kept within what the journal
    holds (log start .. end): below it retention deleted the records, past it nothing is."""
    if not partitions:
        return {}
    if target.kind == "beginning":
        return admin.log_start_offsets(partitions)
    if target.kind == "end":
        return admin.end_offsets(partitions)
    if target.kind == "timestamp":
        assert target.moment is not None
        return admin.offsets_for_time(partitions, int(target.moment.timestamp() * 1000))
    topics = sorted({topic for topic, _ in partitions})
    wanted: dict[tuple[str, int], int] = {}
    for topic, partition, offset in target.offsets:
        if topic is None:
            if len(topics) != 1:
                raise ResetTargetError(
                    f"the queue reads {len(topics)} journals ({', '.join(topics) or 'none'}); "
                    "name the topic: TOPIC:PARTITION:OFFSET")
            topic = topics[0]
        if (topic, partition) not in partitions:
            raise ResetTargetError(f"the queue does not read {topic} partition {partition} "
                                   f"(it reads {_listed(partitions)})")
        wanted[(topic, partition)] = offset
    firsts = admin.log_start_offsets(list(wanted))
    ends = admin.end_offsets(list(wanted))
    return {tp: min(max(offset, firsts.get(tp, 0)), ends.get(tp, offset))
            for tp, offset in wanted.items()}


def _listed(partitions: Iterable[tuple[str, int]]) -> str:
    by_topic: dict[str, list[int]] = {}
    for topic, partition in sorted(partitions):
        by_topic.setdefault(topic, []).append(partition)
    return "; ".join(f"{t} partitions {','.join(map(str, ps))}" for t, ps in by_topic.items())


def moved(old: Mapping[tuple[str, int], int], new: Mapping[tuple[str, int], int]
          ) -> dict[tuple[str, int], tuple[int | None, int]]:
    """The partitions whose position changes: old (None: none yet) -> new."""
    return {tp: (old.get(tp), offset) for tp, offset in sorted(new.items())
            if old.get(tp) != offset}
