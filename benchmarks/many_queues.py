"""Operating many queues (issue 33): `qlayer stats`, `stats --json`, `queue list`, `view Q -n
20` on a queue of ``--view-records`` entries, and the console's overview and queue list over a
stack holding a thousand queues, timed as a user meets them (each command a whole new process;
the console's pages from a running console: the first byte, the whole response, and, with
Debian's chromium and chromedriver installed, the page fully rendered in headless Chromium:
the navigation's ``loadEventEnd``).

It makes a scratch database and ``--queues`` queues, each on a journal of its own (one
partition), with ``--records`` records on ``--busy`` of them (the others idle, as most queues
of a large installation are), then times each command ``--runs`` times and prints the
median, min and max. With ``--before DIR`` (a checkout of an earlier commit) each command runs
from that tree too, alternated with the current one, so both are measured in one run on one
machine: `git worktree add /tmp/before <commit>`, then ``--before /tmp/before``.

    python benchmarks/many_queues.py --bootstrap-servers 127.0.0.1:9092 \\
        --admin-database-url postgresql+psycopg://postgres@127.0.0.1:15432/postgres \\
        [--queues 1000 --busy 50 --records 200 --view-records 100000 --runs 5] \\
        [--before /tmp/before] \\
        [--output benchmarks/results/many-queues.json]

No coordinator runs: the figures come from PostgreSQL and the journals, which is what these
commands read. The topics and the database are deleted at the end (``--keep`` keeps them).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import delete_topics, drop_database, machine, scratch_database
from layer.kafka.logs import logged
from layer.store.store import Store

COMMANDS: dict[str, list[str]] = {
    "stats": ["stats"],
    "stats --json": ["stats", "--json"],
    "queue list": ["queue", "list"],
    "view Big -n 20": ["view", "Big", "-n", "20"],
}
CONSOLE_PAGES = {"console /queues": "/queues", "console / (overview)": "/"}
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


def make_queues(bootstrap: str, url: str, prefix: str, count: int, busy: int,
                records: int, view_records: int = 0) -> list[str]:
    """``count`` queues Q0000... on a journal each, ``busy`` of them with ``records`` records,
    and the queue ``Big`` with ``view_records`` on its own journal (one more queue)."""
    admin = AdminClient(logged({"bootstrap.servers": bootstrap}))
    topics = [f"{prefix}journal-{i:04d}" for i in range(count)] + [f"{prefix}big"]
    for start in range(0, count, 200):
        futures = admin.create_topics([NewTopic(t, 1, 1) for t in topics[start:start + 200]])
        for future in futures.values():
            future.result(60)
    now = time.time()
    with Store(url) as store:
        for i, topic in enumerate(topics[:count]):
            store.put_queue(f"Q{i:04d}", {"name": f"Q{i:04d}", "underlying_topic": topic}, now)
        store.put_queue("Big", {"name": "Big", "underlying_topic": topics[-1]}, now)
    producer = Producer(logged({"bootstrap.servers": bootstrap, "linger.ms": 20}))
    for topic, n_records in [*((t, records) for t in topics[:busy]),
                             (topics[-1], view_records)]:
        for n in range(n_records):
            while True:
                try:
                    producer.produce(topic, json.dumps({"n": n, "pad": "x" * 200}).encode())
                    break
                except BufferError:  # the local queue is full: let it drain
                    producer.poll(0.1)
            producer.poll(0)
    producer.flush(120)
    return topics


def _shim(tree: Path) -> Path:
    """A directory that makes ``layer`` and ``layer_cli`` import from ``tree`` (PYTHONPATH
    comes before the installed editable finder)."""
    shim = Path(tempfile.mkdtemp(prefix="qlayer-tree-"))
    for name, source in (("layer", "layer"), ("layer_cli", "cli"),
                         ("layer_migrations", "migrations")):
        (shim / name).symlink_to(tree / source)
    return shim


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    # cwd: not the checkout, whose layer/ would come first on sys.path.
    done = subprocess.run([sys.executable, "-m", "layer_cli.main", *argv], env=env,
                          cwd=tempfile.gettempdir(), capture_output=True, text=True, check=False)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"`qlayer {' '.join(argv)}` failed:\n{done.stdout}\n{done.stderr}")
    return took


def _first_byte(port: int, path: str) -> tuple[float, float] | None:
    """(seconds to the first byte of the answer, seconds to its end) of one GET; None when it
    is not a page (the overview before 0014 was a redirect)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        started = time.perf_counter()
        connection.request("GET", path)
        answer = connection.getresponse()  # returns once the status line is read
        first = time.perf_counter() - started
        answer.read()
        whole = time.perf_counter() - started
        return (first, whole) if answer.status == 200 else None
    finally:
        connection.close()


def _browser() -> Any:
    """A headless Chromium (Debian's), or None when it is not installed."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        return None
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


def _rendered(driver: Any, url: str) -> float:
    """Seconds from the navigation's start to its load event (HTML, stylesheet, script and
    the page laid out), as the browser measured it."""
    driver.get(url)
    timing = driver.execute_script(
        "const n = performance.getEntriesByType('navigation')[0];"
        "return [n.startTime, n.loadEventEnd];")
    return float(timing[1] - timing[0]) / 1000


def console_times(env: dict[str, str], runs: int, port: int) -> dict[str, list[float]]:
    """`qlayer console`'s pages, ``runs`` times each: first byte, whole answer, rendered."""
    console = subprocess.Popen(
        [sys.executable, "-m", "layer_cli.main", "console", "--port", str(port),
         "--sample-interval", "3600"], env=env, cwd=tempfile.gettempdir(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    out: dict[str, list[float]] = {}
    driver = None
    try:
        deadline = time.monotonic() + 120
        while True:  # up, and its first sample (the sampler's) taken
            try:
                with urllib.request.urlopen(f"{base}/queues", timeout=300) as answer:
                    answer.read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        driver = _browser()
        for name, path in CONSOLE_PAGES.items():
            for _ in range(runs):
                got = _first_byte(port, path)
                if got is None:
                    break
                first, whole = got
                out.setdefault(f"{name} first byte", []).append(first)
                out.setdefault(name, []).append(whole)
                if driver is not None:
                    out.setdefault(f"{name} rendered", []).append(
                        _rendered(driver, base + path))
        return out
    finally:
        if driver is not None:
            driver.quit()
        console.terminate()
        console.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-servers", default="127.0.0.1:9092")
    parser.add_argument("--admin-database-url",
                        default="postgresql+psycopg://postgres@127.0.0.1:15432/postgres")
    parser.add_argument("--queues", type=int, default=1000)
    parser.add_argument("--busy", type=int, default=50)
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--view-records", type=int, default=100_000,
                        help="records of the queue `Big` that `view Big -n 20` reads")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before-runs", type=int, default=None,
                        help="runs of the earlier tree (default: --runs; it may take minutes "
                             "a run at a thousand queues)")
    parser.add_argument("--before", type=Path, help="a checkout of an earlier commit")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--port", type=int, default=28_880, help="the console's port")
    args = parser.parse_args(argv)

    url = scratch_database(args.admin_database_url)
    prefix = f"mq{uuid.uuid4().hex[:6]}."
    trees: dict[str, Path | None] = {"after": None}
    if args.before is not None:
        trees = {"before": _shim(args.before.resolve()), "after": None}
    topics: list[str] = []
    try:
        started = time.perf_counter()
        topics = make_queues(args.bootstrap_servers, url, prefix, args.queues, args.busy,
                             args.records, args.view_records)
        print(f"{args.queues} queues ({args.busy} with {args.records} records) made in "
              f"{time.perf_counter() - started:.1f}s", flush=True)
        if args.keep:
            print(f"kept: QLAYER_DATABASE_URL={url} QLAYER_TOPIC_PREFIX={prefix}", flush=True)
        # As a user's install runs: with its bytecode cached (this workplace's environment
        # sets PYTHONDONTWRITEBYTECODE, which would compile every module on every start and
        # add ~0.3 s to each command); one untimed run per tree and command writes the cache.
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
               "QLAYER_BOOTSTRAP_SERVERS": args.bootstrap_servers,
               "QLAYER_DATABASE_URL": url, "QLAYER_TOPIC_PREFIX": prefix,
               "QLAYER_CONFIG": os.devnull, "COLUMNS": "200"}
        for shim in trees.values():
            for command in COMMANDS.values():
                timed(command, env if shim is None else {**env, "PYTHONPATH": str(shim)})
        times: dict[str, dict[str, list[float]]] = {
            label: {name: [] for name in COMMANDS} for label in trees}
        runs = {"before": args.runs if args.before_runs is None else args.before_runs,
                "after": args.runs}
        for run in range(max(runs.values())):
            for name, command in COMMANDS.items():
                for label, shim in trees.items():
                    if run >= runs[label]:
                        continue
                    run_env = dict(env)
                    if shim is not None:
                        run_env["PYTHONPATH"] = str(shim)
                    took = timed(command, run_env)
                    times[label][name].append(took)
                    print(f"run {run + 1}: {label:6} qlayer {name:14} {took:7.2f}s", flush=True)
        for label, shim in trees.items():
            run_env = dict(env)
            if shim is not None:
                run_env["PYTHONPATH"] = str(shim)
            for name, values in console_times(run_env, runs[label], args.port).items():
                times[label][name] = values
                print(f"{label:6} {name} " + " ".join(f"{t:.3f}s" for t in values),
                      flush=True)
        result: dict[str, Any] = {
            "command": "python benchmarks/many_queues.py " + " ".join(sys.argv[1:]),
            "machine": machine(), "queues": args.queues, "busy": args.busy,
            "records": args.records, "view_records": args.view_records, "runs": args.runs,
            "results": {}}
        print(f"\n{'command':36} " + " ".join(f"{label + ' median (min-max) s':>28}"
                                              for label in trees))
        names = list(dict.fromkeys(n for label in trees for n in times[label]))
        for name in names:
            cells = []
            for label in trees:
                measured = times[label].get(name) or []
                if not measured:
                    cells.append("-")
                    continue
                result["results"].setdefault(name, {})[label] = {
                    "seconds": [round(v, 3) for v in measured],
                    "median": round(statistics.median(measured), 3)}
                cells.append(f"{statistics.median(measured):10.3f} ({min(measured):.3f}-"
                             f"{max(measured):.3f})")
            print(f"{name:36} " + " ".join(f"{c:>28}" for c in cells))
        if args.output is not None:
            args.output.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        if not args.keep:
            delete_topics(args.bootstrap_servers, topics)
            drop_database(url)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
