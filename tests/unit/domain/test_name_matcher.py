"""Regex subscriptions match queue names with RE2: whole names, in linear time."""

from __future__ import annotations

import re

import pytest

from layer.domain.likepattern import NamePatternError, name_matcher


def test_a_pattern_matches_whole_names() -> None:
    matches = name_matcher("Orders_.*")
    assert matches("Orders_EU") and matches("Orders_")
    assert not matches("xOrders_EU") and not matches("Orders")


def test_a_pattern_that_backtracks_exponentially_in_re_is_answered() -> None:
    # With `re` this takes longer than the age of the universe; RE2 is linear in the name.
    assert name_matcher("(a+)+$")("a" * 5000 + "b") is False
    assert name_matcher("(a|aa)*c")("a" * 5000) is False


@pytest.mark.parametrize(("pattern", "says"), [
    ("(W)o\\1", "backreferences"),
    ("Work(?=s)", "look"),
    ("Wo(rk", "missing )"),
])
def test_what_re2_cannot_run_is_an_re_error_saying_why(pattern: str, says: str) -> None:
    with pytest.raises(NamePatternError, match=re.escape(says)) as raised:
        name_matcher(pattern)
    assert isinstance(raised.value, re.error)  # refused wherever an invalid regex was
