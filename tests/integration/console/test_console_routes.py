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


def state_of(settings: Settings, **options: object) -> ConsoleState:
    return ConsoleState(settings, ConsoleOptions(**options))  # type: ignore[arg-type]


def test_the_queue_list_shows_the_latest_sampling_and_a_new_one_moves_it(
        settings: Settings, jobs: str) -> None:
    state = state_of(settings, sample_interval=0.02)
    web = TestClient(create_app(state, sampler=False))
    page = web.get("/queues")
    assert page.status_code == 200
    row = re.search(r'<tr data-queue="Jobs">(.*?)</tr>', page.text, re.S)
    assert row is not None, page.text
    assert re.search(r'<td class="depth num">3</td>', row.group(1))
    # One sampling so far: a dot for the depth sparkline.
    assert row.group(1).count("<circle") == 1
    produce(settings.bootstrap_servers, jobs, [b'{"n": 4}'])
    # The page shows the sampler's latest sampling (a thousand queues are not read per
    # page load): still 3, until the next sampling.
    assert '<td class="depth num">3</td>' in web.get("/queues").text
    time.sleep(0.05)
    state.sample()
    row = re.search(r'<tr data-queue="Jobs">(.*?)</tr>', web.get("/queues").text, re.S)
    assert row is not None
    assert '<td class="depth num">4</td>' in row.group(1)
    assert row.group(1).count("<polyline") == 1  # two samplings: a line from 3 to 4


def test_the_overview_adds_every_queue_up_and_says_whether_coordinators_run(
        settings: Settings, jobs: str, create_topic: Callable[..., str],
        unique_name: Callable[[str], str]) -> None:
    other = create_topic(unique_name("other"), 1)
    put_queues(settings, {"name": "Other", "underlying_topic": other})
    produce(settings.bootstrap_servers, other, [b"x", b"y"])
    web = client(settings)
    page = web.get("/")
    assert page.status_code == 200
    found = dict(re.findall(r'id="total-(queues|depth)">(\d+)<', page.text))
    # Other tests' queues may share this database: at least these two, all of their depth.
    assert int(found["queues"]) >= 2 and int(found["depth"]) >= 5
    deepest = re.search(r'<section id="deepest">(.*?)</section>', page.text, re.S)
    assert deepest is not None and 'data-queue="Jobs"' in deepest.group(1)
    # No coordinator runs in this test: the overview says the queues are not served.
    health = re.search(r'id="coordinator-health">(.*?)</div>', page.text, re.S)
    assert health is not None and "attention" in health.group(1)
    assert page.text.count("<svg") == 5  # depth and the four rates, for all queues


def test_search_sort_and_pages_of_the_queue_list(settings: Settings,
                                                 create_topic: Callable[..., str],
                                                 unique_name: Callable[[str], str]) -> None:
    journal = create_topic(unique_name("many"), 1)
    tag = uuid.uuid4().hex[:6]
    names = [f"L{tag}q{i:02d}" for i in range(12)]
    put_queues(settings, *({"name": n, "underlying_topic": journal} for n in names))
    web = client(settings)
    page = web.get(f"/queues?q=l{tag}Q&per=5&page=2")
    listed = re.findall(r'<tr data-queue="([^"]+)">', page.text)
    assert listed == names[5:10]
    # A fresh database: these 12 queues are all there is, and all match.
    assert '<strong id="total">12</strong> queues, 6–10 shown' in page.text
    assert 'id="matched"' not in page.text and "page 2 of 3" in page.text
    narrower = web.get(f"/queues?q=l{tag}q1")
    assert '<strong id="matched">2</strong> of <strong id="total">12</strong>' in narrower.text
    # The pager keeps the search and the page size; the next page is the last one.
    assert f'href="/queues?q=l{tag}Q&amp;page=3&amp;per=5" rel="next"' in page.text
    last = web.get(f"/queues?q=l{tag}Q&per=5&page=3")
    assert re.findall(r'<tr data-queue="([^"]+)">', last.text) == names[10:]
    down = web.get(f"/queues?q=l{tag}Q&sort=name&order=desc&per=3")
    assert re.findall(r'<tr data-queue="([^"]+)">', down.text) == names[::-1][:3]
    bad = web.get("/queues?sort=colour&per=many")
    assert bad.status_code == 200 and "unknown sort &#39;colour&#39;" in bad.text
    none = web.get("/queues?q=no-such-queue-anywhere")
    assert 'id="no-match"' in none.text


def test_the_live_part_comes_alone_for_the_page_script(settings: Settings, jobs: str) -> None:
    web = client(settings)
    for url in ("/queues", "/"):
        whole = web.get(url)
        part = web.get(url, headers={"X-Qlayer-Fragment": "live"})
        assert part.status_code == 200 and part.headers["cache-control"] == "no-store"
        assert "<html" not in part.text and "<html" in whole.text
        assert 'id="sampled"' in part.text
        # The page holds the same part inside its live container, and loads the script.
        assert 'id="live" data-refresh="5.0"' in whole.text
        assert '<script src="/static/console.js" defer></script>' in whole.text
    script = web.get("/static/console.js")
    assert script.status_code == 200 and "X-Qlayer-Fragment" in script.text


def test_the_chart_history_survives_a_console_restart(settings: Settings, jobs: str) -> None:
    from layer.store.history import ConsoleSamples
    from layer.store.store import Store

    first = state_of(settings, sample_interval=0.02)
    first.sample()
    time.sleep(0.05)
    produce(settings.bootstrap_servers, jobs, [b'{"n": 4}'])
    first.sample()
    assert first.history_problem is None
    with Store(settings.database_url) as store:
        stored = [r for r in ConsoleSamples(store.engine).since(time.time() - 60)
                  if r.queue == "Jobs"]
    assert [r.depth for r in stored][-2:] == [3, 4]
    # A console started afterwards reads them back: Jobs' depth line is drawn at once (the
    # same interval: samplings closer than half of it are read as one).
    page = client(settings, sample_interval=0.02).get("/queues/Jobs")
    charts = re.search(r'<section class="charts" id="charts">(.*?)</section>', page.text, re.S)
    assert charts is not None and "<polyline" in charts.group(1)


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
    assert '<td class="shard">-</td>' in consumers.text  # stored without a shard here


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


def test_a_message_page_shows_the_record_its_lease_and_its_events(
        settings: Settings, jobs: str) -> None:
    from layer.sdk import QueueConsumer
    from tests.support.coordinator import running_coordinator, wait_for_counters

    big = b"v" * 10_000
    produce(settings.bootstrap_servers, jobs, [big], keys=[b"k-big"],
            headers=[("trace", b"t-1")])
    web = client(settings)
    untouched = web.get(f"/queues/Jobs/messages/{jobs}/0/3")
    assert untouched.status_code == 200
    assert re.search(r'id="message-state"[^>]*><strong>AVAILABLE</strong>', untouched.text)
    assert "10000 bytes, the first 4096 shown" in untouched.text
    assert "k-big" in untouched.text and "t-1" in untouched.text
    with running_coordinator(settings):
        consumer = QueueConsumer("Jobs", settings.bootstrap_servers, consumer_id="reader-1",
                                 topic_prefix=settings.topic_prefix)
        try:
            message = consumer.receive(timeout=20)
            assert message is not None
            where = f"/queues/Jobs/messages/{message.bookmark}"
            leased = web.get(where)
            assert re.search(r'<strong>LEASED</strong>: leased to reader-1', leased.text)
            assert '<td id="lease-holder">reader-1</td>' in leased.text
            assert re.search(r'id="delivery-count">1<', leased.text)
            message.ack()
            consumer._flush_acks()
            wait_for_counters(settings, "Jobs", acked=1)
        finally:
            consumer.close()
        done = web.get(where)
        assert re.search(r"<strong>(ACKED|DONE)</strong>", done.text)
        events = re.findall(r'<td class="type">(\w+)</td>', done.text)
        assert events[:1] == ["ENQUEUED"] and "LEASED" in events and events[-1] == "ACKED"


def test_a_bookmark_that_is_not_the_queues_is_404(settings: Settings, jobs: str) -> None:
    web = client(settings)
    for bookmark, why in (("nonsense", "not topic/partition/offset"),
                          ("other-topic/0/1", "is not a journal of queue"),
                          (f"{jobs}/0/01", "canonical")):
        response = web.get(f"/queues/Jobs/messages/{bookmark}")
        assert response.status_code == 404 and why in response.text, bookmark
    missing = web.get(f"/queues/Jobs/messages/{jobs}/0/999")
    assert missing.status_code == 200 and 'id="no-record"' in missing.text
    assert "nothing is written there yet" in missing.text
