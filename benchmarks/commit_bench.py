"""What one coordinator iteration's PostgreSQL transaction (`Store.commit`) costs, in wall time.

    .venv/bin/python benchmarks/commit_bench.py \\
        --database-url postgresql+psycopg://postgres@127.0.0.1:15432/postgres \\
        [--before REV] [--repetitions 3] [--commits 300] [--burners 2]

Each commit carries the shape of an at-least-once iteration: ``--messages`` new leases (one
consumer, one partition, random 32-hex tokens), the acks of the previous iteration's leases,
the recovery point moved past them, the queue's counters, the ack topic's input position and
one event batch into the outbox. ``small`` (7 messages) is an iteration at 1,000 msg/s, where
the fixed cost of a transaction (its round trips) is what the delivery waits for; ``large``
(270) is one of a throughput cell. Each figure is the commit's wall time (p50, p90) and the
mean CPU time the calling process spent in it (its client side: composing, adapting, sending).

With ``--burners N``, N processes beside it each burn a CPU 2 ms out of every 3 (as the
broker, the consumers and the producers of a cell keep waking up): on this two-core machine the
commit then pays for every wake-up of the server's backend, as it does in a benchmark cell.

With ``--before REV`` the same measurement also runs on the tree of that commit (a temporary
git worktree, imported through PYTHONPATH) against the same server, the two trees interleaved
``--repetitions`` times, so both figures come from one run on this shared machine. Each
measurement runs in a scratch database of its own, migrated to the head of the tree measuring
(a newer schema is left to the newer tree; revision 0012 only adds a function).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"small": 7, "large": 270}
BURNER = """
import time
while True:
    end = time.perf_counter() + 0.002
    while time.perf_counter() < end:
        pass
    time.sleep(0.001)
"""


def measure(database_url: str, commits: int) -> dict[str, dict[str, float]]:
    """In this interpreter, with whatever `layer` it imports: p50/p90 ms per commit by shape."""
    from layer.store.batch import WriteBatch
    from layer.store.migrate import upgrade
    from layer.store.rows import EntryRow
    from layer.store.store import Store

    upgrade(database_url)
    store = Store(database_url)
    shard = "0"
    epoch = store.take_shard(shard, "bench", time.time())
    store.put_queue("Bench", {"name": "Bench", "underlying_topic": "bench-journal"}, time.time())
    results: dict[str, dict[str, float]] = {}
    offset = 0
    for shape, size in SHAPES.items():
        previous: list[EntryRow] = []
        times: list[float] = []
        cpu = 0.0
        for i in range(commits + 20):
            now = time.time()
            batch = WriteBatch()
            leased = [EntryRow("Bench", "bench-journal", 0, offset + k, "LEASED", 1, 0, "w-1",
                               os.urandom(16).hex(), now + 60) for k in range(size)]
            offset += size
            for row in leased:
                batch.put_entry(row)
            for row in previous:
                batch.put_entry(row._replace(state="ACKED", lease_consumer=None,
                                             lease_token=None, lease_deadline=None))
            if previous:
                batch.set_recovery_point("Bench", "bench-journal", 0, previous[-1].offset + 1)
            batch.count("Bench", "delivered", size)
            batch.count("Bench", "acked", len(previous))
            batch.set_input_position("bench.ack", 0, i)
            batch.put_events([os.urandom(40 * size)])
            started, cpu_started = time.perf_counter(), time.process_time()
            store.commit(batch, shard, "bench", epoch, now)
            if i >= 20:  # past the warm-up: connections open, statements prepared
                times.append(time.perf_counter() - started)
                cpu += time.process_time() - cpu_started
            previous = leased
        times.sort()
        results[shape] = {"p50_ms": round(1000 * times[len(times) // 2], 3),
                          "p90_ms": round(1000 * times[int(len(times) * 0.9)], 3),
                          "cpu_ms": round(1000 * cpu / len(times), 3)}
    store.close()
    return results


def scratch(admin_url: str) -> str:
    import sqlalchemy as sa

    name = f"qlayer_commit_bench_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    engine.dispose()
    return str(sa.engine.make_url(admin_url).set(database=name).render_as_string(
        hide_password=False))


def drop(admin_url: str, url: str) -> None:
    import sqlalchemy as sa

    name = sa.engine.make_url(url).database
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    engine.dispose()


def run_tree(tree: Path, admin_url: str, commits: int) -> dict[str, dict[str, float]]:
    database = scratch(admin_url)
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--measure", database, "--commits", str(commits)],
            env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, check=True,
            capture_output=True, text=True)
        return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
    finally:
        drop(admin_url, database)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url",
                        default="postgresql+psycopg://postgres@127.0.0.1:15432/postgres",
                        help="a server URL where CREATE DATABASE is allowed")
    parser.add_argument("--before", help="also measure the tree of this commit, interleaved")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--commits", type=int, default=300)
    parser.add_argument("--burners", type=int, default=0,
                        help="duty-cycled CPU burners to run beside the measurement")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.commits)))
        return
    trees = {"now": ROOT}
    worktree = None
    if args.before:
        worktree = Path(tempfile.mkdtemp(prefix="qlayer-before-"))
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.before],
                       cwd=ROOT, check=True, capture_output=True)
        trees = {f"before ({args.before})": worktree, "now": ROOT}
    runs: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name in trees}
    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(args.burners)]
    try:
        for _ in range(args.repetitions):
            for name, tree in trees.items():
                runs[name].append(run_tree(tree, args.database_url, args.commits))
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        if worktree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT,
                           check=False, capture_output=True)
    print(f"{'tree':28} {'shape':6} {'msgs':>5} {'p50 ms (median)':>16} {'p90 ms':>8} "
          f"{'client CPU ms':>13}  each p50")
    for name, found in runs.items():
        for shape, size in SHAPES.items():
            p50s = [r[shape]["p50_ms"] for r in found]
            p90s = [r[shape]["p90_ms"] for r in found]
            cpus = [r[shape]["cpu_ms"] for r in found]
            print(f"{name:28} {shape:6} {size:5} {statistics.median(p50s):16.3f} "
                  f"{statistics.median(p90s):8.3f} {statistics.median(cpus):13.3f}  "
                  f"{', '.join(f'{p:.3f}' for p in p50s)}")


if __name__ == "__main__":
    main()
