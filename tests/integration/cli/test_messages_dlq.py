"""`qlayer publish`, `consume` and `dlq list | redrive` against a real coordinator, Kafka and
PostgreSQL, through typer's runner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from layer.kafka import KafkaAdmin
from layer.protocol import Bookmark, header_value
from layer.protocol.headers import DLQ_VALUE_OMITTED, DeadLetterInfo, dead_letter_headers
from layer.sdk import QueueDirectory
from layer.services.messages import REDRIVEN_FROM, redrive
from layer.settings import Settings
from layer.store.rows import ConsumerRow
from layer.store.store import Store
from layer_cli.main import app
from tests.support.coordinator import (
    TopicReader,
    counters,
    produce,
    put_queues,
    running_coordinator,
    wait_for_counters,
    wait_until,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(bootstrap_servers: str, database_url: str) -> Settings:
    return Settings(bootstrap_servers=bootstrap_servers, database_url=database_url,
                    topic_prefix=f"qc{uuid.uuid4().hex[:8]}.")


def qlayer(settings: Settings, *args: str, input: str | None = None) -> Result:
    flags = ["--bootstrap-servers", settings.bootstrap_servers,
             "--database-url", settings.database_url, "--topic-prefix", settings.topic_prefix]
    result = CliRunner().invoke(app, [*args, *flags], input=input, catch_exceptions=False,
                               env={"COLUMNS": "250"})
    return result


def wait_for_directory(settings: Settings, queue: str) -> None:
    """The coordinator publishes the queue directory when it starts; publishers route by it."""
    with QueueDirectory(settings.bootstrap_servers, topic_prefix=settings.topic_prefix,
                        miss_refresh_interval=0.1) as directory:
        wait_until(lambda: directory.get(queue), what=f"{queue} in the queue directory")


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_publish_routes_a_queue_name_and_consume_acks(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    direct = create_topic(unique_name("OrdersDirect"), partitions=1)
    put_queues(settings, {"name": "Orders", "underlying_topic": direct,
                          "default_publish_target": direct})
    with running_coordinator(settings):
        wait_for_directory(settings, "Orders")
        published = qlayer(settings, "publish", "Orders", "--key", "k1", "--header", "src=cli",
                           input='{"n": 1}\n{"n": 2}\n\n{"n": 3}\n')
        assert published.exit_code == 0, published.output
        assert published.stdout.strip() == (
            f"published 3 message(s) to {direct} (routed from Orders)")

        consumed = qlayer(settings, "consume", "Orders", "--count", "3", "--max-backlog", "3",
                          "--json")
        assert consumed.exit_code == 0, consumed.output
        messages = json_lines(consumed.stdout)
        assert [m["value"] for m in messages] == ['{"n": 1}', '{"n": 2}', '{"n": 3}']
        assert {m["key"] for m in messages} == {"k1"}
        assert all(m["headers"] == {"src": "cli"} for m in messages)
        assert [m["bookmark"] for m in messages] == [f"{direct}/0/{i}" for i in range(3)]
        assert {m["settled"] for m in messages} == {"ack"}
        got = wait_for_counters(settings, "Orders", acked=3)
        assert (got["enqueued"], got["delivered"], got["acked"]) == (3, 3, 3)


def test_reject_dead_letters_list_them_and_redrive_each_exactly_once(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    jobs = create_topic(unique_name("Jobs"), partitions=2)
    put_queues(settings, {"name": "Jobs", "underlying_topic": jobs})
    admin = KafkaAdmin(settings.kafka_config())
    with running_coordinator(settings):
        lines = "".join(json.dumps({"job": i, "kind": "big" if i % 2 else "small"}) + "\n"
                        for i in range(6))
        assert qlayer(settings, "publish", jobs, "--key", "acct-7", input=lines).exit_code == 0
        rejected = qlayer(settings, "consume", "Jobs", "--count", "6", "--reject",
                          "--reason", "no such customer")
        assert rejected.exit_code == 0, rejected.output
        assert [line.split()[-1] for line in rejected.stdout.splitlines()
                if "/" in line and "delivery 1" in line] == ["rejected"] * 6
        wait_for_counters(settings, "Jobs", dead_lettered=6)

        listed = qlayer(settings, "dlq", "list", "Jobs", "--json")
        assert listed.exit_code == 0, listed.output
        letters = json.loads(listed.stdout)["dead_letters"]
        assert len(letters) == 6
        assert {(d["reason"], d["detail"], d["delivery_count"]) for d in letters} == {
            ("rejected", "no such customer", 1)}
        originals = {d["bookmark"]: d["value"] for d in letters}
        assert {Bookmark.parse(b).topic for b in originals} == {jobs}
        table = qlayer(settings, "dlq", "list", "Jobs")
        assert table.exit_code == 0 and "no such customer" in table.stdout

        before = sum(admin.end_offsets([(jobs, 0), (jobs, 1)]).values())
        dry = qlayer(settings, "dlq", "redrive", "Jobs", "--dry-run", "--json")
        assert json.loads(dry.stdout)["moved"] == 6
        assert sum(admin.end_offsets([(jobs, 0), (jobs, 1)]).values()) == before

        moved = qlayer(settings, "dlq", "redrive", "Jobs", "--json", "--rate", "100")
        assert moved.exit_code == 0, moved.output
        summary = json.loads(moved.stdout)
        assert (summary["moved"], summary["targets"]) == (6, {jobs: 6})
        again = qlayer(settings, "dlq", "redrive", "Jobs")
        assert again.exit_code == 0, again.output
        assert again.stdout.startswith("moved 0 dead letter(s) of Jobs")

        # Each dead letter came back into the queue exactly once, as it was, marked.
        back = qlayer(settings, "consume", "Jobs", "--count", "6", "--max-backlog", "6",
                      "--json")
        messages = json_lines(back.stdout)
        sources = Counter(str(m["headers"]["qlayer.redriven-from"])  # type: ignore[index]
                          for m in messages)
        assert sources == Counter(list(originals))
        assert all(originals[str(m["headers"]["qlayer.redriven-from"])]  # type: ignore[index]
                   == m["value"] for m in messages)
        assert not any(name.startswith("qlayer.dlq.") for m in messages
                       for name in m["headers"])  # type: ignore[union-attr]
        assert {m["key"] for m in messages} == {"acct-7"}
        wait_for_counters(settings, "Jobs", acked=6)
        rest = qlayer(settings, "consume", "Jobs", "--idle-timeout", "2", "--json")
        assert rest.exit_code == 0 and rest.stdout == ""


def test_redrive_with_a_filter_moves_only_matching_letters_once(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    jobs = create_topic(unique_name("Work"), partitions=1)
    put_queues(settings, {"name": "Work", "underlying_topic": jobs,
                          "dead_letter_topic": jobs + ".failed"})
    with running_coordinator(settings):
        lines = "".join(json.dumps({"n": i, "big": i >= 2}) + "\n" for i in range(4))
        wait_for_directory(settings, "Work")
        assert qlayer(settings, "publish", "Work", input=lines).exit_code == 0
        assert qlayer(settings, "consume", "Work", "--count", "4", "--reject").exit_code == 0
        wait_for_counters(settings, "Work", dead_lettered=4)
        first = json.loads(qlayer(settings, "dlq", "redrive", "Work", "--filter",
                                  "/big = true", "--json").stdout)
        assert (first["moved"], first["kept_for_later"]) == (2, 2)
        # Issue 16 item 7: the letters the filter passed over are not stranded.
        listed = json.loads(qlayer(settings, "dlq", "list", "Work", "--json").stdout)
        assert sorted(json.loads(str(d["value"]))["n"] for d in listed["dead_letters"]) == [0, 1]
        second = json.loads(qlayer(settings, "dlq", "redrive", "Work", "--json").stdout)
        assert (second["moved"], second["kept_for_later"]) == (2, 0)
        third = json.loads(qlayer(settings, "dlq", "redrive", "Work", "--json").stdout)
        assert third["moved"] == 0
        reader = TopicReader(settings.bootstrap_servers, jobs)
        try:
            records = reader.read_until(lambda got: len(got) >= 8)
            records += reader.read(1.0)  # anything beyond would show up here
        finally:
            reader.close()
        redriven = [r for r in records if header_value(r.headers, "qlayer.redriven-from")]
        assert sorted(json.loads(r.value or b"")["n"] for r in redriven) == [0, 1, 2, 3]


def test_dlq_list_totals_redrive_by_bookmark_and_delete(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    jobs = create_topic(unique_name("Marks"), partitions=1)
    put_queues(settings, {"name": "Marks", "underlying_topic": jobs})
    with running_coordinator(settings):
        lines = "".join(json.dumps({"n": i}) + "\n" for i in range(4))
        assert qlayer(settings, "publish", jobs, input=lines).exit_code == 0
        assert qlayer(settings, "consume", "Marks", "--count", "4", "--reject").exit_code == 0
        wait_for_counters(settings, "Marks", dead_lettered=4)

        table = qlayer(settings, "dlq", "list", "Marks", "--limit", "3")
        assert table.exit_code == 0, table.output
        assert "dead letters of Marks (shown 3 of 4)" in table.stdout
        assert "4 dead letter(s) waiting: 4 rejected" in table.stdout
        listed = json.loads(qlayer(settings, "dlq", "list", "Marks", "--json").stdout)
        assert (listed["total"], listed["by_reason"]) == (4, {"rejected": 4})
        bookmark = {json.loads(str(d["value"]))["n"]: d["bookmark"]
                    for d in listed["dead_letters"]}

        one = json.loads(qlayer(settings, "dlq", "redrive", "Marks", "--bookmark", bookmark[1],
                                "--json").stdout)
        assert (one["moved"], one["kept_for_later"]) == (1, 3)
        dry = json.loads(qlayer(settings, "dlq", "delete", "Marks", "--bookmark", bookmark[2],
                                "--dry-run", "--json").stdout)
        assert dry["deleted"] == 1
        gone = qlayer(settings, "dlq", "delete", "Marks", "--bookmark", bookmark[2])
        assert gone.exit_code == 0, gone.output
        assert gone.stdout.startswith("deleted 1 dead letter(s) of Marks")
        listed = json.loads(qlayer(settings, "dlq", "list", "Marks", "--json").stdout)
        assert listed["total"] == 2
        assert sorted(json.loads(str(d["value"]))["n"] for d in listed["dead_letters"]) == [0, 3]
        # The kept letters keep their original bookmarks: still addressable as listed first.
        assert {d["bookmark"] for d in listed["dead_letters"]} == {bookmark[0], bookmark[3]}

        rest = json.loads(qlayer(settings, "dlq", "redrive", "Marks", "--json").stdout)
        assert rest["moved"] == 2
        assert json.loads(qlayer(settings, "dlq", "list", "Marks", "--json").stdout)[
            "total"] == 0
        reader = TopicReader(settings.bootstrap_servers, jobs)
        try:
            records = reader.read_until(lambda got: len(got) >= 7)
            records += reader.read(1.0)
        finally:
            reader.close()
        redriven = [r for r in records if header_value(r.headers, REDRIVEN_FROM)]
        # The deleted one never came back; the others exactly once.
        assert sorted(json.loads(r.value or b"")["n"] for r in redriven) == [0, 1, 3]

    usage = qlayer(settings, "dlq", "delete", "Marks")
    assert usage.exit_code == 2
    bad = qlayer(settings, "dlq", "redrive", "Marks", "--bookmark", "nonsense")
    assert bad.exit_code == 2 and "TOPIC/PARTITION/OFFSET" in bad.output


def test_a_dead_letter_without_its_value_is_never_redriven_but_kept_until_deleted(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    jobs = create_topic(unique_name("Omit"), partitions=1)
    put_queues(settings, {"name": "Omit", "underlying_topic": jobs})
    dlq = create_topic(f"{settings.topic_prefix}dlq.Omit", partitions=1)
    # As the coordinator writes them: a rejected letter, and a record too large to deliver,
    # whose letter leaves its value out (issue 15).
    for offset, reason, value, extra in (
            (0, "rejected", b'{"n": 0}', []),
            (1, "too_large", b"", [(DLQ_VALUE_OMITTED, b"1500000")])):
        info = DeadLetterInfo(reason=reason, queue="Omit", bookmark=Bookmark(jobs, 0, offset),
                              delivery_count=0, dead_lettered_at_ms=int(time.time() * 1000))
        headers = [(k, v or b"") for k, v in dead_letter_headers([], info)] + extra
        produce(settings.bootstrap_servers, dlq, [value], keys=[b"k%d" % offset],
                headers=headers)
    too_large = f"{jobs}/0/1"

    dry = json.loads(qlayer(settings, "dlq", "redrive", "Omit", "--dry-run", "--json").stdout)
    assert (dry["moved"], dry["skipped_value_omitted"]) == (1, 1)
    first = qlayer(settings, "dlq", "redrive", "Omit")
    assert first.exit_code == 0, first.output
    assert first.stdout.startswith("moved 1 dead letter(s) of Omit")
    assert "1 dead letter(s) without their value" in first.stdout
    listed = json.loads(qlayer(settings, "dlq", "list", "Omit", "--json").stdout)
    assert (listed["total"], listed["by_reason"]) == (1, {"too_large": 1})
    assert [d["bookmark"] for d in listed["dead_letters"]] == [too_large]
    assert listed["dead_letters"][0]["headers"][DLQ_VALUE_OMITTED] == "1500000"
    # Every redrive says so again, and moves nothing of it.
    again = json.loads(qlayer(settings, "dlq", "redrive", "Omit", "--json").stdout)
    assert (again["moved"], again["skipped_value_omitted"]) == (0, 1)
    gone = qlayer(settings, "dlq", "delete", "Omit", "--bookmark", too_large, "--json")
    assert json.loads(gone.stdout)["deleted"] == 1
    assert json.loads(qlayer(settings, "dlq", "list", "Omit", "--json").stdout)["total"] == 0
    reader = TopicReader(settings.bootstrap_servers, jobs)
    try:
        records = reader.read_until(lambda got: len(got) >= 1)
        records += reader.read(1.0)  # an empty record redriven would show up here
    finally:
        reader.close()
    assert [(r.value, header_value(r.headers, REDRIVEN_FROM)) for r in records] == [
        (b'{"n": 0}', f"{jobs}/0/0".encode())]


def test_an_interrupted_redrive_leaves_nothing_half_done_and_the_next_run_finishes(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    jobs = create_topic(unique_name("Batch"), partitions=1)
    put_queues(settings, {"name": "Batch", "underlying_topic": jobs})
    with running_coordinator(settings):
        lines = "".join(json.dumps({"n": i}) + "\n" for i in range(5))
        assert qlayer(settings, "publish", jobs, input=lines).exit_code == 0
        assert qlayer(settings, "consume", "Batch", "--count", "5", "--reject").exit_code == 0
        wait_for_counters(settings, "Batch", dead_lettered=5)
    # A coordinator that crashed between writing a dead letter and recording it writes it
    # again on recovery: the same entry twice on the dead-letter topic.
    dlq = TopicReader(settings.bootstrap_servers, f"{settings.topic_prefix}dlq.Batch")
    try:
        copy = dlq.read_until(lambda got: len(got) >= 5)[2]
    finally:
        dlq.close()
    produce(settings.bootstrap_servers, f"{settings.topic_prefix}dlq.Batch", [copy.value],
            keys=[copy.key], headers=[(k, v or b"") for k, v in copy.headers])

    def interrupt(done: int, total: int) -> None:
        if done == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of a batch

    with pytest.raises(KeyboardInterrupt):
        redrive(settings, "Batch", progress=interrupt)
    # The interrupted batch was aborted, position and records alike; this run moves it.
    assert redrive(settings, "Batch").moved >= 3
    reader = TopicReader(settings.bootstrap_servers, jobs)
    try:
        records = reader.read_until(
            lambda got: sum(1 for r in got if header_value(r.headers, REDRIVEN_FROM)) >= 5)
        records += reader.read(1.0)  # anything beyond the five would show up here
    finally:
        reader.close()
    sources = Counter(header_value(r.headers, REDRIVEN_FROM) for r in records
                      if header_value(r.headers, REDRIVEN_FROM))
    assert sorted(sources.values()) == [1] * 5
    assert redrive(settings, "Batch").moved == 0


def test_consume_as_a_process_prints_acks_and_closes_cleanly_on_ctrl_c(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    work = create_topic(unique_name("Live"), partitions=1)
    put_queues(settings, {"name": "Live", "underlying_topic": work})
    env = {**os.environ, "QLAYER_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
           "QLAYER_DATABASE_URL": settings.database_url,
           "QLAYER_TOPIC_PREFIX": settings.topic_prefix, "QLAYER_CONFIG": os.devnull}
    with running_coordinator(settings):
        # A shell without job control starts background jobs with SIGINT ignored, and an
        # ignored signal stays ignored across exec (Python then installs no KeyboardInterrupt
        # handler): Ctrl-C is restored for the child, as a terminal would have it.
        process = subprocess.Popen([sys.executable, "-m", "layer_cli.main", "consume", "Live",
                                    "--json"],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, preexec_fn=_default_sigint)
        try:
            wait_until(lambda: any(c.queue == "Live" for c in consumer_rows(settings)),
                       what="the consume process subscribed")
            assert qlayer(settings, "publish", work, input="one\ntwo\n").exit_code == 0
            assert process.stdout is not None
            lines = [json.loads(process.stdout.readline()) for _ in range(2)]
            assert [m["value"] for m in lines] == ["one", "two"]
            wait_for_counters(settings, "Live", acked=2)
            process.send_signal(signal.SIGINT)
            # close() may wait up to 10 s for Kafka twice (acks, then the Unsubscribe).
            _, stderr = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
        assert process.returncode == 130
        assert stderr.strip().splitlines()[-1] == "stopped"
        # Closing unsubscribed it: the coordinator dropped the consumer.
        wait_until(lambda: not any(c.queue == "Live" for c in consumer_rows(settings)),
                   what="the consumer gone after Ctrl-C")


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def consumer_rows(settings: Settings) -> list[ConsumerRow]:
    with Store(settings.database_url) as store:
        return store.load_consumers()


def test_publish_from_a_file_consume_with_a_filter_and_release(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str],
    tmp_path: Path
) -> None:
    work = create_topic(unique_name("Files"), partitions=1)
    put_queues(settings, {"name": "Files", "underlying_topic": work})
    lines = tmp_path / "lines.txt"
    lines.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(4)))
    with running_coordinator(settings):
        published = qlayer(settings, "publish", work, "--file", str(lines))
        assert published.stdout.strip() == f"published 4 message(s) to {work}"
        released = qlayer(settings, "consume", "Files", "--filter", "/n >= 2", "--count", "2",
                          "--release", "--json")
        assert released.exit_code == 0, released.output
        # A released entry keeps its place at the front: the same one comes again.
        assert [(json.loads(str(m["value"]))["n"], m["delivery_count"], m["settled"])
                for m in json_lines(released.stdout)] == [(2, 1, "release"), (2, 2, "release")]
        wait_for_counters(settings, "Files", released=2)
        everything = qlayer(settings, "consume", "Files", "--count", "4", "--max-backlog", "4",
                            "--json")
        counts = {json.loads(str(m["value"]))["n"]: m["delivery_count"]
                  for m in json_lines(everything.stdout)}
        # n=2 was shown twice and released twice; consume leased nothing it did not show
        # (issue 16 item 6), so this is its third delivery, not a fourth.
        assert counts == {0: 1, 1: 1, 2: 3, 3: 1}


def test_consume_count_release_uses_up_only_the_deliveries_it_shows(
    settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    # Issue 16 item 6: `consume --count 1 --release` three times on a max_deliveries 3 queue
    # showed the message fewer times than it was delivered, and dead-lettered it early.
    work = create_topic(unique_name("Peek"), partitions=1)
    put_queues(settings, {"name": "Peek", "underlying_topic": work, "max_deliveries": 3})
    with running_coordinator(settings):
        assert qlayer(settings, "publish", work, input='{"n": 1}\n').exit_code == 0
        shown = []
        for _ in range(3):
            peek = qlayer(settings, "consume", "Peek", "--count", "1", "--release",
                          "--max-backlog", "5", "--json")
            assert peek.exit_code == 0, peek.output
            shown += [m["delivery_count"] for m in json_lines(peek.stdout)]
        assert shown == [1, 2, 3]
        # Every delivery was shown (the counters agree), and the message left for the
        # dead-letter topic only once it had been shown max_deliveries times.
        wait_for_counters(settings, "Peek", released=3)
        time.sleep(2)  # a hidden lease would be committed by now (refresh ~ 0.1-1 s)
        found = counters(settings, "Peek")
        assert (found["delivered"], found["dead_lettered"]) == (3, 1)
