"""`qlayer security principal|grant|revoke|mode` against the real PostgreSQL: what an operator
types, what it prints, and what a coordinator then loads."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from typer.testing import Result

from layer.domain.authorization import parse_credential
from layer.settings import Settings
from layer.store.principals import Principals
from layer.store.store import Store

pytestmark = pytest.mark.integration


def test_an_operator_makes_principals_grants_them_and_prints_no_credential_twice(
        settings: Settings, invoke: Callable[..., Result]) -> None:
    made = invoke("security", "principal", "add", "alice", "--queue", "orders.*")
    assert made.exit_code == 0, made.output
    credential = parse_credential(made.stdout.strip())
    assert credential.principal == "alice"
    assert "shown this once" in made.stderr
    as_json = invoke("security", "principal", "add", "bob", "--queue", "Jobs",
                     "--consumer-id", "bob-*", "--consumer-id", "batch-7", "--json")
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["principal"] == "bob"

    # A consumer id belongs to one principal: an overlapping grant is refused, naming why.
    # (Through typer's runner a qlayer error is the result's exception; `qlayer` prints it as
    # one `error:` line and exits 1, or 2 for a usage error such as a bad pattern.)
    clash = invoke("security", "grant", "bob", "--consumer-id", "alice-w*")
    assert "overlaps 'alice-*' of principal 'alice'" in str(clash.exception)
    again = invoke("security", "principal", "add", "alice")
    assert "security principal rotate alice" in str(again.exception)
    assert "unknown principal 'carol'" in str(
        invoke("security", "grant", "carol", "--queue", "x").exception)
    bad = invoke("security", "grant", "bob", "--queue", "a*b").exception
    assert "'*' may only end it" in str(bad) and getattr(bad, "exit_status", 1) == 2
    assert invoke("security", "grant", "bob").exit_code == 2  # nothing to grant

    listed = invoke("security", "principal", "list", "--json")
    assert listed.exit_code == 0, listed.output
    document = json.loads(listed.stdout)
    assert document["mode"] == "open"
    assert [(p["name"], p["queues"], p["consumer_ids"]) for p in document["principals"]] == [
        ("alice", ["orders.*"], ["alice-*"]), ("bob", ["Jobs"], ["batch-7", "bob-*"])]
    assert credential.secret not in listed.stdout
    table = invoke("security", "principal", "list")
    assert "authorization mode: open" in table.stdout and "orders.*" in table.stdout

    # Revoking the last grant of a queue opens it while the mode is open: said so.
    Store(settings.database_url).put_queue("Jobs", {"name": "Jobs"}, 0.0)
    revoked = invoke("security", "revoke", "bob", "--queue", "Jobs")
    assert revoked.exit_code == 0, revoked.output
    assert "anyone may consume" in revoked.stderr
    assert invoke("security", "mode", "required").stdout.strip() == "required"
    assert invoke("security", "mode").stdout.strip() == "required"

    rotated = invoke("security", "principal", "rotate", "alice")
    assert rotated.exit_code == 0
    new = parse_credential(rotated.stdout.strip())
    with Store(settings.database_url) as store:
        loaded = Principals(store.engine).load_entitlements()
    assert loaded.authenticate(new) is not None and loaded.authenticate(credential) is None
    assert loaded.required and loaded.owner_of("batch-7") == "bob"
    assert invoke("security", "principal", "remove", "alice").exit_code == 0
    assert "unknown principal 'alice'" in str(
        invoke("security", "principal", "remove", "alice").exception)
