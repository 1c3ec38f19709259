"""The `qlayer` command: the operator's tool.

Start-up time matters (every command pays it): the command modules import the heavy parts
(SQLAlchemy, the Kafka client, Avro, PySpark, pydantic models) inside the commands that use
them; tests/unit/cli/test_startup.py fails if one comes back at import time.
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from layer_cli import (
    console,
    consumers,
    coordinator,
    coordinators,
    db,
    dev,
    dlq,
    messages,
    pipeline,
    queue,
    security,
    stats,
    view,
)
from layer_cli.demo import demo as demo_command
from layer_cli.errors import run_friendly
from layer_cli.helpfix import install as install_help_fixes

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
app.add_typer(security.app, name="security")
app.command(name="demo")(demo_command)
app.command(name="console")(console.console)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"qlayer {version('qlayer')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("qlayer (not installed: no package metadata)")
        raise typer.Exit()


#: Commands that set up logging of their own (the coordinator logs librdkafka's lines, said
#: once a minute each, as an operator of a running service wants them).
_OWN_LOGGING = frozenset({"coordinator"})


def _client_lines(debug: bool) -> None:
    """librdkafka's lines (``layer.kafka.client``, `layer.kafka.logs.logged`): on stderr with
    ``--debug``, else not shown; a Kafka failure a command meets is its error message."""
    lines = logging.getLogger("layer.kafka.client")
    lines.propagate = False
    if debug:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        lines.addHandler(handler)
        lines.setLevel(logging.INFO)
    else:
        lines.addHandler(logging.NullHandler())


@app.callback()
def main(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option(
        "--debug", help="Show tracebacks on errors, and the Kafka client's own log lines.")
                     ] = False,
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True,
        help="Print the installed qlayer version and exit.")] = False,
) -> None:
    """AMPS-style message queues on Apache Kafka.

    Settings come from flags, then QLAYER_* environment variables, then the config file
    (QLAYER_CONFIG or ./qlayer.yaml).
    """
    if ctx.invoked_subcommand not in _OWN_LOGGING:
        _client_lines(debug)


def run() -> None:
    """Console-script entry point."""
    run_friendly(app, sys.argv[1:])


if __name__ == "__main__":
    run()
