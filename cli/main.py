"""The `qlayer` command: the operator's tool.

Start-up time matters (every command pays it): the command modules import the heavy parts
(SQLAlchemy, the Kafka client, Avro, PySpark, pydantic models) inside the commands that use
them; tests/unit/cli/test_startup.py fails if one comes back at import time.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from typing import Annotated

import typer

from layer_cli.errors import run_friendly
from layer_cli.helpfix import install as install_help_fixes

install_help_fixes()


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


#: Every command and group, in the order `qlayer --help` lists them: its module in layer_cli
#: and the Typer app or function there. Imported when asked for: a command pays for its own
#: module only (`queue` loads YAML, `console` its pages; ~40 ms of every other command).
_PARTS: dict[str, tuple[str, str]] = {
    "dev": ("dev", "app"), "db": ("db", "app"), "coordinator": ("coordinator", "app"),
    "coordinators": ("coordinators", "coordinators"), "publish": ("messages", "publish"),
    "consume": ("messages", "consume"), "dlq": ("dlq", "app"), "view": ("view", "view"),
    "stats": ("stats", "stats"), "queue": ("queue", "app"), "consumers": ("consumers", "app"),
    "pipeline": ("pipeline", "app"), "security": ("security", "app"), "demo": ("demo", "demo"),
    "console": ("console", "console")}


def _part(name: str) -> typer.Typer | Callable[..., None]:
    module, attribute = _PARTS[name]
    part: typer.Typer | Callable[..., None] = getattr(
        importlib.import_module(f"layer_cli.{module}"), attribute)
    return part


def _new_app(names: list[str]) -> typer.Typer:
    built = typer.Typer(
        name="qlayer",
        help="AMPS-style message queues on Apache Kafka.",
        no_args_is_help=True,
        pretty_exceptions_enable=False,
    )
    for name in names:
        part = _part(name)
        if isinstance(part, typer.Typer):
            built.add_typer(part, name=name)
        else:
            built.command(name=name)(part)
    built.callback()(main)
    return built


def __getattr__(name: str) -> typer.Typer:
    """``app``, the whole command (what tests, docs and `qlayer --help` see), made on first
    use: a single command builds only itself (`_app_for`)."""
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    whole = globals()["app"] = _new_app(list(_PARTS))
    return whole


def _app_for(argv: list[str]) -> typer.Typer:
    """Only the command asked for, when it is one: typer reads every command's parameters
    (their annotations evaluated, 84 functions) before running any, 0.1 s of each start
    (issue 33). Help, a mistyped name or no command get the whole app, so what they say is
    unchanged."""
    first = next((a for a in argv if not a.startswith("-")), None)
    if first is None or first not in _PARTS:
        whole: typer.Typer = __getattr__("app")
        return whole
    return _new_app([first])


def run() -> None:
    """Console-script entry point."""
    run_friendly(_app_for(sys.argv[1:]), sys.argv[1:])


if __name__ == "__main__":
    run()
