"""`qlayer demo`: the main job — qlayer's headline features, end to end, on real services."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from layer.demo.run import DemoReport


def demo(
    bootstrap_servers: Annotated[str | None, typer.Option(
        help="Kafka bootstrap servers [env: QLAYER_BOOTSTRAP_SERVERS]; given (here or in the "
        "environment), the local stack is not started")] = None,
    database_url: Annotated[str | None, typer.Option(
        help="PostgreSQL URL [env: QLAYER_DATABASE_URL]; given, the local stack is not "
        "started")] = None,
    topic_prefix: Annotated[str | None, typer.Option(
        help="Prefix of qlayer's internal topics [env: QLAYER_TOPIC_PREFIX]")] = None,
    session_timeout: Annotated[float, typer.Option(
        help="Session timeout (s) of the consumer that crashes: how long its leases outlive "
        "it")] = 3.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Show qlayer working: queues, a coordinator, consumers (one crashes), real traffic.

    Starts the local Kafka and PostgreSQL when needed (`qlayer dev up`), migrates, applies the
    sample queues (fresh names each run), runs a coordinator and consumers for about half a
    minute, and prints what happened. The stack stays up; the demo's coordinator stops with it.
    """
    # Imported here: the demo loads the coordinator, which other commands do not need.
    from layer.demo.run import DemoOptions, run_demo
    from layer.settings import Settings

    given = (bootstrap_servers or database_url or os.environ.get("QLAYER_BOOTSTRAP_SERVERS")
             or os.environ.get("QLAYER_DATABASE_URL"))
    settings = Settings.load(bootstrap_servers=bootstrap_servers, database_url=database_url,
                             topic_prefix=topic_prefix)
    err = Console(stderr=True)
    options = DemoOptions(settings=settings, start_stack=not given,
                          session_timeout=session_timeout)
    report = run_demo(options, progress=lambda line: err.print(f"[dim]·[/] {line}"))
    if json_out:
        typer.echo(report.to_json())
        return
    render(report, Console())


def render(report: DemoReport, console: Console) -> None:
    """The report for people: one small table per scene, then where to look next."""
    q = report.queues
    jobs = report.jobs
    console.print(f"\n[bold]qlayer demo[/] run [cyan]{report.run}[/] in {report.seconds:g}s "
                  f"(coordinator {report.coordinator})\n")

    table = Table(title=f"{q['Jobs']}: at-least-once, a crash, dead letters", title_justify="left")
    table.add_column("consumer")
    table.add_column("jobs acked", justify="right")
    for name, count in jobs.processed_by.items():
        table.add_row(name, str(count))
    table.add_row(f"{jobs.crashed_consumer} (SIGKILLed)", "0")
    console.print(table)
    moved = ", ".join(f"job {k} → {v}" for k, v in sorted(jobs.redelivered_to.items()))
    console.print(f"  {jobs.crashed_consumer} held jobs {jobs.crashed_held} when it was killed; "
                  f"after its session timeout they were redelivered: {moved}")
    console.print(f"  {len(jobs.acked)} of {jobs.published} jobs acked; "
                  f"redeliveries {jobs.counters.get('redelivered', 0)}, "
                  f"dead letters {jobs.counters.get('dead_lettered', 0)}:")
    for d in jobs.dead_letters:
        console.print(f"    job {d['id']} → {q['FailedJobs']}: reason [yellow]{d['reason']}[/]"
                      + (f" ({d['detail']})" if d["detail"] else ""))

    p = report.priority
    console.print(f"\n[bold]{q['OrderPriority']}[/]: priority /price * /qty")
    console.print("  published " + " ".join(p.published_order) + "  →  delivered "
                  + " ".join(f"{n}({p.values[n]:g})" for n in p.delivered_order))

    b = report.barrier
    console.print(f"\n[bold]{q['Settlements']}[/]: barrier /type = 'end-of-day'")
    console.print(f"  the barrier waited for {b.acked_before_barrier} of {b.earlier} earlier "
                  f"trades to be acked, held back later trades "
                  f"({b.later_delivered_before_barrier} delivered before it), then went to "
                  f"{len(b.barrier_reached)} consumers: {', '.join(b.barrier_reached)}")

    f = report.fairness
    table = Table(title=f"{q['Work']}: proportional fairness", title_justify="left")
    for column in ("consumer", "max_backlog", "leased", "ratio"):
        table.add_column(column, justify="left" if column == "consumer" else "right")
    for name, backlog in f.max_backlog.items():
        leased = f.leased[name]
        table.add_row(name, str(backlog), str(leased), f"{leased / backlog:.2f}")
    console.print()
    console.print(table)

    table = Table(title="ORDERS: one publish, many queues", title_justify="left")
    for column in ("published to", "journal", "enqueued by"):
        table.add_column(column)
    for route in report.orders:
        table.add_row(route.published_to, route.journal, ", ".join(route.queues))
    console.print()
    console.print(table)
    console.print(f"  (names end in _{report.run} in this run)")

    coordinator = ("the demo's coordinator stopped with it" if report.own_coordinator
                   else f"coordinator {report.coordinator} keeps serving the queues")
    console.print(f"\n[bold]Look around[/] (the stack is still up; {coordinator}):")
    from layer.settings import Settings

    hint = path_hint()
    if hint:
        console.print(f"  {hint}", soft_wrap=True)
    defaults = Settings.model_construct()
    env = [f"{name}={value}" for name, value, default in (
        ("QLAYER_BOOTSTRAP_SERVERS", report.bootstrap_servers, defaults.bootstrap_servers),
        ("QLAYER_DATABASE_URL", report.database_url, defaults.database_url),
        ("QLAYER_TOPIC_PREFIX", report.topic_prefix, defaults.topic_prefix)) if value != default]
    if env:
        console.print(f"  export {' '.join(env)}", soft_wrap=True)
    looks = Table.grid(padding=(0, 3))
    looks.add_row("  qlayer stats", "every queue's depth and counters")
    looks.add_row(f"  qlayer view {q['FailedJobs']}", "what waits in a queue (the dead letters)")
    looks.add_row(f"  qlayer dlq list {q['Jobs']}", "the dead letters and their reasons")
    if report.own_coordinator:
        looks.add_row("  qlayer coordinator run", "keep the queues going")
    console.print(looks)
    console.print("[bold]Stop[/]: qlayer dev down")


def path_hint(argv0: str | None = None, path: str | None = None) -> str | None:
    """How to run `qlayer` by that name, when this one is not what the shell finds.

    `make demo` installs qlayer into .venv, which is not on PATH: the commands printed below
    would fail with "command not found" without this line. Nothing is installed globally.
    """
    here = Path(argv0 if argv0 is not None else sys.argv[0]).resolve()
    if here.name != "qlayer":
        return None  # run as `python -m layer_cli.main`: no script to point at
    found = shutil.which("qlayer", path=path)
    if found is not None and Path(found).resolve() == here:
        return None
    bin_dir = here.parent
    try:
        shown = bin_dir.relative_to(Path.cwd())
    except ValueError:
        shown = bin_dir
    return (f"qlayer is in {shown}, not on your PATH: run `source {shown}/activate` "
            f"(or call {shown}/qlayer)")
