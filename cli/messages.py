"""`qlayer publish` and `qlayer consume`: put lines on a queue, take messages off it by hand."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from layer.domain.errors import QlayerError
from layer_cli.output import BootstrapServers, DatabaseUrl, TopicPrefix, load_settings

# layer.services loads SQLAlchemy, the Kafka client and the domain models: the commands import
# what they use when they run, so `qlayer --help` and the other commands start without them.
if TYPE_CHECKING:
    from layer.services.messages import ConsumedMessage, Settle


def payload_text(value: bytes | None) -> str:
    """A key or value as a person reads it: the text when it is UTF-8, else its repr."""
    if value is None:
        return "-"
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return repr(value)


def payload_json(value: bytes | None) -> str | None:
    """A key or value in JSON output: the text when it is UTF-8, else its Python repr."""
    return None if value is None else payload_text(value)


_PAST = {"ack": "acked", "release": "released", "reject": "rejected"}


class NotText(QlayerError):
    """A line of publish's input is not UTF-8: the message names the line and what was sent."""


def _lines(file: Path | None) -> Iterator[str]:
    """The input's lines as text, read as bytes and decoded here: a line that is not UTF-8
    stops the publish with a `NotText` naming it (stdin's own decoding would raise a
    UnicodeDecodeError traceback, or under a C locale pass surrogates on to the encoder).

    Lines are text, not bytes published as is: `publish` is for JSON and text payloads, and
    a binary payload split at its 0x0a bytes would be wrong anyway.
    """
    name = "stdin" if file is None else str(file)
    published = 0
    # stdin in a nullcontext: the process's, not closed on the way out.
    source = file.open("rb") if file is not None else nullcontext(sys.stdin.buffer)
    with source as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise NotText(
                    f"{name} line {number} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at "
                    f"column {exc.start + 1}): publish sends each line as UTF-8 text; "
                    f"{published} message(s) from the lines before it were published, "
                    "nothing from it on") from None
            if line.rstrip("\r\n"):  # publish_lines skips empty lines
                published += 1
            yield line


def publish(
    queue_or_topic: Annotated[str, typer.Argument(
        help="A queue name (routed to its default_publish_target) or a topic.")],
    file: Annotated[Path | None, typer.Option(
        "--file", "-f", exists=True, dir_okay=False, help="Read lines from this file.")] = None,
    key: Annotated[str | None, typer.Option("--key", help="Record key of every line.")] = None,
    header: Annotated[list[str] | None, typer.Option(
        "--header", help="A record header name=value (repeatable).")] = None,
    deliver_at: Annotated[str | None, typer.Option(
        "--deliver-at", help="Hold until then: ISO-8601 with zone, or +30s / +5m.")] = None,
    expiration: Annotated[str | None, typer.Option(
        "--expiration", help="The message's own expiration, in place of the queue's: it "
        "leaves unprocessed once this old and not leased (e.g. 30s, 5m, 1h).")] = None,
    bootstrap_servers: BootstrapServers = None,
    database_url: DatabaseUrl = None,
    topic_prefix: TopicPrefix = None,
) -> None:
    """Publish one message per line of stdin (or --file)."""
    from layer.services.messages import (
        InvalidOptionError,
        parse_deliver_at_option,
        parse_expiration_option,
        parse_header_options,
        publish_lines,
    )

    # A value that cannot be used is a usage error (exit 2, typer's message), as a wrong flag
    # is, and is found before anything is read or sent.
    try:
        headers = parse_header_options(header or [])
        at = (None if deliver_at is None
              else parse_deliver_at_option(deliver_at, datetime.now(UTC)))
        ttl = None if expiration is None else parse_expiration_option(expiration)
    except InvalidOptionError as exc:
        raise typer.BadParameter(str(exc)) from None
    settings = load_settings(database_url, bootstrap_servers, topic_prefix)
    result = publish_lines(settings, queue_or_topic, _lines(file), key=key, headers=headers,
                           deliver_at=at, expiration=ttl)
    routed = "" if result.topic == queue_or_topic else f" (routed from {queue_or_topic})"
    typer.echo(f"published {result.count} message(s) to {result.topic}{routed}")


def _document(message: ConsumedMessage) -> dict[str, Any]:
    return {
        "queue": message.queue,
        "bookmark": message.bookmark,
        "delivery_count": message.delivery_count,
        "key": payload_json(message.key),
        "value": payload_json(message.value),
        "headers": {name: payload_json(value) for name, value in message.headers},
        "timestamp": None if message.timestamp is None else message.timestamp.isoformat(),
        "settled": message.settled,
    }


def consume(
    queue: Annotated[str, typer.Argument(help="The queue to consume from.")],
    max_backlog: Annotated[int, typer.Option(
        "--max-backlog", min=1, help="Messages held unsettled at once.")] = 1,
    count: Annotated[int | None, typer.Option(
        "--count", "-n", min=1, help="Stop after this many messages (default: Ctrl-C).")] = None,
    filter: Annotated[str | None, typer.Option(
        "--filter", help="Only messages matching this expression.")] = None,
    release: Annotated[bool, typer.Option(
        "--release", help="Release each message (back to the queue) instead of acking.")
    ] = False,
    reject: Annotated[bool, typer.Option(
        "--reject", help="Reject each message (to the dead-letter topic) instead of acking.")
    ] = False,
    reason: Annotated[str | None, typer.Option(
        "--reason", help="Reason recorded with --reject.")] = None,
    idle_timeout: Annotated[float | None, typer.Option(
        "--idle-timeout", min=0, help="Stop after this many seconds without a message.")
    ] = None,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object per message and line (JSON Lines), for "
        "scripts; no summary on stderr.")] = False,
    bootstrap_servers: BootstrapServers = None,
    database_url: DatabaseUrl = None,
    topic_prefix: TopicPrefix = None,
) -> None:
    """A debug consumer: prints each message and acks it (or --release / --reject).

    With --json, one JSON object per line (JSON Lines), one per message.
    """
    if release and reject:
        raise typer.BadParameter("give --release or --reject, not both")
    if reason is not None and not reject:
        raise typer.BadParameter("--reason goes with --reject")
    from layer.services.messages import consume as consume_messages

    settle: Settle = "release" if release else "reject" if reject else "ack"
    settings = load_settings(database_url, bootstrap_servers, topic_prefix)

    def show(message: ConsumedMessage) -> None:
        if json_out:
            typer.echo(json.dumps(_document(message)))
            return
        settled = _PAST.get(message.settled, message.settled)
        typer.echo(f"{message.bookmark}  delivery {message.delivery_count}  "
                   f"key={payload_text(message.key)}  {settled}")
        typer.echo(f"  {payload_text(message.value)}")

    try:
        handled = consume_messages(settings, queue, show, max_backlog=max_backlog, count=count,
                                   filter=filter, settle=settle, reason=reason,
                                   idle_timeout=idle_timeout)
    except KeyboardInterrupt:
        # The consumer was closed on the way out: what it held goes back to the queue.
        typer.echo("stopped", err=True)
        raise typer.Exit(130) from None
    if not json_out:
        typer.echo(f"{handled} message(s) {_PAST[settle]}", err=True)
