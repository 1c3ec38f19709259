"""Write docs/benchmarks.md and its plots from benchmarks/results/bench.json.

    .venv/bin/python benchmarks/report.py [--results benchmarks/results/bench.json]

Everything in the page is computed from the JSON, so the page and the figures cannot disagree.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from report_parts import PARTS, plot_parts, render_parts
from report_tx import TX, render_tx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "bench.json"
DOC = ROOT / "docs" / "benchmarks.md"
PLOTS = ROOT / "docs" / "benchmarks"

LABELS = {
    "relay": "raw Kafka relay (Python)",
    "share-ck": "share group, confluent-kafka",
    "share-tool": "share group, ShareConsumerPerformance",
    "qlayer-alo": "qlayer at-least-once",
    "qlayer-amo": "qlayer at-most-once",
    "qlayer-alo-python": "qlayer at-least-once, Python core",
}

#: The loop's own frames, left out of "qlayer's own functions" (they include everything).
_LOOP_FRAMES = ("CoordinatorProcess.run (", "CoordinatorProcess.run_once (",
                "ShardLoop.run_once (")


def _fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "–"
    if isinstance(value, float | int):
        return f"{value:,.{digits}f}"
    return str(value)


def plot_throughput(cells: list[dict[str, Any]], out: Path) -> None:
    systems = [s for s in LABELS if any(c["system"] == s for c in cells)]
    groups = sorted({(c["size"], c["consumers"]) for c in cells})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        heights = []
        for size, consumers in groups:
            match = [c for c in cells if (c["system"], c["size"], c["consumers"]) ==
                     (system, size, consumers)]
            # The tool's own figure is mostly its group join: plot what its records cost.
            figure = "drain_per_second" if system == "share-tool" else "acked_per_second"
            heights.append(match[0].get(figure) or 0 if match else 0)
        label = LABELS[system] + (" (drain)" if system == "share-tool" else "")
        ax.bar([g + i * width for g in range(len(groups))], heights, width, label=label)
    ax.set_xticks([g + width * (len(systems) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([f"{size} B, {n} consumer{'s' if n > 1 else ''}"
                        for size, n in groups])
    ax.set_ylabel("acknowledged messages / s (median)")
    ax.set_title("End-to-end throughput, every message acknowledged")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_latency(latency: list[dict[str, Any]], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4))
    quantiles = ["p50", "p99", "p99.9"]
    width = 0.8 / max(1, len(latency))
    for i, cell in enumerate(latency):
        values = [cell["latency_ms"][q] for q in quantiles]
        ax.bar([q + i * width for q in range(len(quantiles))], values, width,
               label=LABELS.get(cell["system"], cell["system"]))
    ax.set_xticks([q + width * (len(latency) - 1) / 2 for q in range(len(quantiles))])
    ax.set_xticklabels(quantiles)
    ax.set_ylabel("publish-to-delivery latency (ms)")
    if latency:
        c = latency[0]
        ax.set_title(f"Latency at {c['rate']:,.0f} msg/s, {c['size']} B, "
                     f"{c['consumers']} consumer(s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _profiled_lines(path: str, commit: str | None) -> list[str]:
    """A source file as it was at the profiled commit (as it is now without one): the line
    numbers py-spy recorded point into that version, not into today's."""
    if commit is not None:
        shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT,
                               capture_output=True, text=True, check=False)
        if shown.returncode == 0:
            return shown.stdout.splitlines()
    try:
        return (ROOT / path).read_text().splitlines()
    except OSError:
        return []


def _source(frame: str, commit: str | None = None) -> str:
    """The line of qlayer's own code a frame points at, so the table reads without the source."""
    match = re.search(r"\((layer/[^:]+):(\d+)\)$", frame)
    if match is None:
        return ""
    lines = _SOURCES.get((match[1], commit))
    if lines is None:
        lines = _SOURCES[(match[1], commit)] = _profiled_lines(match[1], commit)
    try:
        text = lines[int(match[2]) - 1].strip()
    except IndexError:
        return ""
    return f": `{text[:90]}`".replace("|", "\\|")


_SOURCES: dict[tuple[str, str | None], list[str]] = {}


def profile_summary(raw: Path, top: int = 12) -> list[str]:
    """The coordinator's busiest functions by inclusive time, from py-spy's raw (collapsed) output.

    Each line of the raw file is one distinct stack and how many samples it had; a function's
    inclusive share is the samples of the stacks it appears in, over all samples. The lines
    quoted are those of the commit profiled (``<raw>.commit``, written by
    profile_coordinator.sh), not today's.
    """
    marker = raw.with_suffix(".commit")
    commit = marker.read_text().split()[0] if marker.exists() else None
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        samples = int(count)
        total += samples
        frames = stack.split(";")
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + samples
        own[frames[-1]] = own.get(frames[-1], 0) + samples
    if not total:
        return []

    def table(title: str, rows: list[tuple[int, str]], counts: dict[str, int]) -> list[str]:
        out = ["", title, "", "| share | function (file:line) |", "|---:|---|"]
        for n, frame in sorted(rows, reverse=True)[:top]:
            out.append(f"| {100 * n / total:.1f} % | `{frame}`{_source(frame, commit)} |")
        return out

    # Steps of one iteration: samples under each line of run_once that the loop was in.
    steps: dict[str, int] = {}
    for frame, n in inclusive.items():
        if frame.startswith("ShardLoop.run_once (layer/coordinator/shard.py:"):
            steps[frame] = n
    at = f", at commit {commit[:7]}" if commit else ""
    lines = [f"{total:,} samples at 100 Hz over 12 s in the coordinator process (threads that "
             f"were not idle){at}."]
    lines += table("By step of `ShardLoop.run_once` (inclusive):",
                   [(n, f) for f, n in steps.items()], inclusive)
    ours = [(n, f) for f, n in inclusive.items()
            if "(layer/" in f and not f.startswith(_LOOP_FRAMES)]
    lines += table("qlayer's own functions, inclusive:", ours, inclusive)
    lines += table("Self time, any code:", [(n, f) for f, n in own.items()], own)
    return lines


def render(data: dict[str, Any], profile: Path | None = None) -> str:
    cells = data["throughput"]
    plan = data["plan"]
    m = data["machine"]
    lines = [
        "# Benchmarks: qlayer next to the raw Kafka limit and Kafka share groups",
        "",
        "Generated by `benchmarks/report.py` from `benchmarks/results/bench.json`; do not edit.",
        "",
        f"- command: `{data['command']}` (argv: `{' '.join(data['argv'])}`), "
        f"{data['mode']} mode, {data['seconds']} s",
        f"- machine: {m['cpus']} × {m['cpu']}, {m.get('memory')}, Python {m['python']}, "
        f"{m['platform']}; broker and PostgreSQL on the same machine (the local stack), "
        "shared with other work, so figures are noisy",
        f"- plan: {plan['messages']:,} messages per repetition, {plan['repetitions']} "
        f"repetitions (median) after a {plan['warmup']:,}-message warm-up; journal of 4 "
        "partitions; 1,000 distinct random payloads from a fixed seed, cycled",
        "",
        "## Throughput (acknowledged messages per second, median)",
        "",
        "![throughput](benchmarks/throughput.png)",
        "",
        "| system | size | consumers | acked/s | repetitions | layer CPU s / 1k msg "
        "| layer peak RSS MiB | PG statements / msg | PG rows / msg | Kafka bytes / msg "
        "(journal) |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        reps = ", ".join(f"{r:,}" for r in c.get("repetitions", []))
        if c["system"] == "share-tool" and c.get("drain_per_second"):
            reps += f" (drain {c['drain_per_second']:,}/s)"
        kafka = c.get("kafka_bytes_per_message")
        kafka_text = (f"{kafka:,} ({c.get('journal_bytes_per_message', 0):,})"
                      if kafka is not None else "–")
        lines.append(
            f"| {LABELS.get(c['system'], c['system'])} | {c['size']} | {c['consumers']} | "
            f"{_fmt(c.get('acked_per_second'))}{' (incomplete)' if c.get('incomplete') else ''}"
            f" | {reps} | {_fmt(c.get('layer_cpu_seconds_per_1k'), 3)} | "
            f"{_fmt(c.get('layer_peak_rss_mb'), 1)} | "
            f"{_fmt(c.get('statements_per_message'), 4)} | {_fmt(c.get('rows_per_message'), 2)}"
            f" | {kafka_text} |")
    lines += [
        "",
        "## qlayer's ratios (same run, same cell)",
        "",
        "| qlayer | size | consumers | ÷ raw relay | ÷ share group (confluent-kafka) "
        "| ÷ ShareConsumerPerformance drain |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in data["ratios"]:
        lines.append(f"| {LABELS[r['system']]} | {r['size']} | {r['consumers']} | "
                     f"{_fmt(r['vs_relay'], 2)} | {_fmt(r['vs_share-ck'], 2)} | "
                     f"{_fmt(r['vs_share-tool-drain'], 2)} |")
    lines += [
        "",
        "The target (issue 13, coordinator v2 part 2) is qlayer at-least-once ≥ 0.5 × the raw "
        "relay and ≥ 0.6 × the confluent-kafka share consumer.",
        "",
        f"## Latency at a fixed rate ({plan['latency_rate']:,.0f} msg/s for "
        f"{plan['latency_seconds']:.0f} s, {plan['repetitions']} repetitions)",
        "",
        "![latency](benchmarks/latency.png)",
        "",
        "Each quantile is the median of the repetitions' own (one run's p99 is its worst 1 %, "
        "which a single pause of the shared machine decides); *p99 of each* lists them. The "
        "harness publishes each record at once in these cells (`linger.ms` 0, as qlayer's "
        "coordinator does), so no system's figure carries the harness's own batching wait.",
        "",
        "| system | size | consumers | samples | p50 ms | p99 ms | p99.9 ms | p99 of each |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in data["latency"]:
        q = c["latency_ms"]
        each = ", ".join(_fmt(r["p99"], 1) for r in c.get("latency_repetitions", []))
        lines.append(f"| {LABELS.get(c['system'], c['system'])} | {c['size']} | "
                     f"{c['consumers']} | {c['latency_samples']:,} | {_fmt(q['p50'], 1)} | "
                     f"{_fmt(q['p99'], 1)} | {_fmt(q['p99.9'], 1)} | {each or '–'} |")
    lines += loop_phases(cells)
    lines += before_and_after_v2(data, BASELINE_V2)
    lines += before_and_after(data, BASELINE)
    # Before/after checks measured by hand, kept beside their results (a regenerated page
    # must not drop them).
    for note in sorted((ROOT / "benchmarks" / "results").glob("stop*-before-after.md")):
        lines += ["", note.read_text().rstrip()]
    lines += ["", *limits(CPU_SHARE)]
    if profile is not None and profile.exists():
        lines += ["", "## Where the coordinator spends its time (qlayer at-least-once)", "",
                  "`benchmarks/profile_coordinator.sh`: py-spy on the coordinator process during "
                  "an at-least-once throughput cell (1 KiB, 4 consumers, 30 × 20,000 messages); "
                  "raw profile in `benchmarks/results/coordinator-profile.txt`.", ""]
        lines += profile_summary(profile)
    lines += ["", METHOD]
    return "\n".join(lines) + "\n"


BASELINE = ROOT / "benchmarks" / "results" / "bench-baseline.json"


def loop_phases(cells: list[dict[str, Any]]) -> list[str]:
    """The coordinator loop's wall time per message by phase (its own counters)."""
    rows = [c for c in cells if c.get("loop_us_per_message")]
    if not rows:
        return []
    phases = ("polling", "deciding", "committing", "encoding", "writing")
    lines = ["", "## The coordinator loop, phase by phase (wall µs per message)", "",
             "From the coordinator's own counters over the measured repetitions: waiting for "
             "input (`polling`), applying acks and journal records and deciding "
             "(`deciding`), the PostgreSQL transaction (`committing`), building deliveries "
             "and events (`encoding`), handing them to the producer (`writing`; not waited "
             "for, unless the coordinator runs with `--transactions`). The sum is the loop's "
             "wall time per message, the inverse of what one coordinator can sustain at that "
             "batch size.", "",
             "| system | size | consumers | " + " | ".join(phases) + " | sum |",
             "|---|---:|---:|" + "---:|" * (len(phases) + 1)]
    for c in rows:
        loop = c["loop_us_per_message"]
        lines.append(f"| {LABELS.get(c['system'], c['system'])} | {c['size']} | "
                     f"{c['consumers']} | " + " | ".join(_fmt(loop.get(p), 1) for p in phases)
                     + f" | {_fmt(sum(loop.get(p, 0) for p in phases), 1)} |")
    return lines


def before_and_after(data: dict[str, Any], baseline_path: Path) -> list[str]:
    """qlayer before the speed work against now, each as a ratio within its own run."""
    if not baseline_path.exists():
        return []
    before = json.loads(baseline_path.read_text())

    def ratio(run: dict[str, Any], size: int, consumers: int) -> tuple[Any, Any, Any]:
        cell = {(c["system"], c["size"], c["consumers"]): c for c in run["throughput"]}
        q = cell.get(("qlayer-alo", size, consumers))
        share = cell.get(("share-ck", size, consumers))
        if q is None or share is None or not share.get("acked_per_second"):
            return None, None, None
        return (q["acked_per_second"] / share["acked_per_second"],
                q.get("layer_cpu_seconds_per_1k"), q["acked_per_second"])

    lines = ["", "## Before and after the speed work", "",
             f"`benchmarks/results/bench-baseline.json` is the same cell measured at commit "
             f"{before.get('commit', '?')}, before the speed work of issue 7 "
             f"(`{' '.join(before['argv'])}`). Absolute rates drift between runs on this shared "
             "machine, so the comparison is qlayer's ratio to the share consumer *within each "
             "run*, and the coordinator's CPU per message (which load changes much less).", "",
             "| cell | ÷ share group, before | ÷ share group, now | coordinator CPU s / 1k, "
             "before | now |", "|---|---:|---:|---:|---:|"]
    for c in before["throughput"]:
        if c["system"] != "qlayer-alo":
            continue
        old_ratio, old_cpu, _ = ratio(before, c["size"], c["consumers"])
        new_ratio, new_cpu, _ = ratio(data, c["size"], c["consumers"])
        lines.append(f"| at-least-once, {c['size']} B, {c['consumers']} consumers | "
                     f"{_fmt(old_ratio, 3)} | {_fmt(new_ratio, 3)} | {_fmt(old_cpu, 3)} | "
                     f"{_fmt(new_cpu, 3)} |")
    return lines


BASELINE_V2 = ROOT / "benchmarks" / "results" / "bench-before-v2.json"


def before_and_after_v2(data: dict[str, Any], baseline_path: Path) -> list[str]:
    """qlayer before the batch shapes of coordinator v2 part 2 against now: each cell as a
    ratio to the raw relay within its own run, and the coordinator's CPU and rows per
    message."""
    if not baseline_path.exists():
        return []
    before = json.loads(baseline_path.read_text())

    def cells(run: dict[str, Any]) -> dict[tuple[str, int, int], dict[str, Any]]:
        return {(c["system"], c["size"], c["consumers"]): c for c in run["throughput"]}

    old, new = cells(before), cells(data)

    def vs_relay(table: dict[tuple[str, int, int], dict[str, Any]], key: tuple[str, int, int]
                 ) -> float | None:
        q, relay = table.get(key), table.get(("relay", key[1], key[2]))
        if q is None or relay is None or not relay.get("acked_per_second"):
            return None
        return float(q["acked_per_second"]) / float(relay["acked_per_second"])

    lines = ["", "## Before and after the batch shapes (coordinator v2, part 2)", "",
             f"`benchmarks/results/bench-before-v2.json` is the same plan run with the tree of "
             f"commit {before.get('commit', '?')} (shards, one record per delivery, a row per "
             f"lease, three event records per message; `{' '.join(before['argv'])}`), on the same "
             "stack within the hour of the run above (two trees cannot share one run). Rates "
             "drift between runs on this shared "
             "machine, so the comparison is each cell's ratio to the raw relay *within its own "
             "run*, with the coordinator's CPU and PostgreSQL rows per message.", "",
             "| cell | ÷ relay, before | ÷ relay, now | CPU µs / msg, before | now "
             "| PG rows / msg, before | now |", "|---|---:|---:|---:|---:|---:|---:|"]
    for key in sorted(k for k in old if k[0].startswith("qlayer")):
        o, n = old[key], new.get(key, {})
        label = LABELS.get(key[0], key[0])
        o_cpu, n_cpu = o.get("layer_cpu_seconds_per_1k"), n.get("layer_cpu_seconds_per_1k")
        lines.append(
            f"| {label}, {key[1]} B, {key[2]} consumer{'s' if key[2] > 1 else ''} | "
            f"{_fmt(vs_relay(old, key), 2)} | {_fmt(vs_relay(new, key), 2)} | "
            f"{_fmt(o_cpu * 1000 if o_cpu is not None else None, 1)} | "
            f"{_fmt(n_cpu * 1000 if n_cpu is not None else None, 1)} | "
            f"{_fmt(o.get('rows_per_message'), 3)} | {_fmt(n.get('rows_per_message'), 3)} |")
    return lines


CPU_SHARE = ROOT / "benchmarks" / "results" / "cpu-share.json"


def limits(cpu_share_path: Path) -> list[str]:
    """What limits qlayer now: the CPU reading of benchmarks/cpu_share.py and the reasons."""
    lines = ["## What limits qlayer now", "", SPEED_WORK, ""]
    # benchmarks/cpu_share.py was last run against version 1; rerun it to show it again.
    if cpu_share_path.exists() and json.loads(cpu_share_path.read_text()).get("version", 1) >= 2:
        share = json.loads(cpu_share_path.read_text())
        cell = share["cell"]
        lines += [
            f"**Where the machine's CPU goes** (`{share['command']}`: one at-least-once cell, "
            f"1 KiB, 4 consumers, {cell['acked_per_second']:,} acked/s; CPU ticks of each "
            f"process over {share['window_seconds']:.0f} s in the middle of it, as a share of "
            "both cores):", "",
            "| process | % of the machine |", "|---|---:|"]
        lines += [f"| {name} | {value} |" for name, value in
                  share["percent_of_machine"].items()]
        idle = share["percent_of_machine"].get("idle", 0.0)
        coordinator = share["percent_of_machine"].get("coordinator", 0.0)
        lines += [
            "",
            f"The machine is {idle:.0f} % idle and the coordinator uses "
            f"{2 * coordinator:.0f} % of one core.", ""]
    lines += [NEXT_STEPS]
    return lines


SPEED_WORK = """Coordinator v2, part 2 (issue 13) changed the shapes around each message: leases and
acks are stored as runs (*PG rows / msg* fell from about 2.1 to 0.06), a consumer gets one
delivery record per iteration carrying many messages (`delivery batches`), ACCEPTs come back
many per record (`AcceptRecord`), and an iteration's events are one EventBatch record through a
PostgreSQL outbox, with the events of many entries as one `EventRun` item. The loop no longer
waits on Kafka, and an iteration's transaction (BEGIN, the guard, the statements, COMMIT) goes
to PostgreSQL in one round trip (revision 0012; `benchmarks/commit_bench.py`). Then the
per-message work moved to a native core (`native/`, Rust; [native-core.md](native-core.md)):
the coordinator's CPU per message fell from 58–74 µs before part 2 to 17–22 µs with the Python
core and 8–11 µs with the native one (the tables above, `qlayer-alo-python` beside
`qlayer-alo` in one run). The SDK consumer makes its message objects lazily and buffers
batch-delivered ACCEPTs as plain values. A qlayer consumer holds, with the others, the
in-flight allowance a share group has over the journal (2,000 per partition)."""

NEXT_STEPS = """**What bounds it now.** Not one process: the coordinator is a fifth of the machine,
and the machine is nearly busy. Per message, qlayer moves the journal record, a delivery (batched),
an ack (batched) and its events through the broker, which makes the broker the largest user of
the two cores; four Python consumers that each build a message and ack it are the next; the
coordinator and PostgreSQL follow. The relay's consumers only read and commit batches, and a
share group's work is all inside the broker. The loop's own phases (the table above) show the
PostgreSQL commit as its largest wait: writing the leases and deleting them again once acked.

**Latency.** At 1,000 msg/s an iteration carries a handful of messages, and its PostgreSQL
transaction is most of its wall time: py-spy on a latency cell put 90 % of the shard loop in
`Store.commit`, and per-call timers put 4–5 ms in it per iteration, against 1.6 ms for the same
transaction on an idle machine (`benchmarks/commit_bench.py`). The difference is the CPU the
broker, the consumers and the harness take from the same two
cores. The p50 gap to the relay (a few ms) is that transaction; the p99 gap is the same
transaction at its slowest rather than a periodic stall: in one traced cell, each of the 459
records slower than 25 ms overlapped a commit of more than 4 ms, 51 of them also a catalog
reload and 45 a long step.

**What would move it**, each measured or estimated on this machine:
- fewer statements per transaction: the prunes folded into the recovery points' statement,
  the outbox's delete and insert into one. The statements already go to libpq's pipeline
  directly, prepared once per connection and flushed once (`layer/store/pipeline.py`): that
  halved the client's CPU for a small commit (1.12 → 0.57 ms; 1.60 → 1.18 ms for 270
  messages, `commit_bench.py --before c8546cb`), but beside CPU burners its wall time did not
  move, so what is left is the server's own work and its wake-ups on the shared cores;
- lease tokens derived from one random base per lease batch (stored once per run instead of 33
  bytes per message): 10–25 % of a 1,000-message commit (`commit_bench.py` with random tokens
  against a constant one, three runs each), about 0.5–1 µs per message;
- the journal's records handed to the native core without a Python tuple each (the polling
  phase), and a native decoder for delivery batches in the SDK (optional, as the SDK needs
  nothing but Kafka);
- deciding without the GIL (native code that holds no Python object on its hot path), which
  would let the write-out run beside the loop: tried three times and slower each time while
  the deciding holds the GIL (`benchmarks/experiments/README.md`, sections 1, 4 and 5);
- more coordinator processes on more cores: two processes carry 1.97× what one does
  ([benchmarks-shards.md](benchmarks-shards.md)), which is the way to scale past one machine's
  worth of one process."""


METHOD = """## How each figure is measured

- **acked/s**: consumers (and the relay or the coordinator) are started and a warm-up batch
  goes through; then each repetition produces N records as fast as one confluent-kafka
  producer can and the figure is N / (first produce → last record acknowledged). Acknowledged
  means: relay — the final consumer committed its offsets after reading; share group — the
  consumer `acknowledge`d (ACCEPT) every record and `commit_sync` returned; qlayer — the SDK
  consumer called `ack()` on every message *and* the queue's recovery points in PostgreSQL
  reached the journal's end (the coordinator applied every ack).
- **ShareConsumerPerformance** (Java, implicit acknowledgement, `--threads` = consumers) reads
  records produced beforehand (at least 20,000) and times itself from its start, so its
  nMsg.sec includes joining the share group (about 5 s here); the *drain* figure counts from
  the first record any of its consumers received, i.e. what the records cost once the group
  is formed. Neither includes producing; qlayer's ratio is to the drain figure (to nMsg.sec
  it would mostly compare with five seconds of group join).
- **Raw relay**: one Python process consumes the journal (batches of up to 2,000), produces
  each record to a second 4-partition topic (same partition), flushes, then commits — the
  least an at-least-once layer of this shape pays; its final consumers commit synchronously
  after each batch.
- **layer CPU / peak RSS**: the relay process or the coordinator process (the coordinator runs
  alone in a child process, started per cell): user + system CPU from `/proc/PID/stat` over the
  measured repetitions, divided by the messages; peak RSS is `VmHWM`. For share groups the work
  is inside the broker, which is shared with other users of the machine, so it is not shown.
- **PG statements / msg**: the coordinator's own count (`counters["statements"]`) over the
  measured messages. **PG rows / msg**: `tup_inserted + tup_updated + tup_deleted` of the
  cell's scratch database in `pg_stat_database` (read 1.5 s after the run so the statistics are
  flushed).
- **Kafka bytes / msg**: growth of the `.log` segment files, in the broker's log directory, of
  the topics the cell wrote — the journal and, for the relay, its output topic; for qlayer the
  journal and every topic under the cell's own prefix (deliveries, acks, control, events) —
  divided by the messages. The journal's share is in brackets. Broker-wide internal topics
  (`__consumer_offsets`, `__share_group_state`, `__transaction_state`) are shared with
  other users of the broker and are not counted: offset commits, share-group state and the
  coordinator's transaction markers in those are missing from every system's figure.
- **Latency**: records carry their send time; at a fixed rate the consumers record receive
  time minus send time (same machine, same clock). p99.9 of a few thousand samples rests on a
  handful of records.
"""


# --- the coordinator at scale (benchmarks/scale.py, benchmarks/results/scale.json) -------------

SCALE = ROOT / "benchmarks" / "results" / "scale.json"
SCALE_STATIC = ROOT / "benchmarks" / "results" / "scale-static.json"


def render_scale(data: dict[str, Any]) -> str:
    """The section for `make bench-scale`: memory per queued message and restart time."""
    p = data["parameters"]
    m = data["machine"]
    journal = data.get("journal", {})
    lines = [
        "",
        "## The coordinator at scale",
        "",
        f"Generated from `benchmarks/results/scale.json` (`{data['command']}`, argv: "
        f"`{' '.join(data['argv'])}`, started {data.get('started_at', '?')}, "
        f"{data.get('seconds', '?')} s); {m['cpus']} × {m['cpu']}, {m.get('memory')}, "
        "shared with other work.",
    ]
    code = data.get("code")
    if code:
        dirty = code.get("uncommitted_in_layer") or []
        lines += ["", f"Code measured: commit `{code.get('commit')}`"
                  + (f" with uncommitted changes in {', '.join(f'`{f}`' for f in dirty)} "
                     "(the tree is shared with work on the coordinator)." if dirty else ".")]
    lines += [
        "",
        f"One journal of {p['partitions']} partitions holds {p['messages']:,} distinct JSON "
        f"records of {journal.get('payload_bytes', p['payload_bytes'])} B (keys of "
        f"{journal.get('key_bytes', '?')} B), produced before any coordinator runs.",
        "",
        f"### Memory per queued message ({p['messages']:,} queued, no consumers)",
        "",
        "| payload budget | payloads in memory | RSS before MiB | RSS after MiB | peak RSS MiB "
        "| **bytes / queued message** | admitted / s | CPU µs / message |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data.get("memory", []):
        budget = (f"default ({r['payload_budget_bytes'] / 1024 / 1024:,.0f} MiB)"
                  if r["payload_budget"] == "default"
                  else f"{r['payload_budget_bytes'] / 1024 / 1024:,.0f} MiB")
        held = "yes" if r["payloads_in_memory"] else "no (documents projected)"
        lines.append(
            f"| {budget} | {held} | {_fmt(r['rss_before_mib'], 1)} | "
            f"{_fmt(r['rss_after_mib'], 1)} | {_fmt(r['peak_rss_mib'], 1)} | "
            f"**{_fmt(r['bytes_per_message'])}** | {_fmt(r['admitted_per_second'])} | "
            f"{_fmt(r['cpu_us_per_message'], 1)} |")
    restart = data.get("restart")
    if restart:
        med = restart["medians"]
        rounds = restart["rounds"]
        ok = restart["correctness"]
        lines += [
            "",
            f"### Restart to first delivery ({p['messages']:,} queued, {p['leased']:,} leased)",
            "",
            f"{restart['holders']} consumers hold {restart['backlog_per_holder']:,} leases each "
            f"(lease period {p['lease_period_s']:.0f} s, never acked); a prober consumer "
            f"holds a full backlog ({restart['prober_backlog']}) it has received. The "
            "coordinator (default options) is SIGKILLed, the prober acks its backlog while "
            "no coordinator runs (so its next message needs the new one to read an ack, free "
            "a slot and deliver) and a new process is started; times from just before it is "
            f"spawned, median of {len(rounds)} kills:",
            "",
            *restart_milestones(med, rounds),
        ]
        lines += [
            "",
            f"- replay rate after taking the shard: {_fmt(med.get('replay_per_second'))} "
            "records/s; coordinator RSS after the replay: "
            f"{_fmt(med.get('rss_after_replay_mib'), 1)} MiB",
            "- journal records replayed when the first ack was read / the first delivery "
            "produced: " + ", ".join(
                f"{_fmt(r.get('records_replayed_at_first_ack'))} / "
                f"{_fmt(r.get('records_replayed_at_first_delivery'))}" for r in rounds)
            + f" (of {_fmt(rounds[0]['at_kill']['replay_records']) if rounds else '–'})",
            f"- leases recorded in PostgreSQL before each kill: "
            f"{', '.join(_fmt(r['at_kill']['leased']) for r in rounds)}; after each restart: "
            f"{', '.join(_fmt(r['leased_after']) for r in rounds)}",
            *([f"- the queue's counters in PostgreSQL after the restarts: enqueued "
               f"{_fmt(c['enqueued'])} (the journal holds {p['messages']:,}"
               + ("; the replays after the restarts counted its records again"
                  if c["enqueued"] > p["messages"] else "")
               + f"), delivered {_fmt(c['delivered'])}, acked "
               f"{_fmt(c['acked'])}"] if (c := restart.get("queue_counters_at_end")) else []),
            f"- correctness over {ok['receipts']:,} receipts: {ok['redelivered_while_leased']} "
            f"entries delivered again while their lease was held, "
            f"{ok['redelivered_after_ack']} delivered again after an ack, "
            f"{len(ok['consumer_errors'])} consumer errors",
            *([f"- the last restart sent the deliveries of its {_fmt(resent)} restored leases "
               "again (they may have been lost between the PostgreSQL commit and the Kafka "
               "write); the consumers dropped them as repeats, so the receipts above count each "
               "lease once, and *first delivery produced* may be one of these"]
              if (resent := restart.get("last_coordinator_counters", {})
                  .get("deliveries_resent")) else []),
        ]
    lines += [
        "",
        "How: the coordinator runs alone in a child process. Bytes per queued message = "
        "(VmRSS once all records are admitted and the loop idles − VmRSS of the idle "
        "coordinator before the queue existed) / messages; admitted when the queue's "
        "`enqueued` counter in PostgreSQL reaches the count; the admission rate is timed by "
        "the coordinator's own record count, first record to last. With budget 0 no payload "
        "is kept and each entry keeps only the document fields the queue's expressions read "
        "(none here). A delivery counts as the restarted coordinator's when its lease began "
        "after the kill (lease deadline minus lease period, the coordinator's clock; same "
        "machine). The coordinator's milestones come from its counters, which an iteration "
        "updates at its end, so they may trail a consumer's receipt by a few milliseconds. "
        "After a SIGKILL the coordinators' Kafka group gives the shard to the new process only "
        "once its session timeout (6 s by default) has passed without a heartbeat from the "
        "killed one: that is the floor of the figure, unless the processes run with "
        "`--instance-id` (below, when measured).",
    ]
    return "\n".join(lines) + "\n"


def restart_milestones(med: dict[str, Any], rounds: list[dict[str, Any]]) -> list[str]:
    """The restart's milestones: median and each kill."""
    lines = ["| milestone | median s | each kill |", "|---|---:|---|"]
    for key, label in (
            ("spawn_to_imported_s", "coordinator module imported"),
            ("spawn_to_owner_s", "shard owned (given by the coordinators' group)"),
            ("spawn_to_first_iteration_s", "first loop iteration done"),
            ("spawn_to_first_ack_read_s", "first ack read (the prober's, ack topic)"),
            ("spawn_to_first_delivery_produced_s", "first delivery produced"),
            ("spawn_to_first_delivery_received_s", "**first delivery received**"),
            ("spawn_to_replayed_s", "whole journal replayed")):
        each = ", ".join(_fmt(r.get(key), 2) for r in rounds)
        lines.append(f"| {label} | {_fmt(med.get(key), 2)} | {each} |")
    return lines


def render_static_restart(data: dict[str, Any]) -> str:
    """The same restart with every coordinator under one `--instance-id` (scale-static.json)."""
    restart = data.get("restart")
    if not restart:
        return ""
    p = data["parameters"]
    ok = restart["correctness"]
    return "\n".join([
        "",
        f"### Restart in place with `--instance-id` ({p['messages']:,} queued, "
        f"{p['leased']:,} leased)",
        "",
        f"`benchmarks/results/scale-static.json` (argv: `{' '.join(data['argv'])}`, started "
        f"{data.get('started_at', '?')}, code `{data.get('code', {}).get('commit')}`): the same "
        "kills, every coordinator run under one instance id (Kafka static membership), so the "
        "new process is given the shard without waiting for the group to notice the killed "
        f"one. Median of {len(restart['rounds'])} kills:",
        "",
        *restart_milestones(restart["medians"], restart["rounds"]),
        "",
        f"Correctness over {ok['receipts']:,} receipts: {ok['redelivered_while_leased']} "
        f"entries delivered again while their lease was held, {ok['redelivered_after_ack']} "
        f"after an ack, {len(ok['consumer_errors'])} consumer errors.",
    ]) + "\n"

# --- end of the scale section ----------------------------------------------------------------


# --- the coordinator's CPU without I/O (benchmarks/core_bench.py) ----------------------------

CORE = [ROOT / "benchmarks" / "results" / name for name in ("core-before.json", "core.json")]


def render_core(runs: list[dict[str, Any]]) -> str:
    """The in-process figures of core_bench.py, before and after, from one session."""
    lines = ["", "## The coordinator's own CPU per message, without I/O", "",
             "`benchmarks/core_bench.py`: `ShardCore.step` and the loop's encoding (events, "
             "store rows grouped into runs, delivery batches) for 1 KiB messages to four "
             "consumers, acks as AcceptRecords, no Kafka and no PostgreSQL. It isolates the "
             "Python the coordinator runs per message; the end-to-end figures above add the "
             "clients, the broker and PostgreSQL. The process runs with the coordinator's "
             "garbage-collector settings. Median of three runs each, the two measured one "
             "after the other in one session (`QLAYER_CORE=python`, then `native`; compare "
             "the ratio, not the absolute figures) on "
             f"{runs[-1]['machine'].get('cpu', 'this machine')}. With the native core the "
             "events and the rows are made inside the step.", "",
             "| core | µs/msg | " + " | ".join(runs[-1]["phases_us_per_msg"]) + " |",
             "|---|---:|" + "---:|" * len(runs[-1]["phases_us_per_msg"])]
    for run in runs:
        phases = run["phases_us_per_msg"]
        lines.append(f"| {run['label'] or run['commit']} ({run['commit']}) | "
                     f"{run['median_us_per_msg']:.1f} | "
                     + " | ".join(f"{v:.1f}" for v in phases.values()) + " |")
    lines += ["", "Commands: " + ", ".join(f"`QLAYER_CORE=... {run['command']}`"
                                           for run in runs) + ".", ""]
    return "\n".join(lines)


CREDIT = ROOT / "benchmarks" / "results" / "credit.json"


def render_credit(data: dict[str, Any]) -> str:
    """`benchmarks/credit_bench.py`: one backlog over several shards (protocol 8)."""
    def row(label: str, key: str) -> str:
        cell = data[key]
        return f"| {label} | {cell['acked_per_s']:,} | {cell['cpu_us_per_msg']:.1f} |"

    lines = ["", "## One backlog over several shards (credit, protocol 8)", "",
             "`benchmarks/credit_bench.py`: one real `qlayer coordinator run` process and one "
             "SDK consumer process (max_backlog 500, acking everything), 1 KiB messages, "
             f"{data.get('messages', 20000):,} per cell produced as fast as possible; acked/s "
             "and the coordinator's CPU µs per message, medians of the runs, the cells "
             "alternated in one session on "
             f"{data['machine'].get('cpu', 'this machine')} "
             f"({data['machine'].get('cpus', '?')} cores). \"before\" is the checkout given "
             f"as `--before-tree` ({data.get('before_commit') or 'its commit not recorded'}), "
             "run in the same session.", "",
             "| cell | acked/s | coordinator CPU µs/msg |", "|---|---:|---:|"]
    if "one_queue_before" in data:
        lines.append(row("one queue, one shard (before)", "one_queue_before"))
    lines.append(row("one queue, one shard", "one_queue"))
    lines.append(row("regex over 4 queues on one shard (no credit)", "regex_4_queues_1_shard"))
    if "regex_4_shards_before" in data:
        lines.append(row("regex over 4 queues on 4 shards (credit, before)",
                         "regex_4_shards_before"))
    lines.append(row("regex over 4 queues on 4 shards (credit)", "regex_4_shards"))
    ratios = [f"regex on 4 shards / one queue: {data['regex_4_shards_vs_one_queue']:.2f}x",
              "regex on 4 shards / the same regex on one shard: "
              f"{data['regex_4_shards_vs_regex_1_shard']:.2f}x"]
    if "one_queue_after_vs_before" in data:
        ratios.append(f"one queue after / before: {data['one_queue_after_vs_before']:.2f}x")
    if "regex_4_shards_after_vs_before" in data:
        ratios.append("regex on 4 shards after / before: "
                      f"{data['regex_4_shards_after_vs_before']:.2f}x")
    latency = data["credit_latency"]
    lines += ["", "Ratios (same run): " + "; ".join(ratios) + ".", "",
              "From an ack on one shard to the next delivery from another shard that only "
              "then gets the credit (max_backlog 1, "
              f"{latency['rounds']} rounds): p50 {latency['across_shards_p50_ms']:.1f} ms, "
              f"p99 {latency['across_shards_p99_ms']:.1f} ms; the same on one shard (no credit "
              f"moves): p50 {latency['same_shard_p50_ms']:.1f} ms, "
              f"p99 {latency['same_shard_p99_ms']:.1f} ms.", "",
              f"Command: `{data['command']}`.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    data = json.loads(args.results.read_text())
    PLOTS.mkdir(parents=True, exist_ok=True)
    plot_throughput(data["throughput"], PLOTS / "throughput.png")
    if data["latency"]:
        plot_latency(data["latency"], PLOTS / "latency.png")
    page = render(data, args.results.parent / "coordinator-profile.txt")
    core = [json.loads(path.read_text()) for path in CORE if path.exists()]
    if core:
        page += render_core(core)
    if SCALE.exists():
        page += render_scale(json.loads(SCALE.read_text()))
    if SCALE_STATIC.exists():
        page += render_static_restart(json.loads(SCALE_STATIC.read_text()))
    if CREDIT.exists():
        page += render_credit(json.loads(CREDIT.read_text()))
    if PARTS.exists():
        parts = json.loads(PARTS.read_text())
        plot_parts(parts, PLOTS / "parts.png")
        page += render_parts(parts)
    if TX.exists():
        page += render_tx(json.loads(TX.read_text()))
    DOC.write_text(page)
    print(f"written to {DOC}")


if __name__ == "__main__":
    main()
