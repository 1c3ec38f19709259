"""The incremental streams' plain-Python steps: window lengths, journal reads by offset, and
which version of a checkpoint part a micro-batch reads (no Spark)."""

from __future__ import annotations

import pytest

from layer.pipeline.changes import offset_rounds, window_ms
from layer.pipeline.checkpoint import read_version, stale_versions


@pytest.mark.parametrize(("window", "ms"), [
    ("1 minute", 60_000), ("90 seconds", 90_000), ("1 hour 30 minutes", 5_400_000),
    ("2 days", 172_800_000), ("1 week", 604_800_000), ("500 milliseconds", 500),
    ("10 Minutes", 600_000),
])
def test_a_window_in_milliseconds(window: str, ms: int) -> None:
    assert window_ms(window) == ms


def test_a_window_without_a_length_is_refused() -> None:
    with pytest.raises(ValueError, match="no length"):
        window_ms("soon")


def test_offsets_close_together_are_one_read_per_partition() -> None:
    rounds = offset_rounds([("t", 0, 5), ("t", 0, 7), ("t", 0, 6), ("t", 1, 100), ("u", 0, 3)])
    assert rounds == [{("t", 0): (5, 8), ("t", 1): (100, 101), ("u", 0): (3, 4)}]


def test_a_queues_head_and_tail_are_two_reads_not_everything_between() -> None:
    head, tail = [10, 11, 12], [90_000, 90_001]
    rounds = offset_rounds([("t", 0, o) for o in [*tail, *head]], max_gap=1000)
    assert rounds == [{("t", 0): (10, 13)}, {("t", 0): (90_000, 90_002)}]


def test_the_reads_are_bounded_by_splitting_at_the_widest_gaps() -> None:
    offsets = [0, 5_000, 5_001, 20_000, 100_000]  # gaps 5000, 1, 14999, 80000
    rounds = offset_rounds([("t", 0, o) for o in offsets], max_gap=1000, max_rounds=3)
    assert [r[("t", 0)] for r in rounds] == [(0, 5_002), (20_000, 20_001), (100_000, 100_001)]
    assert offset_rounds([]) == []


def test_a_micro_batch_reads_the_latest_version_written_before_it() -> None:
    assert read_version([], 4) is None
    assert read_version([1, 3], 4) == 3
    # A version of this very batch is an attempt that did not commit: Spark runs the batch
    # again with the input and state of the batch before, so it reads what that one read.
    assert read_version([1, 3, 4], 4) == 3
    assert read_version([4], 4) is None


def test_versions_older_than_the_one_read_go_the_one_read_stays() -> None:
    assert stale_versions([1, 3, 4], 4) == [1]  # 3 stays: batch 4 may be run again
    assert stale_versions([3, 4], 4) == []
    assert stale_versions([4], 4) == []
