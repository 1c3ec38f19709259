"""The exactly-once soak (issue 34): `make soak SOAK_ARGS=--exactly-once`.

A stack of its own; ``--messages`` inputs (20,000 by default here) at ``--rate`` through one
queue, consumed, transformed and produced by five transactional worker processes
(tests/support/tx_worker.py): four SIGKILL themselves at every point of a message's processing
(before the produce, between produce and commit, after the commit, at a random moment such as
a commit) and are restarted with the same consumer id; the fifth is SIGSTOPped past its lease
with its transaction open and resumed; and the coordinator process SIGKILLed and replaced
(``--coordinator-kills``; tests/support/exactly_once.py). Then:

- a ``read_committed`` reader of the output topic has every input's result exactly once;
- the events say every entry was acked once and none was leased after its ack;
- `qlayer pipeline reconcile Work` (Spark, unless ``--no-audit``) finds every entry done, no
  violation, nothing pending.

Exits 1 with the problems listed otherwise.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from layer.localstack import StackConfig
from layer.localstack.stack import LocalStack
from layer.settings import Settings
from layer.store import migrate
from tests.soak.checks import audit_check
from tests.soak.report import audit_verdict
from tests.support.exactly_once import faulty_run
from tests.support.kafka import create_topic
from tests.support.ports import reserve_ports
from tests.support.processes import Subprocess, _env, audit, read_events

__all__ = ["run_exactly_once"]


def run_exactly_once(plan: Any, state_dir: Path, say: Callable[[str], None]) -> dict[str, Any]:
    """The scenario with ``plan``'s messages, rate, coordinator kills, seed-free faults and
    audit; returns the figures and ``problems`` (empty when it passed)."""
    # Held while the stack runs (other suites' stacks look for free ports too).
    kafka, postgres = reserve_ports(39700, 2), reserve_ports(35700, 1)
    stack = LocalStack(StackConfig.from_env(
        {}, state_dir=state_dir / f"stack-{kafka.first}", kafka_port=kafka.first,
        postgres_port=postgres.first))
    started: list[Subprocess] = []
    problems: list[str] = []
    figures: dict[str, Any] = {"scenario": "exactly-once", "messages": plan.messages}
    try:
        endpoints = stack.up()
        settings = Settings(bootstrap_servers=endpoints.bootstrap_servers,
                            database_url=endpoints.database_url,
                            topic_prefix=f"qe{uuid.uuid4().hex[:6]}.")
        migrate.upgrade(settings.database_url)
        journal, out = "soak-work", "soak-results"
        create_topic(settings.bootstrap_servers, journal, plan.partitions)
        create_topic(settings.bootstrap_servers, out, 2)
        say(f"{plan.messages:,} inputs at {plan.rate:g}/s, 5 transactional workers, "
            f"{plan.coordinator_kills} coordinator SIGKILLs")
        run = faulty_run(settings, journal, out, state_dir, started, total=plan.messages,
                         coordinator_kills=plan.coordinator_kills,
                         pauses=max(1, plan.consumer_kills // 2), rate=plan.rate,
                         timeout=plan.messages / plan.rate + plan.drain_timeout, say=say)
        results = run.results
        figures.update(worker_restarts=run.worker_restarts, pauses=run.pauses,
                       coordinator_kills=run.coordinator_kills, seconds=run.seconds,
                       results=len(results), duplicates=sum(c - 1 for c in results.values()))
        missing = plan.messages - len(set(results) & set(range(plan.messages)))
        if missing:
            problems.append(f"{missing} inputs have no result")
        twice = sorted(n for n, c in results.items() if c > 1)
        if twice:
            problems.append(f"{len(twice)} inputs have more than one result: {twice[:10]}")
        acked, late = audit(read_events(settings, {"Work"}))
        if len(acked) != plan.messages or max(acked.values(), default=0) > 1:
            problems.append(f"the events acked {len(acked)} entries (of {plan.messages}), "
                            f"at most {max(acked.values(), default=0)} times each")
        if late:
            problems.append(f"{len(late)} entries were leased after their ack")
        if plan.audit:
            problems += _reconcile(settings, journal, state_dir, say)
    finally:
        for process in started:
            process.stop()
        stack.down()
        kafka.release()
        postgres.release()
    figures["problems"] = problems
    return figures


def _reconcile(settings: Settings, journal: str, state_dir: Path,
               say: Callable[[str], None]) -> list[str]:
    """`qlayer pipeline reconcile Work` against every entry of the journal."""
    statuses_dir = state_dir / "reconcile-Work.parquet"
    done = subprocess.run(
        [sys.executable, "-m", "layer_cli.main", "pipeline", "reconcile", "Work",
         "--journal", journal, "--json", "--output", str(statuses_dir)],
        env=_env(settings), capture_output=True, text=True, timeout=900, check=False)
    (state_dir / "reconcile-Work.log").write_text(done.stdout + "\n" + done.stderr,
                                                  encoding="utf-8")
    verdict = audit_verdict("Work", done.returncode, done.stdout, done.stderr)
    statuses = None
    if not verdict.error:
        import pyarrow.parquet as pq

        read = pq.read_table(statuses_dir, columns=["bookmark", "status"]).to_pydict()
        statuses = {str(b): str(s) for b, s in zip(read["bookmark"], read["status"],
                                                   strict=True)}
    check = audit_check(verdict, _entries(settings, journal), statuses)
    say(f"reconcile Work: {verdict.done} done (of {check.expected} expected), "
        f"{verdict.pending} pending, {len(verdict.violations)} violations")
    return list(check.problems)


def _entries(settings: Settings, journal: str) -> set[str]:
    """Every record of the journal, as bookmarks (``topic/partition/offset``)."""
    consumer = Consumer({"bootstrap.servers": settings.bootstrap_servers,
                         "group.id": f"soak-entries-{uuid.uuid4().hex[:6]}",
                         "enable.auto.commit": False, "enable.partition.eof": True})
    parts = list(consumer.list_topics(journal, timeout=10).topics[journal].partitions)
    consumer.assign([TopicPartition(journal, p, 0) for p in parts])
    found: set[str] = set()
    ended: set[int] = set()
    deadline = time.monotonic() + 120
    while len(ended) < len(parts) and time.monotonic() < deadline:
        for m in consumer.consume(10_000, 0.5):
            if m.error() is not None:
                ended.add(int(m.partition() or 0))
                continue
            found.add(f"{journal}/{m.partition()}/{m.offset()}")
    consumer.close()
    return found
