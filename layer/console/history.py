"""The console's memory of the last hour: samples of every queue's depth and counters, taken by
the console itself while it runs, and the charts drawn from them.

Nothing stores a history of the counters (PostgreSQL keeps their current totals only), so the
console samples them every few seconds and keeps the last ``window`` seconds in memory: a
console started a minute ago shows a minute. Rates are per second between two consecutive
samples of one queue; a counter that went down (a queue deleted and made again) counts as 0.

Pure: ``now`` and the samples come from the caller; the charts are inline SVG drawn here, so
the pages need no JavaScript and no chart library.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html import escape

from layer.domain.durations import format_duration

__all__ = ["CHARTED_RATES", "History", "Sample", "svg_chart"]

#: The counters charted as rates on the queues page (a subset of `qlayer stats`' rates).
CHARTED_RATES = ("enqueued", "delivered", "acked", "dead_lettered")


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    depth: int
    counters: dict[str, int]


class History:
    """The last ``window`` seconds of samples, per queue, oldest first.

    A sample less than ``min_gap`` seconds after the previous one is not kept: a page loaded
    just after the sampler's tick would otherwise make a rate over a few milliseconds, where
    one event reads as hundreds per second.
    """

    def __init__(self, window: float = 3600.0, min_gap: float = 0.0) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        self.min_gap = min_gap
        self._samples: dict[str, deque[Sample]] = {}

    def add(self, queue: str, sample: Sample) -> None:
        found = self._samples.setdefault(queue, deque())
        if found and sample.at - found[-1].at < max(self.min_gap, 1e-9):
            return  # too close to the last one, or a clock step back: keep time ordered
        found.append(sample)
        while found and found[0].at < sample.at - self.window:
            found.popleft()

    def keep_only(self, queues: Iterable[str]) -> None:
        """Forget queues that no longer exist."""
        keep = set(queues)
        for name in [q for q in self._samples if q not in keep]:
            del self._samples[name]

    def samples(self, queue: str) -> list[Sample]:
        return list(self._samples.get(queue, ()))

    def depth_series(self, queue: str) -> list[tuple[float, float]]:
        return [(s.at, float(s.depth)) for s in self._samples.get(queue, ())]

    def rate_series(self, queue: str, counter: str) -> list[tuple[float, float]]:
        """(time, per-second rate since the previous sample) for each sample but the first."""
        found = self._samples.get(queue, ())
        out = []
        for before, after in zip(found, list(found)[1:], strict=False):
            out.append((after.at, _rate(before, after, counter)))
        return out

    def latest_rates(self, queue: str, counters: Sequence[str]) -> dict[str, float] | None:
        """Per-second rates between the last two samples, or None with fewer than two."""
        found = self._samples.get(queue)
        if found is None or len(found) < 2:
            return None
        return {name: _rate(found[-2], found[-1], name) for name in counters}


def _rate(before: Sample, after: Sample, counter: str) -> float:
    elapsed = after.at - before.at
    if elapsed <= 0:
        return 0.0
    return max(0, after.counters.get(counter, 0) - before.counters.get(counter, 0)) / elapsed


def svg_chart(points: Sequence[tuple[float, float]], *, now: float, window: float, label: str,
              width: int = 240, height: int = 48) -> str:
    """A line chart of ``points`` over the ``window`` seconds up to ``now``, as inline SVG.

    The x axis starts at the oldest point still in the window (a console started a minute ago
    charts that minute across the whole width, not a sliver at the right edge of an hour) and
    says how far back it reaches; the y axis runs from 0 to the largest value (shown in the
    corner). With no points the chart says so instead of drawing a flat line that would read
    as "zero".
    """
    title = escape(label)
    head = (f'<svg class="chart" role="img" aria-label="{title}" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}" '
            'xmlns="http://www.w3.org/2000/svg">'
            f"<title>{title}</title>"
            f'<rect x="0" y="0" width="{width}" height="{height}" class="frame"/>')
    start = now - window
    shown = [(t, v) for t, v in points if start <= t <= now]
    if not shown:
        return (head + f'<text x="4" y="{height // 2 + 4}" class="empty">no samples yet'
                "</text></svg>")
    start = min(t for t, _ in shown)
    span = now - start
    top = max(v for _, v in shown)
    scale = top if top > 0 else 1.0
    pad = 2

    def xy(t: float, v: float) -> str:
        x = pad + ((t - start) / span if span > 0 else 1.0) * (width - 2 * pad)
        y = height - pad - v / scale * (height - 2 * pad)
        return f"{x:.1f},{y:.1f}"

    if len(shown) > 1:
        mark = ('<polyline points="' + " ".join(xy(t, v) for t, v in shown)
                + '" class="line" fill="none"/>')
    else:  # one sample: a dot where the line will start
        x, y = xy(*shown[0]).split(",")
        mark = f'<circle cx="{x}" cy="{y}" r="2" class="line"/>'
    return (head + mark + f'<text x="{width - 4}" y="12" class="max" text-anchor="end">max '
            f'{_number(top)}</text><text x="4" y="{height - 4}" class="span">last '
            f"{format_duration(round(span))}</text></svg>")


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:.2f}"
