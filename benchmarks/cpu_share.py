"""Where the machine's CPU goes while qlayer runs at full speed (issue 7's "what limits it").

    .venv/bin/python benchmarks/cpu_share.py [--bootstrap-servers ...] [--database-url ...]
        [--size 1024] [--consumers 4] [--output benchmarks/results/cpu-share.json]

Runs one qlayer at-least-once throughput cell (1 KiB, 4 consumers, 40 × 20,000 messages: each
repetition fits the coordinator's default payload budget, as in `make bench`) with
benchmarks/bench.py and, in the middle of it, reads the CPU ticks of every process involved
from /proc twice, some seconds apart: the coordinator, the SDK consumers, the harness (which
produces the journal), the Kafka broker and PostgreSQL, and the machine's idle time. Writes
benchmarks/results/cpu-share.json; benchmarks/report.py shows it in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "cpu-share.json"
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import machine  # noqa: E402


def ticks(pid: int) -> int:
    """utime + stime of one process, in clock ticks (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def pids_of(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def machine_ticks() -> tuple[int, int]:
    """(busy, idle) ticks of the whole machine."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, idle


def postgres_ticks() -> dict[int, int]:
    """Every PostgreSQL process (server and backends, which come and go), by pid."""
    out = subprocess.run(["pgrep", "-u", "postgres"], capture_output=True, text=True).stdout
    return {int(p): ticks(int(p)) for p in out.split()}


def snapshot(bench: int, broker: list[int], consumers: int) -> dict[str, int]:
    kids = [p for p in children(bench) if "resource_tracker" not in cmdline(p)]
    # The harness spawns the coordinator first, then the consumers.
    kids.sort()
    busy, idle = machine_ticks()
    return {
        "harness (produces the journal)": ticks(bench),
        "coordinator": ticks(kids[0]) if kids else 0,
        f"SDK consumers ({consumers})": sum(ticks(p) for p in kids[1:]),
        "Kafka broker": sum(ticks(p) for p in broker),
        "_busy": busy,
        "_idle": idle,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:29092")
    parser.add_argument("--database-url",
                        default="postgresql+psycopg://postgres@127.0.0.1:25432/postgres")
    parser.add_argument("--broker-pattern", default="kafka.Kafka",
                        help="pgrep -f pattern of the broker's process")
    parser.add_argument("--window", type=float, default=8.0, help="seconds between readings")
    parser.add_argument("--size", type=int, default=1024, help="payload bytes")
    parser.add_argument("--consumers", type=int, default=4, help="SDK consumer processes")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    argv = [sys.executable, "benchmarks/bench.py", "--bootstrap-servers", args.bootstrap_servers,
            "--database-url", args.database_url, "--systems", "qlayer-alo",
            "--sizes", str(args.size), "--consumer-counts", str(args.consumers),
            "--messages", "20000", "--repetitions", "40",
            "--no-latency", "--output", "/tmp/qlayer-cpu-share-cell.json"]
    bench = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True)
    broker = pids_of(args.broker_pattern)
    time.sleep(13)  # coordinator, consumers and warm-up: into the first repetition
    before, pg_before = snapshot(bench.pid, broker, args.consumers), postgres_ticks()
    time.sleep(args.window)
    after, pg_after = snapshot(bench.pid, broker, args.consumers), postgres_ticks()
    # Backends that lived through the window (one that ended is not counted; one that
    # started counts from 0).
    before["PostgreSQL"] = sum(pg_before.get(p, 0) for p in pg_after)
    after["PostgreSQL"] = sum(pg_after.values())
    out, _ = bench.communicate(timeout=600)
    cell = next(json.loads(line) for line in out.splitlines() if line.startswith('{"system"'))
    hz = os.sysconf("SC_CLK_TCK")
    total = (after["_busy"] - before["_busy"]) + (after["_idle"] - before["_idle"])
    shares = {name: round(100 * (after[name] - before[name]) / total, 1)
              for name in before if not name.startswith("_")}
    shares["idle"] = round(100 * (after["_idle"] - before["_idle"]) / total, 1)
    result: dict[str, Any] = {
        "version": 2,
        "command": "python benchmarks/cpu_share.py", "argv": argv[1:], "machine": machine(),
        "window_seconds": args.window, "clock_ticks_per_second": hz,
        "percent_of_machine": shares, "cell": cell,
    }
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(shares))


if __name__ == "__main__":
    main()
