"""The console's in-memory history and its inline SVG charts: pure, no I/O."""

from __future__ import annotations

import re

import pytest

from layer.console.history import History, Sample, svg_chart


def sample(at: float, depth: int, enqueued: int) -> Sample:
    return Sample(at, depth, {"enqueued": enqueued})


def test_rates_are_per_second_between_consecutive_samples() -> None:
    history = History(window=3600)
    for at, depth, enqueued in ((100, 0, 0), (110, 5, 50), (130, 2, 70)):
        history.add("Jobs", sample(at, depth, enqueued))
    assert history.rate_series("Jobs", "enqueued") == [(110, 5.0), (130, 1.0)]
    assert history.latest_rates("Jobs", ["enqueued", "acked"]) == {"enqueued": 1.0, "acked": 0}
    assert history.depth_series("Jobs") == [(100, 0.0), (110, 5.0), (130, 2.0)]


def test_a_sample_too_close_to_the_last_one_is_not_kept() -> None:
    history = History(min_gap=5)
    for at, enqueued in ((0, 0), (10, 10), (10.01, 11), (16, 16)):
        history.add("Jobs", sample(at, 0, enqueued))
    assert history.rate_series("Jobs", "enqueued") == [(10, 1.0), (16, 1.0)]


def test_a_counter_that_went_down_counts_as_no_traffic() -> None:
    history = History()
    history.add("Jobs", sample(0, 0, 40))
    history.add("Jobs", sample(10, 0, 3))  # the queue was deleted and made again
    assert history.rate_series("Jobs", "enqueued") == [(10, 0.0)]


def test_samples_older_than_the_window_are_dropped_and_time_stays_ordered() -> None:
    history = History(window=60)
    for at in (0, 30, 61, 95):
        history.add("Jobs", sample(at, at, 0))
    history.add("Jobs", sample(90, 1, 0))  # a clock step back: ignored
    assert [s.at for s in history.samples("Jobs")] == [61, 95]
    assert history.latest_rates("Gone", ["enqueued"]) is None
    history.keep_only(["Other"])
    assert history.samples("Jobs") == []
    with pytest.raises(ValueError, match="window"):
        History(window=0)


def test_the_chart_places_points_in_the_window_and_scales_to_the_largest_value() -> None:
    svg = svg_chart([(40.0, 0.0), (70.0, 10.0), (100.0, 5.0)], now=100, window=60,
                    label="Jobs <depth>", width=124, height=44)
    points = re.search(r'points="([^"]+)"', svg)
    assert points is not None
    xy = [tuple(map(float, p.split(","))) for p in points.group(1).split()]
    # x: 2 px padding, 120 px for 60 s; y: 0 at the bottom (42), the max (10) at the top (2).
    assert xy == [(2.0, 42.0), (62.0, 2.0), (122.0, 22.0)]
    assert "max 10" in svg and "last 1m" in svg
    assert "Jobs &lt;depth&gt;" in svg and "<depth>" not in svg


def test_the_chart_spans_what_was_sampled_when_that_is_less_than_the_window() -> None:
    svg = svg_chart([(3590.0, 1.0), (3600.0, 1.0)], now=3600, window=3600, label="x",
                    width=104, height=44)
    assert 'points="2.0,2.0 102.0,2.0"' in svg and "last 10s" in svg


def test_a_chart_without_samples_says_so_and_one_sample_is_a_dot() -> None:
    svg = svg_chart([(0.0, 3.0)], now=5000, window=3600, label="x")  # older than the window
    assert "no samples yet" in svg and "polyline" not in svg
    dot = svg_chart([(4000.0, 3.0)], now=5000, window=3600, label="x")
    assert "<circle" in dot and "polyline" not in dot and "max 3" in dot
