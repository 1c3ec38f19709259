"""`wait_until`, by which the local stack waits for its servers: a server that keeps making
progress (a broker loading its logs) is waited for longer than one that is stuck."""

from __future__ import annotations

import itertools
import time

import pytest

from layer.localstack.process import LocalStackError, wait_until


def test_a_process_making_progress_is_given_more_time_up_to_the_longest() -> None:
    ticks = itertools.count()
    started = time.monotonic()
    with pytest.raises(LocalStackError, match="did not become ready within 2s"):
        # Never ready, always progressing: waited for `longest`, not `timeout`.
        wait_until(lambda: False, 0.5, "busy", progress=lambda: next(ticks), longest=2.0)
    assert 1.9 <= time.monotonic() - started < 10.0


def test_a_stuck_process_is_given_the_timeout_only() -> None:
    started = time.monotonic()
    with pytest.raises(LocalStackError, match="stuck did not become ready"):
        wait_until(lambda: False, 0.5, "stuck", progress=lambda: 0, longest=30.0)
    assert time.monotonic() - started < 10.0  # far from the 30 s it would get progressing


def test_ready_returns_and_a_dead_process_fails_fast() -> None:
    wait_until(lambda: True, 0.5, "ready")
    with pytest.raises(LocalStackError, match=r"exited during start-up\. its log says so"):
        wait_until(lambda: False, 30, "dead", alive=lambda: False,
                   on_death=lambda: "its log says so")
