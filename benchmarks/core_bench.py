"""The coordinator's per-message CPU without I/O: `ShardCore.step` and the shard loop's
encoding (events, store rows, delivery batches) on one shard, in one process.

    .venv/bin/python benchmarks/core_bench.py [--messages 40000] [--profile]

What one message costs the coordinator besides Kafka's and PostgreSQL's clients: decoding
its journal record into an entry, leasing it, encoding its delivery into a batch, its
events into the outbox, its lease and ack as store rows (grouped into runs, as `Store.commit`
does before its statements), and applying its ack (an AcceptRecord, as the SDK writes it).
Four consumers, 1 KiB JSON payloads, iterations of up to 2,000 journal records and the acks of
the previous iteration's deliveries, as the loop sees them at full speed. The figure is
µs per message (median of the repetitions); ``--profile`` prints cProfile's top functions.
The end-to-end figures (benchmarks/bench.py) add the clients, the broker and PostgreSQL.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import itertools
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine  # noqa: E402

from layer.coordinator.catalog import Catalog  # noqa: E402
from layer.coordinator.core import QueueState, ShardCore  # noqa: E402
from layer.coordinator.options import CoordinatorOptions  # noqa: E402
from layer.coordinator.output import Output  # noqa: E402
from layer.coordinator.ports import FakeTopicAdmin  # noqa: E402
from layer.domain import events as ev  # noqa: E402
from layer.domain.definitions import QueueDefinition  # noqa: E402
from layer.domain.states import Bookmark  # noqa: E402
from layer.kafka import JournalRecord  # noqa: E402
from layer.protocol import (  # noqa: E402
    AcceptGroup,
    AcceptRecord,
    Codec,
    Subscribe,
    TopicNames,
)
from layer.protocol.batch import DELIVERY_FORMAT, decode_delivery_batch  # noqa: E402
from layer.protocol.headers import PROOF, SECRET  # noqa: E402
from layer.store.rows import QueueRecord  # noqa: E402
from layer.store.store import _split_passed_entries, runs_of  # noqa: E402

TOPICS = TopicNames("bench.")
JOURNAL = "orders"
CONSUMERS = 4
CORE = os.environ.get("QLAYER_CORE", "auto")
PARTITIONS = 4


class Bench:
    def __init__(self, backlog: int) -> None:
        # As benchmarks/bench.py sets the queue up: consumers ask for 500 each.
        definition = {"name": "Work", "underlying_topic": JOURNAL, "lease_period": "60s",
                      "max_per_subscription_backlog": 1000}
        work = QueueRecord(name="Work", definition=definition, version=1, created_at=0.0,
                           updated_at=0.0, shard=0)
        catalog = Catalog.of(1, [work], [], now=0.0)
        admin = FakeTopicAdmin({JOURNAL: PARTITIONS, TOPICS.control: 1, TOPICS.ack: 1})
        counter = itertools.count()
        self.core = ShardCore(0, CoordinatorOptions(owner_id="bench", core=CORE), topics=TOPICS,
                              catalog=lambda: catalog, admin=admin,
                              tokens=lambda: f"{next(counter):032x}", owner_id="bench")
        self.core.epoch = 1
        starts = {(JOURNAL, p): 0 for p in range(PARTITIONS)}
        self.core.add_queue(QueueState(QueueDefinition.from_mapping(definition), 1, [], starts,
                                       {}, {}, starts), [], 0.0)
        self.output = Output(self.core)
        self.phases: dict[str, float] = dict.fromkeys(
            ("step (decode, lease, ack, rows)", "events", "store rows to runs",
             "delivery batches"), 0.0)
        self.codec = Codec()
        self.untimed = 0.0  # CPU spent decoding deliveries as the consumers would
        self.offsets = dict.fromkeys(range(PARTITIONS), 0)
        self.inputs = itertools.count()
        self.payload = json.dumps({"customer": "c-1", "amount": 12.5,
                                   "note": "x" * 960}).encode()
        subscribes = [self._input(TOPICS.control, self.codec.encode_control(Subscribe(
            consumer_id=f"c{i}", session_id=f"s{i}", request_id="r", queue="Work",
            queue_is_regex=False, max_backlog=backlog, filter=None,
            delivery_topic=TOPICS.delivery(f"c{i}"), session_timeout_ms=600_000,
            client_name="bench", client_version="0", sent_at_ms=0)), f"c{i}".encode(),
            [(DELIVERY_FORMAT, b"batch"), (SECRET, self._secret(f"c{i}"))])
            for i in range(CONSUMERS)]
        self.run(subscribes, 0.0)

    @staticmethod
    def _secret(consumer: str) -> bytes:
        """Each consumer's session secret (protocol 5): its AcceptRecords prove it, so the
        figure includes the coordinator's identity check, once per record."""
        return (consumer * 64)[:64].encode()

    def _input(self, topic: str, value: bytes, key: bytes | None = None,
               headers: list[tuple[str, bytes | None]] | None = None) -> JournalRecord:
        return JournalRecord(topic, 0, next(self.inputs), key, value, 1, headers)

    def journal(self, n: int) -> list[JournalRecord]:
        out = []
        for i in range(n):
            p = i % PARTITIONS
            out.append(JournalRecord(JOURNAL, p, self.offsets[p], None, self.payload,
                                     1_700_000_000_000, None))
            self.offsets[p] += 1
        return out

    def accepts(self, leased: list[ev.EntryLeased]) -> list[JournalRecord]:
        """What the SDK writes: one AcceptRecord per consumer, grouped by partition."""
        by: dict[str, dict[int, list[ev.EntryLeased]]] = {}
        for d in leased:
            by.setdefault(d.consumer_id, {}).setdefault(d.bookmark.partition, []).append(d)
        return [self._input(TOPICS.ack, self.codec.encode_accept(AcceptRecord(
            consumer_id=c, session_id=f"s{c[1:]}", sent_at_ms=0, groups=tuple(
                AcceptGroup(queue="Work", topic=JOURNAL, partition=p,
                            offsets=tuple(d.bookmark.offset for d in ds),
                            leases=tuple(d.token for d in ds)) for p, ds in parts.items()))),
            c.encode(), [(PROOF, self._secret(c))]) for c, parts in by.items()]

    def run(self, records: list[JournalRecord], now: float) -> list[ev.EntryLeased]:
        """One loop iteration's work on the coordinator's side, without the I/O."""
        core, output, phases, clock = self.core, self.output, self.phases, time.process_time
        t0 = clock()
        plan = core.step(records, now)
        t1 = clock()
        events = output.event_records(plan.events, plan.fresh)
        if events:
            plan.batch.put_events(core.codec.event_arrays(events))
        t2 = clock()
        upserts, _deletes = _split_passed_entries(plan.batch)
        runs_of(upserts.values())
        t3 = clock()
        records = output.deliveries(plan.deliveries, {})
        core.settled(plan)
        t4 = clock()
        phases["step (decode, lease, ack, rows)"] += t1 - t0
        phases["events"] += t2 - t1
        phases["store rows to runs"] += t3 - t2
        phases["delivery batches"] += t4 - t3
        # What the consumers read (their work, not the coordinator's: not timed).
        leased = []
        for record in records:
            consumer = (record.key or b"").decode()
            for entry in decode_delivery_batch(record.value or b""):
                leased.append(ev.EntryLeased(
                    entry.queue, Bookmark(entry.topic, entry.partition, entry.offset), consumer,
                    record.topic, entry.lease, entry.lease_expires_ms / 1000,
                    entry.delivery_count, now))
        self.untimed += clock() - t4
        return leased


def measure(messages: int, per_iteration: int, backlog: int
            ) -> tuple[float, dict[str, float]]:
    # As the coordinator's process runs (`CoordinatorOptions.gc_threshold`).
    gc.set_threshold(CoordinatorOptions().gc_threshold, 50, 100)
    bench = Bench(backlog)
    bench.phases = dict.fromkeys(bench.phases, 0.0)
    now = 1.0
    leased: list[ev.EntryLeased] = []
    sent = 0
    started = time.process_time()
    while sent < messages or leased:
        n = min(per_iteration, messages - sent)
        # The consumers' acks are encoded here as the SDK would; not the coordinator's time.
        t0 = time.process_time()
        acks = bench.accepts(leased)
        journal = bench.journal(n)
        started += time.process_time() - t0
        sent += n
        now += 0.01
        leased = bench.run(acks + journal, now)
        started += bench.untimed
        bench.untimed = 0.0
    assert bench.core.counters["ack_ok"] == messages, bench.core.counters
    total = (time.process_time() - started) / messages * 1e6
    return total, {k: v / messages * 1e6 for k, v in bench.phases.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--per-iteration", type=int, default=2_000)
    parser.add_argument("--backlog", type=int, default=500)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--output", type=Path,
                        help="also write the figures as JSON (benchmarks/report.py shows "
                             "benchmarks/results/core.json and core-before.json)")
    parser.add_argument("--label", default="", help="what the JSON says was measured")
    args = parser.parse_args()
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        measure(args.messages, args.per_iteration, args.backlog)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(35)
        return
    runs = [measure(args.messages, args.per_iteration, args.backlog)
            for _ in range(args.repetitions)]
    figures = [total for total, _ in runs]
    print(f"coordinator CPU without I/O: {statistics.median(figures):.1f} µs/msg "
          f"(runs: {', '.join(f'{f:.1f}' for f in figures)})")
    phases = {phase: statistics.median(r[1][phase] for r in runs) for phase in runs[0][1]}
    for phase, figure in phases.items():
        print(f"  {phase:34} {figure:5.1f} µs/msg")
    if args.output is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=ROOT, check=False).stdout.strip()
        args.output.write_text(json.dumps({
            "label": args.label, "commit": commit, "command": " ".join(sys.argv),
            "machine": machine(), "median_us_per_msg": statistics.median(figures),
            "runs_us_per_msg": figures, "phases_us_per_msg": phases}, indent=2) + "\n")


if __name__ == "__main__":
    main()
