"""The "Exactly-once processing" section of docs/benchmarks.md, from
benchmarks/results/tx.json (`benchmarks/tx_bench.py`). Called by benchmarks/report.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TX", "render_tx"]

TX = Path(__file__).resolve().parent / "results" / "tx.json"


def render_tx(data: dict[str, Any]) -> str:
    """The section's Markdown."""
    cells = data["cells"]
    first = cells[0]
    machine = data["machine"]
    lines = ["", "## Exactly-once processing (transactional consumers)", "",
             "`benchmarks/tx_bench.py`: consume-transform-produce through one queue (a "
             f"4-partition journal, one coordinator process), {first['consumers']} SDK "
             "consumer processes settling groups of up to N messages (the transaction size): "
             "**at-least-once** produces one result per message, flushes, then acks; "
             "**transactional** produces the results and acks them in one Kafka transaction of "
             "the consumer (`consumer.transaction()`). "
             f"{first['message_size']:,} B messages; acked/s is the median of "
             f"{len(first['runs'])} runs (first produce to every record acked); "
             "**settle** latency is from the moment a consumer received a message to its "
             "group's settlement (the ack sent, or the commit done), **end-to-end** from the "
             "record's produce time (it includes the wait in the queue behind each run's burst "
             "of records), p50 and p99 over the runs. All cells in one session on "
             f"{machine.get('cpu', 'this machine')} "
             f"({machine.get('cpus', '?')} cores).", "",
             "| transaction size | mode | acked/s | / at-least-once | settle p50 / p99 ms "
             "| end-to-end p50 / p99 ms |",
             "|---:|---|---:|---:|---:|---:|"]
    for c in cells:
        lines.append(f"| {c['transaction_size']} | {c['mode']} | {c['acked_per_second']:,} | "
                     f"{c['vs_at_least_once']:.2f}x | {c['settle_p50_ms']:.1f} / "
                     f"{c['settle_p99_ms']:.1f} | {c['p50_ms']:,.0f} / {c['p99_ms']:,.0f} |")
    single = next((c for c in cells if c["mode"] == "transactional"
                   and c["transaction_size"] == 1), None)
    largest = max((c for c in cells if c["mode"] == "transactional"),
                  key=lambda c: c["transaction_size"])
    if single is not None:
        lines += ["", f"A transaction costs its consumer about {single['settle_p50_ms']:.0f} ms "
                  "here (p50 of a one-message transaction: the begin, the produce, the ack "
                  "records and the commit, whose markers go to every partition it wrote), "
                  "whatever it holds: settle many messages per transaction where throughput "
                  f"matters ({largest['transaction_size']} per commit: "
                  f"{largest['vs_at_least_once']:.2f}x of at-least-once)."]
    lines += ["", f"Command: `{data['command']}`.", ""]
    return "\n".join(lines)
