"""Where a consumer keeps its session secret, so a restarted process can prove it.

Protocol 5 (docs/security.md, "Session identity"): a Subscribe for a consumer id whose session
is still live is refused unless it proves that session's secret. A worker that crashed and
comes back under its consumer id (docs/protocol.md §8) should still break its old leases at
once, so the SDK keeps the secret of its live session in a file only its user can read: one
file per topic prefix and consumer id, mode 0600, in a directory of mode 0700. The file is
written when the coordinator accepts a Subscribe and removed by ``close()``. A consumer
without a ``consumer_id`` (the SDK makes one up) keeps no file: no later process has its id.

The directory: the consumer's ``state_dir`` argument, else ``QLAYER_SDK_STATE_DIR``, else
``$XDG_STATE_HOME/qlayer/sessions`` (``~/.local/state/qlayer/sessions``). A restarted process
must see the same directory (a container needs a volume there); without the file it is
refused until the old session times out, as the refusal says.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["STATE_DIR_ENV", "SecretStore", "default_state_dir"]

log = logging.getLogger(__name__)

STATE_DIR_ENV = "QLAYER_SDK_STATE_DIR"


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """``QLAYER_SDK_STATE_DIR``, else ``$XDG_STATE_HOME/qlayer/sessions``, else
    ``~/.local/state/qlayer/sessions``."""
    env = os.environ if env is None else env
    if env.get(STATE_DIR_ENV):
        return Path(env[STATE_DIR_ENV])
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "qlayer" / "sessions"


class SecretStore:
    """One consumer's session secret on disk. Failures to read or write are logged, never
    raised: without the file a restart waits for the old session's timeout, nothing worse."""

    def __init__(self, directory: Path, prefix: str, consumer_id: str) -> None:
        # Topic prefixes and consumer ids are legal in Kafka topic names ([a-zA-Z0-9._-]),
        # so they are legal, separator-free file names too.
        self.path = directory / f"{prefix}{consumer_id}.secret"

    def load(self) -> bytes | None:
        """The secret a previous process of this consumer kept, if any."""
        try:
            data = self.path.read_bytes().strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read the session secret %s: %s", self.path, exc)
            return None
        return data or None

    def save(self, secret: bytes) -> None:
        """Keep ``secret`` (replacing any older one): written to a fresh 0600 file, then
        renamed over the old, so a reader sees one secret or the other, never half."""
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, secret)
            finally:
                os.close(fd)
            os.replace(temporary, self.path)
        except OSError as exc:
            log.warning("cannot keep the session secret in %s (%s): a restart under this "
                        "consumer id will wait for this session's timeout", self.path, exc)

    def forget(self, secret: bytes) -> None:
        """Remove the file if it still holds ``secret`` (another process of the same id may
        have replaced it since)."""
        if self.load() != secret:
            return
        try:
            self.path.unlink()
        except OSError as exc:
            log.debug("cannot remove the session secret %s: %s", self.path, exc)
