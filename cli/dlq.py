"""`qlayer dlq list | redrive`: look at a queue's dead letters, and send them back."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cli.messages import payload_json, payload_text
from cli.output import (
    BootstrapServers,
    DatabaseUrl,
    JsonOut,
    TopicPrefix,
    emit_json,
    load_settings,
    new_table,
    show,
)
from layer.services.messages import DeadLetter, list_dead_letters, redrive

app = typer.Typer(help="A queue's dead letters: list them, redrive them.", no_args_is_help=True)

_PREVIEW = 60


def _preview(value: bytes | None) -> str:
    text = payload_text(value)
    return text if len(text) <= _PREVIEW else text[: _PREVIEW - 1] + "…"


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")


def _document(letter: DeadLetter) -> dict[str, Any]:
    info = letter.info
    return {
        "position": letter.position,
        "reason": None if info is None else info.reason,
        "detail": None if info is None else info.detail,
        "bookmark": None if info is None else info.bookmark.format(),
        "delivery_count": None if info is None else info.delivery_count,
        "last_consumer": None if info is None else info.last_consumer,
        "dead_lettered_at": None if info is None else datetime.fromtimestamp(
            info.dead_lettered_at_ms / 1000, UTC).isoformat(timespec="milliseconds"),
        "key": payload_json(letter.key),
        "value": payload_json(letter.value),
        "headers": {name: payload_json(value) for name, value in letter.headers},
    }


@app.command("list")
def list_(
    queue: Annotated[str, typer.Argument(help="The queue whose dead letters to show.")],
    limit: Annotated[int, typer.Option("--limit", min=1, help="Show at most this many.")] = 100,
    json_out: JsonOut = False,
    bootstrap_servers: BootstrapServers = None,
    database_url: DatabaseUrl = None,
    topic_prefix: TopicPrefix = None,
) -> None:
    """The queue's dead letters, oldest first: why, from where, after how many deliveries."""
    settings = load_settings(database_url, bootstrap_servers, topic_prefix)
    letters = list_dead_letters(settings, queue, limit=limit)
    if json_out:
        emit_json({"queue": queue, "dead_letters": [_document(d) for d in letters]})
        return
    table = new_table("reason", "bookmark", "deliveries", "last consumer", "dead-lettered at",
                      "key", "value", title=f"dead letters of {queue} ({len(letters)})")
    for letter in letters:
        info = letter.info
        assert info is not None  # list_dead_letters keeps this queue's letters only
        reason = info.reason if info.detail is None else f"{info.reason}: {info.detail}"
        table.add_row(reason, info.bookmark.format(), str(info.delivery_count),
                      info.last_consumer or "-", _when(info.dead_lettered_at_ms),
                      payload_text(letter.key), _preview(letter.value))
    show(table)


@app.command("redrive")
def redrive_(
    queue: Annotated[str, typer.Argument(help="The queue whose dead letters to send back.")],
    rate: Annotated[float | None, typer.Option(
        "--rate", min=0.001, help="At most this many messages per second.")] = None,
    filter: Annotated[str | None, typer.Option(
        "--filter", help="Only dead letters whose payload matches this expression.")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Count what would move; move nothing.")] = False,
    json_out: JsonOut = False,
    bootstrap_servers: BootstrapServers = None,
    database_url: DatabaseUrl = None,
    topic_prefix: TopicPrefix = None,
) -> None:
    """Re-publish dead letters to the queue's journal, each exactly once (also across runs).

    A second redrive moves only what was dead-lettered since the first.
    """
    settings = load_settings(database_url, bootstrap_servers, topic_prefix)
    with Progress(TextColumn("redrive {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=True, disable=json_out,
                  console=Console(stderr=True)) as bar:  # stdout stays the result only
        task = bar.add_task(queue, total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        result = redrive(settings, queue, rate=rate, filter=filter, dry_run=dry_run,
                         progress=progress)
    if json_out:
        emit_json({"queue": queue, "dead_letter_topic": result.dead_letter_topic,
                   "dry_run": result.dry_run, "scanned": result.scanned,
                   "moved": result.moved, "skipped_by_filter": result.skipped_filter,
                   "skipped_other_queues": result.skipped_other,
                   "skipped_duplicates": result.skipped_duplicate, "targets": result.targets})
        return
    verb = "would move" if dry_run else "moved"
    where = ", ".join(f"{n} to {t}" for t, n in sorted(result.targets.items())) or "nothing"
    typer.echo(f"{verb} {result.moved} dead letter(s) of {queue} from "
               f"{result.dead_letter_topic}: {where}")
    if result.skipped_filter:
        typer.echo(f"{result.skipped_filter} did not match the filter and were passed over")
    if result.skipped_duplicate:
        typer.echo(f"{result.skipped_duplicate} duplicate dead letter(s) were passed over")
