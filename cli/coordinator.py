"""`qlayer coordinator run`: the service that turns journals into queues."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

app = typer.Typer(help="Run the qlayer coordinator.", no_args_is_help=True)


@app.command()
def run(
    bootstrap_servers: Annotated[str | None, typer.Option(
        help="Kafka bootstrap servers [env: QLAYER_BOOTSTRAP_SERVERS]")] = None,
    database_url: Annotated[str | None, typer.Option(
        help="PostgreSQL URL [env: QLAYER_DATABASE_URL]")] = None,
    topic_prefix: Annotated[str | None, typer.Option(
        help="Prefix of qlayer's internal topics [env: QLAYER_TOPIC_PREFIX]")] = None,
    owner_id: Annotated[str | None, typer.Option(
        help="This process's name in the ownership table (default: host-pid-random)")] = None,
    group_session_timeout: Annotated[float, typer.Option(
        min=1.0, help="Seconds without a heartbeat after which Kafka gives this process's "
        "shards to the other coordinators (the broker accepts 6 to 1800 by default)")] = 6.0,
    instance_id: Annotated[str | None, typer.Option(
        envvar="QLAYER_INSTANCE_ID",
        help="A stable name for this process among the coordinators (Kafka static "
        "membership): restarted under the same name (systemd, a StatefulSet pod), it takes "
        "its shards back at once instead of after --group-session-timeout; but a stopped "
        "process's shards then go to the others only after that timeout. Unique per "
        "process")] = None,
    session_timeout: Annotated[float, typer.Option(
        help="Session timeout (s) for consumers that do not give one")] = 30.0,
    transactions: Annotated[bool, typer.Option(
        "--transactions/--no-transactions", help="Write deliveries and events in Kafka "
        "transactions, so a paused, replaced coordinator's late writes are fenced in Kafka "
        "too (PostgreSQL's epoch already fences its decisions); every iteration then waits "
        "for the transaction's commit (docs/coordinator.md)")] = False,
    payload_budget_mb: Annotated[int, typer.Option(
        help="MiB of journal records kept in memory; past it records are re-read from the "
        "journal when they come up for delivery")] = 32,
    core: Annotated[str, typer.Option(
        envvar="QLAYER_CORE",
        help="Which shard core decides: native (the Rust port, built by make install), "
        "python (the reference), or auto (native when installed)")] = "auto",
    metrics_port: Annotated[int | None, typer.Option(
        envvar="QLAYER_METRICS_PORT", min=0, max=65535,
        help="Serve Prometheus metrics (/metrics), /healthz and /readyz on this port "
        "(docs/operations.md, \"Metrics and health\"); off when not given")] = None,
    metrics_host: Annotated[str, typer.Option(
        help="The address the metrics port listens on")] = "0.0.0.0",
    require_identity: Annotated[bool, typer.Option(
        "--require-identity/--no-require-identity", envvar="QLAYER_REQUIRE_IDENTITY",
        help="Refuse a Subscribe that carries no session secret (protocol 5; the Python SDK sends "
        "one). Off: a consumer of protocol 1 to 4 still subscribes, as an "
        "unproven session that can never take over or act for a proven one "
        "(docs/security.md, 'Session identity')")] = False,
    delivery_topic_retention: Annotated[str, typer.Option(
        envvar="QLAYER_DELIVERY_TOPIC_RETENTION",
        help="How long a consumer's delivery topic (<prefix>delivery.<consumer id>) stays "
        "after the last session that used it ended (closed, timed out, evicted), e.g. 30m, "
        "1h; then the process running shard 0 deletes it. 0: never delete "
        "(docs/operations.md, 'Delivery topics')")] = "1h",
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR")] = "INFO",
    log_format: Annotated[str, typer.Option(
        envvar="QLAYER_LOG_FORMAT",
        help="text, or json: one JSON object per line with time, level, logger, message "
        "and the line's queue, shard and epoch fields")] = "text",
) -> None:
    """Run a coordinator process until SIGTERM or Ctrl-C.

    Every process joins the coordinators' Kafka consumer group and runs the shards the group
    assigns it; start more processes (on this or other machines) to spread the queues, up to
    one per shard. A process with no shard is a hot standby. `qlayer coordinators` shows who
    runs what.
    """
    from layer.coordinator.options import CORES, CoordinatorOptions, default_owner_id
    from layer.coordinator.process import CoordinatorProcess
    from layer.domain.native import native_available

    if core not in CORES:
        raise typer.BadParameter(f"must be one of {', '.join(CORES)}", param_hint="--core")
    if core == "native" and not native_available():
        raise typer.BadParameter("the native core is not installed: run `make install` (or "
                                 "`pip install ./native`), or use --core python",
                                 param_hint="--core")

    from layer.domain.durations import parse_duration

    try:
        retention = parse_duration(delivery_topic_retention)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--delivery-topic-retention") from exc
    if retention < 0:
        raise typer.BadParameter("must be 0 (never delete) or more",
                                 param_hint="--delivery-topic-retention")

    from layer.coordinator.logformat import LOG_FORMATS, configure

    if log_format not in LOG_FORMATS:
        raise typer.BadParameter(f"must be one of {', '.join(LOG_FORMATS)}",
                                 param_hint="--log-format")
    configure(log_level, log_format)
    from layer.settings import Settings  # pydantic: when the command runs

    settings = Settings.load(bootstrap_servers=bootstrap_servers, database_url=database_url,
                             topic_prefix=topic_prefix)
    options = CoordinatorOptions(owner_id=owner_id or default_owner_id(),
                                 group_session_timeout=group_session_timeout,
                                 instance_id=instance_id,
                                 default_session_timeout=session_timeout,
                                 transactional=transactions,
                                 payload_budget=payload_budget_mb * 1024 * 1024,
                                 core=core, metrics_port=metrics_port,
                                 metrics_host=metrics_host,
                                 require_identity=require_identity,
                                 delivery_topic_retention=retention)
    logging.getLogger("layer.coordinator").info(
        "shard core: %s", "native" if options.native_core else "python (the reference)")
    CoordinatorProcess(settings, options).run()
