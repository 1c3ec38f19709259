"""Directory records (key = queue name, value = definition JSON, tombstone = deleted)."""

from __future__ import annotations

import json

import pytest

from layer.domain.definitions import QueueDefinition, load_queue_file
from layer.domain.errors import QueueConfigError
from layer.sdk.directory import (
    decode_definition,
    decode_placed_definition,
    encode_definition,
)
from layer.sdk.publisher import deliver_at_ms, expiration_ms

QUEUES = load_queue_file("""
queues:
  - name: ORDERS_ANALYTICS
    underlying_topic: ^ORDERS$|^ORDERS_ANALYTICS_DIRECT$
    default_publish_target: ORDERS_ANALYTICS_DIRECT
    priority: /price * /qty
    lease_period: 1m
    redelivery_backoff: {initial: 1s, maximum: 1m}
  - name: Jobs
    semantics: at-most-once
    expiration: 1d
    recovery_point: 2026-01-01T00:00:00Z
""")


@pytest.mark.parametrize("definition", QUEUES, ids=lambda d: d.name)
def test_definitions_round_trip(definition: QueueDefinition) -> None:
    key, value = encode_definition(definition)
    assert key == definition.name.encode()
    assert json.loads(value)["name"] == definition.name
    assert decode_definition(key, value) == (definition.name, definition)


@pytest.mark.parametrize("definition", QUEUES, ids=lambda d: d.name)
def test_format_two_carries_the_shard(definition: QueueDefinition) -> None:
    key, value = encode_definition(definition, 3, 16)
    document = json.loads(value)
    assert (document["format"], document["shard"], document["shard_count"]) == (2, 3, 16)
    assert document["definition"]["name"] == definition.name
    assert decode_placed_definition(key, value) == (definition.name, definition, 3)
    assert decode_definition(key, value) == (definition.name, definition)
    # A format-1 record (an older coordinator's) reads with no shard.
    old_key, old_value = encode_definition(definition)
    assert decode_placed_definition(old_key, old_value) == (definition.name, definition, None)


def test_an_unknown_format_is_refused_not_misread() -> None:
    with pytest.raises(ValueError, match="unknown format 3"):
        decode_placed_definition(b"Jobs", b'{"format": 3, "definition": {"name": "Jobs"}}')


def test_a_tombstone_deletes() -> None:
    assert decode_definition(b"Jobs", None) == ("Jobs", None)


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [(None, b"{}", "without a key"),
     (b"\xff", b"{}", "not UTF-8"),
     (b"Jobs", b"{", "not JSON"),
     (b"Jobs", b"[1]", "not a JSON object"),
     (b"Jobs", b'{"name": "Other"}', "defines queue 'Other'")],
)
def test_bad_records_are_refused_with_a_reason(key: bytes | None, value: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        decode_definition(key, value)


def test_a_definition_this_version_cannot_accept_is_a_config_error() -> None:
    with pytest.raises(QueueConfigError, match="lease_perod"):
        decode_definition(b"Jobs", b'{"name": "Jobs", "lease_perod": "1s"}')


def test_deliver_at_conversions() -> None:
    from datetime import UTC, datetime, timedelta, timezone

    assert deliver_at_ms(datetime(2026, 1, 1, tzinfo=UTC)) == 1_767_225_600_000
    assert deliver_at_ms(datetime(2026, 1, 1, 1, tzinfo=timezone(timedelta(hours=1)))) == (
        1_767_225_600_000)
    assert deliver_at_ms(1_767_225_600.25) == 1_767_225_600_250
    with pytest.raises(ValueError, match="time zone"):
        deliver_at_ms(datetime(2026, 1, 1))
    with pytest.raises(ValueError):
        deliver_at_ms(-1)
    with pytest.raises(TypeError):
        deliver_at_ms("2026-01-01")  # type: ignore[arg-type]


def test_expiration_conversions() -> None:
    from datetime import timedelta

    assert expiration_ms(timedelta(minutes=5)) == 300_000
    assert expiration_ms(2.5) == 2_500
    assert expiration_ms(0.001) == 1
    for bad in (0, -1, 0.0001, 367 * 24 * 3600, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="between 1 ms and 366 days"):
            expiration_ms(bad)
    with pytest.raises(TypeError):
        expiration_ms("5m")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        expiration_ms(True)
