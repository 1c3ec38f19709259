"""Queue engine benchmark: lease-and-ack throughput and memory per AVAILABLE entry.

Targets (issue 3): on one core, >= 200,000 lease-and-ack cycles per second for a one-consumer
FIFO queue, and <= 150 bytes of memory per AVAILABLE entry with 1,000,000 entries queued.

    .venv/bin/python benchmarks/engine_bench.py            # full run, writes results JSON
    .venv/bin/python benchmarks/engine_bench.py --quick    # smaller, for a smoke test

Throughput runs the coordinator's loop as it will run it, batch by batch: enqueue a batch of
journal records, dispatch (lease) them to the consumer, acknowledge them all, drain the outbox
(events and changed entry states). A cycle is one entry through all of that. A second figure
times only dispatch + ack + drain over a pre-filled queue. Lease tokens are 128-bit, drawn
from the OS in blocks (what the coordinator should inject). The machine is shared and noisy,
so each figure is the median of several runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from layer.domain.definitions import QueueDefinition
from layer.domain.engine import EntryAck, QueueEngine
from layer.domain.entries import OfferedRecord
from layer.domain.states import AckType

RESULTS = Path(__file__).resolve().parent / "results" / "engine.json"
PARTITIONS = 4


def os_tokens(block: int = 4096) -> Callable[[], str]:
    """128-bit tokens from os.urandom, read a block at a time (one syscall per 4096 tokens)."""
    pending: list[str] = []

    def token() -> str:
        if not pending:
            raw = os.urandom(16 * block).hex()
            pending.extend(raw[i : i + 32] for i in range(0, len(raw), 32))
        return pending.pop()

    return token


def records(start: int, count: int, topic: str = "Work") -> Iterator[OfferedRecord]:
    """Journal records spread over PARTITIONS partitions, as a poll batch would bring them."""
    for n in range(start, start + count):
        yield OfferedRecord(topic, n % PARTITIONS, n // PARTITIONS, None, None, 1_700_000_000.0)


def fifo_engine(backlog: int) -> QueueEngine:
    definition = QueueDefinition(name="Work", max_per_subscription_backlog=backlog)
    engine = QueueEngine(definition, tokens=os_tokens())
    engine.subscribe(
        "worker", "session-1", 0.0, delivery_topic="deliver.worker", max_backlog=backlog
    )
    return engine


class Rate(NamedTuple):
    """Cycles per second by the wall clock, and per second of this process's CPU time.

    On a shared machine other processes steal the core; CPU time is what one core spends.
    """

    wall: float
    cpu: float


def full_cycle_run(total: int, batch: int) -> Rate:
    """enqueue + dispatch + ack + drain per batch; returns cycles per second."""
    engine = fifo_engine(batch)
    gc.collect()
    now = 1.0
    started, cpu_started = time.perf_counter(), time.process_time()
    for start in range(0, total, batch):
        engine.enqueue(records(start, batch), now)
        leases = engine.dispatch(now)
        engine.ack([EntryAck(lease.bookmark, lease.token, AckType.ACCEPT) for lease in leases], now)
        engine.drain()
        now += 0.001
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    assert engine.stats().available == 0 and engine.stats().leased == 0
    return Rate(total / elapsed, total / cpu)


def lease_ack_run(total: int, batch: int) -> Rate:
    """dispatch + ack + drain over a pre-filled queue; returns cycles per second."""
    engine = fifo_engine(batch)
    engine.enqueue(records(0, total), 0.0)
    engine.drain()
    gc.collect()
    now = 1.0
    started, cpu_started = time.perf_counter(), time.process_time()
    done = 0
    while done < total:
        leases = engine.dispatch(now)
        engine.ack([EntryAck(lease.bookmark, lease.token, AckType.ACCEPT) for lease in leases], now)
        engine.drain()
        done += len(leases)
        now += 0.001
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return Rate(total / elapsed, total / cpu)


def memory_per_entry(entries: int, *, priority: bool = False) -> float:
    """Traced bytes per AVAILABLE entry with ``entries`` queued (baseline subtracted)."""
    definition = QueueDefinition(
        name="Work", priority="/p" if priority else None, max_per_subscription_backlog=10
    )
    gc.collect()
    tracemalloc.start()
    baseline = tracemalloc.get_traced_memory()[0]
    engine = QueueEngine(definition, tokens=os_tokens())
    docs = [{"p": p} for p in range(10)]
    step = 10_000
    for start in range(0, entries, step):
        if priority:
            # Ten shared documents: the figure is the engine's own cost, not the documents'
            # (what a record keeps in memory is the coordinator's projection, not the engine's).
            batch = [
                OfferedRecord("Work", n % PARTITIONS, n // PARTITIONS, None, docs[n % 10], 1.0)
                for n in range(start, start + step)
            ]
        else:
            batch = list(records(start, step))
        engine.enqueue(batch, 0.0)
        engine.drain()
        del batch
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - baseline
    tracemalloc.stop()
    assert engine.stats().available == entries
    return used / entries


def machine() -> dict[str, object]:
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        nproc = int(subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip())
    except (OSError, ValueError):
        nproc = os.cpu_count() or 0
    return {
        "nproc": nproc,
        "cpu_model": model,
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
    }


def summary(rates: list[Rate]) -> dict[str, object]:
    return {
        "cpu_median": round(statistics.median(r.cpu for r in rates)),
        "wall_median": round(statistics.median(r.wall for r in rates)),
        "cpu_runs": [round(r.cpu) for r in rates],
        "wall_runs": [round(r.wall) for r in rates],
    }


def show(label: str, rates: list[Rate]) -> dict[str, object]:
    figures = summary(rates)
    print(
        f"{label}: median {figures['cpu_median']:,}/s per CPU second, "
        f"{figures['wall_median']:,}/s wall  (cpu runs {figures['cpu_runs']})"
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, no results file")
    parser.add_argument("--runs", type=int, default=5, help="runs per figure (median reported)")
    args = parser.parse_args()
    total = 50_000 if args.quick else 300_000
    entries = 100_000 if args.quick else 1_000_000
    runs = 1 if args.quick else args.runs
    batch = 1000

    info = machine()
    print(f"machine: nproc={info['nproc']} cpu={info['cpu_model']!r} python={info['python']}")
    full = show(
        f"full cycle (enqueue+lease+ack+drain), batch {batch}",
        [full_cycle_run(total, batch) for _ in range(runs)],
    )
    lease_ack = show(
        f"lease+ack+drain over a filled queue, batch {batch}",
        [lease_ack_run(total, batch) for _ in range(runs)],
    )
    memory = memory_per_entry(entries)
    print(f"memory per AVAILABLE entry, {entries:,} queued (FIFO): {memory:.1f} bytes")
    memory_priority = memory_per_entry(entries, priority=True)
    print(
        f"memory per AVAILABLE entry, {entries:,} queued (priority queue): "
        f"{memory_priority:.1f} bytes"
    )
    if args.quick:
        return
    result = {
        "machine": info,
        "command": "python benchmarks/engine_bench.py",
        "batch": batch,
        "cycles_per_run": total,
        "runs": runs,
        "full_cycle_per_second": full,
        "lease_ack_per_second": lease_ack,
        "entries_queued": entries,
        "bytes_per_available_entry_fifo": round(memory, 1),
        "bytes_per_available_entry_priority": round(memory_priority, 1),
        "targets": {"cycles_per_second": 200_000, "bytes_per_entry": 150},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
