"""Input a user gets wrong is one line and an exit status, not a traceback (issue 16 item 4):
non-UTF-8 lines given to `qlayer publish`, a QLAYER_KAFKA that is not a JSON object."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from layer.services.messages import PublishResult
from layer_cli.main import app
from layer_cli.messages import NotText, _lines

runner = CliRunner()


def qlayer(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
           stdin: bytes = b"") -> tuple[int, str, str]:
    config = tmp_path / "empty.yaml"  # no ./qlayer.yaml or QLAYER_CONFIG of the caller's
    config.write_text("{}\n")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("QLAYER_")}
    environment.update({"QLAYER_CONFIG": str(config), **(env or {})})
    done = subprocess.run([sys.executable, "-m", "layer_cli.main", *args], input=stdin,
                          capture_output=True, env=environment, cwd=tmp_path, timeout=120,
                          check=False)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """publish_lines without Kafka: it takes the lines as the real one does, one at a time."""
    sent: list[str] = []

    def fake(settings: Any, queue_or_topic: str, lines: Iterable[str],
             **options: Any) -> PublishResult:
        for line in lines:
            if line.rstrip("\r\n"):
                sent.append(line.rstrip("\r\n"))
        return PublishResult(queue_or_topic, len(sent))

    monkeypatch.setattr("layer.services.messages.publish_lines", fake)
    return sent


def test_a_line_that_is_not_utf8_stops_publish_naming_the_line(published: list[str]) -> None:
    result = runner.invoke(app, ["publish", "Q"], input=b"one\n\ntwo\nbad \xff\xfe\nthree\n")
    # CliRunner calls the app without run_friendly, which turns this into `error: ...`, exit 1.
    assert isinstance(result.exception, NotText)
    assert str(result.exception).startswith("stdin line 4 is not UTF-8 text (byte 0xff at "
                                            "column 5)")
    assert "2 message(s) from the lines before it were published" in str(result.exception)
    assert published == ["one", "two"]  # the lines before it; nothing from it on


def test_the_message_names_the_file_the_line_and_what_was_sent(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_bytes("é ok\n{\"a\": 1}\n\n".encode() + b"caf\xe9\n")
    with pytest.raises(NotText) as caught:
        list(_lines(source))
    assert str(caught.value) == (
        f"{source} line 4 is not UTF-8 text (byte 0xe9 at column 4): publish sends each line "
        "as UTF-8 text; 2 message(s) from the lines before it were published, nothing from "
        "it on")


def test_utf8_lines_pass_as_text(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_bytes("é\r\n{\"price\": 1}\n".encode())
    assert list(_lines(source)) == ["é\r\n", "{\"price\": 1}\n"]


@pytest.mark.parametrize(("value", "why"), [
    ("{bad", "QLAYER_KAFKA is not a JSON object of librdkafka properties: Expecting property "
             "name enclosed in double quotes: line 1 column 2 (char 1); write it like "
             "QLAYER_KAFKA='{\"security.protocol\": \"SASL_SSL\"}'"),
    ("[1, 2]", "invalid settings: kafka (QLAYER_KAFKA or kafka: in the config file): Input "
               "should be a valid dictionary"),
    ('{"linger.ms": [5]}', "invalid settings: kafka.linger.ms (QLAYER_KAFKA or kafka: in the "
                           "config file): should be a string, a number or a boolean"),
])
def test_a_bad_qlayer_kafka_is_one_line_and_exit_2(tmp_path: Path, value: str,
                                                   why: str) -> None:
    code, out, err = qlayer(tmp_path, "queue", "list", env={"QLAYER_KAFKA": value})
    assert (code, out) == (2, "")
    assert err == f"error: {why}\n"


def test_qlayer_kafka_takes_numbers_and_booleans(monkeypatch: pytest.MonkeyPatch) -> None:
    from layer.settings import Settings

    monkeypatch.setenv("QLAYER_KAFKA", '{"linger.ms": 5, "enable.idempotence": true}')
    assert Settings.load().kafka == {"linger.ms": 5, "enable.idempotence": True}


def test_a_config_file_that_is_not_yaml_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("bootstrap_servers: [\n")
    code, out, err = qlayer(tmp_path, "queue", "list", env={"QLAYER_CONFIG": str(bad)})
    assert (code, out) == (2, "")
    assert err.startswith(f"error: cannot read config file {bad}: ")
    assert len(err.splitlines()) == 1


def test_publish_of_non_utf8_stdin_is_one_line_and_exit_1(tmp_path: Path) -> None:
    # A real process through the entry point (run_friendly), with publish_lines replaced by
    # one that reads the lines without Kafka.
    code = ("import sys\nimport layer.services.messages as m\n"
            "m.publish_lines = lambda settings, queue, lines, **options: list(lines)\n"
            "sys.argv = ['qlayer', 'publish', 'Q']\nfrom layer_cli.main import run\nrun()\n")
    done = subprocess.run([sys.executable, "-c", code], input=b"ok\n\x80\n", cwd=tmp_path,
                          capture_output=True, timeout=120, check=False)
    assert done.returncode == 1
    assert done.stderr.decode() == (
        "error: stdin line 2 is not UTF-8 text (byte 0x80 at column 1): publish sends each "
        "line as UTF-8 text; 1 message(s) from the lines before it were published, nothing "
        "from it on\n")
