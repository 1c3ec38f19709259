"""`qlayer security acls`: the Kafka ACLs of a consumer, publisher, coordinator, operator or the
Spark pipeline (docs/security.md), printed, or created with --apply."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from layer_cli.output import BootstrapServers, JsonOut, TopicPrefix, emit_json, load_settings

app = typer.Typer(help="Kafka ACLs for qlayer's principals (docs/security.md).",
                  no_args_is_help=True)


class RoleName(StrEnum):
    # The values of layer.kafka.acls.Role, repeated so `qlayer --help` need not import it.
    consumer = "consumer"
    publisher = "publisher"
    coordinator = "coordinator"
    operator = "operator"
    pipeline = "pipeline"


@app.command()
def acls(
    role: Annotated[RoleName, typer.Option("--role", help="Who the principal is to qlayer.")],
    user: Annotated[str, typer.Option(
        "--user", help="The SASL user name (User:NAME) or a full principal (User:CN=...).")],
    consumer_id: Annotated[str | None, typer.Option(
        "--consumer-id", help="A consumer's id: its delivery topic (required with "
        "--role consumer).")] = None,
    journal: Annotated[list[str] | None, typer.Option(
        "--journal", help="A journal topic (repeatable).")] = None,
    journal_prefix: Annotated[list[str] | None, typer.Option(
        "--journal-prefix", help="Every journal topic starting with this (repeatable).")
        ] = None,
    apply: Annotated[bool, typer.Option(
        "--apply", help="Create the ACLs with the current Kafka settings (a super user's, "
        "or one allowed to alter ACLs) instead of printing them.")] = False,
    json_out: JsonOut = False,
    bootstrap_servers: BootstrapServers = None,
    topic_prefix: TopicPrefix = None,
) -> None:
    """Print (or create, --apply) the ACLs one principal needs, and nothing more.

    A consumer may write the control and ack topics and read its own delivery topic only; a
    coordinator and an operator may do everything under the topic prefix and read the
    journals (an operator also writes them); the pipeline reads the journals and events.
    """
    if role is RoleName.consumer and not consumer_id:
        raise typer.BadParameter("a consumer's ACLs name its delivery topic: give its id",
                                 param_hint="--consumer-id")
    settings = load_settings(None, bootstrap_servers, topic_prefix)
    from layer.kafka.acls import Role
    from layer.services.security import acl_recipe, create_acls

    rules = acl_recipe(settings, Role(role.value), user, consumer_id=consumer_id,
                       journals=journal or [], journal_prefixes=journal_prefix or [])
    if apply:
        count = create_acls(settings, rules)
        typer.echo(f"created {count} ACLs for {rules[0].principal if rules else user} on "
                   f"{settings.bootstrap_servers}", err=json_out)
    if json_out:
        emit_json([rule.as_dict() for rule in rules])
    elif not apply:
        for rule in rules:
            typer.echo(str(rule))
