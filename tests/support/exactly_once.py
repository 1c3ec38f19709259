"""The exactly-once fault run (issue 34), shared by its integration test and `make soak
SOAK_ARGS=--exactly-once`: consume-transform-produce workers (tests/support/tx_worker.py)
SIGKILLed at every point of a message's processing and restarted with the same consumer id,
one SIGSTOPped past its lease with its transaction open and resumed, the coordinator process
SIGKILLed and replaced; then how many times each input's result is in the output topic
(``read_committed``)."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import TopicReader, put_queues, wait_until
from tests.support.processes import CoordinatorSubprocess, Subprocess, produce_numbers

__all__ = ["FaultRun", "TxWorker", "faulty_run"]

#: The points where a worker SIGKILLs itself (tests/support/tx_worker.py), one worker each
#: (``anytime``: at a random moment, wherever it is, a commit included); one more worker is
#: the one paused past its lease.
POINTS = ("before-produce", "after-produce", "after-commit", "anytime")
PAUSED = len(POINTS)


class TxWorker(Subprocess):
    """One tests/support/tx_worker.py process over queue ``Work``."""

    def __init__(self, settings: Settings, log_dir: Path, name: str, out: str,
                 *options: str) -> None:
        self.name, self.options, self.settings, self.log_dir, self.out = (
            name, options, settings, log_dir, out)
        (log_dir / f"{name}.state").mkdir(exist_ok=True)
        super().__init__([sys.executable, "-m", "tests.support.tx_worker", "Work", out, name,
                          str(log_dir / f"{name}.state"), *options],
                         settings, log_dir / f"{name}.log")

    def again(self) -> TxWorker:
        """The same worker (consumer id, state dir) started anew."""
        return TxWorker(self.settings, self.log_dir, self.name, self.out, *self.options)

    def died(self) -> bool:
        return self.proc.poll() is not None


@dataclass
class FaultRun:
    """What happened, and what the output topic holds."""

    results: Counter[int] = field(default_factory=Counter)
    worker_restarts: int = 0
    pauses: int = 0
    coordinator_kills: int = 0
    seconds: float = 0.0


def faulty_run(settings: Settings, topic: str, out: str, log_dir: Path,
               started: list[Subprocess], *, total: int, plain: bool = False,
               die_chance: float = 0.01, coordinator_kills: int = 1, pauses: int = 1,
               rate: float | None = None, timeout: float = 300.0,
               say: Callable[[str], None] = lambda line: None) -> FaultRun:
    """Run queue ``Work`` over ``topic`` with the faults above until every one of ``total``
    inputs has a result in ``out`` (or ``timeout``), then 8 s more for late duplicates.
    ``plain``: the workers settle at-least-once instead. ``rate``: records a second (None:
    all at once). Every process started is appended to ``started`` (the caller stops them)."""
    mode = ["--plain"] if plain else []
    put_queues(settings, {"name": "Work", "underlying_topic": topic, "lease_period": "3s",
                          "max_per_subscription_backlog": 5})
    run = FaultRun()
    coordinator = CoordinatorSubprocess(settings, log_dir, "c0")
    started.append(coordinator)
    with Store(settings.database_url) as store:
        count = store.shard_count()
        wait_until(lambda: len([o for o in store.owners() if o.owner_id]) == count or None,
                   90, what="the coordinator running every shard")
    workers = [TxWorker(settings, log_dir, f"w{i}", out, *mode, "--die-at", point,
                        "--die-chance", str(die_chance)) for i, point in enumerate(POINTS)]
    workers.append(TxWorker(settings, log_dir, f"w{PAUSED}", out, *mode))  # the one paused
    started.extend(workers)
    reader = TopicReader(settings.bootstrap_servers, out)
    began = time.monotonic()
    published = 0
    paused_at: float | None = None
    # When each pause and coordinator kill comes: spread over the run, by inputs processed.
    pause_marks = [total * (i + 1) // (pauses + 1) for i in range(pauses)]
    kill_marks = [total * (2 * i + 1) // (2 * coordinator_kills + 1)
                  for i in range(coordinator_kills)]
    deadline = began + timeout
    try:
        while time.monotonic() < deadline:
            if published < total:
                due = total if rate is None else min(
                    total, int((time.monotonic() - began) * rate) + 1)
                if due > published:
                    produce_numbers(settings.bootstrap_servers, topic, due - published,
                                    start=published)
                    published = due
            reader.read(0.2)
            done = len(set(outputs(reader)))
            if done >= total:
                break
            for i, worker in enumerate(workers):
                if worker.died():
                    workers[i] = worker.again()
                    started.append(workers[i])
                    run.worker_restarts += 1
            if paused_at is None and pause_marks and done >= pause_marks[0]:
                pause_marks.pop(0)
                workers[PAUSED].proc.send_signal(signal.SIGSTOP)  # past its 3 s lease
                paused_at = time.monotonic()
                say(f"w{PAUSED} paused at {done} results")
            if paused_at is not None and time.monotonic() - paused_at > 5:
                workers[PAUSED].proc.send_signal(signal.SIGCONT)
                paused_at = None
                run.pauses += 1
            if kill_marks and done >= kill_marks[0]:
                kill_marks.pop(0)
                coordinator.kill()
                run.coordinator_kills += 1
                coordinator = CoordinatorSubprocess(settings, log_dir,
                                                    f"c{run.coordinator_kills}")
                started.append(coordinator)
                say(f"coordinator SIGKILLed at {done} results; c{run.coordinator_kills} started")
        if paused_at is not None:
            workers[PAUSED].proc.send_signal(signal.SIGCONT)
            run.pauses += 1
        # Late duplicates have time to show: a resumed worker's commit, a redelivery.
        settle = time.monotonic() + 8
        while time.monotonic() < settle:
            reader.read(0.5)
        run.results = outputs(reader)
    finally:
        reader.close()
    run.seconds = round(time.monotonic() - began, 1)
    return run


def outputs(reader: TopicReader) -> Counter[int]:
    """How many times each input's result is in the output topic."""
    return Counter(json.loads(r.value or b"{}")["n"] for r in reader.records)
