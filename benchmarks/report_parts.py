"""The "One queue over several processes" section of docs/benchmarks.md, from
benchmarks/results/parts.json (`benchmarks/parts_bench.py`), with its plot
(docs/benchmarks/parts.png). Called by benchmarks/report.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

__all__ = ["PARTS", "plot_parts", "render_parts"]

PARTS = Path(__file__).resolve().parent / "results" / "parts.json"


def _label(cell: dict[str, Any]) -> str:
    return (f"{cell['parts']} part{'s' if cell['parts'] > 1 else ''}, "
            f"{cell['processes']} process{'es' if cell['processes'] > 1 else ''}")


def plot_parts(data: dict[str, Any], out: Path) -> None:
    cells = data["cells"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(cells)), [c["acked_per_second"] for c in cells], 0.6)
    for i, c in enumerate(cells):
        ax.annotate(f"{c['vs_one_process']:.2f}x", (i, c["acked_per_second"]),
                    ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([_label(c) for c in cells], fontsize=8)
    ax.set_ylabel("acknowledged messages / s (median)")
    share = cells[0]["cpu_per_process"]
    ax.set_title(f"One queue, each coordinator process held to {share:g} of a core")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def render_parts(data: dict[str, Any]) -> str:
    """The section's Markdown."""
    cells = data["cells"]
    share = cells[0]["cpu_per_process"]
    machine = data["machine"]
    lines = ["", "## One queue over several processes (partitioned queues)", "",
             "`benchmarks/parts_bench.py`: one queue over an 8-partition journal, with "
             "`parts` 1, 2 and 4 on 4 shards served by 1, 2 and 4 `qlayer coordinator run` "
             f"processes, each process held to {share:g} of a core by a cgroup of its own (the "
             "broker, PostgreSQL, the consumers and the harness outside the limit, so the "
             "coordinator is what limits); "
             f"{cells[0]['consumers']} SDK consumer processes on the queue by name, acking "
             f"everything; {cells[0]['size']:,} B messages; medians of "
             f"{len(cells[0]['runs'])} runs per cell, all cells in one session on "
             f"{machine.get('cpu', 'this machine')} ({machine.get('cpus', '?')} cores).", "",
             "![parts](benchmarks/parts.png)", "",
             "| cell | acked/s | / one process | coordinator CPU µs/msg |",
             "|---|---:|---:|---:|"]
    for c in cells:
        lines.append(f"| {_label(c)} | {c['acked_per_second']:,} | "
                     f"{c['vs_one_process']:.2f}x | {c['coordinator_cpu_us_per_message']:.1f} |")
    lines += ["", f"Command: `{data['command']}`.", ""]
    return "\n".join(lines)
