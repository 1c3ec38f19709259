"""The expression language: what a filter, priority or barrier written by a user evaluates to."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layer.domain.errors import ExpressionError, QlayerError
from layer.domain.expressions import (
    Expression,
    RawDocument,
    as_number,
    compile_expression,
    document_of,
    parse_document,
    project,
)
from tests.support.examples import examples

ORDER: dict[str, Any] = {
    "region": "EU",
    "price": 2.5,
    "qty": 4,
    "qty_text": "4",
    "name": "Widget",
    "flag": True,
    "nothing": None,
    "blank": "",
    "order": {"id": "A-1", "lines": [{"sku": "x", "n": 1}, {"sku": "y", "n": 3}]},
    "tags": ["red", "green"],
    "scores": [10, 20, 40],
    "empty": [],
    "order-id": "hyphenated",
    "@Px": 90.25,
    "ünïcode": "yes",
}


def ev(text: str, doc: object = ORDER) -> object:
    return compile_expression(text).evaluate(doc)


# -- values and paths ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/region", "EU"),
        ("/order/id", "A-1"),
        ("/order/lines[1]/sku", "y"),
        ("/order/lines/1/sku", "y"),  # a digit segment indexes an array too
        ("/tags[0]", "red"),
        ("/order-id", "hyphenated"),  # '-' inside a name belongs to the name
        ("/@Px", 90.25),
        ("/ünïcode", "yes"),
        ("/missing", None),
        ("/region/deeper", None),  # a path through a string
        ("/tags[9]", None),  # past the end
        ("/nothing", None),
        ("/blank", None),  # AMPS: an empty string is NULL
        ("42", 42),
        ("2.5e2", 250.0),
        (".5", 0.5),
        ("'it''s'", "it's"),
        ('"double ""quoted"""', 'double "quoted"'),
        ("TRUE", True),
        ("false", False),
        ("NULL", None),
        ("''", None),
    ],
)
def test_values_and_paths(text: str, expected: object) -> None:
    assert ev(text) == expected
    assert type(ev(text)) is type(expected)


def test_path_through_array_of_objects_collects_every_element() -> None:
    assert ev("/order/lines/sku") == ["x", "y"]
    assert ev("/order/lines/sku = 'y'") is True
    assert ev("/order/lines/n > 2") is True
    assert ev("/order/lines/n > 3") is False
    assert ev("/order/lines/absent") is None


def test_paths_on_documents_that_are_not_objects_are_null() -> None:
    for doc in (None, 5, "text", [1, 2], True):
        assert ev("/region", doc) is None
    assert ev("/0", [7, 8]) == 7
    assert ev("/1/a", [{}, {"a": 1}]) == 1


def test_string_literals_keep_backslashes_for_regular_expressions() -> None:
    assert ev(r"'\d+'") == r"\d+"


# -- arithmetic ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/price * /qty", 10.0),
        ("/qty + 1", 5),
        ("/qty - 10", -6),
        ("/qty / 8", 0.5),
        ("7 % 3", 1),
        ("-7 % 3", -1),  # the sign follows the dividend, as in AMPS
        ("7 % -3", 1),
        ("-5 MOD 3", -2),
        ("5 mod -3", 2),
        ("7.5 % 2", 1.5),
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("10 - 4 - 3", 3),  # left-associative
        ("16 / 4 / 2", 2.0),
        ("-/qty", -4),
        ("- -3", 3),
        ("+/qty_text", 4),
        ("/qty_text * 2", 8),  # numeric strings are numbers, as for AMPS text fields
        ("' 12 ' + 1", 13),
        ("/scores + 1", 11),  # an array stands for its first element
        ("10/2", 5.0),  # after a number, '/' can only be division
        ("/qty /2", 2.0),  # after a path, a spaced '/' divides
    ],
)
def test_arithmetic(text: str, expected: object) -> None:
    result = ev(text)
    assert result == expected
    assert type(result) is type(expected)


@pytest.mark.parametrize(
    "text",
    [
        "'abc' * 2",
        "/name + 1",
        "/missing + 1",
        "1 + NULL",
        "/qty / 0",
        "/qty % 0",
        "TRUE + 1",
        "/order * 2",
        "/empty + 1",
        "1e308 * 10",  # overflow to infinity is not a number
        "-'x'",
        "'1e999' + 1",
    ],
)
def test_arithmetic_type_problems_are_null_not_errors(text: str) -> None:
    assert ev(text) is None


def test_path_with_division_needs_spaces_because_slash_starts_a_path() -> None:
    # "/a/2" is the path a → 2, as in AMPS, where '/' must be spaced to divide.
    assert ev("/a/2", {"a": {"2": "two"}}) == "two"
    assert ev("/a / 2", {"a": 8}) == 4.0
    assert compile_expression("/a/2").fields() == frozenset({"/a/2"})


# -- comparisons -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/region = 'EU'", True),
        ("/region == 'EU'", True),
        ("/region != 'EU'", False),
        ("/region <> 'US'", True),
        ("/qty > 3", True),
        ("/qty >= 4", True),
        ("/qty < 4", False),
        ("/qty <= 4", True),
        ("2 = 2.0", True),
        ("/qty = '4'", True),  # number against numeric string compares numerically
        ("/qty_text = 4.0", True),
        ("10 < '2'", False),  # AMPS: '2' is converted to a number
        ("'2.000' <> '2.0'", True),  # two strings compare as strings
        ("10 < 'Crank It Up'", True),  # AMPS: strings are greater than numbers
        ("'Crank It Up' > 10", True),
        ("/qty = 'four'", False),
        ("'apple' < 'banana'", True),
        ("'B' < 'a'", True),  # code point order
        ("/flag = TRUE", True),
        ("/flag != FALSE", True),
        ("/flag = 1", False),  # a boolean is not a number
    ],
)
def test_comparisons(text: str, expected: bool) -> None:
    assert ev(text) is expected


@pytest.mark.parametrize(
    "text",
    [
        "/missing = 1",
        "/nothing != 1",
        "NULL = NULL",
        "'' = ''",  # AMPS: an empty string is NULL, so even '' = '' is not TRUE
        "10 < ''",
        "10 > ''",
        "/blank = ''",
        "/flag > FALSE",  # booleans have no order
        "/order = /order",  # objects are not comparable
        "/empty = 1",  # an empty array is NULL
    ],
)
def test_comparisons_with_null_are_null(text: str) -> None:
    assert ev(text) is None


def test_comparison_operators_are_array_aware() -> None:
    doc = {"data": [1, 2, "zebra", 4], "other": [4, 30, 50]}
    assert ev("/data = 1", doc) is True
    assert ev("/data = 'zebra'", doc) is True
    assert ev("/data != 'zebra'", doc) is True  # some element is not 'zebra'
    assert ev("/data = 42", doc) is False
    assert ev("/other > 40", doc) is True
    assert ev("/other > 50", doc) is False
    assert ev("/data = /other", doc) is True  # 4 is in both
    assert ev("/data[0] = 1", doc) is True
    assert ev("/data[1] != 1", doc) is True
    assert ev("/data[2] = 'zebra'", doc) is True


# -- logic -----------------------------------------------------------------------------------

TRUTH = {"TRUE": True, "FALSE": False, "NULL": None}


@pytest.mark.parametrize("left", TRUTH)
@pytest.mark.parametrize("right", TRUTH)
def test_and_or_follow_three_valued_logic(left: str, right: str) -> None:
    a, b = TRUTH[left], TRUTH[right]
    # Kleene logic: FALSE dominates AND, TRUE dominates OR, otherwise unknown stays unknown.
    expected_and = False if False in (a, b) else (True if a is True and b is True else None)
    expected_or = True if True in (a, b) else (False if a is False and b is False else None)
    assert ev(f"{left} AND {right}") is expected_and
    assert ev(f"{left} OR {right}") is expected_or


def test_not_is_the_three_valued_complement() -> None:
    assert ev("NOT TRUE") is False
    assert ev("NOT FALSE") is True
    assert ev("NOT NULL") is None
    assert ev("NOT /missing = 1") is None
    assert ev("NOT NOT /flag") is True


def test_logic_on_values_that_are_not_booleans_is_null() -> None:
    assert ev("/qty AND TRUE") is None
    assert ev("NOT /region") is None
    assert ev("/region OR FALSE") is None
    assert ev("/region OR TRUE") is True  # TRUE decides OR whatever the other side is
    assert ev("/region AND FALSE") is False


def test_precedence_not_over_and_over_or() -> None:
    # Read as (TRUE) OR (FALSE AND FALSE) → TRUE; if OR bound tighter it would be FALSE.
    assert ev("TRUE OR FALSE AND FALSE") is True
    # NOT binds tighter than AND: (NOT FALSE) AND FALSE → FALSE.
    assert ev("NOT FALSE AND FALSE") is False
    assert ev("NOT (FALSE AND FALSE)") is True
    # Comparison binds tighter than NOT.
    assert ev("NOT /qty = 5") is True


def test_keywords_are_case_insensitive() -> None:
    assert ev("/qty between 1 and 5 aNd /region In ('EU') oR fAlSe") is True
    assert ev("/nothing is not null") is False
    assert ev("/region NoT LiKe 'U$'") is False


def test_and_short_circuits_but_keeps_null_semantics() -> None:
    assert ev("FALSE AND /qty / 0 > 1") is False
    assert ev("TRUE OR /qty / 0 > 1") is True
    assert ev("/qty / 0 > 1 AND FALSE") is False
    assert ev("/qty / 0 > 1 OR TRUE") is True


# -- IN, LIKE, BETWEEN, IS NULL ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/region IN ('EU', 'US')", True),
        ("/region IN ('US', 'APAC')", False),
        ("/region NOT IN ('US', 'APAC')", True),
        ("/region NOT IN ('EU')", False),
        ("/qty IN (1, 2, 4)", True),
        ("/qty IN ('4')", True),
        ("/qty_text IN (4)", True),
        ("/qty_text IN ('4.0')", False),  # two strings compare as strings
        ("/flag IN (TRUE)", True),
        ("/flag IN (1)", False),
        ("/qty IN (/price + 1.5, 100)", True),  # members may be expressions
        ("/qty IN (/missing, 4)", True),
        ("/region IN ('US', NULL)", None),  # no match and a NULL member: unknown
        ("/region IN ('EU', NULL)", True),
        ("/region NOT IN ('US', NULL)", None),
        ("/missing IN (1, 2)", None),
        ("/missing NOT IN (1, 2)", None),
        ("/qty IN (/missing, 5)", None),
        ("/tags IN ('green')", True),  # any element of an array
        ("/tags NOT IN ('green')", False),
        ("/empty IN (1)", None),
    ],
)
def test_in(text: str, expected: bool | None) -> None:
    assert ev(text) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/name LIKE 'idg'", True),  # a regular expression search, not anchored
        ("/name LIKE '^idg'", False),
        ("/name LIKE '^Wid.*t$'", True),
        ("/name LIKE '^widget$'", False),  # case-sensitive
        ("/name LIKE '(?i)^widget$'", True),  # PCRE-style inline flag for case
        ("/name NOT LIKE 'x'", True),
        ("'a.b' LIKE '^a\\.b$'", True),  # no escape processing in strings: \. reaches the regex
        ("'axb' LIKE '^a\\.b$'", False),
        ("'Straße' LIKE '(?i)^STRASSE$'", False),  # case folding is per character
        ("'ÉCOLE' LIKE '(?i)^école$'", True),  # ...and Unicode-aware
        ("'a7' LIKE '^a\\d$'", True),
        ("'a٣' LIKE '^a\\d$'", False),  # \d is [0-9], as in PCRE (AMPS)
        ("'Wid' LIKE '^[[:alpha:]]+$'", True),  # POSIX classes read as in PCRE
        ("'W1d' LIKE '^[[:alpha:]]+$'", False),
        ("'aaa' LIKE '^a{0,3}$'", True),
        ("'aaaa' LIKE '^a{0,3}$'", False),
        ("'a\nb' LIKE '^b'", False),  # ^ and $ are the text's ends...
        ("'a\nb' LIKE '(?m)^b'", True),  # ...or its lines' with (?m)
        ("'a\nb' LIKE 'a.b'", False),  # . is not a newline...
        ("'a\nb' LIKE '(?s)a.b'", True),  # ...unless (?s)
        ("'x' LIKE '\\Qx\\E'", True),
        ("/qty LIKE '^4$'", True),  # numbers match as their JSON text
        ("/price LIKE '^2\\.5$'", True),
        ("/tags LIKE '^gr'", True),  # any element of an array
        ("/name LIKE 'it''s'", False),
        ("'it''s' LIKE 't''s$'", True),
    ],
)
def test_like_is_a_regular_expression_match(text: str, expected: bool) -> None:
    assert ev(text) is expected


@pytest.mark.parametrize(
    "text", ["/missing LIKE 'a'", "/flag LIKE 'True'", "/order LIKE 'a'", "/blank LIKE '^$'"]
)
def test_like_on_null_or_non_text_is_null(text: str) -> None:
    assert ev(text) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/qty BETWEEN 4 AND 10", True),  # inclusive at both ends
        ("/qty BETWEEN 0 AND 4", True),
        ("/qty BETWEEN 5 AND 10", False),
        ("/qty NOT BETWEEN 5 AND 10", True),
        ("/price BETWEEN 2 AND 3 AND /region = 'EU'", True),  # the first AND is BETWEEN's
        ("(/price * /qty) BETWEEN 0 AND 10", True),
        ("/name BETWEEN 'A' AND 'Z'", True),
        ("/scores BETWEEN 15 AND 25", True),  # one element in range
        ("/scores BETWEEN 21 AND 39", False),
        ("/qty BETWEEN 10 AND 1", False),
        ("/qty_text BETWEEN 3 AND 5", True),
        ("/missing BETWEEN 1 AND 2", None),
        ("/qty BETWEEN NULL AND 10", None),
        ("/qty BETWEEN NULL AND 3", False),  # qty <= 3 is FALSE whatever the low bound
        ("/qty NOT BETWEEN NULL AND 10", None),
    ],
)
def test_between(text: str, expected: bool | None) -> None:
    assert ev(text) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/missing IS NULL", True),
        ("/nothing IS NULL", True),
        ("/blank IS NULL", True),
        ("/empty IS NULL", True),  # AMPS: an empty array is NULL
        ("/region IS NULL", False),
        ("/region IS NOT NULL", True),
        ("/nothing IS NOT NULL", False),
        ("/tags IS NOT NULL", True),
        ("(/qty / 0) IS NULL", True),
        ("'abc' * 2 IS NULL", True),
    ],
)
def test_is_null_is_never_null_itself(text: str, expected: bool) -> None:
    assert ev(text) is expected


# -- the Expression object -------------------------------------------------------------------


def test_matches_only_when_exactly_true() -> None:
    assert compile_expression("/region = 'EU'").matches(ORDER)
    assert not compile_expression("/region = 'US'").matches(ORDER)
    assert not compile_expression("/missing = 'EU'").matches(ORDER)  # null does not match
    assert not compile_expression("NOT (/missing = 'EU')").matches(ORDER)
    assert not compile_expression("/qty").matches(ORDER)  # 4 is not TRUE
    assert compile_expression("/flag").matches(ORDER)


def test_fields_lists_the_normalised_paths_read() -> None:
    expression = compile_expression(
        "/region = 'EU' AND /order/qty * /price > 10 OR /items[2]/sku LIKE 'x' OR 1 = 1"
    )
    assert expression.fields() == frozenset({"/region", "/order/qty", "/price", "/items/2/sku"})
    assert compile_expression("1 + 2").fields() == frozenset()


def test_expressions_are_equal_and_hash_by_text() -> None:
    first = compile_expression("/a = 1")
    assert first == compile_expression("/a = 1")
    assert hash(first) == hash(compile_expression("/a = 1"))
    assert first != compile_expression("/a=1")
    assert {first, compile_expression("/a = 1")} == {first}
    assert first.text == "/a = 1"
    assert repr(first) == "Expression('/a = 1')"


def test_expressions_survive_pickling() -> None:
    original = compile_expression("/qty * 2 > 5")
    copy = pickle.loads(pickle.dumps(original))
    assert copy == original
    assert copy.evaluate(ORDER) is True


def test_expression_is_immutable() -> None:
    expression = compile_expression("/a = 1")
    with pytest.raises(AttributeError):
        expression.text = "/b = 2"  # type: ignore[misc]


def test_constant_sub_expressions_do_not_read_the_document() -> None:
    # Folded at compile time: a document of any shape gives the same value.
    expression = compile_expression("(1 + 2) * 3 = 9 AND 'a' IN ('a', 'b')")
    assert expression.evaluate(None) is True
    assert expression.evaluate({"anything": 1}) is True


def test_evaluate_never_raises_on_unusual_python_objects() -> None:
    class Weird(dict[str, Any]):
        def get(self, key: str, default: object = None) -> object:
            raise RuntimeError("boom")

    expression = compile_expression("/a = 1")
    assert expression.evaluate(Weird()) is None
    assert expression.evaluate(object()) is None
    assert compile_expression("/a > 1").evaluate({"a": float("nan")}) is False


def test_as_number_is_the_coercion_used_for_priorities() -> None:
    assert as_number(5) == 5
    assert as_number(2.5) == 2.5
    assert as_number("42") == 42
    assert as_number(" -1.5e1 ") == -15.0
    assert as_number([7, 8]) == 7
    for value in (None, True, "abc", "", [], {}, float("nan"), float("inf"), "nan", "1_000"):
        assert as_number(value) is None


# -- parse errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "column", "expected_words"),
    [
        ("/a = ", 5, ["expected a value", "end of the expression"]),
        ("/price > > 3", 10, ["expected a value", "found '>'"]),
        ("/a = 1 AND", 11, ["expected", "end of the expression"]),
        ("(/a = 1", 8, ["')'"]),
        ("/a IN 1, 2", 7, ["'('", "found '1'"]),
        ("region = 'EU'", 1, ["expected a value", "found 'r'"]),
        ("/a = 'unterminated", 6, ['found "\'"']),
        ("/a LIKE /b", 9, ["a 'string'", "found '/b'"]),
        ("/a # 1", 4, ["'#'"]),
        ("/a BETWEEN 1 OR 2", 14, ["AND", "found 'OR'"]),
        ("/a IS 1", 7, ["NULL", "NOT"]),
    ],
)
def test_syntax_errors_name_the_column_and_what_was_expected(
    text: str, column: int, expected_words: list[str]
) -> None:
    with pytest.raises(ExpressionError) as caught:
        compile_expression(text)
    error = caught.value
    assert error.column == column, str(error)
    assert error.line == 1
    assert error.position == column - 1
    assert error.text == text
    assert f"column {column}" in str(error)
    for word in expected_words:
        assert word in str(error), str(error)


def test_syntax_error_on_a_later_line_names_line_and_column() -> None:
    with pytest.raises(ExpressionError) as caught:
        compile_expression("/a = 1\nAND /b = = 2")
    assert (caught.value.line, caught.value.column) == (2, 10)
    assert "line 2, column 10" in str(caught.value)


def test_invalid_like_pattern_is_reported_at_the_pattern() -> None:
    with pytest.raises(ExpressionError) as caught:
        compile_expression("/name LIKE '(unclosed'")
    assert caught.value.column == 12
    assert "regular expression" in str(caught.value)


@pytest.mark.parametrize("pattern", ["a\\K", "(?R)", "a++", "(?>a)", "(?x) a", "a\\N{DASH}"])
def test_pcre_only_like_syntax_is_refused_rather_than_misread(pattern: str) -> None:
    with pytest.raises(ExpressionError, match="regular expression"):
        compile_expression(f"/name LIKE '{pattern}'")


# -- LIKE runs in linear time (issue 15 item 4) ------------------------------------------------


def test_a_catastrophic_like_pattern_is_answered_in_linear_time() -> None:
    # With a backtracking engine '^(a+)+$' against 'a' * 27 + 'b' took 17.8 s; against
    # 'a' * 5000 + 'b' it would not finish in the life of the universe.
    expression = compile_expression("/s LIKE '^(a+)+$'")
    assert expression.evaluate({"s": "a" * 27 + "b"}) is False
    assert expression.evaluate({"s": "a" * 5000 + "b"}) is False
    assert expression.evaluate({"s": "a" * 5000}) is True
    assert compile_expression("/s LIKE '(x+x+)+y'").evaluate({"s": "x" * 5000}) is False
    assert compile_expression("/s NOT LIKE '^(a|aa)+$'").evaluate({"s": "a" * 5000 + "!"}) is True


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("(.)\\1", "backreferences such as \\1 are not supported"),
        ("(?P<c>.)(?P=c)", "a backreference (?P=name) is not supported"),
        ("(a)\\k<1>", "backreferences such as \\k<name> are not supported"),
        ("^(?=.*x)", "lookahead (?=...) is not supported"),
        ("^(?!x)", "lookahead (?!...) is not supported"),
        ("(?<=a)b", "lookbehind (?<=...) is not supported"),
        ("(?<!a)b", "lookbehind (?<!...) is not supported"),
        ("(a|b(?1))", "recursion (?1...) is not supported"),
        ("(?>a+)b", "an atomic group (?>...) is not supported"),
    ],
)
def test_like_patterns_only_a_backtracking_engine_can_run_are_refused_with_the_reason(
    pattern: str, why: str
) -> None:
    text = f"/state LIKE '{pattern}'"
    with pytest.raises(ExpressionError) as caught:
        compile_expression(text)
    message = str(caught.value)
    assert message.startswith(f"invalid regular expression for LIKE '{pattern}': {why}: "), message
    assert "linear-time regular expression engine (RE2)" in message
    assert message.endswith("at column 13")
    assert caught.value.column == 13


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("a{,3}", "write {0,3} for a repetition"),  # re: {0,3}; PCRE and RE2: the text
        ("a{,}", "write {0,} for a repetition"),
        ("end\\Z", "write $"),  # re: the very end; PCRE: also before a final newline
        ("end\\z", "write $"),
    ],
)
def test_like_syntax_engines_read_differently_is_refused(pattern: str, why: str) -> None:
    with pytest.raises(ExpressionError, match="regular expression for LIKE") as caught:
        compile_expression(f"/s LIKE '{pattern}'")
    assert why in str(caught.value)


@pytest.mark.parametrize(
    "pattern",
    ["[(?=]x", "[a{,3}]", "\\(?=", "\\Q(?=\\1\\E", "[]{,3}]", "\\{,3}", "\\\\Z", "\\101"],
)
def test_refused_constructs_are_fine_as_text(pattern: str) -> None:
    # Inside a class, escaped or quoted, the same characters are plain text.
    expression = compile_expression(f"/s LIKE '{pattern}'")
    assert expression.evaluate({"s": "nothing here"}) is False


@pytest.mark.parametrize(
    ("subject", "pattern", "expected"),
    [
        ("abc\n", "^abc$", True),  # $ matches before a final newline, as in PCRE and re
        ("abc\n", "c$", True),
        ("abc\n", "^abc\n$", True),
        ("abc\n\n", "^abc$", False),  # only one
        ("abc\nd", "c$", False),
        ("abc\nd", "(?m)c$", True),
        ("abc", "^abc$", True),
    ],
)
def test_dollar_matches_as_in_pcre(subject: str, pattern: str, expected: bool) -> None:
    expression = compile_expression(f"/s LIKE '{pattern}'")
    assert expression.evaluate({"s": subject}) is expected


def test_like_never_raises_on_text_that_is_not_unicode() -> None:
    # json.loads accepts a lone surrogate ("\\ud800"), which has no UTF-8 form; it is one
    # character to LIKE, as it was to Python's re.
    document = json.loads('{"s": "x\\ud800y"}')
    assert compile_expression("/s LIKE '^x.y$'").evaluate(document) is True
    assert compile_expression("/s LIKE '^x..y$'").evaluate(document) is False
    assert compile_expression("/s LIKE '^xy'").evaluate(document) is False


def test_a_pattern_too_large_for_the_engine_is_refused() -> None:
    with pytest.raises(ExpressionError, match="pattern too large"):
        compile_expression("/s LIKE '\\pL{1000}'")


@pytest.mark.parametrize("text", ["", "   ", "\n"])
def test_empty_expression_is_an_error(text: str) -> None:
    with pytest.raises(ExpressionError, match="empty"):
        compile_expression(text)


def test_expression_error_is_a_qlayer_error_and_a_value_error() -> None:
    with pytest.raises(QlayerError):
        compile_expression("/a =")
    with pytest.raises(ValueError):
        compile_expression("/a =")


def test_number_literal_too_large_is_a_compile_error() -> None:
    # (More digits than int() converts, 4,300, no longer fit in an expression: MAX_LENGTH.)
    with pytest.raises(ExpressionError, match="out of range"):
        compile_expression("/a = 1e999")


def test_deeply_nested_expression_compiles_or_fails_cleanly() -> None:
    text = "(" * 50 + "/a" + ")" * 50 + " = 1"
    assert compile_expression(text).evaluate({"a": 1}) is True
    # Deeper than MAX_DEPTH (test_expression_limits.py): refused by a count on the parse tree,
    # before compiling could exhaust Python's stack (or evaluating could, giving NULL).
    deep = "NOT " * 1000 + "/a"
    with pytest.raises(ExpressionError, match="nested 1,001 levels deep"):
        compile_expression(deep)


# -- documents -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"a": 1}', {"a": 1}),
        ('{"a": [1, "x"]}', {"a": [1, "x"]}),
        (bytearray(b"[1, 2]"), [1, 2]),
        (memoryview(b'"text"'), "text"),
        ("\ufeff{}".encode(), {}),  # a UTF-8 byte-order mark is tolerated
        (b"null", None),
        (None, None),
        (b"", None),
        (b"{not json", None),
        (b'{"a": 1} trailing', None),
        (b"\xff\xfe{}", None),  # not UTF-8
        ('{"a": 1}'.encode("utf-16"), None),  # valid JSON, but not UTF-8
        (b'{"a": NaN}', None),  # NaN and Infinity are not JSON
        (b"[Infinity]", None),
        (b"[" * 100_000 + b"]" * 100_000, None),  # nesting beyond the recursion limit
        (b"1" * 5000, None),  # more digits than Python will convert
    ],
)
def test_parse_document(raw: bytes | str | None, expected: object) -> None:
    assert parse_document(raw) == expected


def test_malformed_payload_makes_filters_null_without_stopping() -> None:
    expression = compile_expression("/region = 'EU' OR /region IS NULL")
    assert expression.evaluate(parse_document(b"\x00\x01garbage")) is True
    assert not compile_expression("/region = 'EU'").matches(parse_document(b"\xc3\x28"))


# -- projection ------------------------------------------------------------------------------


def test_project_keeps_only_the_fields_an_expression_reads() -> None:
    expression = compile_expression(
        "/order/lines/n > 2 AND /tags[1] = 'green' AND /region = 'EU' AND /gone IS NULL"
    )
    kept = project(ORDER, expression.fields())
    assert kept == {
        "order": {"lines": ORDER["order"]["lines"]},
        "tags": {"1": "green"},
        "region": "EU",
    }
    assert expression.evaluate(kept) is True
    assert len(json.dumps(kept)) < len(json.dumps(ORDER))


def test_project_of_a_field_and_a_field_below_it_keeps_the_outer_one_whole() -> None:
    kept = project(ORDER, ["/order/id", "/order"])
    assert kept == {"order": ORDER["order"]}


def test_project_of_a_top_level_array_fanned_out_returns_it() -> None:
    doc = [{"a": 1}, {"a": 2}]
    assert project(doc, ["/a"]) is doc
    assert project(None, ["/a"]) == {}


# -- properties ------------------------------------------------------------------------------

KEYS = ["a", "b", "c", "0", "1"]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5)
    | st.sampled_from(["", "1", "2.5", "-3", "abc", "EU"]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS), children, max_size=4)
    ),
    max_leaves=12,
)
documents = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=5) | json_values

paths = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3).map(lambda p: "/" + "/".join(p))
literals = st.sampled_from(
    ["0", "1", "2.5", "-3", "'EU'", "'1'", "''", "'abc'", "TRUE", "FALSE", "NULL", "1e300"]
)
# Also the bracket form of an index: "/a/0" → "/a[0]" (never at the start: "[0]" alone is no path).
operands = paths | literals | paths.map(lambda p: p[:2] + p[2:].replace("/0", "[0]", 1))


def _arithmetic(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.tuples(children, st.sampled_from(["+", "-", "*", "/", "%", "MOD"]), children).map(
        lambda t: f"({t[0]} {t[1]} {t[2]})"
    )


values = st.recursive(operands, _arithmetic, max_leaves=4)


def _predicates() -> st.SearchStrategy[str]:
    comparison = st.tuples(
        values, st.sampled_from(["=", "==", "!=", "<>", "<", "<=", ">", ">="]), values
    ).map(lambda t: f"{t[0]} {t[1]} {t[2]}")
    membership = st.tuples(values, st.booleans(), st.lists(values, min_size=1, max_size=3)).map(
        lambda t: f"{t[0]} {'NOT ' if t[1] else ''}IN ({', '.join(t[2])})"
    )
    like = st.tuples(values, st.sampled_from(["'^a'", "'1$'", "'(?i)eu'", "'.'"])).map(
        lambda t: f"{t[0]} LIKE {t[1]}"
    )
    between = st.tuples(values, values, values).map(lambda t: f"{t[0]} BETWEEN {t[1]} AND {t[2]}")
    is_null = st.tuples(values, st.booleans()).map(
        lambda t: f"{t[0]} IS {'NOT ' if t[1] else ''}NULL"
    )
    return comparison | membership | like | between | is_null | values


def _logic(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    binary = st.tuples(children, st.sampled_from(["AND", "OR"]), children).map(
        lambda t: f"({t[0]} {t[1]} {t[2]})"
    )
    return binary | children.map(lambda c: f"NOT ({c})")


expressions = st.recursive(_predicates(), _logic, max_leaves=5)


@settings(max_examples=examples(300), deadline=None)
@given(text=expressions, doc=documents)
def test_evaluate_never_raises_and_matches_agrees(text: str, doc: object) -> None:
    expression = compile_expression(text)
    value = expression.evaluate(doc)
    assert expression.matches(doc) is (value is True)


@settings(max_examples=examples(200), deadline=None)
@given(text=expressions, doc=documents)
def test_not_is_the_three_valued_complement_for_any_expression(text: str, doc: object) -> None:
    value = compile_expression(text).evaluate(doc)
    negated = compile_expression(f"NOT ({text})").evaluate(doc)
    expected = {True: False, False: True}.get(value) if isinstance(value, bool) else None
    assert negated is expected


@settings(max_examples=examples(200), deadline=None)
@given(left=expressions, right=expressions, doc=documents)
def test_de_morgan_holds_in_three_valued_logic(left: str, right: str, doc: object) -> None:
    a = compile_expression(f"NOT (({left}) AND ({right}))").evaluate(doc)
    b = compile_expression(f"(NOT ({left})) OR (NOT ({right}))").evaluate(doc)
    assert a is b


@settings(max_examples=examples(200), deadline=None)
@given(text=expressions, doc=documents)
def test_projection_gives_the_same_result(text: str, doc: object) -> None:
    expression = compile_expression(text)
    assert expression.evaluate(project(doc, expression.fields())) == expression.evaluate(doc)


@settings(max_examples=examples(300), deadline=None)
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_parse_document_never_raises(raw: bytes) -> None:
    document = parse_document(raw)
    if document is not None:
        # Whatever it decodes to is plain JSON, so it encodes back.
        json.dumps(document)


@settings(max_examples=examples(300), deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("/ab01 ()'=<>!+-*%,.NOTANDINLKE")), max_size=30))
def test_compile_raises_only_expression_errors(text: str) -> None:
    try:
        expression = compile_expression(text)
    except ExpressionError as error:
        assert error.text == text
        if error.position is not None:
            assert 0 <= error.position <= len(text)
    else:
        assert isinstance(expression, Expression)
        expression.evaluate({"a": 1, "b": [1, "x"]})


MIRRORED = {"=": "=", "!=": "!=", "<>": "<>", "<": ">", "<=": ">=", ">": "<", ">=": "<="}


@settings(max_examples=examples(300), deadline=None)
@given(
    path=paths,
    op=st.sampled_from(sorted(MIRRORED)),
    literal=literals | st.integers(-5, 5).map(str) | st.sampled_from(["'a'", "'2'", "'EU'"]),
    doc=documents,
)
def test_comparison_is_symmetric_under_mirroring(
    path: str, op: str, literal: str, doc: object
) -> None:
    # "/a < 3" and "3 > /a" must agree (the first takes the field-against-literal fast path).
    forward = compile_expression(f"{path} {op} {literal}").evaluate(doc)
    mirrored = compile_expression(f"{literal} {MIRRORED[op]} {path}").evaluate(doc)
    assert forward is mirrored


# --- documents parsed on first read ------------------------------------------------------------


@settings(max_examples=examples(300))
@given(expressions, documents)
def test_a_raw_document_evaluates_as_its_parsed_json(text: str, doc: Any) -> None:
    # The coordinator hands queues the record's bytes (RawDocument), parsed when a filter
    # first reads them: every expression must see exactly what the parsed document gives.
    expression = compile_expression(text)
    raw = RawDocument(json.dumps(doc).encode())
    assert expression.evaluate(raw) == expression.evaluate(parse_document(json.dumps(doc)))
    assert document_of(raw) == parse_document(json.dumps(doc))


def test_a_raw_document_that_is_not_json_reads_as_null_everywhere() -> None:
    raw = RawDocument(b"\xff not json")
    assert compile_expression("/a IS NULL").matches(raw)
    assert not compile_expression("/a = 1").matches(raw)
    assert document_of(raw) is None
    assert document_of(RawDocument(None)) is None


def test_a_raw_document_is_parsed_once() -> None:
    raw = RawDocument(b'{"region": "EU", "qty": 3}')
    first = document_of(raw)
    assert first == {"region": "EU", "qty": 3}
    assert document_of(raw) is first
    assert project(raw, ["/qty"]) == {"qty": 3}
