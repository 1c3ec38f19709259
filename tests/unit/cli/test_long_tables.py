"""Tables past `LONG_TABLE` rows print plain (issue 33: a thousand queues' table took rich
1.2 s to lay out); shorter ones keep rich's boxes."""

from __future__ import annotations

import re

import pytest
from rich.console import Group
from rich.table import Table

from layer_cli import output
from layer_cli.output import LONG_TABLE, new_table, show


def _table(rows: int) -> Table:
    table = new_table("queue", "depth", "note", title="queues")
    table.columns[1].justify = "right"
    for n in range(rows):
        table.add_row(f"Q{n:04d}", str(n * 7), "[red]stalled[/]" if n == 3 else "-")
    return table


def test_a_long_table_prints_plain_aligned_rows_without_markup(
        capsys: pytest.CaptureFixture[str]) -> None:
    show(_table(LONG_TABLE + 1))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"queues ({LONG_TABLE + 1} rows)"
    assert lines[1].split() == ["queue", "depth", "note"]
    assert set(lines[2].replace(" ", "")) == {"-"}
    rows = lines[3:]
    assert len(rows) == LONG_TABLE + 1
    assert rows[3].split() == ["Q0003", "21", "stalled"]  # markup gone, text kept
    assert rows[-1].split() == [f"Q{LONG_TABLE:04d}", str(LONG_TABLE * 7), "-"]
    # Right-justified columns stay right-justified: every depth ends in the same column.
    ends = {list(re.finditer(r"\S+", row))[1].end() for row in rows}
    assert len(ends) == 1
    assert not any(c in "".join(lines) for c in "┃│┏━")


def test_a_table_of_up_to_long_table_rows_keeps_its_box(
        capsys: pytest.CaptureFixture[str]) -> None:
    show(_table(LONG_TABLE))
    out = capsys.readouterr().out
    assert "┃" in out and "Q0099" in out and "stalled" in out and "[red]" not in out


def test_a_long_table_inside_a_group_is_found(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output, "LONG_TABLE", 2)
    show(Group(_table(3), _table(1), "[red]queue Q0000: broken[/]"))
    out = capsys.readouterr().out
    assert out.startswith("queues (3 rows)\n")
    assert "┃" in out  # the one-row table
    assert "queue Q0000: broken" in out and "[red]" not in out


def test_plain_columns_align_by_terminal_cells_and_honour_each_justification() -> None:
    text = output.plain_lines(["name", "n", "mid"], [["注文", "7", "a"], ["Q1", "1234", "bbb"]],
                              ["left", "right", "center"])
    header, rule, wide, narrow = text.splitlines()
    assert rule == "----  ----  ---"
    assert wide == "注文     7   a"  # the two wide characters fill four cells
    assert narrow == "Q1    1234  bbb"
    assert header == "name     n  mid"
