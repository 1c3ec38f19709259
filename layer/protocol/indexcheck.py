"""Union branch and enum symbol indexes checked before a record is decoded.

An Avro union is written as the branch's index (a zig-zag long), then the value; an enum as
its symbol's index. fastavro looks the index up with Python's ``list[index]``, so a negative
index counts from the end: ``-1`` in a ``["null", "long"]`` union decodes as the long branch,
``-1`` in an enum as its last symbol. A record no Avro writer produces would pass as valid.
(An index past the end fails in fastavro already, but with only "list index out of range".)

`index_checker` compiles a parsed schema into a walk over the binary body that skips every
value and raises `ProtocolError` (kind ``MALFORMED``) for the first union or enum index outside
``0 .. n-1``, naming the field. A schema without unions and enums needs no walk (``None``).
Anything else wrong with the body (truncation, bad UTF-8) is left to the decoder, which
reports it: the walk stops quietly where it cannot go on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from layer.protocol.errors import ProtocolError, ProtocolErrorKind

__all__ = ["IndexChecker", "index_checker"]

#: ``walk(data, position) -> position after the value``.
_Walk = Callable[[bytes, int], int]
#: Checks ``data`` from ``start`` (the body's first byte); raises `ProtocolError`.
IndexChecker = Callable[[bytes, int], None]


class _Stop(Exception):
    """The body ends (or is garbage) before the walk does: the decoder reports it."""


def _read_long(data: bytes, pos: int) -> tuple[int, int]:
    byte = data[pos]
    if byte < 0x80:  # one byte: most indexes, counts and lengths
        return (byte >> 1) ^ -(byte & 1), pos + 1
    z = byte & 0x7F
    shift = 7
    while byte & 0x80:
        pos += 1
        byte = data[pos]
        z |= (byte & 0x7F) << shift
        shift += 7
        if shift > 70:  # longer than any long: garbage
            raise _Stop
    return (z >> 1) ^ -(z & 1), pos + 1


def _skip_long(data: bytes, pos: int) -> int:
    end = pos + 10
    while data[pos] & 0x80:
        pos += 1
        if pos >= end:
            raise _Stop
    return pos + 1


def _skip_bytes(data: bytes, pos: int) -> int:
    byte = data[pos]
    if byte < 0x80:
        length, pos = (byte >> 1) ^ -(byte & 1), pos + 1
    else:
        length, pos = _read_long(data, pos)
    if length < 0 or pos + length > len(data):
        raise _Stop
    return pos + length


def _fixed(size: int) -> _Walk:
    def walk(data: bytes, pos: int) -> int:
        if pos + size > len(data):
            raise _Stop
        return pos + size

    return walk


def _null(data: bytes, pos: int) -> int:
    return pos


_PRIMITIVES: Mapping[str, _Walk] = {
    "null": _null,
    "boolean": _fixed(1),
    "int": _skip_long,
    "long": _skip_long,
    "float": _fixed(4),
    "double": _fixed(8),
    "bytes": _skip_bytes,
    "string": _skip_bytes,
}


def _bad_index(what: str, index: int, count: int, where: str) -> ProtocolError:
    return ProtocolError(
        f"{what} index {index} at {where or 'the top level'} is not one of its {count} "
        f"{'branches' if what == 'union branch' else 'symbols'} (0..{count - 1})",
        kind=ProtocolErrorKind.MALFORMED,
    )


class _Compiler:
    def __init__(self, named: Mapping[str, Any]) -> None:
        self.named = named
        self.found = False  # a union or an enum somewhere
        self._building: dict[str, list[_Walk]] = {}

    def walk(self, schema: Any, where: str) -> _Walk:
        if isinstance(schema, list):
            return self._union(schema, where)
        if isinstance(schema, str):
            primitive = _PRIMITIVES.get(schema)
            if primitive is not None:
                return primitive
            return self._named(schema, where)
        kind = schema["type"]
        if kind in ("record", "error"):
            return self._record(schema, where)
        if kind == "enum":
            return self._enum(schema, where)
        if kind == "array":
            return self._blocks(self.walk(schema["items"], f"{where}[]"), keyed=False)
        if kind == "map":
            return self._blocks(self.walk(schema["values"], f"{where}{{}}"), keyed=True)
        if kind == "fixed":
            return _fixed(int(schema["size"]))
        return self.walk(kind, where)  # a primitive with attributes (logicalType ...)

    def _named(self, name: str, where: str) -> _Walk:
        if name in self._building:  # a recursive type: bind late
            cell = self._building[name]
            return lambda data, pos: cell[0](data, pos)
        return self.walk(self.named[name], where)

    def _record(self, schema: Mapping[str, Any], where: str) -> _Walk:
        name = schema.get("name", "")
        cell: list[_Walk] = []
        self._building[name] = cell
        prefix = f"{where}." if where else ""
        fields = tuple(self.walk(f["type"], prefix + f["name"]) for f in schema["fields"])
        del self._building[name]

        def record(data: bytes, pos: int) -> int:
            for field in fields:
                pos = field(data, pos)
            return pos

        cell.append(record)
        return record

    def _enum(self, schema: Mapping[str, Any], where: str) -> _Walk:
        self.found = True
        count = len(schema["symbols"])

        def enum(data: bytes, pos: int) -> int:
            index, pos = _read_long(data, pos)
            if not 0 <= index < count:
                raise _bad_index("enum symbol", index, count, where)
            return pos

        return enum

    def _union(self, branches: list[Any], where: str) -> _Walk:
        self.found = True
        walks = tuple(self.walk(branch, where) for branch in branches)
        count = len(walks)
        if count == 2 and walks[0] is _null:
            return self._optional(walks[1], where)

        def union(data: bytes, pos: int) -> int:
            index, pos = _read_long(data, pos)
            if not 0 <= index < count:
                raise _bad_index("union branch", index, count, where)
            return walks[index](data, pos)

        return union

    @staticmethod
    def _optional(value: _Walk, where: str) -> _Walk:
        # ["null", T], the usual union: index 0 (byte 00) or 1 (byte 02).
        def optional(data: bytes, pos: int) -> int:
            byte = data[pos]
            if byte == 0:
                return pos + 1
            if byte == 2:
                return value(data, pos + 1)
            index, pos = _read_long(data, pos)  # written in more bytes than it needs?
            if index == 0:
                return pos
            if index == 1:
                return value(data, pos)
            raise _bad_index("union branch", index, 2, where)

        return optional

    @staticmethod
    def _blocks(item: _Walk, *, keyed: bool) -> _Walk:
        def blocks(data: bytes, pos: int) -> int:
            while True:
                count, pos = _read_long(data, pos)
                if count == 0:
                    return pos
                if count < 0:  # a block with its size in bytes: count is -count
                    count = -count
                    pos = _skip_long(data, pos)
                if count > len(data):  # more items than bytes: garbage
                    raise _Stop
                for _ in range(count):
                    if keyed:
                        pos = _skip_bytes(data, pos)
                    pos = item(data, pos)

        return blocks


def index_checker(parsed: Any, named: Mapping[str, Any]) -> IndexChecker | None:
    """The check for records of ``parsed`` (fastavro's parsed schema; ``named`` its named
    types), or ``None`` when the schema has no union and no enum."""
    compiler = _Compiler(named)
    walk = compiler.walk(parsed, "")
    if not compiler.found:
        return None

    def check(data: bytes, start: int) -> None:
        try:
            walk(data, start)
        except (_Stop, IndexError):
            return  # cut short or garbage: the decoder says which

    return check
