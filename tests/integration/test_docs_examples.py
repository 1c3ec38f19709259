"""docs/getting-started.md's first queue, run as written against a real coordinator.

The queue file is applied, then the publish and worker programs run unchanged, but for the
queue name (unique per test, so records of earlier runs on the shared broker do not count) and
the environment they read their endpoints from.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from layer.domain.definitions import load_queue_file
from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import running_coordinator
from tests.unit.test_docs_examples import example

pytestmark = pytest.mark.integration


def test_getting_started_publishes_and_works_off_three_tasks(
        bootstrap_servers: str, database_url: str, unique_name: Callable[[str], str],
        create_topic: Callable[..., str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    queue = unique_name("Tasks")
    prefix = unique_name("docs") + "."

    def as_run(name: str) -> str:
        return example(name).body.replace("Tasks", queue)

    queues = load_queue_file(as_run("getting-started-queues"))
    assert [q.name for q in queues] == [queue]
    with Store(database_url) as store:
        for q in queues:
            store.put_queue(q.name, q.model_dump(mode="json"), time.time())
    create_topic(queue)
    monkeypatch.setenv("QLAYER_BOOTSTRAP_SERVERS", bootstrap_servers)
    monkeypatch.setenv("QLAYER_TOPIC_PREFIX", prefix)
    settings = Settings(bootstrap_servers=bootstrap_servers, database_url=database_url,
                        topic_prefix=prefix)
    with running_coordinator(settings):
        exec(compile(as_run("getting-started-publish"), "publish.py", "exec"), {})
        exec(compile(as_run("getting-started-worker"), "worker.py", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "published 3 tasks"
    assert sorted(line for line in out if line.startswith("resized")) == [
        f"resized photo-{n}.jpg delivery 1" for n in (1, 2, 3)]
    assert out[-1] == "3 tasks done"
    with Store(database_url) as store:
        assert store.load_counters(queue)[queue].acked == 3
