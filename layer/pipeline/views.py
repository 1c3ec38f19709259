"""AMPS view definitions over queues, translated to Spark column expressions (docs/pipeline.md).

An AMPS view is a projection with aggregates, a grouping and an optional filter over the
messages of a topic; here the messages are a queue's available entries. Definitions are
written the AMPS way::

    --group-by /region
    --field /region --field "SUM(/price * /qty) AS /total" --field "COUNT(/id) AS /orders"
    --where "/status != 'test'"

Each text is parsed with a LALR grammar (lark) that mirrors the expression language of queue
filters (``layer/domain/expressions.py``, docs/expressions.md) plus aggregate calls and
``AS /alias``, and the tree is turned into Spark ``Column`` objects: nothing is evaluated in
Python and no user text reaches Spark SQL as text. Field values are read from the JSON payload
with ``get_json_object``; numbers follow the AMPS coercion (a string holding a number is that
number; anything else has none and is null in arithmetic).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Final, Literal

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedInput
from pyspark.sql import Column
from pyspark.sql import functions as F

from layer.domain.errors import ExpressionError

__all__ = [
    "AGGREGATES",
    "ViewDefinition",
    "ViewField",
    "column_name",
    "parse_view",
]

#: Aggregate functions a projection field may call, AMPS names.
AGGREGATES: Final = ("AVG", "COUNT", "COUNT_DISTINCT", "MAX", "MIN", "STDDEV_POP",
                     "STDDEV_SAMP", "SUM")

_GRAMMAR: Final = r"""
field: or_expr (AS PATH)?
group: or_expr
where: or_expr

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
     | FUNCTION _LPAR STAR _RPAR            -> count_all
     | FUNCTION _LPAR or_expr _RPAR         -> call
     | _LPAR or_expr _RPAR

OR: /or\b/i
AND: /and\b/i
NOT: /not\b/i
IN: /in\b/i
LIKE: /like\b/i
BETWEEN: /between\b/i
IS: /is\b/i
AS: /as\b/i
NULL: /null\b/i
TRUE: /true\b/i
FALSE: /false\b/i
FUNCTION: /(?!(?:not|and|or|in|like|between|is)\b)[a-z_]+(?=\s*\()/i
STAR: "*"
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

_SEGMENT: Final = re.compile(r"/([^/\[]+)((?:\[\d+\])*)")
_INDEX: Final = re.compile(r"\[(\d+)\]")

_KEYWORDS: Final = frozenset({"IN", "LIKE", "BETWEEN", "IS", "AND", "NULL"})

Kind = Literal["text", "number", "bool", "null"]


@lru_cache(maxsize=1)
def _parser() -> Lark:
    return Lark(_GRAMMAR, parser="lalr", lexer="contextual", maybe_placeholders=True,
                propagate_positions=True, start=["field", "group", "where"])


ColumnMaker = Callable[[], Column]


@dataclass(frozen=True)
class _Value:
    """A translated operand: what kind of value it holds, and how to build its column."""

    make: ColumnMaker
    kind: Kind
    aggregate: bool  # contains an aggregate call

    @property
    def column(self) -> Column:
        return self.make()


@dataclass(frozen=True)
class ViewField:
    """One projection field: the output column's name and its Spark expression.

    ``group`` is the index of the grouping expression a non-aggregate field repeats (None for
    an aggregate, whose ``column`` is the aggregate expression named ``name``).
    """

    name: str
    text: str
    make: ColumnMaker
    group: int | None

    @property
    def column(self) -> Column:
        return self.make().alias(self.name)


@dataclass(frozen=True)
class ViewDefinition:
    """A parsed, checked view: grouping expressions, projection and filter. Its Spark columns
    are built when `transforms.view` asks (they need a running session); parsing does not."""

    groups: tuple[ColumnMaker, ...]
    fields: tuple[ViewField, ...]
    condition: ColumnMaker | None

    @property
    def group_by(self) -> list[Column]:
        return [make() for make in self.groups]

    @property
    def where(self) -> Column | None:
        return None if self.condition is None else self.condition()


def _error(text: str, message: str, position: int | None = None) -> ExpressionError:
    line = column = None
    if position is not None:
        line = text[:position].count("\n") + 1
        column = position - (text.rfind("\n", 0, position) + 1) + 1
    where = f" at column {column}" if column is not None else ""
    return ExpressionError(f"{message}{where} in {text!r}", text=text, position=position,
                           line=line, column=column)


def _parse(text: str, start: str) -> Tree[Token]:
    if not text.strip():
        raise _error(text, "empty expression")
    try:
        return _parser().parse(text, start=start)
    except UnexpectedInput as exc:
        position = getattr(exc, "pos_in_stream", None)
        token = getattr(exc, "token", None)
        if isinstance(token, Token) and token.type != "$END":
            position = token.start_pos
            found = repr(str(token))
        elif token is not None:
            position, found = len(text.rstrip()), "the end of the expression"
        else:
            found = repr(text[position]) if position is not None and position < len(text) \
                else "the end of the expression"
        raise _error(text, f"syntax error: unexpected {found}", position) from None


def _json_path(path: str) -> str:
    """``/a/b[0]`` as the JSONPath `get_json_object` takes: ``$['a']['b'][0]``."""
    parts = ["$"]
    for name, indexes in _SEGMENT.findall(path):
        parts.append(f"['{name}']")
        parts.extend(f"[{i}]" for i in _INDEX.findall(indexes))
    return "".join(parts)


def column_name(path: str) -> str:
    """The output column an ``AS /alias`` (or a bare ``/field``) names: ``/a/b`` -> ``a_b``."""
    return "_".join(name + "".join(f"_{i}" for i in _INDEX.findall(indexes))
                    for name, indexes in _SEGMENT.findall(path))


def _number(value: _Value) -> Column:
    if value.kind == "number":
        return value.column
    if value.kind == "text":
        # AMPS coercion: text holding a number is that number; other text has none (null).
        return value.column.try_cast("double")
    return F.lit(None).cast("double")


def _text(value: _Value) -> Column:
    return value.column.cast("string") if value.kind != "text" else value.column


def _unquote(token: str) -> str:
    quote = token[0]
    return token[1:-1].replace(quote * 2, quote)


def _negated(found: Column, negated: object) -> Column:
    return ~found if negated is not None else found


class _Translator:
    """Turns a parse tree into a `_Value`: its kind and aggregate flag at once (so every
    error is found without Spark), its column when asked (Spark columns need a session)."""

    def __init__(self, text: str, payload: Callable[[], Column]) -> None:
        self.text = text
        self.payload = payload

    def fail(self, message: str, node: Tree[Token] | Token) -> ExpressionError:
        position = node.start_pos if isinstance(node, Token) else \
            getattr(node.meta, "start_pos", None) if not node.meta.empty else None
        return _error(self.text, message, position)

    def value(self, node: Tree[Token] | Token | None) -> _Value:
        if not isinstance(node, Tree):  # pragma: no cover - every operand is a rule
            raise _error(self.text, "unexpected token")
        handler = getattr(self, f"_{node.data}")
        result: _Value = handler(node)
        return result

    # -- operands ----------------------------------------------------------------------------
    def _number(self, node: Tree[Token]) -> _Value:
        number = float(str(node.children[0]))
        return _Value(lambda: F.lit(number), "number", False)

    def _string(self, node: Tree[Token]) -> _Value:
        text = _unquote(str(node.children[0]))
        return _Value(lambda: F.lit(text), "text", False)

    def _path(self, node: Tree[Token]) -> _Value:
        path = _json_path(str(node.children[0]))
        return _Value(lambda: F.get_json_object(self.payload(), path), "text", False)

    def _true(self, node: Tree[Token]) -> _Value:
        return _Value(lambda: F.lit(True), "bool", False)

    def _false(self, node: Tree[Token]) -> _Value:
        return _Value(lambda: F.lit(False), "bool", False)

    def _null(self, node: Tree[Token]) -> _Value:
        return _Value(lambda: F.lit(None), "null", False)

    # -- arithmetic --------------------------------------------------------------------------
    def _arith(self, node: Tree[Token]) -> _Value:
        left_node, op, right_node = node.children
        left, right = self.value(left_node), self.value(right_node)
        symbol = str(op).lower()

        def make() -> Column:
            a, b = _number(left), _number(right)
            if symbol == "+":
                return a + b
            if symbol == "-":
                return a - b
            if symbol == "*":
                return a * b
            if symbol == "/":
                return F.when(b != 0, a / b)  # AMPS: division by zero is null
            # SQL remainder: the sign follows the dividend, as in the filter language.
            return F.when(b != 0, a % b)

        return _Value(make, "number", left.aggregate or right.aggregate)

    def _sign(self, node: Tree[Token]) -> _Value:
        op, operand_node = node.children
        operand = self.value(operand_node)
        minus = str(op) == "-"
        return _Value(lambda: -_number(operand) if minus else _number(operand), "number",
                      operand.aggregate)

    # -- predicates --------------------------------------------------------------------------
    def _compare(self, node: Tree[Token]) -> _Value:
        left_node, op, right_node = node.children
        left, right = self.value(left_node), self.value(right_node)
        symbol = {"==": "=", "<>": "!="}.get(str(op), str(op))

        def apply(a: Column, b: Column) -> Column:
            return {"=": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b,
                    ">=": a >= b}[symbol]

        def make() -> Column:
            if "number" in (left.kind, right.kind):
                return apply(_number(left), _number(right))
            if left.kind == right.kind == "text":
                # Two fields: as numbers when both hold one, else as text (AMPS compares
                # "42" and "042" equal as numbers).
                a, b = _number(left), _number(right)
                return F.when(a.isNotNull() & b.isNotNull(), apply(a, b)).otherwise(
                    apply(left.column, right.column))
            return apply(_text(left), _text(right))

        return _Value(make, "bool", left.aggregate or right.aggregate)

    @staticmethod
    def _parts(node: Tree[Token]) -> list[Tree[Token] | Token | None]:
        """The children without the keywords (IN, BETWEEN ... AND, LIKE, IS, NULL); an
        optional NOT stays in place (None when absent)."""
        return [c for c in node.children
                if not (isinstance(c, Token) and c.type in _KEYWORDS)]

    def _in_op(self, node: Tree[Token]) -> _Value:
        subject_node, negated, *option_nodes = self._parts(node)
        subject = self.value(subject_node)
        options = [self.value(o) for o in option_nodes]

        def make() -> Column:
            if all(o.kind == "number" for o in options):
                return _negated(_number(subject).isin(*[o.column for o in options]), negated)
            return _negated(_text(subject).isin(*[_text(o) for o in options]), negated)

        return _Value(make, "bool", subject.aggregate)

    def _like_op(self, node: Tree[Token]) -> _Value:
        subject_node, negated, pattern = self._parts(node)
        subject = self.value(subject_node)
        regex = _unquote(str(pattern))
        try:
            re.compile(regex)
        except re.error as exc:
            raise self.fail(f"LIKE takes a regular expression: {exc}", node) from None
        # AMPS LIKE takes a regular expression (docs/expressions.md).
        return _Value(lambda: _negated(_text(subject).rlike(regex), negated), "bool",
                      subject.aggregate)

    def _between_op(self, node: Tree[Token]) -> _Value:
        subject_node, negated, low_node, high_node = self._parts(node)
        subject, low, high = (self.value(n) for n in (subject_node, low_node, high_node))
        return _Value(lambda: _negated(_number(subject).between(_number(low), _number(high)),
                                       negated), "bool", subject.aggregate)

    def _is_null_op(self, node: Tree[Token]) -> _Value:
        subject_node, negated = self._parts(node)
        subject = self.value(subject_node)
        return _Value(lambda: subject.column.isNotNull() if negated is not None
                      else subject.column.isNull(), "bool", subject.aggregate)

    def _bool(self, node: Tree[Token], index: int) -> _Value:
        operand = self.value(node.children[index])
        if operand.kind not in ("bool", "null"):
            raise self.fail("AND, OR and NOT take conditions, not values", node)
        return operand

    def _and_op(self, node: Tree[Token]) -> _Value:
        left, right = self._bool(node, 0), self._bool(node, 2)
        return _Value(lambda: left.column & right.column, "bool",
                      left.aggregate or right.aggregate)

    def _or_op(self, node: Tree[Token]) -> _Value:
        left, right = self._bool(node, 0), self._bool(node, 2)
        return _Value(lambda: left.column | right.column, "bool",
                      left.aggregate or right.aggregate)

    def _not_op(self, node: Tree[Token]) -> _Value:
        operand = self._bool(node, 1)
        return _Value(lambda: ~operand.column, "bool", operand.aggregate)

    # -- aggregates --------------------------------------------------------------------------
    def _function(self, node: Tree[Token]) -> str:
        name = str(node.children[0]).upper()
        if name not in AGGREGATES:
            raise self.fail(f"unknown function {name}: views take {', '.join(AGGREGATES)}",
                            node.children[0])
        return name

    def _count_all(self, node: Tree[Token]) -> _Value:
        name = self._function(node)
        if name != "COUNT":
            raise self.fail(f"{name}(*) is not an aggregate; only COUNT(*) is", node.children[0])
        return _Value(lambda: F.count(F.lit(1)), "number", True)

    def _call(self, node: Tree[Token]) -> _Value:
        name = self._function(node)
        argument = self.value(node.children[1])
        if argument.aggregate:
            raise self.fail(f"{name} of an aggregate: aggregates do not nest", node.children[0])

        def make() -> Column:
            if name == "COUNT":
                return F.count(argument.column)
            if name == "COUNT_DISTINCT":
                return F.count_distinct(argument.column)
            aggregate = {"AVG": F.avg, "MAX": F.max, "MIN": F.min, "SUM": F.sum,
                         "STDDEV_POP": F.stddev_pop, "STDDEV_SAMP": F.stddev_samp}[name]
            return aggregate(_number(argument))

        return _Value(make, "number", True)


def _field(text: str, payload: ColumnMaker, grouped: Sequence[str]) -> ViewField:
    """One projection field, ``expression [AS /name]``. A field without ``AS`` must be a
    bare ``/path`` (its name is the path's)."""
    tree = _parse(text, "field")
    expression, _as, alias = [*tree.children, None, None][:3]
    value = _Translator(text, payload).value(expression)
    if alias is not None:
        name = column_name(str(alias))
    elif isinstance(expression, Tree) and expression.data == "path":
        name = column_name(str(expression.children[0]))
    else:
        raise _error(text, "a computed field needs a name: add AS /name")
    if value.aggregate:
        return ViewField(name, text, value.make, None)
    canonical = _canonical_tree(expression)
    if canonical not in grouped:
        raise _error(text, "a field that is not an aggregate must be one of the grouping "
                     "expressions (--group-by) or be aggregated (SUM, COUNT, ...)")
    return ViewField(name, text, value.make, grouped.index(canonical))


def _group(text: str, payload: ColumnMaker) -> ColumnMaker:
    tree = _parse(text, "group")
    (expression,) = tree.children
    value = _Translator(text, payload).value(expression)
    if value.aggregate:
        raise _error(text, "a grouping cannot contain an aggregate")
    return value.make


def parse_view(fields: Sequence[str], group_by: Sequence[str] = (), where: str | None = None,
               payload: str = "payload") -> ViewDefinition:
    """Parse and check an AMPS-style view: projection ``fields``, ``group_by`` expressions, a
    ``where`` filter. Raises `ExpressionError` naming the text and the problem; needs no Spark
    session (so a typo fails before one starts).

    Rules: at least one field; every field is an aggregate or one of the grouping
    expressions (written the same way); the filter is a condition without aggregates.
    ``payload`` names the JSON text column.
    """

    def source() -> Column:
        return F.col(payload)

    if not fields:
        raise ExpressionError("a view needs at least one field (--field)", text="")
    groups = [_group(text, source) for text in group_by]
    grouped = [_canonical(text, "group") for text in group_by]
    parsed = []
    names: set[str] = set()
    for text in fields:
        field = _field(text, source, grouped)
        if field.name in names:
            raise _error(text, f"two fields are named /{field.name}")
        names.add(field.name)
        parsed.append(field)
    condition = None
    if where is not None:
        value = _Translator(where, source).value(_parse(where, "where").children[0])
        if value.aggregate:
            raise _error(where, "a filter cannot contain an aggregate")
        if value.kind not in ("bool", "null"):
            raise _error(where, "a filter must be a condition (a comparison, IN, LIKE, ...)")
        condition = value.make
    return ViewDefinition(tuple(groups), tuple(parsed), condition)


def _canonical_tree(node: Tree[Token] | Token | None) -> str:
    """A spelling-independent form of an expression (case of keywords, spaces)."""
    if node is None:
        return ""
    if isinstance(node, Token):
        return str(node).upper() if node.type not in ("STRING", "PATH") else str(node)
    return f"{node.data}(" + ",".join(_canonical_tree(c) for c in node.children) + ")"


def _canonical(text: str, start: str) -> str:
    return _canonical_tree(_parse(text, start).children[0])
