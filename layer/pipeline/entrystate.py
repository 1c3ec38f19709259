"""Per-entry streaming state for `lifecycle --stream` (docs/pipeline.md, "Incremental
lifecycle").

Spark keeps, in its state store, each open entry's events so far, keyed by (queue,
bookmark). A micro-batch calls `entry_step` only for the entries it has new events for (and
for entries whose timeout came), so its work is its new events and the entries they touch, not
the history. An entry's state is removed once it has an outcome and the watermark has passed
its last event. `entry_step` is pure (no I/O, no clock): it turns what Spark hands it into
the rows to emit, the state to keep and the timeout to set.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from layer.pipeline.transforms import OUTCOME_TYPES

__all__ = ["Step", "entry_step", "plain_rows"]

_OUTCOMES = frozenset(OUTCOME_TYPES)
#: Identifies one event of an EventBatch: a copy of the batch published twice has the same.
_COPY_KEY = ("batch_id", "event_index", "run_index")


def plain_rows(records: Iterable[dict[str, Any]], integral: Sequence[str]
               ) -> list[dict[str, Any]]:
    """Rows as pandas hands them over, as JSON-able Python values: a null in a numeric
    column arrives as NaN (and a whole number as a float or a numpy integer)."""
    out = []
    for record in records:
        row: dict[str, Any] = {}
        for key, value in record.items():
            if value is None or (isinstance(value, float) and math.isnan(value)):
                row[key] = None
            elif key in integral:
                row[key] = int(value)
            elif hasattr(value, "item"):  # a numpy scalar
                row[key] = value.item()
            else:
                row[key] = value
        out.append(row)
    return out


@dataclass(frozen=True)
class Step:
    """What one call does for one entry: the events to emit (all of the entry's, for its rows
    to be recomputed downstream), the state to keep (None: remove it), the event-time timeout
    to set (None: none) and how many of the emitted events were kept from earlier micro-batches
    (the first ``kept``: the metrics and views streams compare the entry before and after)."""

    emit: list[dict[str, Any]]
    state: str | None
    timeout_ms: int | None
    kept: int = 0


def entry_step(kept: str | None, new: Iterator[dict[str, Any]], timed_out: bool) -> Step:
    """One entry's step: ``kept`` its events so far (JSON, from the state), ``new`` its
    events in this micro-batch.

    A timed-out entry (outcome reached, watermark past its last event) is forgotten and
    emits nothing: its row downstream is final. Events already kept (an EventBatch read
    twice) are dropped by their batch position. When nothing new is left, nothing is emitted.
    """
    if timed_out:
        return Step([], None, None)
    events: list[dict[str, Any]] = json.loads(kept) if kept else []
    before = len(events)
    seen = {tuple(e.get(k) for k in _COPY_KEY) for e in events if e.get("batch_id") is not None}
    added = False
    for event in new:
        key = tuple(event.get(k) for k in _COPY_KEY)
        if event.get("batch_id") is not None:
            if key in seen:
                continue
            seen.add(key)
        events.append(event)
        added = True
    finished = any(e.get("type") in _OUTCOMES for e in events)
    timeout = max(int(e["timestamp_ms"]) for e in events) if finished and events else None
    state = json.dumps(events, separators=(",", ":")) if events else None
    return Step(events if added else [], state, timeout, before if added else 0)
