"""Shared pieces of the `qlayer` commands: settings flags, `--json`, rich tables, formats.

Read commands print a rich table for people, or with `--json` exactly one JSON document on
stdout for scripts (nothing else goes to stdout then).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.cells import cell_len
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from layer.domain.durations import format_duration

if TYPE_CHECKING:
    from layer.settings import Settings

DatabaseUrl = Annotated[str | None, typer.Option(
    "--database-url", help="PostgreSQL URL [env: QLAYER_DATABASE_URL]")]
BootstrapServers = Annotated[str | None, typer.Option(
    "--bootstrap-servers", help="Kafka bootstrap servers [env: QLAYER_BOOTSTRAP_SERVERS]")]
TopicPrefix = Annotated[str | None, typer.Option(
    "--topic-prefix", help="Prefix of qlayer's internal topics [env: QLAYER_TOPIC_PREFIX]")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print one JSON document, for scripts.")]

# Fields whose stored value is seconds and which people read as durations (`30s`, `5m`).
_DURATION_FIELDS = frozenset({"lease_period", "expiration", "initial", "maximum"})


def load_settings(
    database_url: str | None = None,
    bootstrap_servers: str | None = None,
    topic_prefix: str | None = None,
) -> Settings:
    """Flags win over QLAYER_* variables, which win over the config file."""
    from layer.settings import Settings  # pydantic-settings: only for commands that need it

    return Settings.load(database_url=database_url, bootstrap_servers=bootstrap_servers,
                         topic_prefix=topic_prefix)


def emit_json(document: Any) -> None:
    typer.echo(json.dumps(document, indent=2, sort_keys=False, default=str))


def new_table(*columns: str, title: str | None = None) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold")
    for index, column in enumerate(columns):
        # The first column names the thing (queue, consumer id) and is copied into commands:
        # keep it whole; the others fold rather than end in "…".
        table.add_column(column, overflow="fold", no_wrap=index == 0)
    return table


def table_console() -> Console:
    """A console for tables: the terminal's width, or a wide page when output is piped (a
    terminal-less 80 columns would fold wide tables such as `qlayer stats` beyond reading)."""
    out = Console()
    return out if out.is_terminal else Console(width=max(out.width, 200))


# Past this many rows a table prints plain (header, a rule, aligned columns, as `kubectl get`
# does): rich measures and wraps every cell, ~0.5 ms each, so a thousand queues' thirteen
# columns took 1.2 s to lay out; `plain_lines` takes 4 ms, and the plain lines suit grep and cut.
LONG_TABLE = 100


def show(*renderables: Any) -> None:
    console = table_console()
    for renderable in renderables:
        for part in _parts(renderable):
            if isinstance(part, Table) and part.row_count > LONG_TABLE:
                _print_plain(console, part)
            else:
                console.print(part)


def _parts(renderable: Any) -> list[Any]:
    """A group's members one by one, so a long table in it is seen as one."""
    if isinstance(renderable, Group):
        return [p for member in renderable.renderables for p in _parts(member)]
    return [renderable]


def _plain(cell: Any) -> str:
    """A cell's text without its markup (most cells have none: skip the parser for them)."""
    if isinstance(cell, Text):
        return cell.plain
    text = str(cell)
    return Text.from_markup(text).plain if "[" in text else text


def _print_plain(console: Console, table: Table) -> None:
    columns = table.columns
    header = [_plain(column.header) for column in columns]
    rows = [[_plain(cell) for cell in row]
            for row in zip(*(list(column.cells) for column in columns), strict=True)]
    if table.title:
        console.print(f"[bold]{escape(_plain(table.title))}[/] ({table.row_count} rows)")
    # soft_wrap: the terminal folds a line wider than itself; rich would re-wrap every line.
    console.print(plain_lines(header, rows, [c.justify for c in columns]), soft_wrap=True,
                  markup=False, highlight=False, emoji=False)


def plain_lines(header: list[str], rows: list[list[str]], justify: list[str]) -> str:
    """Columns two spaces apart under a header and a rule of dashes (tabulate's "simple"
    layout, which took 40 ms for a thousand rows here, ten times this); widths in terminal
    cells, so a wide character keeps its column aligned."""
    widths = [max(map(cell_len, column)) for column in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        out = []
        for cell, width, how in zip(cells, widths, justify, strict=True):
            pad = " " * (width - cell_len(cell))
            out.append(pad + cell if how == "right"
                       else pad[:len(pad) // 2] + cell + pad[len(pad) // 2:] if how == "center"
                       else cell + pad)
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(header), rule, *map(line, rows)])


def value_text(field: str, value: Any) -> str:
    """A definition value as a person reads it: durations as `30s`, none as `-`."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if field in _DURATION_FIELDS and isinstance(value, int | float):
        return format_duration(float(value))
    if isinstance(value, dict):
        return ", ".join(f"{k}: {value_text(k, v)}" for k, v in value.items())
    return str(value)


def age_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    return format_duration(round(seconds))


def time_text(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


def iso_or_none(epoch: float | None) -> str | None:
    """Times in JSON: ISO-8601 UTC with milliseconds, or null."""
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds")
