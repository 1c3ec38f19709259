"""The console's routes through Starlette's TestClient, against the real PostgreSQL and Kafka:
what each page shows, and what it refuses (unknown queue, actions when read-only, no auth)."""

from __future__ import annotations

import base64
import re
import time
import uuid
from collections.abc import Callable

import pytest
from starlette.testclient import TestClient

from layer.console.app import ConsoleOptions, ConsoleState, create_app
from layer.settings import Settings
from tests.integration.cli.conftest import attach_consumer
from tests.support.coordinator import produce, put_queues

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(bootstrap_servers: str, database_url: str) -> Settings:
    return Settings(bootstrap_servers=bootstrap_servers, database_url=database_url,
                    topic_prefix=f"qc{uuid.uuid4().hex[:8]}.")


@pytest.fixture
def jobs(settings: Settings, create_topic: Callable[..., str],
         unique_name: Callable[[str], str]) -> str:
    """A queue "Jobs" over a fresh journal holding three records (no coordinator runs)."""
    journal = create_topic(unique_name("jobs"), 1)
    put_queues(settings, {"name": "Jobs", "underlying_topic": journal, "max_deliveries": 1})
    produce(settings.bootstrap_servers, journal, [b'{"n": 1}', b'{"n": 2}', b'{"n": 3}'])
    return journal


def client(settings: Settings, **options: object) -> TestClient:
    state = ConsoleState(settings, ConsoleOptions(**options))  # type: ignore[arg-type]
    return TestClient(create_app(state, sampler=False))


def test_queues_page_shows_each_queue_depth_and_samples_for_the_charts(
        settings: Settings, jobs: str) -> None:
    web = client(settings, sample_interval=0.02)  # page loads 50 ms apart are both kept
    page = web.get("/queues")
    assert page.status_code == 200
    row = re.search(r'<tr data-queue="Jobs">(.*?)</tr>', page.text, re.S)
    assert row is not None, page.text
    assert re.search(r'<td class="depth num">3</td>', row.group(1))
    charts = re.compile(r'<section class="charts" data-queue="Jobs">(.*?)</section>', re.S)
    first = charts.search(page.text)
    assert first is not None
    # One sample so far: a dot for the depth; no rate yet, and the charts say so rather
    # than drawing a line at zero.
    assert first.group(1).count("no samples yet") == 4
    assert first.group(1).count("<circle") == 1
    time.sleep(0.05)
    again = charts.search(web.get("/queues").text)
    assert again is not None
    # Two samples: the depth line (3 both times) and one rate between them per counter.
    assert again.group(1).count("<polyline") == 1
    assert again.group(1).count("<circle") == 4 and "max 3" in again.group(1)
    assert web.get("/", follow_redirects=False).headers["location"] == "/queues"


def test_a_queue_page_shows_definition_entries_and_consumers(settings: Settings, jobs: str
                                                              ) -> None:
    attach_consumer(settings, "worker-1", "Jobs", max_backlog=4)
    page = client(settings).get("/queues/Jobs")
    assert page.status_code == 200
    assert f"<td>{jobs}</td>" in page.text  # the definition's underlying_topic
    assert page.text.count('<tr class="entry">') == 3
    assert f"{jobs}/0/0" in page.text
    assert 'data-consumer="worker-1"' in page.text
    assert "0 dead letter(s) waiting" in page.text
    # Read-only: no redrive button, a pointer to the CLI instead.
    assert 'id="redrive"' not in page.text and "qlayer dlq redrive Jobs" in page.text
    consumers = client(settings).get("/consumers")
    assert consumers.status_code == 200 and 'data-consumer="worker-1"' in consumers.text


def test_an_unknown_queue_is_404(settings: Settings, jobs: str) -> None:
    web = client(settings, allow_actions=True)
    for response in (web.get("/queues/Nope"), web.get("/queues/Nope/redrive")):
        assert response.status_code == 404
        assert "no queue named Nope" in response.text


def test_actions_are_403_when_read_only(settings: Settings, jobs: str) -> None:
    web = client(settings)
    assert web.get("/queues/Jobs/redrive").status_code == 403
    refused = web.post("/queues/Jobs/redrive", data={"csrf": "x"})
    assert refused.status_code == 403 and "read-only" in refused.text


def test_a_redrive_post_without_the_pages_token_or_from_another_origin_is_403(
        settings: Settings, jobs: str) -> None:
    web = client(settings, allow_actions=True)
    confirm = web.get("/queues/Jobs/redrive")
    assert confirm.status_code == 200
    assert re.search(r'id="would-move">0<', confirm.text)  # the dry run: nothing dead-lettered
    token = re.search(r'name="csrf" value="([0-9a-f]+)"', confirm.text)
    assert token is not None
    assert web.post("/queues/Jobs/redrive", data={"csrf": "0" * 64}).status_code == 403
    assert web.post("/queues/Jobs/redrive").status_code == 403
    foreign = web.post("/queues/Jobs/redrive", data={"csrf": token.group(1)},
                       headers={"origin": "http://evil.example"})
    assert foreign.status_code == 403
    done = web.post("/queues/Jobs/redrive", data={"csrf": token.group(1)},
                    headers={"origin": "http://testserver"})
    assert done.status_code == 200 and "moved <strong>0</strong>" in done.text


def test_basic_auth_when_configured(settings: Settings, jobs: str) -> None:
    web = client(settings, user="ops", password="s3cret")
    missing = web.get("/queues")
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Basic")
    assert web.get("/static/console.css").status_code == 401

    def basic(user: str, password: str) -> dict[str, str]:
        return {"authorization": "Basic " + base64.b64encode(
            f"{user}:{password}".encode()).decode()}

    assert web.get("/queues", headers=basic("ops", "wrong")).status_code == 401
    assert web.get("/queues", headers=basic("ops", "s3cret")).status_code == 200
    assert web.get("/coordinators", headers=basic("ops", "s3cret")).status_code == 200
