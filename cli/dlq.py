"""`qlayer dlq list | redrive | delete`: look at a queue's dead letters, send them back, or
drop them (a recorded skip: Kafka cannot delete one record)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from layer_cli.messages import payload_json, payload_text
from layer_cli.output import (
    BootstrapServers,
    DatabaseUrl,
    JsonOut,
    TopicPrefix,
    emit_json,
    load_settings,
    new_table,
    show,
)

# layer.services loads SQLAlchemy, the Kafka client and the domain models: the commands import
# what they use when they run, so `qlayer --help` and the other commands start without them.
if TYPE_CHECKING:
    from layer.services.messages import DeadLetter, RedriveResult

app = typer.Typer(help="A queue's dead letters: list them, redrive them, delete them.",
                  no_args_is_help=True)

Bookmarks = Annotated[list[str] | None, typer.Option(
    "--bookmark", metavar="TOPIC/PARTITION/OFFSET",
    help="Only the dead letter of this original bookmark, as `qlayer dlq list` shows it "
    "(repeatable).")]

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
    """The dead letters waiting for a redrive, oldest first, and their totals by reason.

    Each: why, from where (its original bookmark), after how many deliveries.
    """
    from layer.services.messages import list_dead_letters

    settings = load_settings(database_url, bootstrap_servers, topic_prefix)
    found = list_dead_letters(settings, queue, limit=limit)
    letters = found.letters
    if json_out:
        emit_json({"queue": queue, "dead_letter_topic": found.dead_letter_topic,
                   "total": found.total, "by_reason": found.by_reason,
                   "dead_letters": [_document(d) for d in letters]})
        return
    table = new_table("reason", "bookmark", "deliveries", "last consumer", "dead-lettered at",
                      "key", "value",
                      title=f"dead letters of {queue} (shown {len(letters)} of {found.total})")
    for letter in letters:
        info = letter.info
        assert info is not None  # list_dead_letters keeps this queue's letters only
        reason = info.reason if info.detail is None else f"{info.reason}: {info.detail}"
        table.add_row(reason, info.bookmark.format(), str(info.delivery_count),
                      info.last_consumer or "-", _when(info.dead_lettered_at_ms),
                      payload_text(letter.key), _preview(letter.value))
    reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(found.by_reason.items()))
    show(table, f"{found.total} dead letter(s) waiting" + (f": {reasons}" if reasons else ""))


@app.command("redrive")
def redrive_(
    queue: Annotated[str, typer.Argument(help="The queue whose dead letters to send back.")],
    rate: Annotated[float | None, typer.Option(
        "--rate", min=0.001, help="At most this many messages per second.")] = None,
    filter: Annotated[str | None, typer.Option(
        "--filter", help="Only dead letters whose payload matches this expression; the "
        "others stay for a later redrive.")] = None,
    bookmark: Bookmarks = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Count what would move; move nothing.")] = False,
    json_out: JsonOut = False,
    bootstrap_servers: BootstrapServers = None,
    database_url: DatabaseUrl = None,
    topic_prefix: TopicPrefix = None,
) -> None:
    """Re-publish dead letters to the queue's journal, each exactly once (also across runs).

    A second redrive moves what the first left (not selected by --filter or --bookmark) and
    what was dead-lettered since. Letters written without their value (reason too_large,
    header qlayer.dlq.value-omitted) are never moved: they are counted and kept, for
    `qlayer dlq delete --bookmark`.
    """
    settings = load_settings(database_url, bootstrap_servers, topic_prefix)
    result = _run(settings, queue, rate=rate, filter=filter, bookmarks=bookmark or [],
                  delete=False, dry_run=dry_run, json_out=json_out)
    if json_out:
        emit_json(_result_json(queue, result))
        return
    verb = "would move" if dry_run else "moved"
    where = ", ".join(f"{n} to {t}" for t, n in sorted(result.targets.items())) or "nothing"
    typer.echo(f"{verb} {result.moved} dead letter(s) of {queue} from "
               f"{result.dead_letter_topic}: {where}")
    _echo_rest(result)


@app.command("delete")
def delete_(
    queue: Annotated[str, typer.Argument(help="The queue whose dead letters to delete.")],
    filter: Annotated[str | None, typer.Option(
        "--filter", help="Only dead letters whose payload matches this expression.")] = None,
    bookmark: Bookmarks = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Count what would be deleted; delete nothing.")] = False,
    json_out: JsonOut = False,
    bootstrap_servers: BootstrapServers = None,
    database_url: DatabaseUrl = None,
    topic_prefix: TopicPrefix = None,
) -> None:
    """Delete the dead letters selected by --filter and/or --bookmark (a recorded skip).

    No redrive moves them and `dlq list` no longer shows them. Kafka cannot delete one
    record from a topic, so this is a recorded skip: the redrive position moves past them and
    the queue's other letters are copied past it (as a selective redrive does). The records
    stay in the topic until its retention removes them.
    """
    if filter is None and not bookmark:
        raise typer.BadParameter("say which: --filter EXPR and/or --bookmark "
                                 "TOPIC/PARTITION/OFFSET", param_hint="--filter/--bookmark")
    settings = load_settings(database_url, bootstrap_servers, topic_prefix)
    result = _run(settings, queue, rate=None, filter=filter, bookmarks=bookmark or [],
                  delete=True, dry_run=dry_run, json_out=json_out)
    if json_out:
        emit_json(_result_json(queue, result))
        return
    verb = "would delete" if dry_run else "deleted"
    typer.echo(f"{verb} {result.deleted} dead letter(s) of {queue} from "
               f"{result.dead_letter_topic}")
    _echo_rest(result)


def _run(settings: Any, queue: str, *, rate: float | None, filter: str | None,
         bookmarks: list[str], delete: bool, dry_run: bool, json_out: bool) -> RedriveResult:
    from layer.services.messages import InvalidOptionError, redrive

    with Progress(TextColumn("redrive {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=True, disable=json_out,
                  console=Console(stderr=True)) as bar:  # stdout stays the result only
        task = bar.add_task(queue, total=None)  # "redrive Q" also for a delete: one pass

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        try:
            return redrive(settings, queue, rate=rate, filter=filter, bookmarks=bookmarks,
                           delete=delete, dry_run=dry_run, progress=progress)
        except InvalidOptionError as exc:
            raise typer.BadParameter(str(exc)) from None


def _result_json(queue: str, result: RedriveResult) -> dict[str, Any]:
    return {"queue": queue, "dead_letter_topic": result.dead_letter_topic,
            "dry_run": result.dry_run, "scanned": result.scanned, "moved": result.moved,
            "deleted": result.deleted, "kept_for_later": result.carried,
            "skipped_by_filter": result.carried,
            "skipped_other_queues": result.skipped_other,
            "skipped_duplicates": result.skipped_duplicate,
            "skipped_value_omitted": result.value_omitted, "targets": result.targets}


def _echo_rest(result: RedriveResult) -> None:
    if result.carried:
        kept = "would be kept" if result.dry_run else "were kept"
        typer.echo(f"{result.carried} not selected {kept} for a later redrive")
    if result.skipped_duplicate:
        typer.echo(f"{result.skipped_duplicate} duplicate dead letter(s) were passed over")
    if result.value_omitted:
        kept = "would be kept" if result.dry_run else "were kept"
        typer.echo(f"{result.value_omitted} dead letter(s) without their value (too large to "
                   f"deliver: qlayer.dlq.value-omitted) cannot be redriven and {kept}; their "
                   "records are at their original bookmarks in the journal until retention "
                   "(`qlayer dlq delete --bookmark` drops the letters)")
