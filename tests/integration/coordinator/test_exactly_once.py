"""Exactly-once processing under faults (issue 34, protocol 9): consume-transform-produce
workers in their own processes, SIGKILLed at every point of a message's processing (before
the result is produced, between produce and commit, after the commit), restarted with the
same consumer id (their next Subscribe waits for the old session's fence); one worker
SIGSTOPped past its lease with its transaction open, then resumed; the coordinator process
SIGKILLed mid-stream and replaced (tests/support/exactly_once.py). A ``read_committed`` reader
of the output topic sees every input exactly once. The same run without transactions produces
duplicates (the test can fail). `make soak SOAK_ARGS=--exactly-once` runs it with 20,000."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from layer.settings import Settings
from tests.support.exactly_once import faulty_run
from tests.support.processes import ConsumerWorker, CoordinatorSubprocess, audit, read_events

pytestmark = pytest.mark.integration

#: Inputs per run: every one is a Kafka transaction of its worker.
TOTAL = int(os.environ.get("QLAYER_EXACTLY_ONCE_MESSAGES", "1500"))


@pytest.fixture
def topics(journal: Callable[..., str], create_topic: Callable[..., str],
           unique_name: Callable[[str], str]) -> tuple[str, str]:
    """The queue's journal (4 partitions) and the workers' output topic."""
    return journal("work", partitions=4), create_topic(unique_name("Results"), 2)


def test_every_input_is_processed_exactly_once_across_worker_and_coordinator_faults(
    settings: Settings, topics: tuple[str, str], tmp_path: Path,
    processes: list[CoordinatorSubprocess | ConsumerWorker],
) -> None:
    topic, out = topics
    run = faulty_run(settings, topic, out, tmp_path, processes,  # type: ignore[arg-type]
                     total=TOTAL)
    assert run.coordinator_kills == 1 and run.pauses == 1, "the faults did not all happen"
    assert run.worker_restarts >= 3, f"only {run.worker_restarts} workers died and restarted"
    results = run.results
    assert set(results) == set(range(TOTAL)), f"{TOTAL - len(results)} inputs never processed"
    twice = {n: c for n, c in results.items() if c > 1}
    assert twice == {}, f"{len(twice)} inputs processed more than once"
    acked, late = audit(read_events(settings, {"Work"}))
    assert len(acked) == TOTAL and max(acked.values()) == 1
    assert late == [], "an entry was delivered after its ack"


def test_the_same_faults_without_transactions_process_inputs_twice(
    settings: Settings, topics: tuple[str, str], tmp_path: Path,
    processes: list[CoordinatorSubprocess | ConsumerWorker],
) -> None:
    topic, out = topics
    run = faulty_run(settings, topic, out, tmp_path, processes,  # type: ignore[arg-type]
                     total=TOTAL, plain=True)
    assert set(run.results) == set(range(TOTAL))  # at-least-once: nothing lost
    assert any(c > 1 for c in run.results.values()), "no input was processed twice"
