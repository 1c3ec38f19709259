"""Queue definitions: defaults, validation messages, queue files and the reference examples."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layer.domain.definitions import (
    DEFAULT_LEASE_PERIOD,
    DEFAULT_MAX_PER_SUBSCRIPTION_BACKLOG,
    Fairness,
    Leasing,
    QueueDefinition,
    RedeliveryBackoff,
    Semantics,
    load_queue_file,
    publish_target,
    queues_for_topic,
)
from layer.domain.durations import format_duration, parse_duration
from layer.domain.errors import QlayerError, QueueConfigError


def problems_of(data: dict[str, object]) -> list[tuple[str, str]]:
    with pytest.raises(QueueConfigError) as caught:
        QueueDefinition.from_mapping(data)
    return caught.value.problems


def messages_of(data: dict[str, object]) -> str:
    with pytest.raises(QueueConfigError) as caught:
        QueueDefinition.from_mapping(data)
    return str(caught.value)


# -- durations -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("250ms", 0.25),
        ("1h30m", 5400.0),
        ("1h 30m", 5400.0),
        ("1.5s", 1.5),
        ("2d", 172800.0),
        ("1w", 604800.0),
        ("90", 90.0),
        ("2.5", 2.5),
        (45, 45.0),
        (0.5, 0.5),
        ("  10S ", 10.0),
        ("-5s", -5.0),  # the sign is the caller's business
    ],
)
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "bad", ["", "5 minutes", "s", "5x", "1h-30m", "ms5", True, None, [5], "inf"]
)
def test_parse_duration_rejects_with_the_accepted_forms(bad: object) -> None:
    with pytest.raises(ValueError, match=r"30s|duration"):
        parse_duration(bad)


@pytest.mark.parametrize("seconds", [0.0, 0.25, 1.0, 30.0, 90.0, 300.0, 5400.0, 86400.0, 1.5])
def test_format_duration_reads_back(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


def test_format_duration_is_the_queue_file_style() -> None:
    assert format_duration(5400) == "1h30m"
    assert format_duration(0.25) == "250ms"
    assert format_duration(300) == "5m"


# -- defaults --------------------------------------------------------------------------------


def test_defaults_follow_amps() -> None:
    queue = QueueDefinition(name="Jobs")
    assert queue.underlying_topic == "Jobs"  # AMPS: leave out UnderlyingTopic → same name
    assert queue.default_publish_target is None
    assert queue.semantics is Semantics.AT_LEAST_ONCE
    assert queue.lease_period == DEFAULT_LEASE_PERIOD == 300.0
    assert queue.max_deliveries == 0
    assert queue.max_cancels == 0
    assert queue.expiration is None
    assert queue.max_per_subscription_backlog == DEFAULT_MAX_PER_SUBSCRIPTION_BACKLOG
    assert queue.fairness is Fairness.PROPORTIONAL  # AMPS default for at-least-once
    assert queue.priority is None and queue.priority_expression is None
    assert queue.barrier_expression is None and queue.barrier_expr is None
    assert queue.filter is None and queue.filter_expression is None
    assert queue.target_queue_depth is None
    assert queue.leasing is Leasing.STRICT
    assert queue.recovery_point == "beginning"  # AMPS: the beginning of the transaction log
    assert queue.recovery_timestamp is None
    assert queue.key_groups is False
    assert queue.redelivery_backoff == RedeliveryBackoff()
    assert queue.redelivery_backoff.delay_for(3) == 0.0  # redelivered at once, as in AMPS
    assert queue.dead_letter_topic is None


def test_at_most_once_defaults_to_round_robin_the_only_fairness_it_allows() -> None:
    queue = QueueDefinition.from_mapping({"name": "WorkToDo", "semantics": "at-most-once"})
    assert queue.fairness is Fairness.ROUND_ROBIN
    assert queue.effective_fairness is Fairness.ROUND_ROBIN
    explicit = QueueDefinition.from_mapping(
        {"name": "W", "semantics": "at-most-once", "fairness": "round-robin"}
    )
    assert explicit.fairness is Fairness.ROUND_ROBIN


@pytest.mark.parametrize("fairness", ["fast", "proportional"])
def test_at_most_once_refuses_other_fairness(fairness: str) -> None:
    assert problems_of({"name": "W", "semantics": "at-most-once", "fairness": fairness}) == [
        (
            "fairness",
            f"at-most-once queues support only round-robin (got {fairness}); "
            "remove fairness or set it to round-robin",
        )
    ]


@pytest.mark.parametrize("fairness", ["fast", "round-robin", "proportional", "ROUND_ROBIN"])
def test_at_least_once_accepts_every_fairness(fairness: str) -> None:
    queue = QueueDefinition.from_mapping({"name": "Q", "fairness": fairness})
    assert queue.fairness == fairness.lower().replace("_", "-")


def test_enums_are_lenient_about_case_and_underscores_but_list_choices_when_wrong() -> None:
    queue = QueueDefinition.from_mapping({"name": "Q", "semantics": "AT_MOST_ONCE"})
    assert queue.semantics is Semantics.AT_MOST_ONCE
    assert problems_of({"name": "Q", "semantics": "exactly-once"}) == [
        ("semantics", "must be one of at-least-once, at-most-once; got 'exactly-once'")
    ]
    assert problems_of({"name": "Q", "leasing": "loose"}) == [
        ("leasing", "must be one of strict, permissive; got 'loose'")
    ]


# -- field validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("30s", 30.0), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25), (45, 45.0)],
)
def test_lease_period_takes_durations(value: object, seconds: float) -> None:
    assert (
        QueueDefinition.from_mapping({"name": "Q", "lease_period": value}).lease_period == seconds
    )


@pytest.mark.parametrize("value", [0, "0s", "-5s", -1, "0.5ms", "12h1s", "1d", 1e308,
                                   "99999999999999999999999999s"])
def test_lease_period_is_from_1ms_to_12h(value: object) -> None:
    # 12 hours is what a RENEW may set a lease to; a lease past the year 9999 could not even
    # be stored.
    assert problems_of({"name": "Q", "lease_period": value}) == [
        ("lease_period", f"must be from 1ms to 12h (e.g. 30s), got {value!r}")
    ]


@pytest.mark.parametrize(("value", "seconds"), [("1ms", 0.001), ("12h", 43_200.0), (30, 30.0)])
def test_lease_period_bounds_are_inclusive(value: object, seconds: float) -> None:
    assert QueueDefinition.from_mapping({"name": "Q", "lease_period": value}).lease_period \
        == seconds


def test_lease_period_in_words_is_refused_with_the_accepted_forms() -> None:
    [(field, message)] = problems_of({"name": "Q", "lease_period": "5 minutes"})
    assert field == "lease_period"
    assert "30s, 5m, 1h30m or 250ms" in message


def test_expiration_is_a_positive_duration_or_absent() -> None:
    assert QueueDefinition.from_mapping({"name": "Q", "expiration": "1h"}).expiration == 3600.0
    assert QueueDefinition.from_mapping({"name": "Q", "expiration": None}).expiration is None
    assert QueueDefinition.from_mapping({"name": "Q", "expiration": "366d"}).expiration \
        == 366 * 86_400.0  # as long as a message's own qlayer.expiration may be
    for value in ("0s", "-1h", "367d", "999999999999d", 1e308):
        assert problems_of({"name": "Q", "expiration": value}) == [(
            "expiration",
            f"must be from 1ms to 366d (e.g. 1h), or left out to never expire; got {value!r}",
        )]


@pytest.mark.parametrize("field", ["initial", "maximum"])
@pytest.mark.parametrize("value", ["-1s", "1d1s", "9999999999d"])
def test_redelivery_backoff_delays_are_from_0s_to_a_day(field: str, value: str) -> None:
    assert problems_of({"name": "Q", "redelivery_backoff": {field: value, "multiplier": 2}}) == [
        (f"redelivery_backoff.{field}", f"must be from 0s to 1d (e.g. 1s), got {value!r}")
    ]
    backoff = {"name": "Q", "redelivery_backoff": {"initial": "1d", "maximum": "1d"}}
    assert QueueDefinition.from_mapping(backoff).redelivery_backoff.maximum == 86_400.0


@pytest.mark.parametrize("field", ["max_deliveries", "max_cancels"])
def test_limits_are_whole_numbers_from_zero(field: str) -> None:
    assert getattr(QueueDefinition.from_mapping({"name": "Q", field: 10}), field) == 10
    assert getattr(QueueDefinition.from_mapping({"name": "Q", field: "3"}), field) == 3
    assert getattr(QueueDefinition.from_mapping({"name": "Q", field: 0}), field) == 0
    for bad in (-1, 2.5, True, "many"):
        [(where, message)] = problems_of({"name": "Q", field: bad})
        assert where == field
        assert "0 means unlimited" in message


@pytest.mark.parametrize("field", ["max_deliveries", "max_cancels",
                                   "max_per_subscription_backlog", "target_queue_depth", "shard"])
def test_counts_fit_what_postgresql_and_the_protocol_store(field: str) -> None:
    """Counts are 32-bit integers in PostgreSQL and on the wire: a larger one is refused
    when the queue is defined, not when the first write fails."""
    largest = 2**31 - 1
    assert getattr(QueueDefinition.from_mapping({"name": "Q", field: largest}), field) == largest
    [(where, message)] = problems_of({"name": "Q", field: 99999999999999999999999999})
    assert where == field
    assert "must be at most 2,147,483,647" in message


def test_every_number_a_queue_definition_holds_is_bounded() -> None:
    """A new numeric option cannot arrive without a bound: every int and float field (and the
    backoff's delays) refuses a value too large to store, naming the field."""
    numeric = {name for name, field in QueueDefinition.model_fields.items()
               if field.annotation in (int, int | None, float, float | None)}
    assert numeric == {"lease_period", "max_deliveries", "max_cancels", "expiration",
                       "delivery_delay", "max_per_subscription_backlog", "target_queue_depth",
                       "shard", "parts"}
    for name in sorted(numeric):
        [(where, message)] = problems_of({"name": "Q", name: 10**20})
        assert (where, message.startswith("must be ")) == (name, True), message
        assert "at most 2,147,483,647" in message or " to " in message, message


def test_max_per_subscription_backlog_is_at_least_one() -> None:
    assert problems_of({"name": "Q", "max_per_subscription_backlog": 0}) == [
        ("max_per_subscription_backlog", "must be at least 1 (e.g. 10), got 0")
    ]


def test_target_queue_depth_alone_is_fine() -> None:
    assert (
        QueueDefinition.from_mapping({"name": "Q", "target_queue_depth": 1000}).target_queue_depth
        == 1000
    )


def test_target_queue_depth_cannot_be_combined_with_priority_or_barrier() -> None:
    # AMPS: "A TargetQueueDepth cannot be set for a queue that specifies a Priority or a
    # BarrierExpression."
    assert problems_of({"name": "Q", "target_queue_depth": 10, "priority": "/p"}) == [
        ("target_queue_depth", "cannot be combined with priority; remove one of them")
    ]
    assert problems_of(
        {"name": "Q", "target_queue_depth": 10, "barrier_expression": "/eod = TRUE"}
    ) == [("target_queue_depth", "cannot be combined with barrier_expression; remove one of them")]


def test_expression_syntax_errors_name_field_and_column() -> None:
    assert problems_of({"name": "Q", "priority": "/price * "}) == [
        (
            "priority",
            "syntax error at column 9: expected a value (number, 'string', /path, TRUE, "
            "FALSE or NULL), a sign (+ or -) or '(', found the end of the expression",
        )
    ]
    [(field, message)] = problems_of({"name": "Q", "filter": "/region = = 'EU'"})
    assert field == "filter"
    assert message.startswith("syntax error at column 11: expected")
    [(field, message)] = problems_of({"name": "Q", "barrier_expression": "/x LIKE '('"})
    assert field == "barrier_expression"
    assert "regular expression" in message


def test_a_like_pattern_the_linear_time_engine_cannot_run_is_a_problem_of_its_field() -> None:
    # Queue definitions are validated like consumers' filters (issue 15 item 4).
    assert problems_of({"name": "Q", "filter": "/state LIKE '(.)\\1'"}) == [
        (
            "filter",
            "invalid regular expression for LIKE '(.)\\1': backreferences such as \\1 are "
            "not supported: LIKE uses a linear-time regular expression engine (RE2), which "
            "cannot run it at column 13",
        )
    ]
    [(field, message)] = problems_of({"name": "Q", "priority": "/p LIKE '(?<=x)y'"})
    assert field == "priority"
    assert "lookbehind (?<=...) is not supported" in message
    catastrophic = QueueDefinition.from_mapping({"name": "Q", "filter": "/s LIKE '^(a+)+$'"})
    assert catastrophic.filter_expression is not None
    assert catastrophic.filter_expression.matches({"s": "a" * 5000 + "b"}) is False


def test_expressions_are_compiled_once_and_exposed() -> None:
    queue = QueueDefinition.from_mapping(
        {
            "name": "Q",
            "filter": " /region = 'EU' ",
            "priority": "/price * /qty",
            "barrier_expression": "/type = 'eod'",
        }
    )
    assert queue.filter == "/region = 'EU'"  # surrounding blanks are not part of it
    assert queue.filter_expression is not None
    assert queue.filter_expression.matches({"region": "EU"})
    assert queue.filter_expression is queue.filter_expression  # cached
    assert queue.priority_expression is not None
    assert queue.priority_expression.evaluate({"price": 2, "qty": 3}) == 6
    assert queue.barrier_expr is not None
    assert queue.barrier_expr.matches({"type": "eod"})
    assert queue.expression_fields == frozenset({"/region", "/price", "/qty", "/type"})


def test_expression_error_columns_count_from_what_the_user_wrote() -> None:
    [(field, message)] = problems_of({"name": "Q", "filter": "   /a = = 1"})
    assert field == "filter"
    assert message.startswith("syntax error at column 9:")  # the second "="


def test_blank_expression_means_none() -> None:
    assert QueueDefinition.from_mapping({"name": "Q", "filter": "   "}).filter is None


@pytest.mark.parametrize("name", ["my queue", "", "a/b", "x" * 250, "..", "Jöbs"])
def test_queue_names_are_kafka_topic_safe(name: str) -> None:
    [(field, message), *_] = problems_of({"name": name})
    assert field == "name"
    assert "letters, digits, '.', '_' or '-'" in message


def test_name_is_required() -> None:
    assert ("name", "is required (the queue's name, e.g. Jobs)") in problems_of(
        {"lease_period": "5s"}
    )


def test_underlying_topic_regex_must_compile() -> None:
    [(field, message)] = problems_of({"name": "Q", "underlying_topic": "^ORDERS(_.*$"})
    assert field == "underlying_topic"
    assert message.startswith("invalid regular expression '^ORDERS(_.*$'")


def test_underlying_topic_name_must_be_a_topic_name() -> None:
    [(field, message)] = problems_of({"name": "Q", "underlying_topic": "two words"})
    assert field == "underlying_topic"
    assert "'two words' is not a valid topic name" in message


@pytest.mark.parametrize("field", ["default_publish_target", "dead_letter_topic"])
def test_target_topics_must_be_names(field: str) -> None:
    [(where, message)] = problems_of({"name": "Q", "underlying_topic": "^Q.*", field: "Q_(x)"})
    assert where == field
    assert "is not a valid topic name" in message


def test_recovery_point() -> None:
    assert (
        QueueDefinition.from_mapping({"name": "Q", "recovery_point": "END"}).recovery_point == "end"
    )
    queue = QueueDefinition.from_mapping({"name": "Q", "recovery_point": "2024-05-01T12:00:00Z"})
    assert queue.recovery_timestamp == datetime(2024, 5, 1, 12, tzinfo=UTC)
    assert queue.recovery_point == "2024-05-01T12:00:00+00:00"
    from_yaml = load_queue_file("queues: [{name: Q, recovery_point: 2024-05-01T12:00:00Z}]")
    assert from_yaml[0].recovery_timestamp == datetime(2024, 5, 1, 12, tzinfo=UTC)
    [(field, message)] = problems_of({"name": "Q", "recovery_point": "2024-05-01T12:00:00"})
    assert field == "recovery_point"
    assert "no UTC offset" in message
    [(field, message)] = problems_of({"name": "Q", "recovery_point": "yesterday"})
    assert "'beginning', 'end' or an ISO-8601 timestamp" in message


def test_key_groups_is_a_boolean() -> None:
    assert QueueDefinition.from_mapping({"name": "Q", "key_groups": True}).key_groups is True
    assert problems_of({"name": "Q", "key_groups": "yes"}) == [
        ("key_groups", "must be true or false, got 'yes'")
    ]


# -- redelivery back-off ---------------------------------------------------------------------


def test_redelivery_backoff_grows_and_caps() -> None:
    backoff = RedeliveryBackoff(initial=1.0, multiplier=2.0, maximum=10.0)
    assert [backoff.delay_for(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff.delay_for(0) == 1.0
    assert backoff.delay_for(100_000) == 10.0  # no overflow for absurd counts


def test_redelivery_backoff_from_a_queue_file_mapping() -> None:
    queue = QueueDefinition.from_mapping(
        {"name": "Q", "redelivery_backoff": {"initial": "500ms", "multiplier": 3, "maximum": "1m"}}
    )
    assert queue.redelivery_backoff == RedeliveryBackoff(initial=0.5, multiplier=3.0, maximum=60.0)
    assert queue.redelivery_backoff.delay_for(3) == 4.5


def test_redelivery_backoff_problems() -> None:
    problems = problems_of(
        {"name": "Q", "redelivery_backoff": {"initail": "1s", "multiplier": 0.5}}
    )
    assert (
        "redelivery_backoff.initail",
        "unknown field 'initail' (did you mean 'initial'?)",
    ) in problems
    assert any(f == "redelivery_backoff.multiplier" and "at least 1" in m for f, m in problems)
    [(field, message)] = problems_of(
        {"name": "Q", "redelivery_backoff": {"initial": "2m", "maximum": "1m"}}
    )
    assert field == "redelivery_backoff"
    assert "raise maximum or lower initial" in message


# -- unknown fields, spellings, many problems at once ----------------------------------------


def test_unknown_field_suggests_the_closest_name() -> None:
    assert problems_of({"name": "Q", "lease_perod": "5s"}) == [
        ("lease_perod", "unknown field 'lease_perod' (did you mean 'lease_period'?)")
    ]
    assert messages_of({"name": "Q", "lease_perod": "5s"}) == (
        "unknown field 'lease_perod' (did you mean 'lease_period'?)"
    )
    [(field, message)] = problems_of({"name": "Q", "zzz": 1})
    assert field == "zzz"
    assert "known fields: name, underlying_topic" in message


def test_amps_element_names_and_kebab_case_are_accepted() -> None:
    queue = QueueDefinition.from_mapping(
        {
            "Name": "Jobs",
            "LeasePeriod": "30s",
            "MaxCancels": 3,
            "MaxDeliveries": 10,
            "max-per-subscription-backlog": 5,
            "Semantics": "at-least-once",
        }
    )
    assert (queue.name, queue.lease_period, queue.max_cancels, queue.max_deliveries) == (
        "Jobs",
        30.0,
        3,
        10,
    )
    assert queue.max_per_subscription_backlog == 5
    assert problems_of({"name": "Q", "lease_period": "5s", "LeasePeriod": "6s"}) == [
        ("lease_period", "given twice (as 'LeasePeriod' and another spelling)")
    ]


def test_amps_message_type_json_is_accepted_and_others_refused() -> None:
    assert QueueDefinition.from_mapping({"Name": "Q", "MessageType": "json"}).name == "Q"
    assert problems_of({"name": "Q", "MessageType": "fix"}) == [
        ("MessageType", "only json is supported, got 'fix'; remove it")
    ]


def test_every_problem_is_reported_at_once() -> None:
    problems = problems_of(
        {
            "name": "Jobs",
            "lease_perod": "30s",
            "lease_period": "0s",
            "max_deliveries": -1,
            "priority": "/p +",
            "underlying_topic": "(",
            "semantics": "at-most-once",
            "fairness": "fast",
            "target_queue_depth": 10,
            "barrier_expression": "/eod",
        }
    )
    fields = [field for field, _ in problems]
    assert fields == [
        "lease_perod",
        "underlying_topic",
        "lease_period",
        "max_deliveries",
        "priority",
        # combinations are checked too, for the fields that were valid themselves
        "target_queue_depth",
        "fairness",
    ]


def test_a_queue_must_be_a_mapping() -> None:
    with pytest.raises(QueueConfigError, match="must be a mapping"):
        QueueDefinition.from_mapping(["name", "Q"])  # type: ignore[arg-type]


def test_queue_config_error_is_a_qlayer_error_and_a_value_error() -> None:
    with pytest.raises(QlayerError):
        QueueDefinition.from_mapping({"name": "Q", "lease_period": 0})
    with pytest.raises(ValueError):
        QueueDefinition.from_mapping({"name": "Q", "lease_period": 0})


# -- the model itself ------------------------------------------------------------------------


def test_definitions_are_frozen_hashable_and_equal_by_value() -> None:
    first = QueueDefinition.from_mapping({"name": "Q", "filter": "/a = 1"})
    second = QueueDefinition.from_mapping({"name": "Q", "filter": "/a = 1"})
    _ = first.filter_expression  # a cached expression does not change equality
    assert first == second
    assert hash(first) == hash(second)
    assert first != QueueDefinition.from_mapping({"name": "Q", "filter": "/a = 2"})
    with pytest.raises(ValueError):
        first.name = "R"  # type: ignore[misc]


def test_model_copy_with_changes_is_validated_and_recompiles_expressions() -> None:
    queue = QueueDefinition.from_mapping({"name": "Q", "filter": "/x = 1"})
    assert queue.filter_expression is not None
    changed = queue.model_copy(update={"filter": "/y = 2", "lease_period": "10s"})
    assert changed.filter_expression is not None
    assert changed.filter_expression.text == "/y = 2"
    assert changed.lease_period == 10.0
    with pytest.raises(QueueConfigError, match="cannot be combined with priority"):
        queue.model_copy(update={"priority": "/p", "target_queue_depth": 5})
    assert queue.model_copy() == queue


def test_a_stored_definition_reads_back_identically() -> None:
    queue = QueueDefinition.from_mapping(
        {
            "name": "ORDERS_RISK",
            "underlying_topic": "^ORDERS$|^ORDERS_RISK_DIRECT$",
            "default_publish_target": "ORDERS_RISK_DIRECT",
            "lease_period": "1m",
            "expiration": "1d",
            "priority": "/price * /qty",
            "recovery_point": "2024-05-01T00:00:00+02:00",
            "redelivery_backoff": {"initial": "1s"},
            "dead_letter_topic": "ORDERS_RISK_DLQ",
            "key_groups": True,
        }
    )
    assert QueueDefinition.from_mapping(queue.model_dump(mode="json")) == queue
    assert QueueDefinition.from_mapping(queue.model_dump()) == queue


def test_default_publish_target_must_feed_the_queue() -> None:
    [(field, message)] = problems_of(
        {"name": "ORDERS_RISK", "underlying_topic": "^ORDERS$", "default_publish_target": "RISK_IN"}
    )
    assert field == "default_publish_target"
    assert "would never enter it" in message


def test_dead_letter_topic_must_not_feed_the_queue() -> None:
    [(field, message)] = problems_of({"name": "Jobs", "dead_letter_topic": "Jobs"})
    assert field == "dead_letter_topic"
    assert "re-enter the queue" in message


# -- topic matching --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("underlying", "topic", "expected"),
    [
        ("orders.eu", "orders.eu", True),  # '.' alone does not make a regex: Kafka names use it
        ("orders.eu", "ordersXeu", False),
        ("orders-.*", "orders-1", True),  # a regex matches the whole name ...
        ("orders-.*", "old-orders-1", False),
        ("^orders-", "orders-1-retry", True),  # ... unless it starts with ^ (AMPS style)
        ("^orders-", "old-orders-1", False),
        ("^ORDERS$|^ORDERS_RISK_DIRECT$", "ORDERS", True),
        ("^ORDERS$|^ORDERS_RISK_DIRECT$", "ORDERS_RISK_DIRECT", True),
        ("^ORDERS$|^ORDERS_RISK_DIRECT$", "ORDERS_ANALYTICS_DIRECT", False),
        ("^ORDERS$|^ORDERS_RISK_DIRECT$", "ORDERS_RISK", False),
        ("(a|b)-in", "a-in", True),
        ("(a|b)-in", "c-in", False),
    ],
)
def test_matches_topic(underlying: str, topic: str, expected: bool) -> None:
    queue = QueueDefinition.from_mapping({"name": "Q", "underlying_topic": underlying})
    assert queue.matches_topic(topic) is expected
    # journal_topics (a lookup for a name) picks exactly the topics matches_topic accepts.
    listed = {topic: 1, "orders.eu": 3, "unrelated": 1}
    assert queue.journal_topics(listed) == sorted(t for t in listed if queue.matches_topic(t))


# -- queue files ------------------------------------------------------------------------------

QUEUE_FILE = """
queues:
  - name: WorkToDo
    underlying_topic: Work
    semantics: at-most-once
  - name: Jobs
    lease_period: 30s
    max_cancels: 3
    max_deliveries: 10
    dead_letter_topic: FailedJobs
  - name: FailedJobs
"""


def test_load_queue_file() -> None:
    work, jobs, failed = load_queue_file(QUEUE_FILE)
    assert (work.name, work.underlying_topic, work.semantics) == (
        "WorkToDo",
        "Work",
        Semantics.AT_MOST_ONCE,
    )
    assert (jobs.lease_period, jobs.max_cancels, jobs.max_deliveries) == (30.0, 3, 10)
    assert failed.underlying_topic == "FailedJobs"


def test_queue_file_problems_are_prefixed_with_the_queue() -> None:
    with pytest.raises(QueueConfigError) as caught:
        load_queue_file(
            """
queues:
  - name: Jobs
    lease_period: 0
  - lease_period: 5s
  - name: Other
    target_queue_depth: 5
    priority: /p
"""
        )
    assert caught.value.problems == [
        ("Jobs.lease_period", "must be from 1ms to 12h (e.g. 30s), got 0"),
        ("queues[1].name", "is required (the queue's name, e.g. Jobs)"),
        ("Other.target_queue_depth", "cannot be combined with priority; remove one of them"),
    ]
    assert "3 problems in queue file" in str(caught.value)
    assert "Jobs.lease_period: must be from 1ms to 12h (e.g. 30s), got 0" in str(caught.value)


def test_queue_file_duplicate_names() -> None:
    with pytest.raises(QueueConfigError) as caught:
        load_queue_file("queues: [{name: Jobs}, {name: Other}, {name: Jobs}]")
    assert caught.value.problems == [
        ("queues[2].name", "duplicate queue name 'Jobs' (first defined at queues[0]); rename one")
    ]


def test_queue_file_publish_target_must_be_a_journal_not_another_queue() -> None:
    with pytest.raises(QueueConfigError) as caught:
        load_queue_file(
            """
queues:
  - {name: A, underlying_topic: "^A$|^B$", default_publish_target: B}
  - {name: B}
"""
        )
    [(field, message)] = caught.value.problems
    assert field == "A.default_publish_target"
    assert "the name of another queue" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("queues: [ {name: Jobs", "not valid YAML at line 1"),
        ("- name: Jobs", "expected a mapping with a 'queues:' list"),
        ("", "expected a mapping with a 'queues:' list at the top, got nothing"),
        ("queues: {name: Jobs}", "must be a list of queues"),
        ("queues: []\nqueus: []", "unknown field 'queus' (did you mean 'queues'?)"),
        ("queues: [Jobs]", "a queue must be a mapping of field names to values, got str"),
    ],
)
def test_queue_file_shape_problems(text: str, expected: str) -> None:
    with pytest.raises(QueueConfigError, match=re.escape(expected)):
        load_queue_file(text)


def test_empty_queue_list_is_no_queues() -> None:
    assert load_queue_file("queues: []") == []
    assert load_queue_file("queues:") == []


# -- the reference examples ------------------------------------------------------------------

# amps-message-queues-chapter.rst "Using Multiple Underlying Topics" (and
# amps-advanced-queue-configuration.txt), with the AMPS element names as written there.
ORDERS_CONFIG = """
queues:
  - Name: ORDERS_ANALYTICS
    MessageType: json
    UnderlyingTopic: ^ORDERS$|^ORDERS_ANALYTICS_DIRECT$
    DefaultPublishTarget: ORDERS_ANALYTICS_DIRECT
  - Name: ORDERS_RISK
    MessageType: json
    UnderlyingTopic: ^ORDERS$|^ORDERS_RISK_DIRECT$
    DefaultPublishTarget: ORDERS_RISK_DIRECT
"""


@pytest.mark.parametrize(
    ("publish_to", "journal", "enqueued_by"),
    [
        # Both ORDERS_ANALYTICS and ORDERS_RISK enqueue the message, since ORDERS matches the
        # UnderlyingTopic of both queues.
        ("ORDERS", "ORDERS", ["ORDERS_ANALYTICS", "ORDERS_RISK"]),
        # Published to the DefaultPublishTarget of ORDERS_ANALYTICS, ORDERS_ANALYTICS_DIRECT,
        # then enqueued to ORDERS_ANALYTICS.
        ("ORDERS_ANALYTICS", "ORDERS_ANALYTICS_DIRECT", ["ORDERS_ANALYTICS"]),
        # Likewise for ORDERS_RISK → ORDERS_RISK_DIRECT.
        ("ORDERS_RISK", "ORDERS_RISK_DIRECT", ["ORDERS_RISK"]),
        # Published to ORDERS_ANALYTICS_DIRECT, then enqueued to ORDERS_ANALYTICS.
        ("ORDERS_ANALYTICS_DIRECT", "ORDERS_ANALYTICS_DIRECT", ["ORDERS_ANALYTICS"]),
        # Published to ORDERS_RISK_DIRECT, then enqueued to ORDERS_RISK.
        ("ORDERS_RISK_DIRECT", "ORDERS_RISK_DIRECT", ["ORDERS_RISK"]),
    ],
)
def test_orders_routing_table(publish_to: str, journal: str, enqueued_by: list[str]) -> None:
    queues = load_queue_file(ORDERS_CONFIG)
    landed_in = publish_target(queues, publish_to)
    assert landed_in == journal
    assert [queue.name for queue in queues_for_topic(queues, landed_in)] == enqueued_by


def test_orders_queues_use_amps_defaults() -> None:
    for queue in load_queue_file(ORDERS_CONFIG):
        assert queue.is_regex_topic
        assert queue.semantics is Semantics.AT_LEAST_ONCE
        assert queue.fairness is Fairness.PROPORTIONAL


def test_work_to_do_getting_started_example() -> None:
    # The getting-started queue: WorkToDo, at-most-once, over the journal Work.
    queues = load_queue_file(QUEUE_FILE)
    assert [q.name for q in queues_for_topic(queues, "Work")] == ["WorkToDo"]
    # A publish to the queue's name goes to the one journal it reads.
    assert publish_target(queues, "WorkToDo") == "Work"
    # Subscribers of the journal itself are untouched: Work is not a queue name.
    assert publish_target(queues, "Work") == "Work"
    [work] = queues_for_topic(queues, "Work")
    assert work.fairness is Fairness.ROUND_ROBIN  # the only model at-most-once allows


def test_jobs_and_failed_jobs_example() -> None:
    # "Handling Unprocessed Messages": Jobs expires a message on the 3rd cancel or after the
    # 10th unsuccessful delivery, and expired messages go to FailedJobs for review.
    queues = load_queue_file(
        """
queues:
  - Name: Jobs
    MessageType: json
    MaxCancels: 3
    MaxDeliveries: 10
    dead_letter_topic: FailedJobs
  - Name: FailedJobs
    MessageType: json
"""
    )
    jobs, failed = queues
    assert (jobs.max_cancels, jobs.max_deliveries) == (3, 10)
    assert (failed.max_cancels, failed.max_deliveries) == (0, 0)  # unlimited by default
    assert [q.name for q in queues_for_topic(queues, "Jobs")] == ["Jobs"]
    # A dead letter of Jobs lands in the FailedJobs journal, which the FailedJobs queue reads.
    assert jobs.dead_letter_topic is not None
    assert [q.name for q in queues_for_topic(queues, jobs.dead_letter_topic)] == ["FailedJobs"]


def test_order_priority_example() -> None:
    # "Priority Queues": deliver in order of price * quantity.
    [queue] = load_queue_file(
        """
queues:
  - Name: OrderPriority
    MessageType: json
    Semantics: at-least-once
    UnderlyingTopic: Orders
    Priority: /price * /qty
"""
    )
    assert queue.matches_topic("Orders")
    assert publish_target([queue], "OrderPriority") == "Orders"
    assert queue.priority_expression is not None
    orders = [{"price": 2, "qty": 5}, {"price": 100, "qty": 1}, {"price": "3", "qty": 4}, {}]
    keys = [queue.priority_expression.evaluate(order) for order in orders]
    assert keys == [10, 100, 12, None]


def test_publish_to_a_regex_queue_without_a_target_is_an_error() -> None:
    queues = load_queue_file('queues: [{name: ALL_ORDERS, underlying_topic: "^ORDERS_.*"}]')
    with pytest.raises(QueueConfigError) as caught:
        publish_target(queues, "ALL_ORDERS")
    [(field, message)] = caught.value.problems
    assert field == "ALL_ORDERS.default_publish_target"
    assert "set default_publish_target" in message
    assert publish_target(queues, "ORDERS_EU") == "ORDERS_EU"
    assert [q.name for q in queues_for_topic(queues, "ORDERS_EU")] == ["ALL_ORDERS"]


@given(
    topic=st.text(alphabet=st.sampled_from(list("ORDERS_ANLYTICIK-.x")), min_size=1, max_size=30)
)
def test_publishing_anywhere_reaches_only_queues_that_read_the_journal(topic: str) -> None:
    queues = load_queue_file(ORDERS_CONFIG)
    journal = publish_target(queues, topic)
    for queue in queues_for_topic(queues, journal):
        assert queue.matches_topic(journal)
    assert journal not in {queue.name for queue in queues}


def test_the_examples_in_the_configuration_guide_load() -> None:
    guide = Path(__file__).parents[3] / "docs" / "queue-configuration.md"
    blocks = re.findall(r"```yaml\n(.*?)```", guide.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 3
    names = [[queue.name for queue in load_queue_file(block)] for block in blocks]
    assert names == [
        ["Jobs", "FailedJobs", "WorkToDo", "OrderPriority", "ORDERS_ANALYTICS"],
        ["ORDERS_ANALYTICS", "ORDERS_RISK"],
        ["Jobs", "FailedJobs"],
    ]
    # The guide's ORDERS block is the same configuration as the AMPS one tested above.
    assert load_queue_file(blocks[1]) == load_queue_file(ORDERS_CONFIG)
