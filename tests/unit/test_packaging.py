"""What the wheel installs (issue 16 item 10): `layer`, `layer_cli` and `layer_migrations`, no
generic top-level names such as `cli` or `migrations` that another distribution could own too;
every package of the source tree listed; the image's constraints pin every dependency."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1].parent


def _setuptools() -> dict[str, Any]:
    config: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config


def _installed_name(folder: Path) -> str:
    """The import name a source folder is installed under (pyproject's package-dir)."""
    mapping = {v: k for k, v in _setuptools()["tool"]["setuptools"]["package-dir"].items()}
    parts = folder.relative_to(ROOT).parts
    return ".".join((mapping.get(parts[0], parts[0]), *parts[1:]))


def test_the_wheel_has_three_top_level_packages_and_every_package_is_listed() -> None:
    listed = set(_setuptools()["tool"]["setuptools"]["packages"])
    assert {name.split(".")[0] for name in listed} == {"layer", "layer_cli", "layer_migrations"}
    found = {_installed_name(init.parent) for top in ("layer", "cli", "migrations")
             for init in (ROOT / top).rglob("__init__.py") if "__pycache__" not in init.parts}
    assert found <= listed
    # The rest are data directories (no __init__.py), listed so setuptools installs them
    # without warning; each has files and a package-data pattern that takes them.
    package_data = _setuptools()["tool"]["setuptools"]["package-data"]
    for name in listed - found:
        folder = ROOT.joinpath(*name.split("."))
        assert folder.is_dir() and any(folder.iterdir()), name
        assert name in package_data, f"{name} has no package-data"


def test_the_entry_point_is_the_installed_cli() -> None:
    project = _setuptools()["project"]
    assert project["scripts"] == {"qlayer": "layer_cli.main:run"}


def test_nothing_imports_the_folders_by_their_names() -> None:
    """`cli` and `migrations` exist only as folders: importing them works in a checkout (its
    root is on sys.path) and fails once installed."""
    wrong = []
    for top in ("layer", "cli", "migrations", "tests", "benchmarks"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom)
                         and node.module and not node.level else [])
                wrong += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n.split(".")[0] in ("cli", "migrations")]
            if re.search(r"-m\W+cli\.main|files\(\W+migrations\W", path.read_text()):
                wrong.append(f"{path.relative_to(ROOT)}: runs cli.main or reads migrations")
    assert wrong == []


def test_the_image_installs_with_pinned_constraints() -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "pip install --constraint constraints.txt ." in dockerfile
    pins = {line.split("==")[0].lower().replace("_", "-")
            for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")}
    for requirement in _setuptools()["project"]["dependencies"]:
        name = re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower()
        assert name in pins, f"{name} is a dependency the image's constraints do not pin"
