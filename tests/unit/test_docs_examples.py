"""The docs' examples stay true: code compiles, queue files validate, settings load, links resolve.

Every fenced ```python block of README.md and docs/*.md is compiled, unless its first line is
`# not run` (for fragments that are deliberately not a program). Every ```yaml block with a
top-level `queues:` key is loaded with `load_queue_file`, as `qlayer queue apply` would; other
YAML blocks must at least parse. A block preceded by `<!-- example:NAME -->` can be found by
name; tests/integration/test_docs_examples.py runs the getting-started ones against a real
coordinator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from layer.demo.run import demo_queues
from layer.domain.definitions import load_queue_file
from layer.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "# not run"

_FENCE = re.compile(r"^```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
_MARKER = re.compile(r"<!--\s*example:(?P<name>[\w.-]+)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    name: str | None
    body: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.search(before)
        found.append(Block(path, text.count("\n", 0, m.start()) + 1, m["lang"],
                           marker["name"] if marker else None, m["body"]))
    return found


def all_blocks(lang: str) -> list[Block]:
    return [b for path in DOCS for b in blocks(path) if b.lang == lang]


def example(name: str) -> Block:
    """The block marked `<!-- example:NAME -->` in the docs (exactly one)."""
    matches = [b for path in DOCS for b in blocks(path) if b.name == name]
    assert len(matches) == 1, f"example {name!r} found {len(matches)} times"
    return matches[0]


PYTHON = all_blocks("python")
YAML = all_blocks("yaml")


def test_the_docs_have_examples() -> None:
    # The parametrized tests below would pass vacuously if the fence pattern broke.
    assert len(PYTHON) >= 15 and len(YAML) >= 8
    assert {"getting-started-publish", "getting-started-worker", "getting-started-queues",
            "amps-mapped", "operations-config"} <= {b.name for b in PYTHON + YAML}


@pytest.mark.parametrize("block", PYTHON, ids=[b.where for b in PYTHON])
def test_python_examples_compile(block: Block) -> None:
    if block.body.lstrip().startswith(NOT_RUN):
        return
    compile(block.body, block.where, "exec")


@pytest.mark.parametrize("block", YAML, ids=[b.where for b in YAML])
def test_yaml_examples_are_valid(block: Block) -> None:
    data = yaml.safe_load(block.body)
    if isinstance(data, dict) and "queues" in data:
        queues = load_queue_file(block.body)
        assert [q.name for q in queues] == [
            q.get("name", q.get("Name")) for q in data["queues"]]


def test_the_operations_config_file_is_a_valid_settings_file() -> None:
    data = yaml.safe_load(example("operations-config").body)
    settings = Settings(**data)
    assert settings.kafka_config()["security.protocol"] == "SASL_SSL"
    assert "sslmode=verify-full" in settings.database_url


def test_the_amps_element_names_give_the_same_queue_as_snake_case() -> None:
    by_amps = {q.name: q for q in load_queue_file(example("amps-element-names").body)}
    by_snake = {q.name: q for q in load_queue_file(example("amps-mapped").body)}
    assert by_amps["Jobs"].max_cancels == by_snake["Jobs"].max_cancels == 3
    assert by_amps["Jobs"].max_deliveries == by_snake["Jobs"].max_deliveries == 10


def test_getting_started_opens_with_the_readme_commands() -> None:
    readme = next(b for b in blocks(ROOT / "README.md") if b.lang == "sh")
    guide = next(b for b in blocks(ROOT / "docs" / "getting-started.md") if b.lang == "sh")
    assert guide.body == readme.body


def test_the_demo_queue_file_is_valid_and_shows_each_headline_feature() -> None:
    queues = {q.name.removesuffix("_dx"): q for q in demo_queues("dx")}
    assert queues["Jobs"].dead_letter_topic == "FailedJobs_dx"
    assert queues["OrderPriority"].priority == "/price * /qty"
    assert queues["Settlements"].barrier_expression is not None
    assert queues["ORDERS_ANALYTICS"].default_publish_target == "ORDERS_ANALYTICS_DIRECT_dx"


_LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_relative_links_point_at_files(path: Path) -> None:
    missing = [m["target"] for m in _LINK.finditer(path.read_text())
               if "://" not in m["target"] and not (path.parent / m["target"]).exists()]
    assert missing == []
