"""The console's memory of the last hour: samples of every queue's figures and of the
installation's totals, and the charts drawn from them.

PostgreSQL keeps the counters' current totals only, so the console samples them every few
seconds (`History.sampling`). A queue's sample is kept only when its figures changed since the
queue's previous sampling, together with that previous sampling (so an idle stretch reads as
no traffic, not as a slow trickle spread over it): a thousand idle queues cost nothing. The
kept samples are what the console stores in PostgreSQL (`layer.store.history`) and reads back
when it starts, so the charts survive a restart. Rates are per second between two consecutive
kept samples of one queue; a counter that went down (a queue deleted and made again) counts
as 0.

Pure: ``now`` and the samples come from the caller; the charts are inline SVG drawn here, so
the pages need no chart library.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from html import escape

from layer.domain.durations import format_duration

__all__ = ["CHARTED_RATES", "TOTALS", "History", "Sample", "svg_chart", "totals"]

#: The counters charted as rates on the queues page (a subset of `qlayer stats`' rates).
CHARTED_RATES = ("enqueued", "delivered", "acked", "dead_lettered")
#: The name the installation's totals are kept under (no queue is named '').
TOTALS = ""


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    depth: int
    counters: dict[str, int]
    leased: int = 0
    consumers: int = 0

    def same_figures(self, other: Sample) -> bool:
        return (self.depth, self.leased, self.consumers, self.counters) == (
            other.depth, other.leased, other.consumers, other.counters)


def totals(at: float, samples: Iterable[Sample]) -> Sample:
    """The installation's figures: the sum of every queue's."""
    depth = leased = consumers = 0
    counters: dict[str, int] = dict.fromkeys(CHARTED_RATES, 0)
    for s in samples:
        depth += s.depth
        leased += s.leased
        consumers += s.consumers
        for name in CHARTED_RATES:
            counters[name] += s.counters.get(name, 0)
    return Sample(at, depth, counters, leased, consumers)


@dataclass(slots=True)
class _Seen:
    """A queue's figures at the last sampling, and whether that sample was kept."""

    sample: Sample
    kept: bool = field(default=True)


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
        self._seen: dict[str, _Seen] = {}
        #: When the last whole sampling was taken (`sampling`); None before the first.
        self.sampled_at: float | None = None

    def add(self, queue: str, sample: Sample) -> bool:
        """Keep one sample; False when it is too close to the queue's last one (or before
        it)."""
        found = self._samples.setdefault(queue, deque())
        if found and sample.at - found[-1].at < max(self.min_gap, 1e-9):
            return False  # too close to the last one, or a clock step back: keep time ordered
        found.append(sample)
        while found and found[0].at < sample.at - self.window:
            found.popleft()
        return True

    def sampling(self, at: float, samples: Mapping[str, Sample]) -> list[tuple[str, Sample]]:
        """Take one sampling of every queue (all taken at ``at``) and the totals; returns the
        samples kept, to be stored: the totals always, a queue's sample when its figures
        changed since its previous sampling (and that previous one too, when it was not kept),
        and a new queue's first."""
        if self.sampled_at is not None and at - self.sampled_at < max(self.min_gap, 1e-9):
            return []  # a page loaded just after the sampler's tick: nothing new to keep
        kept: list[tuple[str, Sample]] = []
        for queue, sample in samples.items():
            seen = self._seen.get(queue)
            if seen is not None and seen.sample.same_figures(sample):
                self._seen[queue] = _Seen(sample, kept=False)
                continue
            if seen is not None and not seen.kept and self.add(queue, seen.sample):
                kept.append((queue, seen.sample))
            if self.add(queue, sample):
                kept.append((queue, sample))
            self._seen[queue] = _Seen(sample)
        total = totals(at, samples.values())
        if self.add(TOTALS, total):
            kept.append((TOTALS, total))
        self.keep_only([*samples, TOTALS])
        self.sampled_at = at
        return kept

    def load(self, rows: Iterable[tuple[str, Sample]]) -> None:
        """Samples read back from the store (oldest first): the charts of a restarted
        console."""
        for queue, sample in rows:
            self.add(queue, sample)
            seen = self._seen.get(queue)
            if seen is None or seen.sample.at <= sample.at:
                self._seen[queue] = _Seen(sample)

    def keep_only(self, queues: Iterable[str]) -> None:
        """Forget queues that no longer exist."""
        keep = set(queues)
        for name in [q for q in self._samples if q not in keep]:
            del self._samples[name]
        for name in [q for q in self._seen if q not in keep]:
            del self._seen[name]

    def _idle_since(self, queue: str) -> bool:
        """Whether the queue's figures stayed as they were at its last kept sample through
        the last sampling (a kept sample older than the last sampling)."""
        found = self._samples.get(queue)
        if not found or self.sampled_at is None:
            return False
        return found[-1].at < self.sampled_at

    def samples(self, queue: str) -> list[Sample]:
        return list(self._samples.get(queue, ()))

    def latest(self, queue: str) -> Sample | None:
        found = self._samples.get(queue)
        return found[-1] if found else None

    def series(self, queue: str, figure: str) -> list[tuple[float, float]]:
        """(time, value) of ``depth``, ``leased`` or ``consumers``, drawn on to the last
        sampling when the queue has been idle since its last kept sample."""
        found = self._samples.get(queue, ())
        out = [(s.at, float(getattr(s, figure))) for s in found]
        if out and self._idle_since(queue):
            assert self.sampled_at is not None
            out.append((self.sampled_at, out[-1][1]))
        return out

    def depth_series(self, queue: str) -> list[tuple[float, float]]:
        return self.series(queue, "depth")

    def rate_series(self, queue: str, counter: str) -> list[tuple[float, float]]:
        """(time, per-second rate since the previous sample) for each sample but the first;
        0 at the last sampling when the queue has been idle since."""
        found = self._samples.get(queue, ())
        out = []
        for before, after in zip(found, list(found)[1:], strict=False):
            out.append((after.at, _rate(before, after, counter)))
        if found and self._idle_since(queue):
            assert self.sampled_at is not None
            out.append((self.sampled_at, 0.0))
        return out

    def latest_rates(self, queue: str, counters: Sequence[str]) -> dict[str, float] | None:
        """Per-second rates between the last two samplings, or None with fewer than two
        samples; all 0 when the queue did not change at the last sampling."""
        found = self._samples.get(queue)
        if found is None or len(found) < 2:
            return None
        if self._idle_since(queue):
            return dict.fromkeys(counters, 0.0)
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
