"""docs/sdk.md stays true: its examples parse and import what exists, its error table names
every SDK error, and the defaults it states are the code's."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import layer.sdk.errors
from layer.sdk import QueueConsumer, QueueDirectory

DOC = (Path(__file__).parents[3] / "docs" / "sdk.md").read_text()
EXAMPLES = dict(re.findall(r"<!-- example:([\w-]+) -->\n```python\n(.*?)```", DOC, re.S))


def test_the_guide_has_the_promised_examples() -> None:
    assert set(EXAMPLES) >= {"iterator", "receive", "run", "settle", "renew", "replace",
                             "regex", "publish", "directory", "errors", "kafka-config"}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_parse_and_import_only_what_exists(name: str) -> None:
    tree = ast.parse(EXAMPLES[name], filename=f"docs/sdk.md example {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("layer"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"


def test_every_sdk_error_is_in_the_error_table() -> None:
    table = DOC.split("## 9. Errors")[1].split("## 10.")[0]
    errors = [n for n in layer.sdk.errors.__all__ if n.endswith("Error")]
    missing = [n for n in errors if f"`{n}`" not in table]
    assert missing == []


@pytest.mark.parametrize(
    ("target", "parameter", "stated"),
    [(QueueConsumer, "max_backlog", "the default is **1**"),
     (QueueConsumer, "ack_batch_size", "(default 500)"),
     (QueueConsumer, "ack_interval", "(default 0.1;"),
     (QueueConsumer, "subscribe_timeout", "`subscribe_timeout` seconds (default 10)"),
     (QueueConsumer, "session_timeout", "(seconds, default 30;"),
     (QueueDirectory, "refresh_interval", "(default 30;"),
     (QueueDirectory, "miss_refresh_interval", "at most\nonce a second")],
)
def test_stated_defaults_are_the_codes(target: type, parameter: str, stated: str) -> None:
    assert stated in DOC
    default = inspect.signature(target).parameters[parameter].default
    number = re.search(r"\d+(\.\d+)?", stated.replace("once a second", "1"))
    assert number is not None and float(number.group()) == default
