from __future__ import annotations

import pytest
from hypothesis import given

from layer.protocol import Bookmark, ProtocolError, ProtocolErrorKind

from . import strategies


def test_parse_and_format() -> None:
    bookmark = Bookmark.parse("orders.eu/2/1041")
    assert bookmark == Bookmark("orders.eu", 2, 1041)
    assert str(bookmark) == bookmark.format() == "orders.eu/2/1041"


def test_bookmarks_order_by_topic_partition_offset() -> None:
    texts = ["b/0/1", "a/1/0", "a/0/10", "a/0/9"]
    assert [str(b) for b in sorted(map(Bookmark.parse, texts))] == [
        "a/0/9",
        "a/0/10",
        "a/1/0",
        "b/0/1",
    ]


@given(strategies.bookmarks)
def test_any_bookmark_round_trips_through_its_text(bookmark: Bookmark) -> None:
    assert Bookmark.parse(str(bookmark)) == bookmark


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("orders/1", "is not topic/partition/offset"),
        ("a/b/1/2", "is not topic/partition/offset"),
        ("", "is not topic/partition/offset"),
        ("orders/-1/5", "partition '-1'"),
        ("orders/+1/5", "partition '+1'"),
        ("orders/01/5", "partition '01'"),
        ("orders/1/ 5", "offset ' 5'"),
        ("orders/1/1_000", "offset '1_000'"),
        ("orders/1/١٢", "offset '١٢'"),  # Arabic-Indic digits: int() would take them
        ("orders/1/", "offset ''"),
        ("orders/1/99999999999999999999", "offset '99999999999999999999'"),
        ("orders/1/9223372036854775808", "offset in 0..9223372036854775807"),
        ("orders/2147483648/0", "partition must be in 0..2147483647"),
        ("/1/2", "topic name cannot be empty"),
        ("ord ers/1/2", "may only contain"),
        ("../1/2", "not allowed"),
    ],
)
def test_malformed_bookmarks_are_refused_with_a_reason(text: str, words: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        Bookmark.parse(text)
    assert caught.value.kind is ProtocolErrorKind.BAD_BOOKMARK
    assert words in str(caught.value)


def test_constructor_refuses_negative_numbers() -> None:
    with pytest.raises(ProtocolError):
        Bookmark("orders", 0, -1)
