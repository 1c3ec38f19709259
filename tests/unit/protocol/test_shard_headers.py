"""Protocol 2 headers: the answering shard on replies, the hop count on passed-on records."""

from __future__ import annotations

from layer.protocol import forwarded_headers, forwarded_hops, reply_headers, reply_shard


def test_a_reply_names_its_shard() -> None:
    assert reply_headers() == [("qlayer.reply", b"1")]
    headers = reply_headers(3)
    assert headers == [("qlayer.reply", b"1"), ("qlayer.shard", b"3")]
    assert reply_shard(headers) == 3
    assert reply_shard(reply_headers()) is None
    assert reply_shard(None) is None


def test_a_bad_shard_header_is_ignored_not_trusted() -> None:
    for value in (b"-1", b"x", b"", b"99999", None):
        assert reply_shard([("qlayer.reply", b"1"), ("qlayer.shard", value)]) is None


def test_hops_count_and_bad_values_read_as_none() -> None:
    assert forwarded_hops(None) == 0
    assert forwarded_hops(forwarded_headers(1)) == 1
    assert forwarded_hops([("qlayer.forwarded", b"2"), ("qlayer.forwarded", b"3")]) == 3
    assert forwarded_hops([("qlayer.forwarded", b"lots")]) == 0
