"""Where the SDK keeps a consumer's session secret for a restarted process (protocol 5)."""

from __future__ import annotations

import stat
from pathlib import Path

from layer.sdk.identity import SecretStore, default_state_dir


def test_the_secret_is_kept_for_the_user_alone_and_forgotten_by_its_session(
        tmp_path: Path) -> None:
    store = SecretStore(tmp_path / "state", "qlayer.", "worker-7")
    assert store.load() is None
    store.save(b"a" * 64)
    assert store.path == tmp_path / "state" / "qlayer.worker-7.secret"
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.path.parent.stat().st_mode) == 0o700
    again = SecretStore(tmp_path / "state", "qlayer.", "worker-7")  # a restarted process
    assert again.load() == b"a" * 64
    again.save(b"b" * 64)
    store.forget(b"a" * 64)  # an older session's close leaves the newer secret alone
    assert again.load() == b"b" * 64
    again.forget(b"b" * 64)
    assert not store.path.exists() and again.load() is None
    assert [p.name for p in store.path.parent.iterdir()] == []


def test_consumer_ids_and_prefixes_keep_their_own_files(tmp_path: Path) -> None:
    one = SecretStore(tmp_path, "a.", "w")
    two = SecretStore(tmp_path, "b.", "w")
    one.save(b"1" * 32)
    assert two.load() is None


def test_a_directory_that_cannot_be_written_is_logged_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = SecretStore(blocker / "sub", "q.", "w")
    store.save(b"x" * 32)  # logged: a restart then waits for the session timeout
    assert store.load() is None


def test_the_state_directory_comes_from_the_environment(tmp_path: Path) -> None:
    assert default_state_dir({"QLAYER_SDK_STATE_DIR": str(tmp_path)}) == tmp_path
    assert default_state_dir({"XDG_STATE_HOME": "/x"}) == Path("/x/qlayer/sessions")
    assert default_state_dir({}) == Path.home() / ".local/state/qlayer/sessions"
