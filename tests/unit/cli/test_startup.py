"""`qlayer` starts quickly: the heavy libraries are imported by the commands that use them.

Not a timed test (timings are noisy on shared machines): it checks the cause instead. Every
command pays the import of `layer_cli.main`; before issue 16 that pulled in PySpark, the Kafka
client, SQLAlchemy and fastavro (about 0.5 s of imports) for `qlayer --help`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layer_cli.demo import path_hint
from layer_cli.main import app

# pydantic itself is not here: typer 0.29 imports it to convert some option types. qlayer's
# own pydantic models (layer.domain.definitions) and pydantic-settings are.
HEAVY = ("pyspark", "confluent_kafka", "sqlalchemy", "fastavro", "pydantic_settings", "alembic",
         "psycopg", "lark", "layer.domain.definitions", "layer.services", "layer.store",
         "layer.sdk", "layer.kafka", "starlette", "uvicorn", "jinja2", "layer.console")

_PROBE = """
import json, sys
{body}
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def _loaded(body: str) -> list[str]:
    # A fresh interpreter: this test process has imported everything already.
    done = subprocess.run([sys.executable, "-c", _PROBE.format(body=body, heavy=HEAVY)],
                          capture_output=True, text=True, timeout=120, check=True)
    loaded: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


def test_importing_the_cli_loads_no_heavy_module() -> None:
    assert _loaded("import layer_cli.main") == []


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["queue", "--help"],
                                  ["pipeline", "views", "--help"], ["dlq", "redrive", "--help"],
                                  ["console", "--help"]])
def test_help_and_version_load_no_heavy_module(args: list[str]) -> None:
    body = ("import sys\nfrom layer_cli.main import app\n"
            f"try:\n    app({args!r})\nexcept SystemExit:\n    pass")
    assert _loaded(body) == []


def test_one_command_loads_only_its_own_module() -> None:
    """`qlayer stats` paid for `queue`'s YAML and the console's pages (~40 ms, issue 33)."""
    probe = ("import json, sys\nfrom layer_cli.main import _app_for\n"
             "_app_for(['stats', '--json'])\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.startswith('layer_cli.') "
             "or m == 'yaml')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=True)
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert "layer_cli.stats" in loaded
    assert not {"layer_cli.queue", "layer_cli.console", "layer_cli.dlq", "yaml"} & set(loaded)


def test_version_is_the_package_metadata() -> None:
    from importlib.metadata import version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"qlayer {version('qlayer')}\n"


def test_the_demo_says_how_to_run_qlayer_when_it_is_not_on_path(tmp_path: Path) -> None:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / "qlayer"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    hint = path_hint(str(script), path=os.defpath)
    assert hint is not None
    assert f"source {bin_dir}/activate" in hint and f"{bin_dir}/qlayer" in hint
    # On PATH (an activated venv): nothing to say.
    assert path_hint(str(script), path=str(bin_dir)) is None
    # `python -m layer_cli.main`: no script to point at.
    assert path_hint("/somewhere/cli/main.py", path=os.defpath) is None
