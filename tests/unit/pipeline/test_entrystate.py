"""The incremental lifecycle's per-entry step, without Spark."""

from __future__ import annotations

import json
import math
from typing import Any

from layer.pipeline.entrystate import entry_step, plain_rows


def event(kind: str, at: int, batch: int | None = None, index: int = 0) -> dict[str, Any]:
    return {"type": kind, "timestamp_ms": at, "batch_id": batch, "event_index": index,
            "run_index": 0}


def test_new_events_are_kept_and_all_of_the_entrys_events_emitted() -> None:
    first = entry_step(None, iter([event("ENQUEUED", 1, 7, 0)]), timed_out=False)
    assert first.emit == [event("ENQUEUED", 1, 7, 0)]
    assert first.timeout_ms is None  # no outcome: kept however long it waits
    second = entry_step(first.state, iter([event("LEASED", 2, 8, 0)]), timed_out=False)
    assert [e["type"] for e in second.emit] == ["ENQUEUED", "LEASED"]
    assert second.state is not None and len(json.loads(second.state)) == 2


def test_a_batch_read_twice_counts_once_and_emits_nothing_new() -> None:
    kept = entry_step(None, iter([event("ENQUEUED", 1, 7, 0)]), timed_out=False).state
    again = entry_step(kept, iter([event("ENQUEUED", 1, 7, 0)]), timed_out=False)
    assert again.emit == [] and again.state == kept
    # Single Event records have no batch position: each one counts (a second ACKED must).
    single = {"type": "ACKED", "timestamp_ms": 3, "batch_id": None}
    twice = entry_step(kept, iter([single, single]), timed_out=False)
    assert [e["type"] for e in twice.emit] == ["ENQUEUED", "ACKED", "ACKED"]


def test_an_outcome_sets_the_timeout_at_the_last_event_and_the_timeout_forgets() -> None:
    kept = entry_step(None, iter([event("ENQUEUED", 1, 7, 0)]), timed_out=False).state
    done = entry_step(kept, iter([event("ACKED", 50, 9, 0), event("RENEWED", 40, 9, 1)]),
                      timed_out=False)
    assert done.timeout_ms == 50
    gone = entry_step(done.state, iter([]), timed_out=True)
    assert (gone.emit, gone.state, gone.timeout_ms) == ([], None, None)


def test_pandas_values_become_plain_ones() -> None:
    import numpy as np

    rows = plain_rows([{"offset": 3.0, "delivery_count": math.nan, "type": "LEASED",
                        "partition": np.int32(1)}], ["offset", "delivery_count", "partition"])
    assert rows == [{"offset": 3, "delivery_count": None, "type": "LEASED", "partition": 1}]
    assert type(rows[0]["partition"]) is int


def test_the_step_says_which_emitted_events_were_kept_from_before() -> None:
    first = entry_step(None, iter([event("ENQUEUED", 1, 7, 0)]), timed_out=False)
    assert first.kept == 0  # a new entry: every event is new
    second = entry_step(first.state, iter([event("LEASED", 2, 8, 0), event("ACKED", 3, 8, 1)]),
                        timed_out=False)
    # The metrics and views streams compare the entry as it was (the first `kept` events)
    # with what it is now (all of them).
    assert second.kept == 1
    assert [e["type"] for e in second.emit[:second.kept]] == ["ENQUEUED"]
    assert [e["type"] for e in second.emit[second.kept:]] == ["LEASED", "ACKED"]
    copies = entry_step(second.state, iter([event("LEASED", 2, 8, 0)]), timed_out=False)
    assert (copies.emit, copies.kept) == ([], 0)
