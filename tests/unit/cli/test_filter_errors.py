"""A LIKE pattern only a backtracking engine can run is refused by the CLI in one line, before
anything is requested or stored (issue 15 item 4), as a real `qlayer` process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Nothing listens there: a command that got as far as the database would say so instead.
UNREACHABLE = "postgresql://x@127.0.0.1:1/db"
WHY = ("backreferences such as \\1 are not supported: LIKE uses a linear-time regular "
       "expression engine (RE2), which cannot run it")


def qlayer(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("QLAYER_")}
    environment["QLAYER_CONFIG"] = str(config)
    done = subprocess.run([sys.executable, "-m", "layer_cli.main", *args], capture_output=True,
                          text=True, env=environment, cwd=tmp_path, timeout=120, check=False)
    return done.returncode, done.stdout, done.stderr


def test_queue_ack_refuses_a_backreference_filter(tmp_path: Path) -> None:
    code, out, err = qlayer(tmp_path, "queue", "ack", "Orders", "--filter",
                            "/state LIKE '(.)\\1'", "--database-url", UNREACHABLE)
    assert (code, out) == (1, "")
    [line] = err.splitlines()
    assert line.startswith("error: --filter ")
    assert f"invalid regular expression for LIKE '(.)\\1': {WHY} at column 13" in line
    assert line.endswith("nothing was requested (see docs/expressions.md)")


def test_queue_apply_refuses_a_queue_whose_filter_uses_lookahead(tmp_path: Path) -> None:
    queues = tmp_path / "queues.yaml"
    queues.write_text("queues:\n"
                      "  - name: Orders\n"
                      "    filter: /id LIKE '^(?!test-)'\n"
                      "  - name: Audit\n")
    code, out, err = qlayer(tmp_path, "queue", "apply", "-f", str(queues), "--database-url",
                            UNREACHABLE)
    assert (code, out) == (1, "")
    assert err.splitlines() == [
        f"error: {queues}: Orders.filter: invalid regular expression for LIKE '^(?!test-)': "
        "lookahead (?!...) is not supported: LIKE uses a linear-time regular expression "
        "engine (RE2), which cannot run it at column 10",
        "nothing was changed; fix the above and run again",
    ]
