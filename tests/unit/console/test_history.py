"""The console's in-memory history and its inline SVG charts: pure, no I/O."""

from __future__ import annotations

import re

import pytest

from layer.console.history import TOTALS, History, Sample, svg_chart, totals


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


def figures(at: float, depth: int, acked: int) -> Sample:
    return Sample(at, depth, {"enqueued": 0, "delivered": 0, "acked": acked,
                              "dead_lettered": 0})


def test_a_sampling_keeps_what_changed_with_the_sampling_before_it_and_always_the_totals(
        ) -> None:
    history = History(window=3600)
    first = history.sampling(0, {"Busy": figures(0, 1, 0), "Idle": figures(0, 0, 0)})
    assert [q for q, _ in first] == ["Busy", "Idle", TOTALS]  # new queues: kept
    assert history.sampling(15, {"Busy": figures(15, 1, 0), "Idle": figures(15, 0, 0)}) == [
        (TOTALS, totals(15, [figures(15, 1, 0), figures(15, 0, 0)]))]  # nothing changed
    assert [q for q, _ in history.sampling(30, {"Busy": figures(30, 1, 0),
                                                  "Idle": figures(30, 0, 0)})] == [TOTALS]
    # Busy acks 30 between 30 and 45: its sample at 30 (not kept then) is kept now, so the
    # rate is 30 over 15 s, not over the 45 s since its last kept sample.
    kept = history.sampling(45, {"Busy": figures(45, 0, 30), "Idle": figures(45, 0, 0)})
    assert [(q, s.at) for q, s in kept] == [("Busy", 30), ("Busy", 45), (TOTALS, 45)]
    assert history.rate_series("Busy", "acked") == [(30, 0.0), (45, 2.0)]
    assert history.latest_rates("Busy", ["acked"]) == {"acked": 2.0}
    # Idle since 0: drawn on to the last sampling, at 0 per second.
    assert history.depth_series("Idle") == [(0, 0.0), (45, 0.0)]
    assert history.latest_rates("Idle", ["acked"]) is None
    history.sampling(60, {"Busy": figures(60, 0, 30)})  # Idle deleted
    assert history.latest_rates("Busy", ["acked"]) == {"acked": 0.0}  # no change since 45
    assert history.samples("Idle") == []
    assert history.latest(TOTALS) == totals(60, [figures(60, 0, 30)])


def test_samples_read_back_make_the_same_charts_as_the_console_that_took_them() -> None:
    taken = History(window=3600)
    stored = []
    for at, acked in ((0, 0), (15, 0), (30, 10), (45, 10), (60, 40)):
        stored += taken.sampling(at, {"Jobs": figures(at, 1, acked)})
    restarted = History(window=3600)
    restarted.load(stored)
    assert restarted.rate_series("Jobs", "acked") == taken.rate_series("Jobs", "acked")
    assert restarted.series(TOTALS, "depth") == taken.series(TOTALS, "depth")
    # The restarted console's next sampling keeps only what changed since the stored one.
    assert [q for q, _ in restarted.sampling(75, {"Jobs": figures(75, 1, 40)})] == [TOTALS]
