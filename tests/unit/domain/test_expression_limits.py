"""What one expression may cost (issue 36, finding 2; docs/expressions.md, "Limits").

Each limit is refused with a message naming it and the figures, and the costly steps are
refused *before* they run: the length before lark parses, the depth and the number of LIKE
patterns before RE2 compiles any. That order is what keeps a refusal in milliseconds (the
benchmark, benchmarks/hostile_filter.py, times it; no test here does). And no expression the
project itself uses (docs, the demo's queue file, the tests) passes a limit.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

import layer.domain.expressions as expressions
from layer.domain.boundedcache import BoundedCache
from layer.domain.errors import ExpressionError
from layer.domain.expressions import (
    EXPRESSION_CACHE_BYTES,
    FILTER_MAX_MEM,
    MAX_DEPTH,
    MAX_LENGTH,
    MAX_LIKE_PATTERNS,
    ExpressionLimitError,
    compile_expression,
)
from layer.domain.likepattern import (
    MAX_INSTRUCTIONS,
    PATTERN_MAX_MEM,
    LikeProgram,
    NamePatternError,
    compile_like,
    name_matcher,
)

ROOT = Path(__file__).resolve().parents[3]

#: The report's filters: 4.6 KB of 200 patterns RE2 took 15-27 s to compile, and 6.9 KB of
#: 299 of them and one RE2 refuses.
REPORTED_A = "/r = 0 AND (" + " OR ".join(["/f0 LIKE '\\pL{140}'"] * 200) + ")"
REPORTED_B = "/r = 0 AND (" + " OR ".join(["/g0 LIKE '\\pL{140}'"] * 299
                                          + ["/g0 LIKE '\\pL{999}'"]) + ")"


@pytest.fixture
def like_compiles(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every (pattern, RE2 budget) the expression compiler hands to RE2, in order."""
    calls: list[tuple[str, int]] = []

    def counting(pattern: str, max_mem: int = PATTERN_MAX_MEM) -> LikeProgram:
        calls.append((pattern, max_mem))
        return compile_like(pattern, max_mem)

    monkeypatch.setattr(expressions, "compile_like", counting)
    return calls


def refused(text: str) -> ExpressionLimitError:
    with pytest.raises(ExpressionLimitError) as caught:
        compile_expression(text)
    assert isinstance(caught.value, ExpressionError)  # caught wherever a bad filter is
    return caught.value


def ors(term: str, count: int) -> str:
    return " OR ".join([term] * count)


# -- length ------------------------------------------------------------------------------------


def test_an_expression_over_the_length_limit_is_refused_before_it_is_parsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_parser() -> None:
        raise AssertionError("parsed")

    monkeypatch.setattr(expressions, "_parser", no_parser)
    error = refused("/a = '" + "x" * MAX_LENGTH + "'")
    assert error.limit == "MAX_LENGTH"
    assert str(error) == (f"the expression is {MAX_LENGTH + 7:,} characters long; "
                          f"the limit is {MAX_LENGTH:,}")


def test_an_expression_of_the_length_limit_compiles() -> None:
    text = "/a = '" + "x" * (MAX_LENGTH - 7) + "'"
    assert len(text) == MAX_LENGTH
    assert compile_expression(text).evaluate({"a": "x" * (MAX_LENGTH - 7)}) is True


@pytest.mark.parametrize("text", [REPORTED_A, REPORTED_B])
def test_the_reported_filters_are_refused_without_compiling_a_pattern(
        text: str, like_compiles: list[tuple[str, int]]) -> None:
    assert refused(text).limit == "MAX_LENGTH"
    assert like_compiles == []


# -- depth ---------------------------------------------------------------------------------------


def test_an_expression_of_the_depth_limit_compiles_and_evaluates() -> None:
    # A chain of n ORs over comparisons is n + 1 levels deep (a comparison over its operands).
    chain = " OR ".join(f"/a = {i}" for i in range(MAX_DEPTH - 1))
    expression = compile_expression(chain)
    assert expression.evaluate({"a": MAX_DEPTH - 2}) is True  # the deepest term is reached
    assert expression.evaluate({"a": -1}) is False
    nots = "NOT " * (MAX_DEPTH - 1) + "/a"
    assert compile_expression(nots).evaluate({"a": True}) is (MAX_DEPTH % 2 == 1)


@pytest.mark.parametrize("text", [
    " OR ".join(f"/a = {i}" for i in range(MAX_DEPTH)),
    "NOT " * MAX_DEPTH + "/a",
    "/a" + " + 1" * MAX_DEPTH,
])
def test_an_expression_over_the_depth_limit_is_refused_before_a_pattern_is_compiled(
        text: str, like_compiles: list[tuple[str, int]]) -> None:
    error = refused(text + " OR /s LIKE 'x'")
    assert error.limit == "MAX_DEPTH"
    assert re.fullmatch(rf"the expression is nested \d+ levels deep; the limit is {MAX_DEPTH} "
                        r"\(every operator is a level, .*write /x IN \(a, b, \.\.\.\) instead\)",
                        str(error)), str(error)
    assert like_compiles == []


def test_parentheses_add_no_depth() -> None:
    text = "(" * 1000 + "/a" + ")" * 1000 + " = 1"
    assert compile_expression(text).evaluate({"a": 1}) is True


# -- LIKE patterns --------------------------------------------------------------------------------


def test_the_most_like_patterns_compile(like_compiles: list[tuple[str, int]]) -> None:
    text = ors("/s LIKE '^a|b$'", MAX_LIKE_PATTERNS)
    assert compile_expression(text).evaluate({"s": "xb"}) is True
    assert len(like_compiles) == MAX_LIKE_PATTERNS


def test_one_like_pattern_too_many_is_refused_before_any_is_compiled(
        like_compiles: list[tuple[str, int]]) -> None:
    text = ors("/s LIKE 'x'", MAX_LIKE_PATTERNS + 1)
    error = refused(text)
    assert error.limit == "MAX_LIKE_PATTERNS"
    assert str(error) == (f"the expression has {MAX_LIKE_PATTERNS + 1} LIKE patterns; the "
                          f"limit is {MAX_LIKE_PATTERNS} (join alternatives into one pattern: "
                          "'a|b|c')")
    assert error.position == text.rindex("'x'")  # the first one over the limit
    assert like_compiles == []


def test_a_filter_of_many_large_patterns_within_the_length_is_refused_by_their_count(
        like_compiles: list[tuple[str, int]]) -> None:
    text = ors("/f LIKE '\\pL{140}'", 180)  # 180 of the report's patterns, 3,956 characters
    assert len(text) <= MAX_LENGTH
    assert refused(text).limit == "MAX_LIKE_PATTERNS"
    assert like_compiles == []


@pytest.mark.parametrize(("count", "each"), [
    (1, PATTERN_MAX_MEM),
    (8, PATTERN_MAX_MEM),
    (9, FILTER_MAX_MEM // 9),
    (MAX_LIKE_PATTERNS, FILTER_MAX_MEM // MAX_LIKE_PATTERNS),
])
def test_the_patterns_of_one_expression_share_its_re2_budget(
        count: int, each: int, like_compiles: list[tuple[str, int]]) -> None:
    compile_expression(ors("/s LIKE 'a+b'", count))
    assert [budget for _, budget in like_compiles] == [each] * count
    assert sum(budget for _, budget in like_compiles) <= FILTER_MAX_MEM


def test_a_pattern_too_large_for_its_re2_budget_is_refused_saying_so() -> None:
    error = refused("/s LIKE '\\pL{999}'")
    assert error.limit == "PATTERN_MAX_MEM"
    assert str(error).startswith(
        "invalid regular expression for LIKE '\\pL{999}': pattern too large: its RE2 program "
        "does not fit in the 1 MiB of memory one pattern may use here")
    assert error.column == 9


def test_a_pattern_of_too_many_instructions_is_refused_saying_so() -> None:
    error = refused("/s LIKE '\\pL{9}'")  # fits 1 MiB of RE2 memory, ~10,800 instructions
    assert error.limit == "MAX_INSTRUCTIONS"
    assert re.match(r"the LIKE patterns up to '\\pL\{9\}' compile to 10,\d{3} RE2 instructions; "
                    rf"the limit is {MAX_INSTRUCTIONS:,} per expression", str(error)), str(error)


def test_the_instructions_of_all_patterns_count_together(
        like_compiles: list[tuple[str, int]]) -> None:
    one = "/s LIKE '\\pL{5}'"  # ~6,000 instructions: one fits, two do not
    assert compile_expression(one).evaluate({"s": "abcde"}) is True
    error = refused(f"{one} OR /t LIKE '\\pL{{5}}'")
    assert error.limit == "MAX_INSTRUCTIONS"
    assert error.column == len(one) + len(" OR /t LIKE ") + 1  # the pattern that passed it
    assert len(like_compiles) == 3  # the first expression's, then two: none after the limit


def test_syntax_errors_are_not_limit_errors() -> None:
    with pytest.raises(ExpressionError) as caught:
        compile_expression("/a = ")
    assert not isinstance(caught.value, ExpressionLimitError)


# -- the caches ------------------------------------------------------------------------------------


def test_the_expression_cache_is_bounded_in_bytes_not_entries() -> None:
    cache = expressions._EXPRESSIONS
    # Distinct LIKE filters, each charged its pattern's 1 MiB RE2 budget: the cache keeps the
    # most recent of them within its budget and lets the older ones go.
    texts = [f"/s LIKE 'bounded{i}'" for i in range(2 * EXPRESSION_CACHE_BYTES // PATTERN_MAX_MEM)]
    compiled = [compile_expression(t) for t in texts]
    assert cache.bytes <= EXPRESSION_CACHE_BYTES
    assert cache.get(texts[0]) is None
    assert cache.get(texts[-1]) is compiled[-1]
    assert compile_expression(texts[-1]) is compiled[-1]  # answered from the cache
    # Small expressions cost little: more of them than the old 1,024 entries fit at once.
    small = [f"/n = {i}" for i in range(1500)]
    for text in small:
        compile_expression(text)
    assert all(cache.get(text) is not None for text in small)
    assert cache.bytes <= EXPRESSION_CACHE_BYTES


def test_bounded_cache_evicts_the_least_recently_used_by_cost() -> None:
    cache: BoundedCache[str, int] = BoundedCache(100)
    cache.put("a", 1, 40)
    cache.put("b", 2, 40)
    assert cache.get("a") == 1  # now b is the least recently used
    cache.put("c", 3, 40)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (1, None, 3)
    assert cache.bytes == 80 and len(cache) == 2
    cache.put("a", 4, 10)  # replaced: its old cost is given back
    assert cache.bytes == 50 and cache.get("a") == 4
    cache.put("huge", 5, 101)  # larger than the whole budget: not kept, nothing evicted
    assert cache.get("huge") is None and len(cache) == 2
    cache.clear()
    assert cache.bytes == 0 and cache.get("a") is None


def test_a_queue_regex_of_too_many_instructions_is_refused() -> None:
    with pytest.raises(NamePatternError, match=rf"10,\d{{3}} RE2 instructions; the limit is "
                       rf"{MAX_INSTRUCTIONS:,}") as caught:
        name_matcher("Orders_\\pL{9}")
    assert isinstance(caught.value, re.error)
    assert name_matcher("Orders_\\pL+")("Orders_Ünï")


def test_a_queue_regex_too_large_for_its_budget_is_refused() -> None:
    with pytest.raises(NamePatternError, match=r"pattern too large: .* 256 KiB"):
        name_matcher("\\pL{999}")


# -- no expression of the project's own passes a limit -------------------------------------------

#: Expressions the project uses to show a limit (they are meant to pass it).
SHOWING_A_LIMIT = {"/s LIKE '\\pL{1000}'"}


def _doc_expressions() -> Iterator[tuple[str, str]]:
    """Code spans, code-block lines and YAML expression fields of every page in docs/."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for span in re.findall(r"`([^`\n]+)`", text):
            yield page.name, span
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                yield page.name, line.strip()
                field = re.match(r"\s*-?\s*(filter|priority|barrier_expression):\s*(.+)", line)
                if field:
                    value = yaml.safe_load(field.group(2))
                    if isinstance(value, str):
                        yield page.name, value
                for quoted in re.findall(r"--filter[ =](\"[^\"]*\"|'[^']*')", line):
                    yield page.name, quoted[1:-1]


def _demo_expressions() -> Iterator[tuple[str, str]]:
    document = yaml.safe_load((ROOT / "layer" / "demo" / "queues.yaml").read_text())
    for queue in document["queues"]:
        for field in ("filter", "priority", "barrier_expression"):
            if isinstance(queue.get(field), str):
                yield "layer/demo/queues.yaml", queue[field]


_EXPRESSION_ARGUMENTS = {"filter", "priority", "barrier_expression", "barrier", "text",
                         "expression"}


def _test_expressions() -> Iterator[tuple[str, str]]:
    """String literals the tests pass to compile_expression or as a filter / priority /
    barrier (positionally or by keyword, or as a queue definition's value)."""
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if name == "compile_expression" and node.args:
                    values = [node.args[0]]
                else:
                    values = [k.value for k in node.keywords if k.arg in _EXPRESSION_ARGUMENTS]
            elif isinstance(node, ast.Dict):
                values = [v for k, v in zip(node.keys, node.values, strict=True)
                          if isinstance(k, ast.Constant) and k.value in _EXPRESSION_ARGUMENTS]
            else:
                continue
            for value in values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield str(path.relative_to(ROOT)), value.value


@pytest.mark.parametrize("source", [_doc_expressions, _demo_expressions, _test_expressions],
                         ids=["docs", "demo", "tests"])
def test_no_expression_the_project_uses_passes_a_limit(
        source: Callable[[], Iterator[tuple[str, str]]]) -> None:
    compiled = 0
    for where, text in source():
        if text in SHOWING_A_LIMIT:
            continue
        try:
            compile_expression(text)
        except ExpressionLimitError as error:
            pytest.fail(f"{where}: {text!r} passes {error.limit}: {error}")
        except ExpressionError:
            continue  # not an expression, or one shown failing for its syntax
        compiled += 1
    assert compiled > 0  # the collection found what it looks for
