"""`qlayer pipeline lifecycle | reconcile | views | metrics`: the Spark jobs (docs/pipeline.md).

Each command starts a local Spark session (``--master``, default ``local[2]``), runs one job
with `layer.pipeline.jobs.run_job` and prints what it did. Exit statuses: 0 done, 1 error,
2 usage error, 3 ``reconcile`` found a violation.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer

from layer.domain.errors import QlayerError
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

# layer.pipeline.jobs imports PySpark (about 0.15 s, and numpy): each command imports what it
# uses when it runs, so `qlayer --help` and the other commands start without it.
if TYPE_CHECKING:
    from layer.pipeline.jobs import EventSource, Job, JobResult, StreamOptions

app = typer.Typer(
    help="Spark jobs over the events topic and the journals: lifecycle, reconcile, views, "
    "metrics.",
    no_args_is_help=True,
)


class PipelineFailed(QlayerError):
    """A Spark job failed (Kafka unreachable, Maven missing, ...); the message says which."""


KafkaOption = Annotated[list[str] | None, typer.Option(
    "--kafka-option", metavar="KEY=VALUE",
    help="A Kafka Java client setting for Spark's source (security.protocol=SASL_SSL); "
    "repeatable.")]
Master = Annotated[str, typer.Option("--master", help="The Spark master.")]
Start = Annotated[str | None, typer.Option(
    "--since", "--start", help="Read from this time on: epoch milliseconds, an ISO-8601 time "
    "(UTC if no zone) or a length before now (30m, 1h, 2d). Only this range is read from "
    "Kafka.")]
End = Annotated[str | None, typer.Option(
    "--until", "--end", help="Read up to this time, exclusive: the same forms as --since.")]
Output = Annotated[str | None, typer.Option(
    "--output", help="Write the table here: a directory (Parquet) or a PostgreSQL URL "
    "(postgresql://user:pw@host/db or jdbc:postgresql://...).")]
Table = Annotated[str | None, typer.Option(
    "--table", help="The Postgres table to write (default qlayer_<job>).")]
Stream = Annotated[bool, typer.Option(
    "--stream", help="Structured streaming: keep the output up to date from new events.")]
Checkpoint = Annotated[str | None, typer.Option(
    "--checkpoint", help="With --stream: the directory keeping the stream's Kafka offsets "
    "and state; a second run goes on where the first stopped.")]
AvailableNow = Annotated[bool, typer.Option(
    "--available-now", help="With --stream: process the events there are, then stop.")]
Trigger = Annotated[str, typer.Option(
    "--trigger", help="With --stream: how often a micro-batch runs ('30 seconds').")]
Limit = Annotated[int, typer.Option("--limit", min=1, help="Show at most this many rows.")]
Journal = Annotated[str | None, typer.Option(
    "--journal", help="The queue's underlying topic (or its regular expression), where the "
    "payloads are [default: the queue's stored underlying_topic, read from PostgreSQL].")]


def _journal(queue: str, journal: str | None, database_url: str | None,
             bootstrap_servers: str | None, topic_prefix: str | None) -> str:
    """--journal, else the stored definition's underlying_topic: the one place it is named
    already, so the operator need not repeat it (nor get it wrong)."""
    if journal is not None:
        return journal
    from layer.services.queues import QueueService  # PostgreSQL only when it is needed

    settings = load_settings(database_url, bootstrap_servers, topic_prefix)
    try:
        with QueueService.from_settings(settings) as service:
            return service.journal_of(queue)
    except QlayerError as exc:
        raise PipelineFailed(f"{exc}; or name the journal with --journal TOPIC") from exc


def _millis(option: str, value: str | None, now_ms: int) -> int | None:
    from layer.pipeline.timerange import TimeRangeError, parse_instant

    if value is None:
        return None
    try:
        return parse_instant(value, now_ms)
    except TimeRangeError as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from None


def _source(bootstrap_servers: str | None, topic_prefix: str | None,
            kafka_option: list[str] | None) -> EventSource:
    from layer.pipeline.io import java_kafka_settings
    from layer.pipeline.jobs import EventSource

    settings = load_settings(None, bootstrap_servers, topic_prefix)
    pairs = [item.partition("=") for item in kafka_option or []]
    bad = [key for key, sep, _ in pairs if not sep]
    if bad:
        raise typer.BadParameter(f"takes KEY=VALUE; got {', '.join(bad)}",
                                 param_hint="--kafka-option")
    # The same kafka: settings as every other client (SASL, TLS), in the Java client's names;
    # --kafka-option (Java names already) wins.
    java, left_out = java_kafka_settings(settings.kafka)
    if left_out:
        typer.echo(f"note: kafka: settings with no Spark equivalent are not passed to the "
                   f"source: {', '.join(left_out)}", err=True)
    return EventSource(settings.bootstrap_servers, settings.topic_prefix,
                       {**java, **{key: value for key, _, value in pairs}})


def _stream(stream: bool, checkpoint: str | None, available_now: bool, trigger: str
            ) -> StreamOptions | None:
    from layer.pipeline.jobs import StreamOptions

    if not stream:
        if checkpoint is not None or available_now:
            raise typer.BadParameter("--checkpoint and --available-now go with --stream",
                                     param_hint="--stream")
        return None
    if checkpoint is None:
        raise typer.BadParameter("--stream needs --checkpoint DIR", param_hint="--checkpoint")
    return StreamOptions(checkpoint, available_now, trigger)


def _run(job: Job, source: EventSource, master: str, *, start: str | None = None,
         end: str | None = None, output: str | None = None, table: str | None = None,
         stream: StreamOptions | None = None, limit: int = 100) -> JobResult:
    from layer.pipeline.jobs import SessionOptions, run_job

    now_ms = int(time.time() * 1000)  # one "now" for both ends of a relative range
    start_ms, end_ms = _millis("--since", start, now_ms), _millis("--until", end, now_ms)
    if start_ms is not None and end_ms is not None and end_ms <= start_ms:
        raise typer.BadParameter(f"the range ends ({end}) before it starts ({start})",
                                 param_hint="--until")
    try:
        return run_job(job, source, session=SessionOptions(master), start_ms=start_ms,
                       end_ms=end_ms, output=output, table=table, stream=stream, limit=limit)
    except QlayerError:
        raise
    except Exception as exc:
        # Spark's errors are Java stack traces: the first line names the cause.
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise PipelineFailed(f"the {type(job).__name__.removesuffix('Job').lower()} job "
                             f"failed: {first}") from exc


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    return value


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.6f}".rstrip("0")
    return str(_json_value(value))


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}ms" if value < 10_000 else f"{value / 1000:.1f}s"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _metrics_table(rows: list[dict[str, Any]]) -> Any:
    """The figures people look at first; --json or --output has every column."""
    table = new_table("queue", "window (UTC)", "enq", "deliv", "acked", "ack/s", "redeliv",
                      "dead", "wait p50/p99", "in queue p50/p99", "processing p50/p99/p99.9",
                      "acks by consumer", title="metrics per window")
    for r in rows:
        start, end = r["window_start"], r["window_end"]
        consumers = ", ".join(f"{c['consumer_id']} {100 * c['share']:.0f}%"
                              for c in (r["consumers"] or [])[:3])
        if len(r["consumers"] or []) > 3:
            consumers += ", ..."
        table.add_row(
            r["queue"], f"{start:%Y-%m-%d %H:%M:%S}-{end:%H:%M:%S}", str(r["enqueued"]),
            str(r["delivered"]), str(r["acked"]), f"{r['throughput_per_s']:.1f}",
            _percent(r["redelivery_rate"]), _percent(r["dead_letter_rate"]),
            f"{_ms(r['wait_ms_p50'])} / {_ms(r['wait_ms_p99'])}",
            f"{_ms(r['time_in_queue_ms_p50'])} / {_ms(r['time_in_queue_ms_p99'])}",
            f"{_ms(r['processing_ms_p50'])} / {_ms(r['processing_ms_p99'])} / "
            f"{_ms(r['processing_ms_p999'])}",
            consumers or "-")
    return table


def _show(result: JobResult, json_out: bool, title: str) -> None:
    stream = result.stream
    if json_out:
        document: dict[str, Any] = {"job": result.job, "output": result.output}
        if stream is not None:
            document["stream"] = {"micro_batches": stream.batches, "new_events": stream.events}
        else:
            document["rows"] = _json_value(result.rows)
        emit_json(document)
        return
    if stream is not None:
        typer.echo(f"{result.job}: {stream.batches} micro-batch(es), {stream.events} new "
                   f"event record(s); output {result.output}")
        return
    if result.rows and result.job == "metrics":
        show(_metrics_table(result.rows))
    elif result.rows:
        table = new_table(*result.rows[0].keys(), title=title)
        for row in result.rows:
            table.add_row(*[_cell(v) for v in row.values()])
        show(table)
    else:
        typer.echo(f"{title}: no rows")
    if result.output is not None:
        typer.echo(f"written to {result.output}")


@app.command("lifecycle")
def lifecycle(
    queue: Annotated[str | None, typer.Option("--queue", help="Only this queue.")] = None,
    start: Start = None, end: End = None, output: Output = None, table: Table = None,
    stream: Stream = False, checkpoint: Checkpoint = None, available_now: AvailableNow = False,
    trigger: Trigger = "1 minute", master: Master = "local[2]", json_out: JsonOut = False,
    bootstrap_servers: BootstrapServers = None, topic_prefix: TopicPrefix = None,
    kafka_option: KafkaOption = None,
) -> None:
    """One row per (queue, bookmark): enqueue time, every delivery, outcome, latencies.

    Prints the entries per queue and outcome; --output writes the whole table.
    """
    from layer.pipeline.jobs import LifecycleJob

    result = _run(LifecycleJob(queue), _source(bootstrap_servers, topic_prefix, kafka_option),
                  master, start=start, end=end, output=output, table=table,
                  stream=_stream(stream, checkpoint, available_now, trigger))
    _show(result, json_out, "entries by outcome")


@app.command("reconcile")
def reconcile(
    queue: Annotated[str, typer.Argument(help="The queue to audit.")],
    journal: Journal = None,
    start: Start = None, end: End = None, output: Output = None, table: Table = None,
    master: Master = "local[2]", json_out: JsonOut = False,
    bootstrap_servers: BootstrapServers = None, topic_prefix: TopicPrefix = None,
    kafka_option: KafkaOption = None, database_url: DatabaseUrl = None,
) -> None:
    """Prove every journal record the queue admitted in [start, end) reached exactly one
    outcome or is pending, and that the journal, the events and PostgreSQL's state of each
    entry agree; list every violation. Exit status 3 when there is one.
    """
    journal = _journal(queue, journal, database_url, bootstrap_servers, topic_prefix)
    from layer.pipeline.jobs import EXIT_VIOLATIONS, ReconcileJob

    # qlayer's own PostgreSQL is the third source: what it says of each entry.
    store = load_settings(database_url, bootstrap_servers, topic_prefix).database_url
    result = _run(ReconcileJob(queue, journal, store),
                  _source(bootstrap_servers, topic_prefix, kafka_option), master, start=start,
                  end=end, output=output, table=table)
    report = result.report
    assert report is not None
    if json_out:
        emit_json({"queue": report.queue, "done": report.done, "pending": report.pending,
                   "ok": report.ok, "output": result.output,
                   "violations": [{"bookmark": v.bookmark, "violation": v.violation}
                                  for v in report.violations]})
    else:
        typer.echo(f"{report.queue}: {report.done} done, {report.pending} pending, "
                   f"{len(report.violations)} violations")
        for v in report.violations:
            typer.echo(f"{v.violation}\t{v.queue}\t{v.bookmark}")
    if result.exit_status == EXIT_VIOLATIONS:
        raise typer.Exit(EXIT_VIOLATIONS)


@app.command("views")
def views(
    queue: Annotated[str, typer.Argument(help="The queue to aggregate.")],
    field: Annotated[list[str], typer.Option(
        "--field", help="A projection field, AMPS style: /region or "
        "'SUM(/price * /qty) AS /total'; repeatable, in output order.")],
    group_by: Annotated[list[str] | None, typer.Option(
        "--group-by", help="A grouping field or expression (/region); repeatable.")] = None,
    where: Annotated[str | None, typer.Option(
        "--where", help="Only entries whose payload matches this filter expression.")] = None,
    include_leased: Annotated[bool, typer.Option(
        "--include-leased", help="Every pending entry, leased and delayed ones too (default: "
        "the available ones only).")] = False,
    as_of: Annotated[str | None, typer.Option(
        "--as-of", help="The queue as it was then: epoch ms or ISO-8601 (default now).")] = None,
    start: Start = None, end: End = None,
    output: Output = None, table: Table = None, stream: Stream = False,
    checkpoint: Checkpoint = None, available_now: AvailableNow = False,
    trigger: Trigger = "1 minute", master: Master = "local[2]", limit: Limit = 100,
    json_out: JsonOut = False, bootstrap_servers: BootstrapServers = None,
    topic_prefix: TopicPrefix = None, kafka_option: KafkaOption = None,
    journal: Journal = None, database_url: DatabaseUrl = None,
) -> None:
    """An AMPS view over the queue: aggregates of the payloads of its available entries
    (pending, not leased), grouped by fields or expressions.
    """
    journal = _journal(queue, journal, database_url, bootstrap_servers, topic_prefix)
    from layer.pipeline.jobs import ViewsJob

    job = ViewsJob(queue, journal, tuple(field), tuple(group_by or ()), where, include_leased,
                   _millis("--as-of", as_of, int(time.time() * 1000)))
    result = _run(job, _source(bootstrap_servers, topic_prefix, kafka_option), master,
                  start=start, end=end, output=output, table=table,
                  stream=_stream(stream, checkpoint, available_now, trigger), limit=limit)
    _show(result, json_out, f"view of {queue}")


@app.command("metrics")
def metrics(
    queue: Annotated[str | None, typer.Option("--queue", help="Only this queue.")] = None,
    window: Annotated[str, typer.Option(
        "--window", help="Tumbling window length, a Spark interval: '1 minute', "
        "'10 seconds', '1 hour'.")] = "1 minute",
    start: Start = None, end: End = None, output: Output = None, table: Table = None,
    stream: Stream = False, checkpoint: Checkpoint = None, available_now: AvailableNow = False,
    trigger: Trigger = "1 minute", master: Master = "local[2]", limit: Limit = 100,
    json_out: JsonOut = False, bootstrap_servers: BootstrapServers = None,
    topic_prefix: TopicPrefix = None, kafka_option: KafkaOption = None,
) -> None:
    """Per queue and window: throughput, latency percentiles (p50/p99/p99.9 of wait, time in
    queue, processing), redelivery and dead-letter rates, each consumer's share of acks.
    """
    from layer.pipeline.jobs import MetricsJob, PipelineUsageError, check_window

    try:
        check_window(window)
    except PipelineUsageError as exc:
        raise typer.BadParameter(str(exc), param_hint="--window") from None
    result = _run(MetricsJob(queue, window),
                  _source(bootstrap_servers, topic_prefix, kafka_option), master, start=start,
                  end=end, output=output, table=table,
                  stream=_stream(stream, checkpoint, available_now, trigger), limit=limit)
    _show(result, json_out, "metrics per window")
