"""The AMPS expression subset used by queue filters, priorities and barriers (DESIGN §4).

An expression is parsed once with a LALR grammar (lark) and compiled to a tree of Python
closures; evaluation walks no parse tree, calls no ``eval`` and never raises. Values follow
SQL three-valued logic: any operation on null is null, and a filter *matches* a document only
when its result is exactly ``True``. The language reference is ``docs/expressions.md``.

Consumers send filters, and the coordinator compiles them on the thread every shard of the
process shares, so what one expression may cost is bounded before anything expensive runs:
its length before it is parsed, its depth and number of LIKE patterns before any pattern is
compiled, and the RE2 memory and program size of its patterns while they are (docs/
expressions.md, "Limits"; issue 36).
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final, TypeAlias

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from layer.domain.boundedcache import BoundedCache
from layer.domain.errors import ExpressionError
from layer.domain.likepattern import (
    MAX_INSTRUCTIONS,
    PATTERN_MAX_MEM,
    LikePatternError,
    LikePatternTooLargeError,
    compile_like,
)

__all__ = [
    "EXPRESSION_CACHE_BYTES",
    "FILTER_MAX_MEM",
    "MAX_DEPTH",
    "MAX_LENGTH",
    "MAX_LIKE_PATTERNS",
    "Document",
    "Expression",
    "ExpressionLimitError",
    "PartialDocument",
    "RawDocument",
    "as_number",
    "compile_expression",
    "document_of",
    "parse_document",
    "parse_path",
    "project",
]

Document: TypeAlias = object
"""A decoded JSON value: dict, list, str, int, float, bool or None."""

Evaluator: TypeAlias = Callable[[Document], object]

# Keywords are case-insensitive and whole words. There are no bare identifiers in the
# language (fields are always /paths), so a keyword can never be mistaken for a field name.
# MUL_OP's "/" and PATH's leading "/" never compete: the contextual lexer only offers PATH
# where an operand is expected and MUL_OP where an operator is expected.
_GRAMMAR: Final = r"""
?start: or_expr

?or_expr: and_expr
        | or_expr OR and_expr               -> or_op
?and_expr: not_expr
         | and_expr AND not_expr            -> and_op
?not_expr: predicate
         | NOT not_expr                     -> not_op
?predicate: sum
          | sum COMPARE sum                 -> compare
          | sum [NOT] IN _LPAR sum (_COMMA sum)* _RPAR -> in_op
          | sum [NOT] LIKE STRING           -> like_op
          | sum [NOT] BETWEEN sum AND sum   -> between_op
          | sum IS [NOT] NULL               -> is_null_op
?sum: product
    | sum ADD_OP product                    -> arith
?product: unary
        | product MUL_OP unary              -> arith
?unary: atom
      | ADD_OP unary                        -> sign
?atom: NUMBER                               -> number
     | STRING                               -> string
     | PATH                                 -> path
     | TRUE                                 -> true
     | FALSE                                -> false
     | NULL                                 -> null
     | _LPAR or_expr _RPAR

OR: /or\b/i
AND: /and\b/i
NOT: /not\b/i
IN: /in\b/i
LIKE: /like\b/i
BETWEEN: /between\b/i
IS: /is\b/i
NULL: /null\b/i
TRUE: /true\b/i
FALSE: /false\b/i
COMPARE: /==|!=|<>|<=|>=|=|<|>/
ADD_OP: /[+-]/
MUL_OP: /[*\/%]|mod\b/i
NUMBER: /(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?/
STRING: /'(?:[^']|'')*'/ | /"(?:[^"]|"")*"/
PATH: /(?:\/[\w$@.:][\w$@.:\-]*(?:\[\d+\])*)+/
_LPAR: "("
_RPAR: ")"
_COMMA: ","

%import common.WS
%ignore WS
"""

_TERMINAL_NAMES: Final[dict[str, str]] = {
    "OR": "OR",
    "AND": "AND",
    "NOT": "NOT",
    "IN": "IN",
    "LIKE": "LIKE",
    "BETWEEN": "BETWEEN",
    "IS": "IS",
    "NULL": "NULL",
    "TRUE": "TRUE",
    "FALSE": "FALSE",
    "COMPARE": "a comparison (= != < <= > >=)",
    "ADD_OP": "a sign (+ or -)",
    "MUL_OP": "an operator (* / % MOD)",
    "ARITHMETIC": "an arithmetic operator (+ - * / % MOD)",
    "NUMBER": "a number",
    "STRING": "a 'string'",
    "PATH": "a /field path",
    "_LPAR": "'('",
    "_RPAR": "')'",
    "_COMMA": "','",
    "$END": "the end of the expression",
}
# Listed in this order in "expected ..." messages: values first, then operators.
_TERMINAL_ORDER: Final[tuple[str, ...]] = tuple(_TERMINAL_NAMES)
_VALUE_TERMINALS: Final = frozenset({"NUMBER", "STRING", "PATH", "TRUE", "FALSE", "NULL"})

# -- Limits (docs/expressions.md, "Limits", says why each value; measured there) --------------

# Characters in one expression, checked before parsing: lark's LALR parser takes 4-10 µs per
# character (the worst shapes are `1+1+1...` and deep parentheses), so 4,096 characters parse
# in 45 ms at worst on the development machine. Filters are typically under 200 characters; an
# IN list of 400 short codes fits.
MAX_LENGTH: Final = 4096

# Levels of the parse tree (parentheses add none; each operator adds one, so a chain of ORs is
# as deep as it is long). Compiling takes two Python frames per level and evaluating up to two,
# so 200 levels stay far below Python's 1,000-frame limit whatever the caller's own depth; past
# ~450 the old code failed to compile or, worse, evaluated to NULL.
MAX_DEPTH: Final = 200

# LIKE patterns in one expression, counted on the parse tree before any is compiled. The 4.6 KB
# filter of issue 36 had 200 and took 11-29 s to compile; with this many at most, one
# expression compiles in well under 100 ms whatever its patterns.
MAX_LIKE_PATTERNS: Final = 16

# RE2 memory all the LIKE patterns of one expression may use together: each pattern gets
# PATTERN_MAX_MEM (1 MiB), or an equal share of this when there are more than eight. RE2 keeps
# each pattern's programs and DFA caches within its budget, so a filter can never grow past it
# however many records it is matched against (the same 8 MiB one pattern could use before).
FILTER_MAX_MEM: Final = 8 << 20

# The compiled-expression cache, bounded by what its entries hold (`_cost`): a subscription
# that ends leaves at most this much behind in it. About 4,000 ordinary filters, or 32 with a
# LIKE pattern at the full 1 MiB budget.
EXPRESSION_CACHE_BYTES: Final = 32 << 20

# What a compiled expression holds besides its patterns' RE2 memory: closures, constants,
# paths. Measured with tracemalloc at 16-100 bytes per character of text (more for IN lists
# of strings, less for long names), plus ~1.6 KB for the smallest; rounded up.
_BASE_BYTES: Final = 2048
_BYTES_PER_CHARACTER: Final = 128



class ExpressionLimitError(ExpressionError):
    """An expression refused for what it would cost, not for its syntax: ``limit`` names the
    constant it passes (``"MAX_LENGTH"``, ``"MAX_DEPTH"``, ``"MAX_LIKE_PATTERNS"``,
    ``"MAX_INSTRUCTIONS"``, ``"PATTERN_MAX_MEM"``), and the message gives the figures."""

    def __init__(
        self,
        limit: str,
        message: str,
        *,
        text: str,
        position: int | None = None,
        line: int | None = None,
        column: int | None = None,
    ) -> None:
        super().__init__(message, text=text, position=position, line=line, column=column)
        self.limit = limit


_PATH_SEGMENT: Final = re.compile(r"/([^/\[]+)((?:\[\d+\])*)")
_INDEX: Final = re.compile(r"\[(\d+)\]")
_NUMERIC_TEXT: Final = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_INT_TEXT: Final = re.compile(r"[+-]?\d+")


@lru_cache(maxsize=1)
def _parser() -> Lark:
    # Built once per process on first use; a Lark LALR parser is immutable after construction.
    return Lark(_GRAMMAR, parser="lalr", lexer="contextual", maybe_placeholders=True)


# --------------------------------------------------------------------------------------------
# Values and the operations on them. Every function here is total: it returns a value or None
# (null) and never raises, which is what lets evaluation run per message inside the loop.
# --------------------------------------------------------------------------------------------


def _number_from_text(text: str) -> int | float | None:
    stripped = text.strip()
    if not _NUMERIC_TEXT.fullmatch(stripped):
        return None
    try:
        if _INT_TEXT.fullmatch(stripped):
            return int(stripped)
        value = float(stripped)
    except ValueError:  # e.g. more digits than int() accepts
        return None
    return value if math.isfinite(value) else None


def as_number(value: object) -> int | float | None:
    """The number ``value`` stands for, with the coercion rules of the language.

    JSON numbers are numbers; strings holding a plain decimal number (``"42"``, ``" 1.5e3 "``)
    are read as numbers, as AMPS does for text fields; an array stands for its first element
    (AMPS: scalar operators use the first element); everything else (bool, null, other
    strings, empty arrays, objects, NaN, infinities) has no number. The engine uses this to
    turn a priority expression's result into a sort key.
    """
    kind = type(value)
    if kind is list:
        return as_number(value[0]) if value else None  # type: ignore[index]
    if kind is int:
        return value  # type: ignore[return-value]
    if kind is float:
        return value if math.isfinite(value) else None  # type: ignore[arg-type,return-value]
    if kind is str:
        return _number_from_text(value)  # type: ignore[arg-type]
    return None


def _finite(result: int | float) -> int | float | None:
    if type(result) is float and not math.isfinite(result):
        return None
    return result


def _add(left: object, right: object) -> object:
    a, b = as_number(left), as_number(right)
    if a is None or b is None:
        return None
    try:
        return _finite(a + b)
    except ArithmeticError:
        return None


def _subtract(left: object, right: object) -> object:
    a, b = as_number(left), as_number(right)
    if a is None or b is None:
        return None
    try:
        return _finite(a - b)
    except ArithmeticError:
        return None


def _multiply(left: object, right: object) -> object:
    a, b = as_number(left), as_number(right)
    if a is None or b is None:
        return None
    try:
        return _finite(a * b)
    except ArithmeticError:
        return None


def _divide(left: object, right: object) -> object:
    a, b = as_number(left), as_number(right)
    if a is None or b is None or b == 0:
        return None
    try:
        return _finite(a / b)
    except ArithmeticError:
        return None


def _remainder(left: object, right: object) -> object:
    # SQL/C remainder: the sign follows the dividend (-7 % 3 = -1), unlike Python's %.
    a, b = as_number(left), as_number(right)
    if a is None or b is None or b == 0:
        return None
    try:
        magnitude = abs(a) % abs(b)
        return _finite(-magnitude if a < 0 else magnitude)
    except ArithmeticError:
        return None


def _negate(value: object) -> object:
    number = as_number(value)
    return None if number is None else -number


def _plus(value: object) -> object:
    return as_number(value)


_ARITHMETIC: Final[dict[str, Callable[[object, object], object]]] = {
    "+": _add,
    "-": _subtract,
    "*": _multiply,
    "/": _divide,
    "%": _remainder,
    "mod": _remainder,
}


def _is_scalar_number(value: object) -> bool:
    kind = type(value)
    return kind is int or kind is float


def _equal(left: object, right: object) -> bool | None:
    """Three-valued equality; values of different kinds are unequal, never an error."""
    if left is None or right is None:
        return None
    left_kind, right_kind = type(left), type(right)
    if left_kind in (list, dict) or right_kind in (list, dict):
        return None
    if left_kind is right_kind:
        return left == right
    left_number = _is_scalar_number(left)
    right_number = _is_scalar_number(right)
    if left_number and right_number:
        return left == right
    # A number against a string compares numerically when the string holds a number (text
    # fields such as "42" are common in JSON from other systems); otherwise they differ.
    if left_number and right_kind is str:
        return _number_from_text(right) == left  # type: ignore[arg-type]
    if right_number and left_kind is str:
        return _number_from_text(left) == right  # type: ignore[arg-type]
    return False


def _order(left: object, right: object) -> tuple[object, object] | None:
    """The pair to compare for <, <=, >, >=; None when the two cannot be ordered."""
    if left is None or right is None:
        return None
    left_kind, right_kind = type(left), type(right)
    if left_kind is str and right_kind is str:
        return left, right
    left_number = left_kind is int or left_kind is float
    right_number = right_kind is int or right_kind is float
    if left_number and right_number:
        return left, right
    if left_number and right_kind is str:
        converted = _number_from_text(right)  # type: ignore[arg-type]
        # AMPS: a string that is not a number is greater than every number.
        return (left, converted) if converted is not None else (0, 1)
    if right_number and left_kind is str:
        converted = _number_from_text(left)  # type: ignore[arg-type]
        return (converted, right) if converted is not None else (1, 0)
    return None  # booleans, arrays of arrays and objects have no order


def _not_equal(left: object, right: object) -> bool | None:
    result = _equal(left, right)
    return None if result is None else not result


def _less(left: object, right: object) -> bool | None:
    pair = _order(left, right)
    return None if pair is None else pair[0] < pair[1]  # type: ignore[operator]


def _less_equal(left: object, right: object) -> bool | None:
    pair = _order(left, right)
    return None if pair is None else pair[0] <= pair[1]  # type: ignore[operator]


def _greater(left: object, right: object) -> bool | None:
    pair = _order(left, right)
    return None if pair is None else pair[0] > pair[1]  # type: ignore[operator]


def _greater_equal(left: object, right: object) -> bool | None:
    pair = _order(left, right)
    return None if pair is None else pair[0] >= pair[1]  # type: ignore[operator]


_COMPARISONS: Final[dict[str, Callable[[object, object], bool | None]]] = {
    "=": _equal,
    "==": _equal,
    "!=": _not_equal,
    "<>": _not_equal,
    "<": _less,
    "<=": _less_equal,
    ">": _greater,
    ">=": _greater_equal,
}


def _any_element(
    compare: Callable[[object, object], bool | None],
) -> Callable[[object, object], bool | None]:
    """Make a comparison array-aware the AMPS way: true when any element (pair) satisfies it.

    An empty array is null; an empty string element is null, like an empty string field.
    """

    def compare_arrays(left: object, right: object) -> bool | None:
        if type(left) is not list and type(right) is not list:
            return compare(left, right)
        lefts = left if type(left) is list else (left,)
        rights = right if type(right) is list else (right,)
        if not lefts or not rights:
            return None
        result: bool | None = False
        for a in lefts:
            for b in rights:
                outcome = compare(None if a == "" else a, None if b == "" else b)
                if outcome is True:
                    return True
                if outcome is None:
                    result = None
        return result

    return compare_arrays


def _any_element_test(test: Callable[[object], bool | None]) -> Callable[[object], bool | None]:
    """The one-operand form of :func:`_any_element`, for IN, LIKE and BETWEEN."""

    def test_arrays(value: object) -> bool | None:
        if type(value) is not list:
            return test(value)
        if not value:
            return None
        result: bool | None = False
        for element in value:
            outcome = test(None if element == "" else element)
            if outcome is True:
                return True
            if outcome is None:
                result = None
        return result

    return test_arrays


_SAME_KIND_COMPARISONS: Final[dict[str, Callable[[Any, Any], Any]]] = {
    "=": operator.eq,
    "==": operator.eq,
    "!=": operator.ne,
    "<>": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def _compare_with_constant(
    left: Evaluator,
    same_kind: Callable[[Any, Any], Any],
    compare: Callable[[object, object], bool | None],
    constant: object,
) -> Evaluator:
    """``/field <op> literal``, the shape of most filters: when the field holds a value of the
    literal's own kind (str against str, int against int ...), the full rules reduce to
    Python's comparison, so that case skips the coercion and array logic."""
    kind = type(constant)
    if kind not in (str, int, float):
        return lambda doc: compare(left(doc), constant)

    def compare_fast(doc: Document) -> object:
        value = left(doc)
        if type(value) is kind:
            return same_kind(value, constant)
        return compare(value, constant)

    return compare_fast


def _not(value: object) -> bool | None:
    if value is True:
        return False
    if value is False:
        return True
    return None


def _and(left: object, right: object) -> bool | None:
    if left is False or right is False:
        return False
    if left is True and right is True:
        return True
    return None


def _or(left: object, right: object) -> bool | None:
    if left is True or right is True:
        return True
    if left is False and right is False:
        return False
    return None


def _like_subject(value: object) -> str | None:
    kind = type(value)
    if kind is str:
        return value  # type: ignore[return-value]
    if kind is int or kind is float:
        # Numbers are matched as their JSON text, the way AMPS matches text fields.
        return json.dumps(value)
    return None


# --------------------------------------------------------------------------------------------
# Compilation: parse tree → closures.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Const:
    """A compiled sub-expression that reads no field; folded at compile time."""

    value: object


_Compiled: TypeAlias = "_Const | Evaluator"


def _as_evaluator(node: _Compiled) -> Evaluator:
    if isinstance(node, _Const):
        value = node.value
        return lambda _doc: value
    return node


def _unary(op: Callable[[object], object], operand: _Compiled) -> _Compiled:
    if isinstance(operand, _Const):
        return _Const(op(operand.value))
    return lambda doc: op(operand(doc))


def _binary(op: Callable[[object, object], object], left: _Compiled, right: _Compiled) -> _Compiled:
    if isinstance(left, _Const) and isinstance(right, _Const):
        return _Const(op(left.value, right.value))
    if isinstance(right, _Const):
        right_value = right.value
        left_fn = _as_evaluator(left)
        return lambda doc: op(left_fn(doc), right_value)
    if isinstance(left, _Const):
        left_value = left.value
        right_fn = _as_evaluator(right)
        return lambda doc: op(left_value, right_fn(doc))
    left_fn, right_fn = left, right
    return lambda doc: op(left_fn(doc), right_fn(doc))


def _logical_and(left: _Compiled, right: _Compiled) -> _Compiled:
    if isinstance(left, _Const) and isinstance(right, _Const):
        return _Const(_and(left.value, right.value))
    left_fn, right_fn = _as_evaluator(left), _as_evaluator(right)

    def evaluate_and(doc: Document) -> object:
        a = left_fn(doc)
        if a is False:  # short-circuit: the right side cannot change FALSE
            return False
        return _and(a, right_fn(doc))

    return evaluate_and


def _logical_or(left: _Compiled, right: _Compiled) -> _Compiled:
    if isinstance(left, _Const) and isinstance(right, _Const):
        return _Const(_or(left.value, right.value))
    left_fn, right_fn = _as_evaluator(left), _as_evaluator(right)

    def evaluate_or(doc: Document) -> object:
        a = left_fn(doc)
        if a is True:  # short-circuit: the right side cannot change TRUE
            return True
        return _or(a, right_fn(doc))

    return evaluate_or


def parse_path(text: str) -> tuple[str, ...]:
    """Split a ``/a/b[0]/c`` path into segments ``("a", "b", "0", "c")``."""
    segments: list[str] = []
    for match in _PATH_SEGMENT.finditer(text):
        segments.append(match.group(1))
        segments.extend(_INDEX.findall(match.group(2)))
    return tuple(segments)


def _path_text(segments: Sequence[str]) -> str:
    return "/" + "/".join(segments)


def _fan_out(elements: list[object], key: str) -> list[object] | None:
    """``key`` of every object in an array, flattened (XPath style); None when there is none."""
    found: list[object] = []
    for element in elements:
        if isinstance(element, dict) and key in element:
            value = element[key]
            if isinstance(value, list):
                found.extend(value)
            else:
                found.append(value)
    return found or None


def _path_getter(segments: tuple[str, ...]) -> Evaluator:
    # A digit segment indexes an array (like /a[0]); against an object it is a key ("0").
    # Any other segment applied to an array collects that field from every element, so
    # /items/price reads all prices and comparisons match if any of them does (AMPS arrays).
    steps = tuple(
        (segment, int(segment) if segment.isascii() and segment.isdigit() else None)
        for segment in segments
    )
    if len(steps) == 1 and steps[0][1] is None:
        key = steps[0][0]

        def get_field(doc: Document) -> object:
            # The common case, kept to one dict lookup.
            if isinstance(doc, dict):
                value = doc.get(key)
                return None if value == "" else value  # AMPS: an empty string is NULL
            return None

        return get_field

    def get(doc: Document) -> object:
        node = doc
        for key, index in steps:
            if isinstance(node, dict):
                node = node.get(key)
            elif isinstance(node, list):
                if index is None:
                    node = _fan_out(node, key)
                elif index < len(node):
                    node = node[index]
                else:
                    return None
            else:
                return None
        return None if node == "" else node

    return get


def _in_test(members: Sequence[object]) -> Callable[[object], bool | None]:
    """Membership over constant members, precomputed into sets for per-message speed."""
    strings = frozenset(m for m in members if type(m) is str)
    numbers = frozenset(m for m in members if _is_scalar_number(m))
    numeric_strings = frozenset(
        number for number in (_number_from_text(s) for s in strings) if number is not None
    )
    booleans = frozenset(m for m in members if type(m) is bool)
    has_null = any(m is None for m in members)
    miss: bool | None = None if has_null else False

    def test(value: object) -> bool | None:
        kind = type(value)
        if kind is str:
            if value in strings:
                return True
            number = _number_from_text(value) if numbers else None  # type: ignore[arg-type]
            return True if number is not None and number in numbers else miss
        if kind is int or kind is float:
            return True if value in numbers or value in numeric_strings else miss
        if kind is bool:
            return True if value in booleans else miss
        return None  # null, list or object

    return test


def _between(value: object, low: object, high: object) -> bool | None:
    """Inclusive at both ends; for an array, true when one element lies in the range."""
    if type(value) is not list:
        return _and(_greater_equal(value, low), _less_equal(value, high))
    if not value:
        return None
    result: bool | None = False
    for element in value:
        element = None if element == "" else element
        outcome = _and(_greater_equal(element, low), _less_equal(element, high))
        if outcome is True:
            return True
        if outcome is None:
            result = None
    return result


_EQUAL_ANY: Final = _any_element(_equal)


def _in_dynamic(value: object, members: Sequence[object]) -> bool | None:
    # IN is the OR of = comparisons (AMPS), so it is array-aware like =.
    if value is None:
        return None
    result: bool | None = False
    for member in members:
        equal = _EQUAL_ANY(value, member)
        if equal is True:
            return True
        if equal is None:
            result = None
    return result


class _Compiler:
    """Turns one parse tree into closures and records the paths it reads."""

    def __init__(self, text: str, like_max_mem: int = PATTERN_MAX_MEM) -> None:
        self._text = text
        self.paths: set[tuple[str, ...]] = set()
        #: The RE2 budget of each LIKE pattern (the expression's share, `FILTER_MAX_MEM`).
        self._like_max_mem = like_max_mem
        #: RE2 instructions of the patterns compiled so far (at most `MAX_INSTRUCTIONS`).
        self.instructions = 0
        #: RE2 memory budgets of the patterns compiled so far: what they may come to hold.
        self.like_bytes = 0

    def compile(self, node: Tree[Token] | Token) -> _Compiled:
        if isinstance(node, Token):  # pragma: no cover - every token is wrapped by a rule
            raise self._error(f"unexpected token {node!r}", node)
        handler = getattr(self, f"_rule_{node.data}", None)
        if handler is None:  # pragma: no cover - the grammar and this class move together
            raise ExpressionError(f"unsupported construct {node.data}", text=self._text)
        result: _Compiled = handler(*node.children)
        return result

    def _error(self, message: str, token: Token, limit: str | None = None) -> ExpressionError:
        where = _describe_position(self._text, token.line, token.column)
        if limit is not None:
            return ExpressionLimitError(
                limit,
                f"{message} at {where}",
                text=self._text,
                position=token.start_pos,
                line=token.line,
                column=token.column,
            )
        return ExpressionError(
            f"{message} at {where}",
            text=self._text,
            position=token.start_pos,
            line=token.line,
            column=token.column,
        )

    # values -----------------------------------------------------------------------------------
    def _rule_number(self, token: Token) -> _Compiled:
        number = _number_from_text(str(token))
        if number is None:
            raise self._error(f"number {str(token)[:20]!r} is out of range", token)
        return _Const(number)

    def _rule_string(self, token: Token) -> _Compiled:
        text = _string_literal(token)
        return _Const(text if text else None)  # AMPS: an empty string is NULL

    def _rule_true(self, _token: Token) -> _Compiled:
        return _Const(True)

    def _rule_false(self, _token: Token) -> _Compiled:
        return _Const(False)

    def _rule_null(self, _token: Token) -> _Compiled:
        return _Const(None)

    def _rule_path(self, token: Token) -> _Compiled:
        segments = parse_path(str(token))
        self.paths.add(segments)
        return _path_getter(segments)

    # operators --------------------------------------------------------------------------------
    def _rule_sign(self, op: Token, operand: Tree[Token]) -> _Compiled:
        return _unary(_negate if op == "-" else _plus, self.compile(operand))

    def _rule_arith(self, left: Tree[Token], op: Token, right: Tree[Token]) -> _Compiled:
        return _binary(_ARITHMETIC[str(op).lower()], self.compile(left), self.compile(right))

    def _rule_compare(self, left: Tree[Token], op: Token, right: Tree[Token]) -> _Compiled:
        compare = _any_element(_COMPARISONS[str(op)])
        compiled_left, compiled_right = self.compile(left), self.compile(right)
        if isinstance(compiled_left, _Const) or not isinstance(compiled_right, _Const):
            return _binary(compare, compiled_left, compiled_right)
        return _compare_with_constant(
            compiled_left, _SAME_KIND_COMPARISONS[str(op)], compare, compiled_right.value
        )

    def _rule_not_op(self, _not_token: Token, operand: Tree[Token]) -> _Compiled:
        return _unary(_not, self.compile(operand))

    def _rule_and_op(self, left: Tree[Token], _and_token: Token, right: Tree[Token]) -> _Compiled:
        return _logical_and(self.compile(left), self.compile(right))

    def _rule_or_op(self, left: Tree[Token], _or_token: Token, right: Tree[Token]) -> _Compiled:
        return _logical_or(self.compile(left), self.compile(right))

    def _rule_is_null_op(
        self, subject: Tree[Token], _is: Token, negated: Token | None, _null: Token
    ) -> _Compiled:
        # IS NULL is the one test that is never null itself; an empty array counts as null.
        if negated is None:
            return _unary(lambda value: value is None or value == [], self.compile(subject))
        return _unary(lambda value: value is not None and value != [], self.compile(subject))

    def _rule_in_op(
        self, subject: Tree[Token], negated: Token | None, _in: Token, *members: Tree[Token]
    ) -> _Compiled:
        compiled_subject = self.compile(subject)
        compiled_members = [self.compile(member) for member in members]
        result: _Compiled
        if all(isinstance(member, _Const) for member in compiled_members):
            test = _in_test([member.value for member in compiled_members])  # type: ignore[union-attr]
            result = _unary(_any_element_test(test), compiled_subject)
        else:
            member_fns = [_as_evaluator(member) for member in compiled_members]
            subject_fn = _as_evaluator(compiled_subject)
            result = lambda doc: _in_dynamic(subject_fn(doc), [fn(doc) for fn in member_fns])  # noqa: E731
        return result if negated is None else _unary(_not, result)

    def _rule_like_op(
        self, subject: Tree[Token], negated: Token | None, _like: Token, pattern: Token
    ) -> _Compiled:
        pattern_text = _string_literal(pattern)
        try:
            program = compile_like(pattern_text, self._like_max_mem)
        except LikePatternError as exc:
            limit = "PATTERN_MAX_MEM" if isinstance(exc, LikePatternTooLargeError) else None
            raise self._error(
                f"invalid regular expression for LIKE {_shorten(pattern_text)}: {exc}",
                pattern,
                limit,
            ) from exc
        self.instructions += program.instructions
        self.like_bytes += program.max_mem
        if self.instructions > MAX_INSTRUCTIONS:
            raise self._error(
                f"the LIKE patterns up to {_shorten(pattern_text)} compile to "
                f"{self.instructions:,} RE2 instructions; the limit is {MAX_INSTRUCTIONS:,} per "
                "expression (matching costs time in proportion to it: \\pL is ~1,200 "
                "instructions, a repetition such as {20} multiplies what it repeats)",
                pattern,
                "MAX_INSTRUCTIONS",
            )
        search = program.search

        def like(value: object) -> bool | None:
            subject_text = _like_subject(value)
            return None if subject_text is None else search(subject_text)

        result = _unary(_any_element_test(like), self.compile(subject))
        return result if negated is None else _unary(_not, result)

    def _rule_between_op(
        self,
        subject: Tree[Token],
        negated: Token | None,
        _between_keyword: Token,
        low: Tree[Token],
        _and_keyword: Token,
        high: Tree[Token],
    ) -> _Compiled:
        compiled_subject = self.compile(subject)
        compiled_low, compiled_high = self.compile(low), self.compile(high)
        if isinstance(compiled_subject, _Const):
            subject_value = compiled_subject.value
            subject_fn: Evaluator = lambda _doc: subject_value  # noqa: E731
        else:
            subject_fn = compiled_subject
        low_fn, high_fn = _as_evaluator(compiled_low), _as_evaluator(compiled_high)

        def between(doc: Document) -> object:
            return _between(subject_fn(doc), low_fn(doc), high_fn(doc))

        result: _Compiled = between
        if all(isinstance(n, _Const) for n in (compiled_subject, compiled_low, compiled_high)):
            result = _Const(between(None))
        return result if negated is None else _unary(_not, result)


def _string_literal(token: Token) -> str:
    # No backslash escapes: LIKE patterns are regular expressions and keep their backslashes.
    # The quote character is escaped by doubling it, as in SQL ('it''s').
    text = str(token)
    quote = text[0]
    return text[1:-1].replace(quote * 2, quote)


def _shorten(pattern: str, limit: int = 60) -> str:
    """``pattern`` quoted as it is written in an expression, cut to ``limit`` characters (it may
    be hostile input); control characters are shown escaped."""
    cut = pattern if len(pattern) <= limit else pattern[: limit - 3] + "..."
    if not cut.isprintable():
        return repr(cut)
    return "'" + cut.replace("'", "''") + "'"


def _describe_position(text: str, line: int | None, column: int | None) -> str:
    if line is None or column is None:
        return "the end of the expression"
    if "\n" in text.strip():
        return f"line {line}, column {column}"
    return f"column {column}"


def _describe_expected(names: Iterable[str]) -> str:
    wanted = set(names)
    if wanted >= _VALUE_TERMINALS:
        wanted -= _VALUE_TERMINALS
        parts = ["a value (number, 'string', /path, TRUE, FALSE or NULL)"]
    else:
        parts = []
    if {"ADD_OP", "MUL_OP"} <= wanted:
        wanted -= {"ADD_OP", "MUL_OP"}
        wanted.add("ARITHMETIC")
    parts += [_TERMINAL_NAMES[name] for name in _TERMINAL_ORDER if name in wanted]
    parts += sorted(name for name in wanted if name not in _TERMINAL_NAMES)
    if not parts:
        return "something else"
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " or " + parts[-1]


def _syntax_error(text: str, exc: UnexpectedInput) -> ExpressionError:
    line: int | None = getattr(exc, "line", None)
    column: int | None = getattr(exc, "column", None)
    position: int | None = getattr(exc, "pos_in_stream", None)
    if isinstance(exc, UnexpectedToken):
        token = exc.token
        if token.type == "$END":
            found = "the end of the expression"
            # lark reports no position for end of input; point just past the last character.
            position = len(text.rstrip())
            line = text[:position].count("\n") + 1
            column = position - (text.rfind("\n", 0, position) + 1) + 1
        else:
            found = repr(str(token))
            position = token.start_pos
        expected = _describe_expected(exc.accepts or exc.expected)
    elif isinstance(exc, UnexpectedCharacters):
        found = repr(text[position]) if position is not None and position < len(text) else "end"
        expected = _describe_expected(exc.allowed or ())
    else:  # pragma: no cover - lark's LALR parser raises only the two above
        found, expected = "unexpected input", "a valid expression"
    where = _describe_position(text, line, column)
    return ExpressionError(
        f"syntax error at {where}: expected {expected}, found {found}",
        text=text,
        position=position,
        line=line,
        column=column,
    )


class Expression:
    """A compiled expression: immutable, hashable and equal by its text."""

    __slots__ = ("_evaluator", "_fields", "_paths", "_text")

    def __init__(self, text: str, evaluator: Evaluator, paths: Iterable[tuple[str, ...]]) -> None:
        self._text = text
        self._evaluator = evaluator
        self._paths: frozenset[tuple[str, ...]] = frozenset(paths)
        self._fields = frozenset(_path_text(path) for path in self._paths)

    @property
    def text(self) -> str:
        return self._text

    def evaluate(self, doc: Document) -> object | None:
        """The expression's value for ``doc``; null (None) on any type problem. Never raises."""
        kind = type(doc)
        if kind is RawDocument:
            doc = doc.value()  # type: ignore[attr-defined]
        elif kind is PartialDocument:
            doc = doc.doc  # type: ignore[attr-defined]
        try:
            return self._evaluator(doc)
        except Exception:
            # The value functions are total; this guards against documents of unexpected
            # Python types (not decoded JSON), so one record can never stop the loop.
            return None

    def matches(self, doc: Document) -> bool:
        """True only when the expression evaluates to exactly TRUE (null and FALSE do not)."""
        return self.evaluate(doc) is True

    def fields(self) -> frozenset[str]:
        """The paths the expression reads, normalised (``/items[0]`` → ``/items/0``)."""
        return self._fields

    def covered_by(self, fields: frozenset[str]) -> bool:
        """Whether a projection that kept ``fields`` gives this expression the same value as
        the whole document (every path it reads was kept)."""
        return self._fields <= fields

    def paths(self) -> frozenset[tuple[str, ...]]:
        """The same paths as segment tuples, for :func:`project`."""
        return self._paths

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Expression):
            return self._text == other._text
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._text)

    def __repr__(self) -> str:
        return f"Expression({self._text!r})"

    def __reduce__(self) -> tuple[Callable[[str], Expression], tuple[str]]:
        # Closures do not pickle; recompiling from the text gives an equal expression.
        return compile_expression, (self._text,)


_EXPRESSIONS: Final[BoundedCache[str, Expression]] = BoundedCache(EXPRESSION_CACHE_BYTES)


def compile_expression(text: str) -> Expression:
    """Parse and compile ``text``; raises :class:`ExpressionError` naming the position, or the
    limit an expression over it passes (`MAX_LENGTH`, `MAX_DEPTH`, `MAX_LIKE_PATTERNS`, the
    RE2 budgets). Compiled expressions are cached by text, within `EXPRESSION_CACHE_BYTES`."""
    if not isinstance(text, str):
        raise ExpressionError(f"expected expression text, got {type(text).__name__}", text="")
    cached = _EXPRESSIONS.get(text)
    if cached is not None:
        return cached
    if not text.strip():
        raise ExpressionError("empty expression", text=text, position=0, line=1, column=1)
    if len(text) > MAX_LENGTH:
        raise ExpressionLimitError(
            "MAX_LENGTH",
            f"the expression is {len(text):,} characters long; the limit is {MAX_LENGTH:,}",
            text=text,
        )
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as exc:
        raise _syntax_error(text, exc) from None
    depth, patterns = _measure(tree)
    if depth > MAX_DEPTH:
        raise ExpressionLimitError(
            "MAX_DEPTH",
            f"the expression is nested {depth:,} levels deep; the limit is {MAX_DEPTH:,} (every "
            "operator is a level, so a long chain of ORs is deep: write /x IN (a, b, ...) instead)",
            text=text,
        )
    if len(patterns) > MAX_LIKE_PATTERNS:
        extra = patterns[MAX_LIKE_PATTERNS]
        raise ExpressionLimitError(
            "MAX_LIKE_PATTERNS",
            f"the expression has {len(patterns):,} LIKE patterns; the limit is "
            f"{MAX_LIKE_PATTERNS:,} (join alternatives into one pattern: 'a|b|c')",
            text=text,
            position=extra.start_pos,
            line=extra.line,
            column=extra.column,
        )
    share = FILTER_MAX_MEM // len(patterns) if patterns else PATTERN_MAX_MEM
    compiler = _Compiler(text, min(PATTERN_MAX_MEM, share))
    try:
        compiled = compiler.compile(tree)
    except RecursionError:  # a backstop: MAX_DEPTH keeps compiling far from the limit
        raise ExpressionError(
            "expression is nested too deeply", text=text, position=0, line=1, column=1
        ) from None
    expression = Expression(text, _as_evaluator(compiled), compiler.paths)
    _EXPRESSIONS.put(text, expression, _cost(text, compiler.like_bytes))
    return expression


def _measure(tree: Tree[Token]) -> tuple[int, list[Token]]:
    """The depth of ``tree`` and its LIKE patterns' tokens, without recursion (the tree may be
    deeper than Python's stack allows)."""
    depth = 0
    patterns: list[Token] = []
    stack: list[tuple[Tree[Token], int]] = [(tree, 1)]
    while stack:
        node, level = stack.pop()
        depth = max(depth, level)
        if node.data == "like_op":
            patterns.append(node.children[-1])  # type: ignore[arg-type]
        for child in node.children:
            if isinstance(child, Tree):
                stack.append((child, level + 1))
    patterns.sort(key=lambda token: token.start_pos or 0)
    return depth, patterns


def _cost(text: str, like_bytes: int) -> int:
    """What a compiled expression may hold, in bytes: its closures (estimated from the text)
    and its LIKE patterns' RE2 budgets. The budgets, not the programs' sizes, because the DFA
    caches fill up to them as records are matched, where Python cannot see them."""
    return _BASE_BYTES + _BYTES_PER_CHARACTER * len(text) + like_bytes


def parse_document(value: bytes | bytearray | memoryview | str | None) -> Document | None:
    """Decode a record value as JSON; anything that is not valid UTF-8 JSON gives None.

    None makes every path null, so a malformed record simply fails filters instead of
    stopping the coordinator. NaN and Infinity (which Python's json accepts) are refused,
    as they are not JSON. A UTF-8 byte-order mark is tolerated.
    """
    if value is None:
        return None
    try:
        text = value if isinstance(value, str) else bytes(value).decode("utf-8-sig")
        document: Document = json.loads(text, parse_constant=_refuse_constant)
        return document
    except (ValueError, RecursionError, TypeError):
        return None


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


_UNPARSED: Final = object()


class RawDocument:
    """A record's value whose JSON is parsed when an expression first reads it (then kept).

    An entry keeps its document for filters that may read it; most queues never do (no
    filter, no priority, no barrier), and a parsed document took several times the record's
    own size in memory, besides the time to parse it. Holding the bytes costs nothing extra
    while the coordinator holds the record anyway (the same object). Expressions accept a
    `RawDocument` wherever they accept a document; `document_of` gives the parsed value.
    """

    __slots__ = ("_parsed", "_raw", "failed")

    def __init__(self, raw: bytes | None) -> None:
        self._raw = raw
        self._parsed: object = _UNPARSED
        #: The value was read and is not JSON: every path in it is null (filters false,
        #: priority lowest). The coordinator counts such records per queue.
        self.failed = False

    def value(self) -> Document:
        """The parsed document (as `parse_document` gives it)."""
        if self._parsed is _UNPARSED:
            raw = self._raw
            self._parsed = parse_document(raw)
            if self._parsed is None and raw is not None:
                self.failed = not is_json_null(raw)
            self._raw = None  # the parsed form is kept; the bytes belong to the record
        return self._parsed


def is_json_null(value: bytes | bytearray | memoryview) -> bool:
    """Whether a value is the JSON document ``null`` (which parses, to None)."""
    return bytes(value).strip().lstrip(b"\xef\xbb\xbf").strip() == b"null"


class PartialDocument:
    """A projection of a record's document (`project`) that says which fields it kept.

    Past the memory window an entry keeps only the fields its queues' expressions read when
    the record arrived. A filter that reads other fields cannot be decided on such a
    projection (it would see null where the record has a value), so the coordinator reads the
    record again and gives the entry this: the projection for the fields read now, and the
    set of them, so an expression can tell whether it is `Expression.covered_by` it.
    """

    __slots__ = ("doc", "fields")

    def __init__(self, doc: Document, fields: frozenset[str]) -> None:
        self.doc = doc
        self.fields = fields


def document_of(doc: object) -> Document:
    """The document itself, parsing a `RawDocument` and unwrapping a `PartialDocument`."""
    kind = type(doc)
    if kind is RawDocument:
        return doc.value()  # type: ignore[attr-defined]
    if kind is PartialDocument:
        return doc.doc  # type: ignore[attr-defined]
    return doc


_ABSENT: Final = object()


def project(doc: Document, fields: Iterable[str | tuple[str, ...]]) -> Document:
    """Keep only the given paths of ``doc``, so expressions over the result give the same values.

    The coordinator keeps this projection of a record once its bytes leave the memory window.
    Containers on the way to a field become objects keyed by segment (an array element
    ``/a/0`` is kept as ``{"a": {"0": ...}}``), which path lookups read the same way; an array
    a path fans out over (``/items/price``) is kept whole. Missing fields are left out (they
    read as null either way). The result is an object, except for a top-level array that a
    path fans out over, which is returned as it is.
    """
    doc = document_of(doc)
    kept: dict[tuple[str, ...], object] = {}
    for field in fields:
        segments = parse_path(field) if isinstance(field, str) else tuple(field)
        if segments:
            prefix, value = _resolve(doc, segments)
            if value is not _ABSENT:
                kept[prefix] = value
    if () in kept:
        return doc  # the document is itself an array a path fans out over: keep it whole
    result: dict[str, object] = {}
    copied: list[tuple[str, ...]] = []
    # Shortest first, so a value kept whole is in place before any deeper path under it.
    for segments in sorted(kept, key=len):
        if any(segments[: len(done)] == done for done in copied):
            continue
        target = result
        for segment in segments[:-1]:
            child = target.get(segment)
            if not isinstance(child, dict):
                child = {}
                target[segment] = child
            target = child
        target[segments[-1]] = kept[segments]
        copied.append(segments)
    return result


def _resolve(doc: Document, segments: tuple[str, ...]) -> tuple[tuple[str, ...], object]:
    """The value at ``segments``, or the array the path fans out over with its own prefix."""
    node = doc
    for position, segment in enumerate(segments):
        if isinstance(node, dict):
            if segment not in node:
                return segments, _ABSENT
            node = node[segment]
        elif isinstance(node, list):
            if not (segment.isascii() and segment.isdigit()):
                return segments[:position], node
            index = int(segment)
            if index >= len(node):
                return segments, _ABSENT
            node = node[index]
        else:
            return segments, _ABSENT
    return segments, node
