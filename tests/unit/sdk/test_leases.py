"""The SDK drops a delivery whose lease token it has already received (a restarted
coordinator sends the deliveries of the leases it restored again)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from layer.sdk.leases import MIN_REMEMBERED, SeenLeases


def test_a_repeated_token_is_dropped_and_a_new_one_kept() -> None:
    seen = SeenLeases()
    assert seen.first_time("t1") is True
    assert seen.first_time("t2") is True
    assert seen.first_time("t1") is False
    assert len(seen) == 2


def test_the_window_covers_a_few_backlogs_and_forgets_the_oldest() -> None:
    assert SeenLeases(10).capacity == MIN_REMEMBERED  # never fewer
    seen = SeenLeases(5_000)
    assert seen.capacity == 20_000
    seen.remember_for(100)  # a smaller grant does not shrink it
    assert seen.capacity == 20_000

    small = SeenLeases()
    for i in range(MIN_REMEMBERED + 1):
        assert small.first_time(f"t{i}")
    assert len(small) == MIN_REMEMBERED
    assert small.first_time("t0") is True  # forgotten: the oldest went first
    assert small.first_time(f"t{MIN_REMEMBERED}") is False


@given(st.lists(st.integers(0, 50), max_size=300))
def test_within_the_window_exactly_the_first_of_each_token_is_kept(tokens: list[int]) -> None:
    seen = SeenLeases()  # 4096 > anything this test draws
    kept = [t for t in tokens if seen.first_time(str(t))]
    assert kept == list(dict.fromkeys(tokens))
