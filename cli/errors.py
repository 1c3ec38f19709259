"""One-line errors for people; a traceback only with --debug."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from layer.domain.errors import QlayerError


def run_friendly(app: Callable[[], object], argv: Sequence[str]) -> None:
    """Run the typer app; a qlayer error becomes `error: ...` on stderr and exit status 1.

    Usage errors stay typer's own (exit status 2), and so does a setting that cannot be used
    (an error class with ``exit_status = 2``, layer.settings.SettingsError: a wrong value in
    QLAYER_* or the config file is the same mistake as a wrong flag). With --debug the
    traceback is shown.
    """
    try:
        app()
    except QlayerError as exc:
        if "--debug" in argv:
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(getattr(exc, "exit_status", 1))
