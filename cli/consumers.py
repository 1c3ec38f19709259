"""`qlayer consumers [QUEUE]` and `qlayer consumers evict ID`."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from typer.core import TyperGroup

from layer_cli.output import (
    DatabaseUrl,
    JsonOut,
    age_text,
    emit_json,
    iso_or_none,
    load_settings,
    new_table,
    show,
)

# layer.services loads SQLAlchemy, the Kafka client and the domain models: imported by the
# commands that use them, so `qlayer --help` and other commands start without them.
if TYPE_CHECKING:
    from layer.services.consumers import ConsumerInfo, ConsumerService


class _QueueOrCommand(TyperGroup):
    """`consumers [QUEUE]` beside `consumers evict ID`: click would read `evict` as the QUEUE
    argument, so a first word that names a subcommand is taken as that subcommand."""

    # `consumers Jobs --json`: options may follow the QUEUE argument.
    allow_interspersed_args = True

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] in self.commands:
            super(TyperGroup, self).parse_args(ctx, [])  # the group's own defaults
            ctx._protected_args, ctx.args = args[:1], args[1:]
            return args[1:]
        return super().parse_args(ctx, args)


app = typer.Typer(help="List the consumers of queues; evict one.", invoke_without_command=True,
                  cls=_QueueOrCommand)


def _service(database_url: str | None) -> ConsumerService:
    from layer.services.consumers import ConsumerService

    return ConsumerService.from_settings(load_settings(database_url))


@app.callback()
def consumers(
    ctx: typer.Context,
    queue: Annotated[str | None, typer.Argument(
        help="Only the consumers attached to this queue (by name or regex).")] = None,
    database_url: DatabaseUrl = None,
    json_out: JsonOut = False,
) -> None:
    """List consumers (of every queue, or of QUEUE).

    Shows id, session, queue, backlog limit, filter, last heartbeat, the shard holding the
    session with the coordinator process running it, and the delivery topic. A regex session
    over queues of several shards shows the credit its consumer granted each shard
    ("credit 0:1, 3:1") and each of those shards with its process. A session that settles in
    Kafka transactions (exactly-once processing) is marked "(transactional)" after its id;
    --json gives its transactional_id.
    """
    if ctx.invoked_subcommand is not None:
        return
    with _service(database_url) as service:
        found = service.list_consumers(queue)
    if json_out:
        emit_json([_json(c) for c in found])
        return
    if not found:
        typer.echo("no consumers" + (f" attached to {queue}" if queue else ""))
        return
    table = new_table("consumer", "principal", "session", "queue", "backlog limit", "filter",
                      "last heartbeat", "shard (coordinator)", "delivery topic")
    for c in found:
        limit = "-" if c.backlog_limit is None else str(c.backlog_limit)
        if c.credit is not None:
            # One backlog over several shards: the credit each holds (protocol 8).
            limit = "credit " + ", ".join(f"{p.shard}:{p.grant}" for p in c.credit)
        elif c.max_backlog is None:
            limit += " (default)"
        heartbeat = f"{age_text(c.heartbeat_age)} ago"
        if c.evict_requested_at is not None:
            heartbeat += " [yellow](eviction requested)[/]"
        table.add_row(c.consumer_id, c.principal or "-",
                      c.session_id[:8] + (" (transactional)" if c.transactional_id else ""),
                      c.queue + (" (regex)" if c.is_regex else ""),
                      limit, c.filter or "-", heartbeat, _shard_text(c), c.delivery_topic)
    show(table)


def _shard_text(c: ConsumerInfo) -> str:
    if c.credit is not None:
        return ", ".join(f"{p.shard} ({escape(p.owner_id)})" if p.owner_id is not None
                         else f"{p.shard} [yellow](no coordinator runs it)[/]"
                         for p in c.credit)
    if c.shard is None:
        return "-"
    if c.owner_id is None:
        return f"{c.shard} [yellow](no coordinator runs it)[/]"
    return f"{c.shard} ({escape(c.owner_id)})"


def _json(c: ConsumerInfo) -> dict[str, object]:
    document = asdict(c)
    for key in ("subscribed_at", "last_heartbeat_at", "evict_requested_at"):
        document[key] = iso_or_none(document[key])
    document["heartbeat_age"] = round(c.heartbeat_age, 3)
    return document


@app.command()
def evict(
    consumer_id: Annotated[str, typer.Argument(metavar="ID", help="Consumer id.")],
    wait: Annotated[bool, typer.Option(
        "--wait", help="Wait until the coordinator has removed the consumer.")] = False,
    timeout: Annotated[float, typer.Option(
        help="Seconds to wait with --wait before giving up (exit 1).")] = 30.0,
    database_url: DatabaseUrl = None,
) -> None:
    """Evict a consumer: its leases break at once and it is told SessionEnded(EVICTED).

    The entries it held go to the other consumers of the queue.
    """
    with _service(database_url) as service:
        result = service.evict(consumer_id, wait=timeout if wait else None)
    if result.gone:
        typer.echo(f"evicted consumer {consumer_id}; its leases were broken")
    else:
        typer.echo(f"eviction of consumer {consumer_id} requested; the coordinator breaks its "
                   "leases within seconds (--wait waits for it)")
