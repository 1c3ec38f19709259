"""The validated queue definition (DESIGN §4) and queue files.

A :class:`QueueDefinition` is immutable and always valid: every field is checked, the
expressions are compiled, and combinations AMPS forbids are refused with a message that names
the field and the fix. ``docs/queue-configuration.md`` documents every field with its AMPS name.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from enum import StrEnum
from functools import cached_property
from typing import Any, Final, Self

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from layer.domain.durations import format_duration, parse_duration
from layer.domain.errors import ExpressionError, QueueConfigError
from layer.domain.expressions import Expression, compile_expression
from layer.domain.positions import DEFAULT_RECOVERY_POINT

__all__ = [
    "DEFAULT_LEASE_PERIOD",
    "DEFAULT_MAX_PER_SUBSCRIPTION_BACKLOG",
    "MAX_PARTS",
    "Fairness",
    "Leasing",
    "QueueDefinition",
    "RedeliveryBackoff",
    "Semantics",
    "is_topic_regex",
    "load_queue_file",
    "publish_target",
    "queues_for_topic",
]

# The AMPS chapters in reference/ give no defaults for these two; qlayer's choices are
# documented in docs/queue-configuration.md.
DEFAULT_LEASE_PERIOD: Final = 300.0
DEFAULT_MAX_PER_SUBSCRIPTION_BACKLOG: Final = 10
#: The longest ``delivery_delay``. SQS stops at 15 minutes; entries waiting here hold their
#: journal position (a restart replays from the oldest), so a day bounds that replay.
MAX_DELIVERY_DELAY: Final = 86_400.0
#: The shortest lease, entry lifetime and backoff a queue may set (below it the engine's
#: millisecond clocks would round it to nothing).
MIN_DURATION: Final = 0.001
#: The longest ``lease_period``: 12 hours, the bound a RENEW has (and SQS's visibility timeout).
MAX_LEASE_PERIOD: Final = 43_200.0
#: The longest ``expiration``: 366 days, the bound of a message's own ``qlayer.expiration``.
MAX_EXPIRATION: Final = 366 * 86_400.0
#: The longest ``redelivery_backoff`` delay (``initial``, ``maximum``): a day, as
#: ``delivery_delay``. Without bounds a lease or delay past the year 9999 would be accepted
#: and then fail every time the coordinator stores its deadline.
MAX_REDELIVERY_BACKOFF: Final = 86_400.0

# Kafka's own rule for topic names (and so for queue names, which double as journal names).
_TOPIC_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,249}")
# "." is legal in Kafka topic names ("orders.eu"), so on its own it does not make a regex.
_REGEX_METACHARACTERS: Final = frozenset("^$*+?()[]{}|\\")


class Semantics(StrEnum):
    """[Semantics] what happens to an entry that was delivered but not processed."""

    AT_LEAST_ONCE = "at-least-once"
    AT_MOST_ONCE = "at-most-once"


class Fairness(StrEnum):
    """[delivery fairness] how an AVAILABLE entry picks among consumers with backlog room."""

    FAST = "fast"
    ROUND_ROBIN = "round-robin"
    PROPORTIONAL = "proportional"


class Leasing(StrEnum):
    """[Leasing] whether only the lease holder's token may acknowledge an entry."""

    STRICT = "strict"
    PERMISSIVE = "permissive"


def _enum_value(enum: type[StrEnum], value: object) -> object:
    """Accept enum values case-insensitively and with ``_`` for ``-`` (``AT_LEAST_ONCE``)."""
    if isinstance(value, enum):
        return value
    if isinstance(value, str):
        wanted = value.strip().lower().replace("_", "-").replace(" ", "-")
        for member in enum:
            if member.value == wanted:
                return member
    choices = ", ".join(member.value for member in enum)
    raise ValueError(f"must be one of {choices}; got {value!r}")


def _duration(value: object) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ValueError(str(exc)) from None


def _bounded_duration(value: object, *, low: float, high: float, example: str) -> float:
    """``value`` in seconds, refused outside ``low .. high`` with both ends in the message."""
    seconds = _duration(value)
    if not low <= seconds <= high:
        raise ValueError(f"must be from {format_duration(low)} to {format_duration(high)} "
                         f"(e.g. {example}), got {value!r}")
    return seconds


#: The largest count a queue may set: delivery and cancel counts, backlogs and depths are
#: 32-bit integers in PostgreSQL and on the wire (Avro ``int``).
MAX_COUNT: Final = 2**31 - 1
#: A part is served by a shard: no installation has more than 1,024 (`MAX_SHARD_COUNT`).
MAX_PARTS: Final = 1024


def _count(value: object, *, minimum: int, example: str) -> int:
    """Whole numbers only: YAML ``true`` or ``2.5`` for a count is a mistake, not 1 or 2."""
    if isinstance(value, bool):
        raise ValueError(f"must be a whole number (e.g. {example}), got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        value = int(value)
    if not isinstance(value, int):
        raise ValueError(f"must be a whole number (e.g. {example}), got {value!r}")
    if value < minimum:
        raise ValueError(f"must be at least {minimum} (e.g. {example}), got {value}")
    if value > MAX_COUNT:
        raise ValueError(f"must be at most {MAX_COUNT:,} (e.g. {example}), got {value:,}")
    return value


def _expression_text(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"must be an expression string, got {type(value).__name__}")
    text = value.strip()
    if not text:
        return None
    try:
        # Compiled as written, so error columns count from what the user typed.
        compile_expression(value)
    except ExpressionError as exc:
        raise ValueError(exc.message) from None
    return text


def _topic_name(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a {what} (text), got {type(value).__name__}")
    name = value.strip()
    if not _TOPIC_NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(
            f"{name!r} is not a valid {what}; use 1-249 letters, digits, '.', '_' or '-'"
        )
    return name


def is_topic_regex(underlying_topic: str) -> bool:
    """Whether an ``underlying_topic`` is read as a regular expression rather than a name."""
    return any(char in _REGEX_METACHARACTERS for char in underlying_topic)


class RedeliveryBackoff(BaseModel):
    """Delay before a RELEASEd or lease-expired entry is offered again (beyond AMPS).

    The n-th failed delivery waits ``initial * multiplier**(n-1)`` seconds, at most
    ``maximum``. The default (``initial`` 0) redelivers at once, as AMPS does.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    initial: float = 0.0
    multiplier: float = 2.0
    maximum: float = 300.0

    @field_validator("initial", "maximum", mode="before")
    @classmethod
    def _parse_delay(cls, value: object) -> float:
        return _bounded_duration(value, low=0.0, high=MAX_REDELIVERY_BACKOFF, example="1s")

    @field_validator("multiplier", mode="before")
    @classmethod
    def _check_multiplier(cls, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError(f"must be a number of at least 1 (e.g. 2), got {value!r}")
        try:
            multiplier = float(value)
        except ValueError:
            raise ValueError(f"must be a number of at least 1 (e.g. 2), got {value!r}") from None
        if not math.isfinite(multiplier) or multiplier < 1:
            raise ValueError(f"must be a number of at least 1 (e.g. 2), got {value!r}")
        return multiplier

    @model_validator(mode="after")
    def _check_bounds(self) -> RedeliveryBackoff:
        if self.maximum < self.initial:
            raise ValueError(
                f"maximum ({self.maximum:g}s) is below initial ({self.initial:g}s); "
                "raise maximum or lower initial"
            )
        return self

    def delay_for(self, delivery_count: int) -> float:
        """Seconds to wait before offering an entry again after its ``delivery_count``-th try."""
        if self.initial == 0 or delivery_count <= 1:
            return min(self.initial, self.maximum)
        try:
            delay = self.initial * self.multiplier ** (delivery_count - 1)
        except OverflowError:
            return self.maximum
        return min(delay, self.maximum)


# AMPS configuration element names, accepted as synonyms of the snake_case fields so an AMPS
# <Queue> can be carried over key by key.
_AMPS_NAMES: Final[dict[str, str]] = {
    "Name": "name",
    "UnderlyingTopic": "underlying_topic",
    "DefaultPublishTarget": "default_publish_target",
    "Semantics": "semantics",
    "LeasePeriod": "lease_period",
    "MaxDeliveries": "max_deliveries",
    "MaxCancels": "max_cancels",
    "Expiration": "expiration",
    "MaxPerSubscriptionBacklog": "max_per_subscription_backlog",
    "FairnessModel": "fairness",
    "Priority": "priority",
    "BarrierExpression": "barrier_expression",
    "TargetQueueDepth": "target_queue_depth",
    "Filter": "filter",
    "Leasing": "leasing",
    "RecoveryPoint": "recovery_point",
}


class QueueDefinition(BaseModel):
    """One queue: a named view over journals with its delivery policy (AMPS names in [])."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """[Name] the queue; Kafka-topic-safe, as it may double as a journal name."""
    underlying_topic: str
    """[UnderlyingTopic] journal name or regex; defaults to ``name``."""
    default_publish_target: str | None = None
    """[DefaultPublishTarget] the journal a publish to ``name`` goes to."""
    semantics: Semantics = Semantics.AT_LEAST_ONCE
    lease_period: float = DEFAULT_LEASE_PERIOD
    """[LeasePeriod] seconds a consumer holds an entry before it returns to the queue."""
    max_deliveries: int = 0
    """[MaxDeliveries] 0 = unlimited."""
    max_cancels: int = 0
    """[MaxCancels] RELEASEs before the entry expires; 0 = unlimited."""
    expiration: float | None = None
    """[Expiration] seconds an entry may stay in the queue; None = never."""
    delivery_delay: float = 0.0
    """Seconds after its record's timestamp before an entry may be delivered (beyond AMPS:
    SQS's DelaySeconds, a queue-wide deliver-at); 0 = at once."""
    max_per_subscription_backlog: int = DEFAULT_MAX_PER_SUBSCRIPTION_BACKLOG
    """[MaxPerSubscriptionBacklog] upper bound on any consumer's ``max_backlog``."""
    fairness: Fairness | None = None
    """[FairnessModel] resolved on validation: proportional (at-least-once) / round-robin."""
    priority: str | None = None
    """[Priority] expression; highest first, ties by age."""
    barrier_expression: str | None = None
    """[BarrierExpression] filter selecting barrier messages."""
    target_queue_depth: int | None = None
    """[TargetQueueDepth] only the first N entries are active."""
    filter: str | None = None
    """[Filter] enqueue filter: which journal records enter the queue."""
    leasing: Leasing = Leasing.STRICT
    recovery_point: str = DEFAULT_RECOVERY_POINT
    """[RecoveryPoint] where a new queue starts: beginning, end or an ISO-8601 timestamp."""
    key_groups: bool = False
    """At most one in-flight (leased) entry per record key (beyond AMPS)."""
    redelivery_backoff: RedeliveryBackoff = RedeliveryBackoff()
    dead_letter_topic: str | None = None
    """None: the coordinator derives one from the topic prefix."""
    dead_letter_expired: bool | None = None
    """Whether an entry that leaves by ``expiration`` goes to the dead-letter topic. None:
    yes when ``dead_letter_topic`` is set (AMPS: the action configured for expired messages
    publishes them there), no otherwise (AMPS: expiration is a normal way to leave)."""
    shard: int | None = None
    """The shard the queue lives on (beyond AMPS); None: chosen by ``shard_group`` or name."""
    shard_group: str | None = None
    """Queues with the same group share a shard, so one regex subscription can read them all
    with one backlog (beyond AMPS; docs/coordinator.md)."""
    parts: int = 1
    """Parts the queue is split into by journal partition (beyond AMPS; docs/coordinator.md,
    "Partitioned queues"): partition p is part p mod ``parts``, each part served by a shard
    of its own, so one queue grows past one process. 1: the whole queue on one shard."""

    # -- field rules ----------------------------------------------------------------------------
    @model_validator(mode="before")
    @classmethod
    def _default_underlying_topic(cls, data: Any) -> Any:
        missing = isinstance(data, Mapping) and data.get("underlying_topic") in (None, "")
        if missing and "name" in data:
            return {**data, "underlying_topic": data["name"]}
        return data

    @field_validator("name", mode="before")
    @classmethod
    def _check_name(cls, value: object) -> str:
        return _topic_name(value, "queue name")

    @field_validator("underlying_topic", mode="before")
    @classmethod
    def _check_underlying_topic(cls, value: object) -> str:
        if not isinstance(value, str):
            raise ValueError(f"must be a topic name or regular expression, got {value!r}")
        topic = value.strip()
        if is_topic_regex(topic):
            try:
                re.compile(topic)
            except re.error as exc:
                raise ValueError(f"invalid regular expression {topic!r}: {exc}") from None
            return topic
        return _topic_name(topic, "topic name (and contains no regular-expression characters)")

    @property
    def dead_letters_expired(self) -> bool:
        """Whether expired entries are dead-lettered (``dead_letter_expired`` resolved)."""
        if self.dead_letter_expired is not None:
            return self.dead_letter_expired
        return self.dead_letter_topic is not None

    @field_validator("default_publish_target", "dead_letter_topic", mode="before")
    @classmethod
    def _check_topic(cls, value: object) -> str | None:
        if value is None:
            return None
        return _topic_name(value, "topic name")

    @field_validator("semantics", mode="before")
    @classmethod
    def _parse_semantics(cls, value: object) -> object:
        return _enum_value(Semantics, value)

    @field_validator("fairness", mode="before")
    @classmethod
    def _parse_fairness(cls, value: object) -> object:
        return None if value is None else _enum_value(Fairness, value)

    @field_validator("leasing", mode="before")
    @classmethod
    def _parse_leasing(cls, value: object) -> object:
        return _enum_value(Leasing, value)

    @field_validator("lease_period", mode="before")
    @classmethod
    def _parse_lease_period(cls, value: object) -> float:
        return _bounded_duration(value, low=MIN_DURATION, high=MAX_LEASE_PERIOD, example="30s")

    @field_validator("delivery_delay", mode="before")
    @classmethod
    def _parse_delivery_delay(cls, value: object) -> float:
        if value is None:
            return 0.0
        seconds = _duration(value)
        if not 0 <= seconds <= MAX_DELIVERY_DELAY:
            raise ValueError(
                f"must be from 0s to 24h (e.g. 30s), got {value!r}")
        return seconds

    @field_validator("expiration", mode="before")
    @classmethod
    def _parse_expiration(cls, value: object) -> float | None:
        if value is None:
            return None
        seconds = _duration(value)
        if not MIN_DURATION <= seconds <= MAX_EXPIRATION:
            raise ValueError(
                f"must be from 1ms to 366d (e.g. 1h), or left out to never expire; got {value!r}"
            )
        return seconds

    @field_validator("max_deliveries", "max_cancels", mode="before")
    @classmethod
    def _parse_limit(cls, value: object) -> int:
        return _count(value, minimum=0, example="10; 0 means unlimited")

    @field_validator("max_per_subscription_backlog", mode="before")
    @classmethod
    def _parse_backlog(cls, value: object) -> int:
        return _count(value, minimum=1, example="10")

    @field_validator("target_queue_depth", mode="before")
    @classmethod
    def _parse_depth(cls, value: object) -> int | None:
        return None if value is None else _count(value, minimum=1, example="10000")

    @field_validator("priority", "barrier_expression", "filter", mode="before")
    @classmethod
    def _parse_expression(cls, value: object) -> str | None:
        return _expression_text(value)

    @field_validator("recovery_point", mode="before")
    @classmethod
    def _parse_recovery_point(cls, value: object) -> str:
        if isinstance(value, datetime):  # YAML reads an unquoted timestamp as a datetime
            moment = value
        elif isinstance(value, str):
            word = value.strip().lower()
            if word in ("beginning", "end"):
                return word
            try:
                moment = datetime.fromisoformat(value.strip())
            except ValueError:
                raise ValueError(
                    f"must be 'beginning', 'end' or an ISO-8601 timestamp such as "
                    f"2024-05-01T00:00:00Z; got {value!r}"
                ) from None
        else:
            raise ValueError(f"must be 'beginning', 'end' or an ISO-8601 timestamp; got {value!r}")
        if moment.tzinfo is None:
            raise ValueError(
                f"timestamp {value!s} has no UTC offset; add one, e.g. 2024-05-01T00:00:00Z"
            )
        return moment.isoformat()

    @field_validator("key_groups", mode="before")
    @classmethod
    def _parse_key_groups(cls, value: object) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {value!r}")
        return value

    @field_validator("shard", mode="before")
    @classmethod
    def _parse_shard(cls, value: object) -> int | None:
        return None if value is None else _count(value, minimum=0, example="3")

    @field_validator("parts", mode="before")
    @classmethod
    def _parse_parts(cls, value: object) -> int:
        if value is None:
            return 1
        parts = _count(value, minimum=1, example="4")
        if parts > MAX_PARTS:
            raise ValueError(f"must be at most {MAX_PARTS} (e.g. 4), got {parts}")
        return parts

    @field_validator("shard_group", mode="before")
    @classmethod
    def _parse_shard_group(cls, value: object) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"must be a non-empty name (e.g. orders), got {value!r}")
        return value.strip()

    @field_validator("redelivery_backoff", mode="before")
    @classmethod
    def _parse_backoff(cls, value: object) -> object:
        return RedeliveryBackoff() if value is None else value

    # -- combinations ---------------------------------------------------------------------------
    @model_validator(mode="after")
    def _check_combinations(self) -> QueueDefinition:
        problems = _combination_problems(self.model_dump())
        if self.default_publish_target is not None and not self.matches_topic(
            self.default_publish_target
        ):
            problems.append(
                (
                    "default_publish_target",
                    f"{self.default_publish_target!r} is not matched by underlying_topic "
                    f"{self.underlying_topic!r}, so records published to the queue would never "
                    "enter it; add it to underlying_topic or pick a topic it matches",
                )
            )
        if self.dead_letter_topic is not None and self.matches_topic(self.dead_letter_topic):
            problems.append(
                (
                    "dead_letter_topic",
                    f"{self.dead_letter_topic!r} is read by this queue's underlying_topic, so "
                    "dead letters would re-enter the queue; choose a topic it does not match",
                )
            )
        if self.shard is not None and self.shard_group is not None:
            problems.append(
                (
                    "shard",
                    "give shard or shard_group, not both: shard places the queue itself, "
                    "shard_group places it with the other queues of its group",
                )
            )
        if problems:
            raise QueueConfigError(problems)
        if self.fairness is None:
            # Resolved here so the engine reads one field (AMPS: proportional for
            # at-least-once, round-robin, the only choice, for at-most-once).
            object.__setattr__(self, "fairness", self.effective_fairness)
        return self

    # -- derived --------------------------------------------------------------------------------
    @property
    def effective_fairness(self) -> Fairness:
        if self.fairness is not None:
            return self.fairness
        if self.semantics is Semantics.AT_MOST_ONCE:
            return Fairness.ROUND_ROBIN
        return Fairness.PROPORTIONAL

    @cached_property
    def filter_expression(self) -> Expression | None:
        return None if self.filter is None else compile_expression(self.filter)

    @cached_property
    def priority_expression(self) -> Expression | None:
        return None if self.priority is None else compile_expression(self.priority)

    @cached_property
    def barrier_expr(self) -> Expression | None:
        return (
            None if self.barrier_expression is None else compile_expression(self.barrier_expression)
        )

    @cached_property
    def expression_fields(self) -> frozenset[str]:
        """Every /path the queue's own expressions read (what a projection must keep)."""
        fields: frozenset[str] = frozenset()
        for expression in (self.filter_expression, self.priority_expression, self.barrier_expr):
            if expression is not None:
                fields |= expression.fields()
        return fields

    @property
    def is_regex_topic(self) -> bool:
        return is_topic_regex(self.underlying_topic)

    @cached_property
    def _topic_matcher(self) -> re.Pattern[str] | None:
        return re.compile(self.underlying_topic) if self.is_regex_topic else None

    @property
    def recovery_timestamp(self) -> datetime | None:
        """The recovery point as a timezone-aware datetime, or None for beginning/end."""
        if self.recovery_point in ("beginning", "end"):
            return None
        return datetime.fromisoformat(self.recovery_point)

    def matches_topic(self, topic: str) -> bool:
        """Whether records of journal ``topic`` are offered to this queue.

        A name matches itself only. A regex that starts with ``^`` is applied as written
        (AMPS style, so ``^ORDERS`` also matches ``ORDERS_EU``); any other regex must match the
        whole topic name (``orders-.*`` does not match ``old-orders-1``).
        """
        matcher = self._topic_matcher
        if matcher is None:
            return topic == self.underlying_topic
        if self.underlying_topic.startswith("^"):
            return matcher.search(topic) is not None
        return matcher.fullmatch(topic) is not None

    def journal_topics(self, listed: Mapping[str, int]) -> list[str]:
        """The topics of ``listed`` (name -> partitions) whose records are offered to this
        queue, sorted: a name is looked up, a regex tried on each (`matches_topic`)."""
        if not self.is_regex_topic:
            return [self.underlying_topic] if self.underlying_topic in listed else []
        return sorted(topic for topic in listed if self.matches_topic(topic))

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A changed copy, validated like a new definition (raises QueueConfigError).

        pydantic's own ``model_copy(update=...)`` skips validation and would carry over the
        compiled expressions cached for the old values.
        """
        if not update:
            return super().model_copy(deep=deep)
        changed = type(self).from_mapping({**self.model_dump(), **update})
        assert isinstance(changed, type(self))
        return changed

    @classmethod
    def from_mapping(cls, data: Mapping[str, object]) -> QueueDefinition:
        """Validate a mapping (a YAML queue, a stored row); raises :class:`QueueConfigError`.

        Keys are the snake_case field names; AMPS element names (``LeasePeriod``) and
        kebab-case (``lease-period``) are accepted too. Every problem is reported at once.
        """
        if not isinstance(data, Mapping):
            raise QueueConfigError(
                [("", f"a queue must be a mapping of field names to values, got {_kind(data)}")]
            )
        values, problems = _normalise_keys(data)
        if "name" not in values and not any(field == "name" for field, _ in problems):
            problems.append(("name", "is required (the queue's name, e.g. Jobs)"))
        try:
            definition = cls.model_validate(values)
        except ValidationError as exc:
            field_problems = _validation_problems(exc)
            failed = {field.split(".")[0] for field, _ in field_problems}
            problems.extend(field_problems)
            # Combinations are checked after the fields; report them now too, where the
            # fields they involve are valid, so one pass fixes the whole queue.
            if not any(field == "" for field in failed):
                known = {k: v for k, v in values.items() if k not in failed}
                problems.extend(p for p in _combination_problems(known) if p not in problems)
            raise QueueConfigError(problems) from None
        if problems:
            raise QueueConfigError(problems)
        return definition


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__


_FIELDS: Final = tuple(QueueDefinition.model_fields)


def _suggest(key: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    if close:
        return f"unknown field {key!r} (did you mean {close[0]!r}?)"
    return f"unknown field {key!r}; known fields: {', '.join(_FIELDS)}"


def _normalise_keys(
    data: Mapping[Any, object],
) -> tuple[dict[str, object], list[tuple[str, str]]]:
    values: dict[str, object] = {}
    problems: list[tuple[str, str]] = []
    for raw_key, value in data.items():
        if not isinstance(raw_key, str):
            problems.append((str(raw_key), f"field names must be text, got {raw_key!r}"))
            continue
        key = raw_key.strip()
        field = _AMPS_NAMES.get(key) or key.replace("-", "_").lower()
        if field in ("messagetype", "message_type"):
            # AMPS configurations name the message type of every queue; qlayer reads JSON, so
            # "json" is accepted (and ignored) to let an AMPS <Queue> carry over unchanged.
            if not (isinstance(value, str) and value.strip().lower() == "json"):
                problems.append((key, f"only json is supported, got {value!r}; remove it"))
            continue
        if field not in QueueDefinition.model_fields:
            problems.append((key, _suggest(key, _FIELDS)))
            continue
        if field in values:
            problems.append((field, f"given twice (as {raw_key!r} and another spelling)"))
            continue
        values[field] = value
    return values, problems


def _validation_problems(exc: ValidationError) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"])
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, QueueConfigError):
            problems.extend((_join_field(field, f), m) for f, m in cause.problems)
            continue
        if error["type"] == "extra_forbidden":
            parent, _, key = field.rpartition(".")
            if parent == "redelivery_backoff":
                message = _suggest(key, RedeliveryBackoff.model_fields)
            else:
                message = _suggest(key, _FIELDS)
            problems.append((field, message))
            continue
        if error["type"] == "missing":
            if field not in ("name", "underlying_topic"):  # both reported as a missing name
                problems.append((field, "is required"))
            continue
        message = str(cause) if cause is not None else error["msg"]
        problems.append((field, message))
    return problems


def _join_field(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent and child else parent or child


def _given(value: object) -> bool:
    return value is not None and not (isinstance(value, str) and not value.strip())


def _combination_problems(values: Mapping[str, object]) -> list[tuple[str, str]]:
    """Rules about pairs of fields; tolerant of raw values so it can run after field errors."""
    problems: list[tuple[str, str]] = []
    problems.extend(_parts_problems(values))
    if _given(values.get("target_queue_depth")):
        if _given(values.get("priority")):
            problems.append(
                ("target_queue_depth", "cannot be combined with priority; remove one of them")
            )
        if _given(values.get("barrier_expression")):
            problems.append(
                (
                    "target_queue_depth",
                    "cannot be combined with barrier_expression; remove one of them",
                )
            )
    try:
        semantics = _enum_value(Semantics, values.get("semantics", Semantics.AT_LEAST_ONCE))
        fairness = (
            None if values.get("fairness") is None else _enum_value(Fairness, values["fairness"])
        )
    except ValueError:
        return problems
    if semantics is Semantics.AT_MOST_ONCE and fairness not in (None, Fairness.ROUND_ROBIN):
        problems.append(
            (
                "fairness",
                f"at-most-once queues support only round-robin (got {fairness}); "
                "remove fairness or set it to round-robin",
            )
        )
    return problems


def _parts_problems(values: Mapping[str, object]) -> list[tuple[str, str]]:
    """Rules a queue of several parts cannot keep: one order over the whole queue (each part
    has its own; docs/amps-mapping.md, "Partitioned queues")."""
    parts = values.get("parts")
    if not isinstance(parts, int) or isinstance(parts, bool) or parts <= 1:
        return []
    problems = []
    for field, why in (("barrier_expression", "a barrier holds back every later message of "
                        "the queue, and a queue of several parts has no one order"),
                       ("target_queue_depth", "the active window is the first N entries "
                        "of the queue, and a queue of several parts has no one order")):
        if _given(values.get(field)):
            problems.append(("parts", f"cannot be combined with {field} ({why}); use "
                                      f"parts: 1 or remove {field}"))
    return problems


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: YAML says keys are
    unique, yet PyYAML keeps the last silently, so a queue file's second ``lease_period:``
    (or a second ``queues:``) would quietly undo the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: construct_mapping refuses it below
            if first is None:
                seen[key] = key_node.start_mark.line + 1
            else:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"duplicate key {key!r} (first given at line {first}); give each key once",
                    key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_queue_file(text: str) -> list[QueueDefinition]:
    """Read a YAML queue file (``queues: [{name: ..., ...}, ...]``); raises QueueConfigError.

    Problems of every queue are collected, each field prefixed with the queue's name (or
    ``queues[i]`` when it has none). Queue names must be unique, and a queue's
    ``default_publish_target`` must be a journal, not another queue's name.
    """
    try:
        document = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise QueueConfigError(
            [("", f"not valid YAML{where}: {problem}")], subject="queue file"
        ) from None
    if not isinstance(document, Mapping) or "queues" not in document:
        raise QueueConfigError(
            [("", f"expected a mapping with a 'queues:' list at the top, got {_kind(document)}")],
            subject="queue file",
        )
    problems: list[tuple[str, str]] = []
    for key in document:
        if key != "queues":
            problems.append((str(key), _suggest(str(key), ("queues",))))
    entries = document["queues"]
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise QueueConfigError(
            [("queues", f"must be a list of queues, got {_kind(entries)}")], subject="queue file"
        )
    definitions: list[QueueDefinition] = []
    first_index: dict[str, int] = {}
    for index, entry in enumerate(entries):
        label = f"queues[{index}]"
        if isinstance(entry, Mapping) and isinstance(entry.get("name"), str):
            label = str(entry["name"]).strip() or label
        try:
            definition = QueueDefinition.from_mapping(entry)
        except QueueConfigError as exc:
            problems.extend((f"{label}.{f}" if f else label, m) for f, m in exc.problems)
            continue
        if definition.name in first_index:
            problems.append(
                (
                    f"queues[{index}].name",
                    f"duplicate queue name {definition.name!r} "
                    f"(first defined at queues[{first_index[definition.name]}]); rename one",
                )
            )
            continue
        first_index[definition.name] = index
        definitions.append(definition)
    for definition in definitions:
        target = definition.default_publish_target
        if target is not None and target in first_index and target != definition.name:
            problems.append(
                (
                    f"{definition.name}.default_publish_target",
                    f"{target!r} is the name of another queue; a publish target must be a "
                    "journal (e.g. a _DIRECT topic)",
                )
            )
    if problems:
        raise QueueConfigError(problems, subject="queue file")
    return definitions


def queues_for_topic(queues: Iterable[QueueDefinition], topic: str) -> list[QueueDefinition]:
    """The queues that offer records of journal ``topic`` to their entries, in given order.

    The queue's enqueue ``filter`` still decides per record; this is the topic match only.
    """
    return [queue for queue in queues if queue.matches_topic(topic)]


def publish_target(queues: Iterable[QueueDefinition], name: str) -> str:
    """The journal a publish to ``name`` is written to.

    A queue's name routes to its ``default_publish_target``, or, when it reads one journal by
    name, to that journal. Any other name is a journal itself. A queue over a regex with no
    ``default_publish_target`` has no single journal: that raises QueueConfigError.
    """
    for queue in queues:
        if queue.name != name:
            continue
        if queue.default_publish_target is not None:
            return queue.default_publish_target
        if not queue.is_regex_topic:
            return queue.underlying_topic
        raise QueueConfigError(
            [
                (
                    f"{name}.default_publish_target",
                    f"queue {name!r} reads the regular expression {queue.underlying_topic!r}, "
                    "so a publish to the queue's name has no journal to go to; set "
                    "default_publish_target or publish to one of its journals",
                )
            ]
        )
    return name
