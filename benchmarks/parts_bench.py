"""One busy queue over several coordinator processes (issue 32, partitioned queues): acked/s
and coordinator CPU per message of one queue with ``parts`` 1, 2 and 4 over 1, 2 and 4
coordinator processes, each process held to the same CPU share, in one run.

    .venv/bin/python benchmarks/parts_bench.py [--bootstrap-servers ...] [--database-url ...]
        [--cpu 0.1] [--messages 12000] [--runs 3] [--size 1024] [--consumers 4]

This machine has 2 cores shared by the broker, PostgreSQL, the consumers and the harness, so
the scaling is shown where the coordinator is the limit: every coordinator process runs in a
cgroup (v1 ``cpu`` controller, ``cpu.cfs_quota_us`` over a 100 ms period) of its own that
allows it ``--cpu`` of one core; everything else runs outside the limit. Without a writable
``/sys/fs/cgroup/cpu`` (or cgroup v2 ``cpu.max``) the benchmark says so and stops.

Each cell is a scratch installation of 4 shards (`qlayer db upgrade --shards 4`, so four
processes get one shard each) under a fresh topic prefix, with one queue over an 8-partition
journal. Its parts are placed on shards of different processes (the first part's shard is
chosen from the group's assignment). ``--consumers`` SDK processes consume the queue by name
and ack everything (max_backlog 500 each). After a warm-up, each run produces
``--messages`` × processes records of ``--size`` bytes as fast as the harness can and times
first produce -> every record acked (the queue's recovery points at the journal's end); the
coordinator CPU is the processes' user+system time over that window. Figures are medians of
``--runs`` runs in one installation.

Results: benchmarks/results/parts.json (with the machine and the command);
benchmarks/report.py renders them, with a plot, into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Feeder, create_topic, machine
from shards_bench import Installation, consume, process_cpu

from layer.domain.shards import part_shards
from layer.settings import Settings

HERE = Path(__file__).resolve().parent.parent
RESULTS = HERE / "benchmarks" / "results" / "parts.json"
SHARDS = 4
PARTITIONS = 8
#: (parts, coordinator processes): the diagonal shows the scaling; four parts on one process
#: what splitting costs where it cannot pay.
CELLS = ((1, 1), (2, 2), (4, 4), (4, 1))
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CpuLimit:
    """A cgroup allowing its processes ``share`` of one core (cgroup v1 ``cpu`` or v2)."""

    def __init__(self, name: str, share: float) -> None:
        quota = max(int(share * PERIOD_US), 1000)
        if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
            self.path = CGROUP_V1 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        elif (CGROUP_V2 / "cgroup.controllers").exists():
            self.path = CGROUP_V2 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            raise SystemExit("no cgroup cpu controller at /sys/fs/cgroup: this benchmark holds "
                             "each coordinator process to a CPU share with one")

    def add(self, pid: int) -> None:
        """The whole process, every thread it has and will have."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def throttled(self) -> float:
        """Seconds the group was held back by its quota so far."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "throttled_time":  # v1: ns
                return int(value) / 1e9
            if key == "throttled_usec":  # v2
                return int(value) / 1e6
        return 0.0

    def remove(self) -> None:
        # A process still in it (stopped later) keeps it; it is empty the next time.
        with contextlib.suppress(OSError):
            self.path.rmdir()


class Cell(Installation):
    """A scratch installation of `SHARDS` shards whose coordinators run CPU-limited."""

    def __init__(self, args: argparse.Namespace, processes: int) -> None:
        self.shard_count = SHARDS
        super().__init__(args.bootstrap_servers, args.database_url, HERE, args.log_dir)
        self.limits: list[CpuLimit] = []
        self.share = args.cpu
        self.processes = processes

    def _cli(self, *args: str) -> None:
        if args == ("db", "upgrade"):
            args = ("db", "upgrade", "--shards", str(SHARDS))
        super()._cli(*args)

    def start(self, name: str) -> int:
        pid = super().start(name)
        limit = CpuLimit(f"qlayer-parts-{os.getpid()}-{name}", self.share)
        limit.add(pid)
        self.limits.append(limit)
        return pid

    def wait_running(self, processes: int, timeout: float = 120) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            owners = self.owners()
            live = {n for n, p in self.procs.items() if p.poll() is None}
            if len(owners) == SHARDS and set(owners.values()) == live \
                    and len(live) == processes:
                return owners
            time.sleep(0.2)
        raise TimeoutError(f"{processes} coordinator processes not running within {timeout}s")

    def spread(self, parts: int, owners: dict[str, str]) -> int:
        """The first part's shard that puts the parts on as many processes as it can."""
        return max(range(SHARDS), key=lambda first: len({
            owners[str(s)] for s in part_shards(first, parts, SHARDS)}))

    def stop(self) -> None:
        super().stop()
        for limit in self.limits:
            limit.remove()


def run_cell(args: argparse.Namespace, parts: int, processes: int) -> dict[str, Any]:
    cell = Cell(args, processes)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    consumers: list[Any] = []
    counters: list[Any] = []
    try:
        for i in range(processes):
            cell.start(f"p{i}")
        owners = cell.wait_running(processes)
        first = cell.spread(parts, owners)
        journal = f"bench-{cell.prefix.rstrip('.')}-parts"
        create_topic(args.bootstrap_servers, journal, PARTITIONS)
        cell._cli("queue", "create", "Busy", "--underlying-topic", journal, "--lease-period",
                  "60s", "--max-backlog", "1000", "--set", f"shard={first}",
                  "--set", f"parts={parts}")
        spread_over = len({owners[str(s)] for s in part_shards(first, parts, SHARDS)})
        counters += [ctx.Value("q", 0) for _ in range(args.consumers)]  # kept: the children
        for counter in counters:  # unpickle them after this loop
            p = ctx.Process(target=consume, args=(args.bootstrap_servers, cell.prefix, "Busy",
                                                  True, counter, stop))
            p.start()
            consumers.append(p)
        feeder = Feeder(args.bootstrap_servers, journal, args.size)

        feeder.produce(2000)  # every consumer subscribed over every part, every shard warm
        cell.wait_acked("Busy", feeder.produced)
        if not all(p.is_alive() for p in consumers):
            raise RuntimeError("a consumer process ended during the warm-up")
        runs = []
        for _ in range(args.runs):
            n = args.messages * processes
            cpu_before = sum(process_cpu(p.pid) for p in cell.procs.values())
            throttled_before = sum(limit.throttled() for limit in cell.limits)
            started = time.time()
            feeder.produce(n)
            cell.wait_acked("Busy", feeder.produced)
            seconds = time.time() - started
            cpu = sum(process_cpu(p.pid) for p in cell.procs.values()) - cpu_before
            throttled = sum(limit.throttled() for limit in cell.limits) - throttled_before
            runs.append({"messages": n, "seconds": round(seconds, 3),
                         "acked_per_second": round(n / seconds),
                         "coordinator_cpu_us_per_message": round(cpu / n * 1e6, 1),
                         "coordinator_cpu_share": round(cpu / seconds / processes, 3),
                         "throttled_seconds": round(throttled, 2)})
            print(json.dumps({"parts": parts, "processes": processes, **runs[-1]}),
                  flush=True)
        return {
            "parts": parts, "processes": processes, "parts_on_processes": spread_over,
            "cpu_per_process": args.cpu, "size": args.size, "consumers": args.consumers,
            "runs": runs,
            "acked_per_second": round(statistics.median(r["acked_per_second"] for r in runs)),
            "coordinator_cpu_us_per_message": round(statistics.median(
                r["coordinator_cpu_us_per_message"] for r in runs), 1),
        }
    finally:
        stop.set()
        for p in consumers:
            p.join(30)
        cell.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-servers", default=None,
                        help="default: the settings' (QLAYER_BOOTSTRAP_SERVERS, the dev stack)")
    parser.add_argument("--database-url", default=None,
                        help="a server URL where CREATE DATABASE is allowed (default: the "
                        "settings')")
    parser.add_argument("--cpu", type=float, default=0.1,
                        help="the share of one core each coordinator process may use")
    parser.add_argument("--messages", type=int, default=12_000,
                        help="records per run and per coordinator process")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--consumers", type=int, default=4)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.bootstrap_servers is None or args.database_url is None:
        settings = Settings.load()
        args.bootstrap_servers = args.bootstrap_servers or settings.bootstrap_servers
        args.database_url = args.database_url or settings.database_url
    cells = [run_cell(args, parts, processes) for parts, processes in CELLS]
    base = next(c for c in cells if (c["parts"], c["processes"]) == (1, 1))
    for c in cells:
        c["vs_one_process"] = round(c["acked_per_second"] / base["acked_per_second"], 2)
    result = {"version": 1, "command": " ".join(["python", *sys.argv]), "machine": machine(),
              "cells": cells}
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps([(c["parts"], c["processes"], c["acked_per_second"],
                       c["vs_one_process"]) for c in cells]))
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
