"""Help output fixes for the typer version qlayer runs on.

typer 0.29's rich help shows a type for every option, so a flag that takes no value
(``--json``, ``--dry-run``, ``--prune/--no-prune``) was listed as ``--json <bool>``, which
reads as if it wanted ``--json true``. Its plain-text help leaves flags bare; this makes the
rich help agree.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperOption

# Older typers have no display_type_rich and print flags bare already.
_original = getattr(TyperOption, "display_type_rich", None)


def _display_type_rich(self: TyperOption, ctx: Any) -> str | None:
    if self.is_flag or self.count or _original is None:
        return None
    result: str | None = _original(self, ctx)
    return result


def install() -> None:
    """Patch once; idempotent (the CLI and the tests both import the app)."""
    if _original is not None:
        TyperOption.display_type_rich = _display_type_rich  # type: ignore[method-assign]
