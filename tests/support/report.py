"""Where a run's time went, printed at its end (issue 35): the ten slowest tests and the time of
each tier and directory, so that a slow test is seen in the CI log of the change that adds it.

Read from the test reports (with xdist the controller receives every worker's), nothing timed
here: a test's time is its setup, call and teardown; a tier's or directory's *summed* time is
that of its tests, its *span* the wall time from its first test's start to its last one's end
(tests of other tiers run beside them under xdist, so spans overlap).
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

__all__ = ["report_times"]


@dataclass
class _Times:
    tests: set[str] = field(default_factory=set)
    summed: float = 0.0
    start: float = float("inf")
    stop: float = 0.0

    def add(self, report: pytest.TestReport) -> None:
        self.tests.add(report.nodeid)
        self.summed += report.duration
        start = getattr(report, "start", None)
        stop = getattr(report, "stop", None)
        if start is not None and stop is not None:
            self.start = min(self.start, start)
            self.stop = max(self.stop, stop)

    @property
    def span(self) -> str:
        return f"{self.stop - self.start:7.1f}" if self.stop >= self.start else "      -"


def _directory(nodeid: str, depth: int) -> str:
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")[:-1]  # the folders, without the module
    return "/".join(parts[:depth])


def report_times(terminal: pytest.TerminalReporter) -> None:
    reports = [r for key in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
               for r in terminal.stats.get(key, []) if isinstance(r, pytest.TestReport)]
    if not reports:
        return
    per_test: dict[str, float] = defaultdict(float)
    tiers: dict[str, _Times] = defaultdict(_Times)
    directories: dict[str, _Times] = defaultdict(_Times)
    for report in reports:
        per_test[report.nodeid] += report.duration
        tiers[_directory(report.nodeid, 2)].add(report)
        directories[_directory(report.nodeid, 3)].add(report)
    terminal.write_sep("=", "where the time went (summed: its tests' time; span: wall time)")
    # Steps run before pytest (`make test`, `make check`): "lint 4210 typecheck 38020" (ms).
    steps = os.environ.get("QLAYER_TIER_TIMES", "").split()
    if steps:
        terminal.write_line("before the tests: " + ", ".join(
            f"{name} {int(ms) / 1000:.1f}s" for name, ms in zip(steps[::2], steps[1::2],
                                                               strict=True)))
    terminal.write_line(f"{'tier / directory':44} {'tests':>6} {'summed s':>9} {'span s':>7}")
    for tier in sorted(tiers):
        t = tiers[tier]
        terminal.write_line(f"{tier:44} {len(t.tests):6} {t.summed:9.1f} {t.span}")
        for directory in sorted(d for d in directories
                                if d == tier or d.startswith(tier + "/")):
            d = directories[directory]
            # The tier's own modules (tests/integration/test_soak.py) are a row of their own.
            label = directory if directory != tier else f"{tier}/test_*.py"
            terminal.write_line(f"  {label:42} {len(d.tests):6} {d.summed:9.1f} {d.span}")
    terminal.write_sep("-", "the ten slowest tests (setup + call + teardown)")
    for nodeid, seconds in sorted(per_test.items(), key=lambda kv: -kv[1])[:10]:
        terminal.write_line(f"{seconds:8.1f}s  {nodeid}")
