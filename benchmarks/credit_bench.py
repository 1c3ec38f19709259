"""One backlog over several shards (protocol 8, issue 31): what credit costs, in one run.

    .venv/bin/python benchmarks/credit_bench.py [--bootstrap-servers 127.0.0.1:9092] \\
        [--database-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres] \\
        [--messages 20000] [--runs 3] [--rounds 40] [--before-tree /path/to/older/checkout]

`make bench` runs it after bench.py (CREDIT_ARGS for its options), on the same stack.

Runs against a local stack (`qlayer dev up`), in scratch databases under fresh topic prefixes,
with one real `qlayer coordinator run` process (its CPU time read from /proc) and consumer
processes running the SDK (acking every message, max_backlog 500, 1 KiB messages).

- one-queue: one queue on one shard, one consumer; N messages produced as fast as possible;
  acked/s = N / (first produce -> the queue's recovery points at the journal's end), and the
  coordinator's CPU µs per message. With --before-tree, the same cell with the coordinator
  and the consumer of that checkout (e.g. a `git worktree` of the commit before protocol 8),
  alternated with this tree's: the single-shard path must not regress.
- regex-4-shards: four queues on shards 0-3, one regex consumer over them (one backlog of
  500 held as credit across the four shards); N messages spread over the four journals.
  With --before-tree, the same cell with that checkout too, alternated.
- regex-4-queues-1-shard: the same four queues all on shard 0 (no credit: one shard holds
  the whole backlog), to tell what credit costs from what spreading over shards costs.
- credit latency: two queues on shards 0 and 1, a regex consumer with max_backlog 1. Each
  round: a message on A is delivered and held, a message on B waits, then A's is acked; the
  figure is the time from that ack to B's delivery (the credit comes back from shard 0 and is
  granted to shard 1), p50/p99 over the rounds. Beside it, the same with both messages on A
  (no credit moves: the settle and the next delivery on one shard).

Medians of --runs. Results: benchmarks/results/credit.json, with the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import create_topic, machine, percentile
from confluent_kafka import Producer
from shards_bench import Installation

from layer.settings import Settings

HERE = Path(__file__).resolve().parent.parent
RESULTS = HERE / "benchmarks" / "results" / "credit.json"
SIZE = 1024

# A consumer process, run with the tree under test on its path: acks everything it gets until
# told to stop on stdin.
CONSUMER = """
import sys, threading, time
from layer import QueueConsumer
queue, regex = sys.argv[1], sys.argv[2] == "1"
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
deadline = time.monotonic() + 120
while True:
    try:
        consumer = QueueConsumer(queue, regex=regex, max_backlog=500, ack_batch_size=500,
                                 ack_interval=0.005, subscribe_timeout=20)
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.5)
print("ready", flush=True)
while not stop.is_set():
    message = consumer.receive(timeout=0.05)
    if message is not None:
        message.ack()
consumer.close()
"""


def _produce(bootstrap: str, journals: list[str], count: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5,
                         "queue.buffering.max.messages": 1_000_000})
    payload = b"x" * SIZE
    for i in range(count):
        while True:
            try:
                producer.produce(journals[i % len(journals)], payload)
                break
            except BufferError:
                producer.poll(0.05)
        if i % 10_000 == 0:
            producer.poll(0)
    producer.flush(60)


def throughput(args: argparse.Namespace, tree: Path, queues: int, regex: bool,
               one_shard: bool = False) -> dict[str, Any]:
    """acked/s and coordinator CPU µs/msg: ``queues`` queues on shards 0.. (all on shard 0
    with ``one_shard``) and one consumer (a regex over them, or the one queue by name)."""
    inst = Installation(args.bootstrap_servers, args.database_url, tree, args.log_dir)
    consumer: subprocess.Popen[bytes] | None = None
    try:
        inst.start("c0")
        inst.wait_running(1)
        names, journals = [], []
        for i in range(queues):
            name, journal = f"Cq{i}", f"credit-{inst.prefix.rstrip('.')}-{i}"
            create_topic(args.bootstrap_servers, journal, 3)
            inst.queue(name, journal, "0" if one_shard else str(i), 1000)
            names.append(name)
            journals.append(journal)
        time.sleep(2.0)  # the coordinator serves the queues before the consumer subscribes
        target = "^Cq[0-9]+$" if regex else names[0]
        consumer = subprocess.Popen(
            [sys.executable, "-c", CONSUMER, target, "1" if regex else "0"], cwd=tree,
            env=inst.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=(args.log_dir / f"{inst.prefix}consumer.log").open("ab"))
        assert consumer.stdout is not None
        if consumer.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the consumer did not start (see {args.log_dir})")
        warm = 1000
        _produce(args.bootstrap_servers, journals, warm)
        _wait(lambda: sum(inst.acked(n) for n in names) >= warm, 120)
        cpu_before = inst.cpu()
        started = time.monotonic()
        _produce(args.bootstrap_servers, journals, args.messages)
        _wait(lambda: sum(inst.acked(n) for n in names) >= warm + args.messages, 600)
        elapsed = time.monotonic() - started
        cpu = inst.cpu() - cpu_before
        return {"acked_per_s": round(args.messages / elapsed),
                "cpu_us_per_msg": round(cpu / args.messages * 1e6, 1)}
    finally:
        if consumer is not None and consumer.stdin is not None:
            consumer.stdin.close()
            try:
                consumer.wait(30)
            except subprocess.TimeoutExpired:
                consumer.kill()
        inst.stop()


def _wait(probe: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise TimeoutError("the cell did not finish in time")
        time.sleep(0.05)


def credit_latency(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds from an ack on shard 0 to the next delivery, from shard 1 (credit moves) and
    from shard 0 itself (no credit moves)."""
    import os

    from layer import QueueConsumer

    inst = Installation(args.bootstrap_servers, args.database_url, HERE, args.log_dir)
    try:
        inst.start("c0")
        inst.wait_running(1)
        journals = {}
        for shard, name in enumerate(("LatA", "LatB")):
            journal = f"credit-{inst.prefix.rstrip('.')}-{name}"
            create_topic(args.bootstrap_servers, journal, 1)
            inst.queue(name, journal, str(shard), 10)
            journals[name] = journal
        time.sleep(2.0)
        os.environ.update({k: v for k, v in inst.env().items() if k.startswith("QLAYER_")})
        producer = Producer({"bootstrap.servers": args.bootstrap_servers, "linger.ms": 0})
        moved: list[float] = []
        stayed: list[float] = []
        with QueueConsumer("^Lat(A|B)$", regex=True, max_backlog=1, ack_interval=0.0,
                           subscribe_timeout=30) as consumer:
            for i in range(args.rounds):
                other = "LatB" if i % 2 == 0 else "LatA"
                producer.produce(journals["LatA"], b"x" * SIZE)
                producer.flush(10)
                first = _receive(consumer)
                assert first.queue == "LatA", first.queue
                producer.produce(journals[other], b"x" * SIZE)
                producer.flush(10)
                time.sleep(0.3)  # the second waits, and its shard has said so
                started = time.monotonic()
                first.ack()
                second = _receive(consumer)
                took = time.monotonic() - started
                assert second.queue == other, (second.queue, other)
                (moved if other == "LatB" else stayed).append(took)
                second.ack()
            moves = consumer.stats.credit_moves
        return {
            "rounds": args.rounds,
            "credit_moves": moves,
            "across_shards_p50_ms": round(percentile(sorted(moved), 0.5) * 1000, 1),
            "across_shards_p99_ms": round(percentile(sorted(moved), 0.99) * 1000, 1),
            "same_shard_p50_ms": round(percentile(sorted(stayed), 0.5) * 1000, 1),
            "same_shard_p99_ms": round(percentile(sorted(stayed), 0.99) * 1000, 1),
        }
    finally:
        inst.stop()


def _receive(consumer: Any) -> Any:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        message = consumer.receive(timeout=0.5)
        if message is not None:
            return message
    raise TimeoutError("no delivery within 30s")


def _median(cells: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: statistics.median(c[key] for c in cells) for key in cells[0]} | {
        "runs": [dict(c) for c in cells]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-servers",
                        help="default: the settings' (QLAYER_BOOTSTRAP_SERVERS, the dev stack)")
    parser.add_argument("--database-url",
                        help="a server URL where CREATE DATABASE is allowed (default: the "
                             "settings')")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--before-tree", type=Path,
                        help="a checkout whose coordinator and SDK run the one-queue and the "
                             "regex-4-shards cells too")
    parser.add_argument("--only-latency", action="store_true", help="the latency cell only")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp") / "qlayer-credit-bench")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.bootstrap_servers is None or args.database_url is None:
        # As `make bench` runs it: on the stack bench.py uses.
        settings = Settings.load(bootstrap_servers=args.bootstrap_servers,
                                 database_url=args.database_url)
        args.bootstrap_servers = settings.bootstrap_servers
        args.database_url = settings.database_url
    args.log_dir.mkdir(parents=True, exist_ok=True)
    cells: dict[str, list[dict[str, Any]]] = {"one_queue": [], "regex_4_shards": [],
                                              "regex_4_queues_1_shard": []}
    if args.before_tree is not None:
        cells["one_queue_before"] = []
        cells["regex_4_shards_before"] = []
    for run in range(0 if args.only_latency else args.runs):
        # Alternated, so that drift on a shared machine falls on both sides alike.
        if args.before_tree is not None:
            cells["one_queue_before"].append(throughput(args, args.before_tree, 1, False))
            print("one_queue_before", run, cells["one_queue_before"][-1], flush=True)
        cells["one_queue"].append(throughput(args, HERE, 1, False))
        print("one_queue", run, cells["one_queue"][-1], flush=True)
        cells["regex_4_shards"].append(throughput(args, HERE, 4, True))
        print("regex_4_shards", run, cells["regex_4_shards"][-1], flush=True)
        if args.before_tree is not None:
            cells["regex_4_shards_before"].append(throughput(args, args.before_tree, 4, True))
            print("regex_4_shards_before", run, cells["regex_4_shards_before"][-1], flush=True)
        cells["regex_4_queues_1_shard"].append(throughput(args, HERE, 4, True, one_shard=True))
        print("regex_4_queues_1_shard", run, cells["regex_4_queues_1_shard"][-1], flush=True)
    result: dict[str, Any] = {name: _median(runs) for name, runs in cells.items() if runs}
    if not args.only_latency:
        result["regex_4_shards_vs_one_queue"] = round(
            result["regex_4_shards"]["acked_per_s"] / result["one_queue"]["acked_per_s"], 2)
        result["regex_4_shards_vs_regex_1_shard"] = round(
            result["regex_4_shards"]["acked_per_s"]
            / result["regex_4_queues_1_shard"]["acked_per_s"], 2)
    if args.before_tree is not None and not args.only_latency:
        result["one_queue_after_vs_before"] = round(
            result["one_queue"]["acked_per_s"] / result["one_queue_before"]["acked_per_s"], 2)
        result["regex_4_shards_after_vs_before"] = round(
            result["regex_4_shards"]["acked_per_s"]
            / result["regex_4_shards_before"]["acked_per_s"], 2)
    result["credit_latency"] = credit_latency(args)
    result["messages"] = args.messages
    if args.before_tree is not None:
        result["before_commit"] = subprocess.run(
            ["git", "-C", str(args.before_tree), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=False).stdout.strip() or None
    result["machine"] = machine()
    result["command"] = " ".join(sys.argv)
    result["id"] = uuid.uuid4().hex[:8]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine",)}, indent=2))


if __name__ == "__main__":
    main()
