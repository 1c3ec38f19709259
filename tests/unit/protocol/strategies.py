"""Hypothesis strategies for every protocol record."""

from __future__ import annotations

from hypothesis import strategies as st

from layer.protocol import (
    AckItem,
    AckItemResult,
    AckRecord,
    AckResult,
    AckStatus,
    AckType,
    Bookmark,
    Event,
    EventType,
    GrantSemantics,
    Heartbeat,
    QueueGrant,
    Replace,
    RequestKind,
    SessionEnded,
    SessionEndReason,
    Subscribe,
    SubscribeResult,
    SubscribeStatus,
    Unsubscribe,
)

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
# Avro strings are UTF-8, which cannot hold lone surrogates.
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
OPT_TEXT = st.none() | TEXT
OPT_INT32 = st.none() | INT32
OPT_INT64 = st.none() | INT64

topic_names = st.from_regex(r"[a-zA-Z0-9._-]{1,40}", fullmatch=True).filter(
    lambda name: name not in (".", "..")
)
bookmarks = st.builds(
    Bookmark,
    topic_names,
    st.integers(min_value=0, max_value=2**31 - 1),
    st.integers(min_value=0, max_value=2**63 - 1),
)

subscribes = st.builds(
    Subscribe,
    consumer_id=TEXT,
    session_id=TEXT,
    request_id=TEXT,
    queue=TEXT,
    queue_is_regex=st.booleans(),
    max_backlog=OPT_INT32,
    filter=OPT_TEXT,
    delivery_topic=TEXT,
    session_timeout_ms=INT64,
    client_name=TEXT,
    client_version=TEXT,
    sent_at_ms=INT64,
)
replaces = st.builds(
    Replace,
    consumer_id=TEXT,
    session_id=TEXT,
    request_id=TEXT,
    queue=TEXT,
    queue_is_regex=st.booleans(),
    max_backlog=OPT_INT32,
    filter=OPT_TEXT,
    delivery_topic=TEXT,
    sent_at_ms=INT64,
)
heartbeats = st.builds(Heartbeat, consumer_id=TEXT, session_id=TEXT, sent_at_ms=INT64)
unsubscribes = st.builds(
    Unsubscribe, consumer_id=TEXT, session_id=TEXT, reason=OPT_TEXT, sent_at_ms=INT64
)
control_messages = st.one_of(subscribes, replaces, heartbeats, unsubscribes)

ack_items = st.builds(
    AckItem,
    queue=TEXT,
    bookmark=TEXT | bookmarks.map(str),
    lease=TEXT,
    type=st.sampled_from(AckType),
    delay_ms=OPT_INT64,
    reason=OPT_TEXT,
)
ack_records = st.builds(
    AckRecord,
    consumer_id=TEXT,
    session_id=TEXT,
    sent_at_ms=INT64,
    items=st.lists(ack_items, max_size=8).map(tuple),
)

queue_grants = st.builds(
    QueueGrant,
    queue=TEXT,
    max_backlog=INT32,
    lease_period_ms=INT64,
    semantics=st.sampled_from(GrantSemantics),
)
subscribe_results = st.builds(
    SubscribeResult,
    consumer_id=TEXT,
    session_id=TEXT,
    request_id=TEXT,
    request=st.sampled_from(RequestKind),
    status=st.sampled_from(SubscribeStatus),
    message=OPT_TEXT,
    queues=st.lists(queue_grants, max_size=4).map(tuple),
    session_timeout_ms=INT64,
    heartbeat_interval_ms=INT64,
    coordinator_id=TEXT,
    sent_at_ms=INT64,
)
ack_results = st.builds(
    AckResult,
    consumer_id=TEXT,
    session_id=TEXT,
    items=st.lists(
        st.builds(
            AckItemResult,
            queue=TEXT,
            bookmark=TEXT,
            type=st.sampled_from(AckType),
            status=st.sampled_from(AckStatus),
            lease_expires_ms=OPT_INT64,
            message=OPT_TEXT,
        ),
        max_size=6,
    ).map(tuple),
    sent_at_ms=INT64,
)
sessions_ended = st.builds(
    SessionEnded,
    consumer_id=TEXT,
    session_id=TEXT,
    reason=st.sampled_from(SessionEndReason),
    message=OPT_TEXT,
    sent_at_ms=INT64,
)
reply_messages = st.one_of(subscribe_results, ack_results, sessions_ended)

events = st.builds(
    Event,
    type=st.sampled_from(EventType),
    timestamp_ms=INT64,
    coordinator_id=TEXT,
    coordinator_epoch=INT64,
    queue=OPT_TEXT,
    bookmark=st.none() | bookmarks,
    consumer_id=OPT_TEXT,
    session_id=OPT_TEXT,
    delivery_count=OPT_INT32,
    reason=OPT_TEXT,
    lease_expires_ms=OPT_INT64,
    available_at_ms=OPT_INT64,
    record_timestamp_ms=OPT_INT64,
)
