"""Small process and port helpers shared by the local Kafka and PostgreSQL nodes.

The local stack runs real servers as plain child processes (no Docker). Each node records its
PID in a file inside the state directory so `qlayer dev status` / `down` work from any shell,
and so we only ever stop processes this stack started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

from layer.domain.errors import QlayerError


class LocalStackError(QlayerError):
    """A one-line, actionable problem with the local development stack."""


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on host:port."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def read_pid(pid_file: Path) -> int | None:
    """The PID recorded in pid_file if that process is still alive, else None."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        # Exists but belongs to another user (e.g. postgres under runuser): still alive.
        return True
    # A zombie is "alive" to kill(0) but has exited: reap it if it is our child; otherwise
    # (a server started by an earlier `qlayer dev up`, reparented to an init that does not
    # reap) read its state from /proc.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): trust kill(0)
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def terminate(pid: int, timeout: float = 30.0) -> None:
    """SIGTERM, wait up to timeout, then SIGKILL. Returns once the process is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def wait_until(
    check: Callable[[], bool],
    timeout: float,
    what: str,
    alive: Callable[[], bool] | None = None,
    on_death: Callable[[], str] | None = None,
    progress: Callable[[], object] | None = None,
    longest: float | None = None,
) -> None:
    """Poll check() until it is true. Fail fast (with on_death()'s text) if the process died.

    With ``progress`` (say, its log's size): while what it returns keeps changing, the process
    is busy starting (a broker loading thousands of partitions) and is given ``timeout`` more
    after each change, up to ``longest`` in all."""
    started = time.monotonic()
    deadline = started + timeout
    last = progress() if progress is not None else None
    while time.monotonic() < deadline:
        if check():
            return
        if alive is not None and not alive():
            detail = on_death() if on_death is not None else ""
            raise LocalStackError(f"{what} exited during start-up. {detail}".strip())
        time.sleep(0.2)
        if progress is not None:
            now, seen = time.monotonic(), progress()
            if seen != last:
                last = seen
                deadline = min(now + timeout, started + (longest or timeout))
    waited = time.monotonic() - started
    raise LocalStackError(f"{what} did not become ready within {waited:.0f}s")


def read_end(path: Path, size: int) -> str:
    """The last `size` bytes of a file as text ("" when it cannot be read)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def tail(path: Path, lines: int = 15, width: int = 400) -> str:
    """The last lines of a log file, for error messages, each cut to `width` characters.

    Reads only the file's end: a broker's log grows to hundreds of MB, and one of its lines
    (the partitions of a failed log directory) can be longer than a screen.
    """
    kept = read_end(path, 256 * 1024).splitlines()[-lines:]
    return "\n".join(line if len(line) <= width else line[:width] + " [...]" for line in kept)
