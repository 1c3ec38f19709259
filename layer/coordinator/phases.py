"""How long each phase of a shard loop's iterations took, as bucket counts (a histogram).

The loop already times its phases (µs) for its counters; this keeps their distribution too,
for the Prometheus endpoint (`layer.coordinator.metrics`): one bisection and two additions per
phase and iteration, never anything per message. Buckets are fixed, so a scrape reads plain
integers and nothing is allocated per iteration.
"""

from __future__ import annotations

from bisect import bisect_left

__all__ = ["PHASES", "PHASE_BUCKETS_US", "PhaseTimes"]

#: The phases of `ShardLoop.run_once`, in order (docs/operations.md, "Metrics").
PHASES = ("polling", "deciding", "committing", "encoding", "writing")
#: Upper bounds (µs) of the buckets; a last, unbounded one (+Inf) follows.
PHASE_BUCKETS_US = (100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000,
                    250_000, 500_000, 1_000_000, 2_500_000, 10_000_000)


class PhaseTimes:
    """Per phase: how many iterations fell in each bucket, and the sum of their µs."""

    __slots__ = ("buckets", "count", "sums")

    def __init__(self) -> None:
        width = len(PHASE_BUCKETS_US) + 1
        #: Per phase, the count of each bucket (not cumulative; the last is +Inf).
        self.buckets: list[list[int]] = [[0] * width for _ in PHASES]
        self.sums: list[int] = [0] * len(PHASES)
        self.count = 0

    def observe(self, polling: int, deciding: int, committing: int, encoding: int,
                writing: int) -> None:
        """One iteration's phases, in µs (a negative time, from a clock step, counts 0)."""
        bounds, buckets, sums = PHASE_BUCKETS_US, self.buckets, self.sums
        for i, us in enumerate((polling, deciding, committing, encoding, writing)):
            us = max(us, 0)
            buckets[i][bisect_left(bounds, us)] += 1
            sums[i] += us
        self.count += 1

    def cumulative(self, phase: int) -> list[int]:
        """The phase's bucket counts as Prometheus wants them: each counts every iteration at
        or below its bound (the last is the total)."""
        out, total = [], 0
        for n in self.buckets[phase]:
            total += n
            out.append(total)
        return out
