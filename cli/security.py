"""`qlayer security acls`: the Kafka ACLs of a consumer, publisher, coordinator, operator or the
Spark pipeline (docs/security.md), printed, or created with --apply; `qlayer security principal
add|list|rotate|remove`, `grant`, `revoke` and `mode`: who may consume which queues, under which
consumer ids (docs/security.md, "Authorization")."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer

from layer_cli.output import (
    BootstrapServers,
    DatabaseUrl,
    JsonOut,
    TopicPrefix,
    emit_json,
    iso_or_none,
    load_settings,
    new_table,
    show,
    time_text,
)

if TYPE_CHECKING:
    from layer.services.principals import PrincipalService

app = typer.Typer(help="Kafka ACLs, principals, grants and the authorization mode "
                       "(docs/security.md).", no_args_is_help=True)


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
    transactional: Annotated[bool, typer.Option(
        "--transactional", help="A consumer that settles in Kafka transactions "
        "(QueueConsumer(transactional=True)): Write on its sessions' transactional ids.")
        ] = False,
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
    if transactional and role is not RoleName.consumer:
        raise typer.BadParameter("only a consumer's ACLs have it (the coordinator has every "
                                 "transactional id under the prefix)",
                                 param_hint="--transactional")
    settings = load_settings(None, bootstrap_servers, topic_prefix)
    from layer.kafka.acls import Role
    from layer.services.security import acl_recipe, create_acls

    rules = acl_recipe(settings, Role(role.value), user, consumer_id=consumer_id,
                       journals=journal or [], journal_prefixes=journal_prefix or [],
                       transactional=transactional)
    if apply:
        count = create_acls(settings, rules)
        typer.echo(f"created {count} ACLs for {rules[0].principal if rules else user} on "
                   f"{settings.bootstrap_servers}", err=json_out)
    if json_out:
        emit_json([rule.as_dict() for rule in rules])
    elif not apply:
        for rule in rules:
            typer.echo(str(rule))


# --- principals, grants and the mode (protocol 7; docs/security.md "Authorization") ----------

principal_app = typer.Typer(
    help="Principals: who a consumer's credential says it is (docs/security.md, "
         "'Authorization').", no_args_is_help=True)
app.add_typer(principal_app, name="principal")

QueuePatterns = Annotated[list[str] | None, typer.Option(
    "--queue", help="A queue it may consume: a name, a prefix ending in '*' (orders.*), or "
    "'*' (repeatable).")]
ConsumerIdPatterns = Annotated[list[str] | None, typer.Option(
    "--consumer-id", help="A consumer id it may subscribe as: a name, a prefix ending in '*', "
    "or '*' (repeatable). A consumer id belongs to one principal.")]


class ModeName(StrEnum):
    # layer.domain.authorization.AuthorizationMode, repeated for a light `qlayer --help`.
    open = "open"
    required = "required"


def _principals(database_url: str | None) -> PrincipalService:
    from layer.services.principals import PrincipalService

    return PrincipalService.from_settings(load_settings(database_url))


def _say_credential(name: str, credential: str, json_out: bool, verb: str) -> None:
    if json_out:
        emit_json({"principal": name, "credential": credential})
        return
    typer.echo(credential)
    typer.echo(f"{verb} principal {name!r}. The line above is its credential, shown this once "
               "(only its SHA-256 is stored): give it to the consumer as QLAYER_CREDENTIAL or "
               "QueueConsumer(credential=...), and keep it secret.", err=True)


@principal_app.command("add")
def principal_add(
    name: Annotated[str, typer.Argument(help="The principal's name (usually its Kafka user).")],
    queue: QueuePatterns = None,
    consumer_id: ConsumerIdPatterns = None,
    database_url: DatabaseUrl = None,
    json_out: JsonOut = False,
) -> None:
    """Make a principal and print its credential (once).

    Without --consumer-id it may subscribe as NAME-* (the SDK's default ids for a consumer
    with a credential start with its principal's name)."""
    with _principals(database_url) as service:
        credential = service.add(name, queue or [], consumer_id)
    _say_credential(name, str(credential), json_out, "made")


@principal_app.command("rotate")
def principal_rotate(
    name: Annotated[str, typer.Argument(help="The principal.")],
    database_url: DatabaseUrl = None,
    json_out: JsonOut = False,
) -> None:
    """Issue a new credential (printed once).

    Sessions of the old one end within the coordinators' refresh interval."""
    with _principals(database_url) as service:
        credential = service.rotate(name)
    _say_credential(name, str(credential), json_out, "rotated the credential of")


@principal_app.command("remove")
def principal_remove(
    name: Annotated[str, typer.Argument(help="The principal.")],
    database_url: DatabaseUrl = None,
) -> None:
    """Remove a principal and its grants.

    Its sessions end within the coordinators' refresh interval."""
    with _principals(database_url) as service:
        service.remove(name)
    typer.echo(f"removed principal {name!r} and its grants")


@principal_app.command("list")
def principal_list(
    database_url: DatabaseUrl = None,
    json_out: JsonOut = False,
) -> None:
    """The principals, their grants and the authorization mode (never a credential)."""
    with _principals(database_url) as service:
        mode = service.mode()
        principals = service.list_principals()
    if json_out:
        emit_json({"mode": mode.value, "principals": [
            {"name": p.name, "created_at": iso_or_none(p.created_at),
             "credential_issued_at": iso_or_none(p.issued_at),
             "queues": [str(g.pattern) for g in p.grants if g.kind.value == "queue"],
             "consumer_ids": [str(g.pattern) for g in p.grants
                              if g.kind.value == "consumer_id"]}
            for p in principals]})
        return
    table = new_table("principal", "queues", "consumer ids", "credential issued",
                      title=f"authorization mode: {mode.value}")
    for p in principals:
        table.add_row(p.name,
                      ", ".join(str(g.pattern) for g in p.grants if g.kind.value == "queue")
                      or "-",
                      ", ".join(str(g.pattern) for g in p.grants
                                if g.kind.value == "consumer_id") or "-",
                      time_text(p.issued_at))
    show(table)


def _change_grants(name: str, queue: list[str] | None, consumer_id: list[str] | None,
                   database_url: str | None, revoke: bool) -> None:
    from layer.domain.authorization import GrantKind

    if not queue and not consumer_id:
        raise typer.BadParameter("give at least one --queue or --consumer-id",
                                 param_hint="--queue")
    wanted = [(GrantKind.QUEUE, p) for p in queue or []] + [
        (GrantKind.CONSUMER_ID, p) for p in consumer_id or []]
    with _principals(database_url) as service:
        for kind, pattern in wanted:
            done = (service.revoke(name, kind, pattern) if revoke
                    else service.grant(name, kind, pattern))
            what = "queue" if kind is GrantKind.QUEUE else "consumer id"
            if revoke:
                typer.echo(f"revoked {what} {pattern} of {name!r}" if done
                           else f"{name!r} had no {what} grant {pattern}")
                opened = service.opened(pattern) if kind is GrantKind.QUEUE else []
                if opened:
                    typer.echo(f"warning: no principal is granted {', '.join(opened)} now; "
                               "while the authorization mode is open, anyone may consume "
                               "it (`qlayer security mode required` closes what no grant "
                               "names)", err=True)
            else:
                typer.echo(f"granted {what} {pattern} to {name!r}" if done
                           else f"{name!r} had {what} {pattern} already")


@app.command()
def grant(
    name: Annotated[str, typer.Argument(help="The principal.")],
    queue: QueuePatterns = None,
    consumer_id: ConsumerIdPatterns = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Let a principal consume queues, or subscribe under consumer ids."""
    _change_grants(name, queue, consumer_id, database_url, revoke=False)


@app.command()
def revoke(
    name: Annotated[str, typer.Argument(help="The principal.")],
    queue: QueuePatterns = None,
    consumer_id: ConsumerIdPatterns = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Take grants back.

    Sessions that relied on them end within the coordinators' refresh interval."""
    _change_grants(name, queue, consumer_id, database_url, revoke=True)


@app.command()
def mode(
    to: Annotated[ModeName | None, typer.Argument(
        help="open: what no grant names is open to anyone; required: a credential and a grant "
        "for everything. Without it, print the current mode.")] = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Show or set the installation's authorization mode (every coordinator applies it)."""
    from layer.domain.authorization import AuthorizationMode

    with _principals(database_url) as service:
        if to is not None:
            service.set_mode(AuthorizationMode(to.value))
        typer.echo(service.mode().value)
