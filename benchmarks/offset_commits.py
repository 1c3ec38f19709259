"""What one Kafka offset commit costs the broker, in CPU time.

    .venv/bin/python benchmarks/offset_commits.py [--bootstrap-servers 127.0.0.1:9092] \\
        [--broker-pid PID] [--rate 300] [--seconds 10] [--repetitions 2]

The coordinator used to commit its ack and control topics' positions to its Kafka group
after every iteration: at 1,000 msg/s about 150 OffsetCommit requests a second, each of them
a write to ``__consumer_offsets`` on the broker, which on this two-core machine shares the CPU
with everything else. This measures the broker's CPU time (utime + stime from /proc, so the
broker must run on this machine; `qlayer dev up` writes its pid file) over ``--seconds`` of
asynchronous commits at ``--rate`` a second, against the same time with none, interleaved
``--repetitions`` times, and prints the broker's CPU per commit. It led to
`CoordinatorOptions.offset_commit_interval` (docs/coordinator.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine

DEV_BROKER_PID = Path("/var/lib/qlayer/dev/kafka/kafka.pid")


def broker_seconds(pid: int) -> float:
    """utime + stime of the broker, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def window(consumer: Consumer, topic: str, rate: float, seconds: float, pid: int
           ) -> tuple[int, float]:
    """(commits made, broker CPU seconds) over ``seconds``, committing ``rate`` a second."""
    before, started, commits = broker_seconds(pid), time.monotonic(), 0
    while (now := time.monotonic()) - started < seconds:
        if rate:
            consumer.commit(offsets=[TopicPartition(topic, 0, 1 + commits % 9)],
                            asynchronous=True)
            commits += 1
        consumer.poll(0)  # serve the commits' callbacks, as the coordinator's poll does
        time.sleep(max(0.0, started + (commits if rate else 1) / (rate or 100) - now))
    return commits, broker_seconds(pid) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    parser.add_argument("--broker-pid", type=int, default=None,
                        help=f"the broker's pid (default: read from {DEV_BROKER_PID})")
    parser.add_argument("--rate", type=float, default=300.0, help="commits a second")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each window")
    parser.add_argument("--repetitions", type=int, default=2)
    args = parser.parse_args()
    if args.broker_pid is not None:
        pid = args.broker_pid
    elif DEV_BROKER_PID.exists():
        pid = int(DEV_BROKER_PID.read_text().strip())
    else:
        parser.error(f"no --broker-pid and no {DEV_BROKER_PID}: start the dev stack "
                     "(qlayer dev up) or name the broker's pid")
    topic = f"offset-commit-bench-{int(time.time())}"
    admin = AdminClient({"bootstrap.servers": args.bootstrap_servers})
    for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        future.result(30)
    producer = Producer({"bootstrap.servers": args.bootstrap_servers})
    for _ in range(10):
        producer.produce(topic, b"x")
    producer.flush(30)
    consumer = Consumer({"bootstrap.servers": args.bootstrap_servers, "group.id": topic,
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, 0, 0)])
    consumer.poll(2.0)
    per_commit: list[float] = []
    try:
        for _ in range(args.repetitions):
            _, idle = window(consumer, topic, 0.0, args.seconds, pid)
            commits, busy = window(consumer, topic, args.rate, args.seconds, pid)
            per_commit.append((busy - idle) / commits * 1e6)
            print(f"{commits} commits: broker {busy:.2f} s of CPU against {idle:.2f} s with "
                  f"none, {per_commit[-1]:.0f} µs per commit", flush=True)
    finally:
        consumer.close()
        admin.delete_topics([topic])
    print(json.dumps({"command": "benchmarks/offset_commits.py", "machine": machine(),
                      "rate": args.rate, "seconds": args.seconds,
                      "broker_us_per_commit": [round(x) for x in per_commit],
                      "median_us": round(statistics.median(per_commit))}, indent=2))


if __name__ == "__main__":
    main()
