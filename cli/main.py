"""The `qlayer` command: the operator's tool."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from cli import (
    consumers,
    coordinator,
    coordinators,
    db,
    dev,
    dlq,
    messages,
    pipeline,
    queue,
    stats,
    view,
)
from cli.demo import demo as demo_command
from cli.errors import run_friendly
from cli.helpfix import install as install_help_fixes

install_help_fixes()

app = typer.Typer(
    name="qlayer",
    help="AMPS-style message queues on Apache Kafka.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(dev.app, name="dev")
app.add_typer(db.app, name="db")
app.add_typer(coordinator.app, name="coordinator")
app.command(name="coordinators")(coordinators.coordinators)
app.command(name="publish")(messages.publish)
app.command(name="consume")(messages.consume)
app.add_typer(dlq.app, name="dlq")
app.command(name="view")(view.view)
app.command(name="stats")(stats.stats)
app.add_typer(queue.app, name="queue")
app.add_typer(consumers.app, name="consumers")
app.add_typer(pipeline.app, name="pipeline")
app.command(name="demo")(demo_command)


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    """AMPS-style message queues on Apache Kafka.

    Settings come from flags, then QLAYER_* environment variables, then the config file
    (QLAYER_CONFIG or ./qlayer.yaml).
    """


def run() -> None:
    """Console-script entry point."""
    run_friendly(app, sys.argv[1:])


if __name__ == "__main__":
    run()
