"""`qlayer console` in a real headless Chromium (Debian's chromium and chromedriver, driven by
Selenium) against the real stack: a coordinator, Kafka and PostgreSQL; the console runs as a
`qlayer console` process, over a thousand queues besides the one the story follows.

The pages must show the real figures (the totals, the depth `qlayer stats` computes, the dead
letters, the consumer and the leases it holds, one message's lease and events), the queue
list must search, sort and page a thousand queues and refresh its figures in place, and a
redrive pressed in the browser must move the letters. Screenshots are written to
artifacts/console/ at the repository root (ignored by git; CI keeps the directory), one per
step, replaced by each run. How fast the pages are is measured by `benchmarks/many_queues.py`,
not here.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from layer.kafka import KafkaAdmin
from layer.sdk import QueueConsumer
from layer.services.messages import list_dead_letters
from layer.services.views import queue_stats
from layer.settings import Settings
from layer.store.store import Store
from tests.support.coordinator import (
    produce,
    put_queues,
    running_coordinator,
    wait_for_counters,
    wait_until,
)
from tests.support.ports import PortReservation, reserve_ports

# Alone (after the parallel workers, `make test`): a coordinator starting 1,001 queues beside
# five busy test workers on two cores took more than a minute to run its four shards.
pytestmark = [pytest.mark.acceptance, pytest.mark.alone]

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "artifacts" / "console"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture
def settings(bootstrap_servers: str, database_url: str) -> Settings:
    return Settings(bootstrap_servers=bootstrap_servers, database_url=database_url,
                    topic_prefix=f"qc{uuid.uuid4().hex[:8]}.")


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    # Not a skip: `make test` installs both (the Makefile's `browser` target); without them
    # this test must fail and say why.
    for path in (CHROMIUM, CHROMEDRIVER):
        assert os.access(path, os.X_OK), (
            f"{path} missing: apt-get install -y chromium chromium-driver (make browser)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(120)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def screenshot() -> Callable[[WebDriver, str], Path]:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for old in SCREENSHOTS.glob("*.png"):
        old.unlink()

    def take(driver: WebDriver, name: str) -> Path:
        # The whole page, not the window: resize to the document's height first (from the
        # default size, so a short page after a long one is not padded).
        driver.set_window_size(1400, 1000)
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1400, max(1000, int(height) + 40))
        path = SCREENSHOTS / f"{name}.png"
        assert driver.save_screenshot(str(path)), f"no screenshot {path}"
        return path

    return take


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Callable[[Settings], str]]:
    """`console(settings)` starts `qlayer console --allow-actions` on a free port and returns
    its address once it answers; stopped (SIGTERM, as Ctrl-C) when the test ends."""
    started: list[subprocess.Popen[bytes]] = []
    reserved: list[PortReservation] = []

    def start(settings: Settings) -> str:
        reserved.append(reserve_ports(36600, 1))
        port = reserved[-1].first
        log = tmp_path / "console.log"
        env = {**os.environ, "QLAYER_DATABASE_URL": settings.database_url,
               "QLAYER_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
               "QLAYER_TOPIC_PREFIX": settings.topic_prefix, "QLAYER_CONFIG": os.devnull}
        qlayer = shutil.which("qlayer", path=str(Path(sys.executable).parent))
        command = [qlayer] if qlayer else [sys.executable, "-m", "layer_cli.main"]
        with log.open("wb") as out:
            process = subprocess.Popen(
                [*command, "console", "--port", str(port), "--allow-actions",
                 "--sample-interval", "1", "--refresh", "1"],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        started.append(process)
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert process.poll() is None, f"qlayer console exited: {log.read_text()}"
            try:
                with urllib.request.urlopen(f"{base}/queues", timeout=30) as response:
                    return bool(response.status == 200)
            except (urllib.error.URLError, ConnectionError):
                return False

        wait_until(up, timeout=60, interval=0.2, what="the console answering")
        return base

    yield start
    log = tmp_path / "console.log"
    for process in started:
        process.terminate()
        try:
            code = process.wait(timeout=20)
            # uvicorn shuts down gracefully, then re-raises the signal it caught.
            assert code in (0, -signal.SIGTERM), f"qlayer console exited {code}: " + (
                log.read_text())
        except subprocess.TimeoutExpired:
            process.kill()
            raise


def text(driver: WebDriver, css: str, timeout: float = 60) -> str:
    """The text of the element ``css`` once the page holding it has loaded (a form's POST may
    still be running when the click returns). Found again when the live refresh replaced it
    meanwhile (a stale element)."""
    return attribute(driver, css, None, timeout)


def attribute(driver: WebDriver, css: str, name: str | None, timeout: float = 60) -> str:
    """Attribute ``name`` (None: the text) of the first element ``css``, as `text`."""
    def read(d: WebDriver) -> str | None:
        found = d.find_elements(By.CSS_SELECTOR, css)
        if not found:
            return None
        value = found[0].text if name is None else found[0].get_attribute(name)
        return str(value or "").strip()

    try:
        return str(WebDriverWait(driver, timeout, ignored_exceptions=(
            StaleElementReferenceException,)).until(lambda d: read(d) is not None and read(d)))
    except TimeoutException:
        body = driver.find_element(By.TAG_NAME, "body").text
        raise AssertionError(f"no {css} on {driver.current_url}: {body[:2000]}") from None


#: Queues besides Jobs, over `BULK_JOURNALS` journals (50 queues each; the first gets traffic).
BULK = 1000
BULK_JOURNALS = 20


def make_bulk_queues(settings: Settings, create_topic: Callable[..., str],
                     unique_name: Callable[[str], str]) -> list[str]:
    """A thousand idle queues as a large installation has them; returns their journals."""
    journals = [create_topic(unique_name(f"bulk{j:02d}"), 1) for j in range(BULK_JOURNALS)]
    per = BULK // BULK_JOURNALS
    put_queues(settings, *({"name": f"Bulk{i:04d}", "underlying_topic": journals[i // per]}
                           for i in range(BULK)))
    return journals


def test_the_console_shows_the_real_figures_and_redrives_from_the_browser(
        settings: Settings, create_topic: Callable[..., str], unique_name: Callable[[str], str],
        browser: WebDriver, screenshot: Callable[[WebDriver, str], Path],
        console: Callable[[Settings], str]) -> None:
    bulk = make_bulk_queues(settings, create_topic, unique_name)
    produce(settings.bootstrap_servers, bulk[0], [b"a", b"b"])  # Bulk0000..0049: depth 2
    journal = create_topic(unique_name("jobs"), 1)
    put_queues(settings, {"name": "Jobs", "underlying_topic": journal, "max_deliveries": 1,
                          "lease_period": "5m"})
    admin = KafkaAdmin(settings.kafka_config())
    with running_coordinator(settings):
        produce(settings.bootstrap_servers, journal,
                [f'{{"job": {i}}}'.encode() for i in range(8)])
        # A coordinator starting 1,001 queues on a machine running five other test workers
        # answered after more than the default 10 s once: a minute.
        holder = QueueConsumer("Jobs", settings.bootstrap_servers, max_backlog=2,
                               consumer_id="holder-1", topic_prefix=settings.topic_prefix,
                               subscribe_timeout=60)
        try:
            # Three rejected (dead-lettered at once), then two received and held.
            for _ in range(3):
                message = holder.receive(timeout=30)
                assert message is not None
                message.reject("no such customer")
            held = [holder.receive(timeout=30) for _ in range(2)]
            assert all(m is not None for m in held)

            def leased() -> bool:
                with Store(settings.database_url) as store:
                    rows = store.load_entries("Jobs")
                return sum(r.state == "LEASED" for r in rows) == 2

            wait_until(leased, timeout=30, what="2 leases held")
            wait_for_counters(settings, "Jobs", dead_lettered=3)
            real = queue_stats(settings, ["Jobs"], now=time.time())[0]
            assert (real.depth, real.leased, real.counters["dead_lettered"]) == (5, 2, 3)

            base = console(settings)
            browser.get(f"{base}/")
            # The overview adds up every queue: Jobs' 5 and 50 bulk queues' 2 each.
            assert text(browser, "#total-queues") == str(BULK + 1)
            assert text(browser, "#total-depth") == str(5 + 50 * 2)
            assert text(browser, "#total-leased") == "2"
            assert text(browser, "#total-dead-lettered") == "3"
            # The coordinator reports every few seconds; one starting 1,001 queues beside five
            # busy test workers was silent for longer than the 10 s that counts as running,
            # and the overview said so (truly). The live refresh shows it healthy once it
            # reports again.
            WebDriverWait(browser, 60, ignored_exceptions=(
                StaleElementReferenceException,)).until(lambda d: "healthy" in d.find_element(
                    By.ID, "coordinator-health").text)
            assert attribute(browser, "#deepest tr[data-queue]", "data-queue") == "Jobs"
            screenshot(browser, "01-overview")

            browser.get(f"{base}/queues")
            assert len(browser.find_elements(By.CSS_SELECTOR, "#queues tbody tr")) == 50
            assert text(browser, "#pager .here") == f"page 1 of {(BULK + 1 + 49) // 50}"
            browser.get(attribute(browser, "#pager a[rel=next]", "href"))
            assert attribute(browser, "#queues tbody tr", "data-queue") == "Bulk0050"
            # Sorted by depth (the column's link), Jobs comes first.
            browser.get(attribute(browser, "#queues th.sortable:nth-child(2) a", "href"))
            assert browser.current_url.endswith("/queues?sort=depth&page=1") or (
                "sort=depth" in browser.current_url)
            assert attribute(browser, "#queues tbody tr", "data-queue") == "Jobs"
            screenshot(browser, "02-queues-by-depth")
            search = browser.find_element(By.CSS_SELECTOR, "#search input[name=q]")
            search.clear()
            search.send_keys("jobs\n")
            row = 'tr[data-queue="Jobs"]'
            assert text(browser, f"{row} td.depth") == str(real.depth)
            assert text(browser, f"{row} td.leased") == "2"
            assert text(browser, f"{row} td.consumers") == "1"
            assert text(browser, f"{row} td.dead_lettered .total") == "3"
            assert len(browser.find_elements(By.CSS_SELECTOR, "#queues tbody tr")) == 1
            # The console's own samplings (one a second) draw the sparkline.
            WebDriverWait(browser, 30).until(lambda d: d.find_elements(
                By.CSS_SELECTOR, f"{row} td.spark svg polyline"))
            screenshot(browser, "03-queues-search")

            # Live: new records show up without a reload (the page keeps its marker).
            browser.get(f"{base}/queues?q=Bulk0001")
            assert text(browser, 'tr[data-queue="Bulk0001"] td.depth') == "2"
            browser.execute_script("window.qlayerMarker = 'not reloaded'")
            produce(settings.bootstrap_servers, bulk[0], [b"c"])
            WebDriverWait(browser, 30).until(lambda d: d.find_elements(
                By.XPATH, '//tr[@data-queue="Bulk0001"]/td[@class="depth num"][text()="3"]'))
            assert browser.execute_script("return window.qlayerMarker") == "not reloaded"
            assert "live: refreshed" in text(browser, "#live-status")

            browser.get(f"{base}/queues?q=jobs")
            browser.find_element(By.LINK_TEXT, "Jobs").click()
            assert browser.current_url == f"{base}/queues/Jobs"
            assert text(browser, "#figures td.depth") == "5"
            assert text(browser, "#dead-letter-total").startswith(
                "3 dead letter(s) waiting")
            reasons = browser.find_elements(By.CSS_SELECTOR, "#dead-letters tr.letter "
                                                             "td.reason")
            assert [r.text for r in reasons] == ["rejected: no such customer"] * 3
            holder_row = '#consumers tr[data-consumer="holder-1"]'
            assert text(browser, f"{holder_row} td.leases") == "2"
            # Active entries as `qlayer view` lists them: the three not leased.
            assert len(browser.find_elements(By.CSS_SELECTOR, "#entries tr.entry")) == 3
            assert "served by coordinator" in text(browser, "#placement")
            screenshot(browser, "04-queue")

            # One leased message, from its bookmark: holder, deadline, its events so far.
            browser.find_element(By.CSS_SELECTOR, f"{holder_row} a").click()
            assert text(browser, "#message-state").startswith("LEASED: leased to holder-1")
            assert text(browser, "#lease-holder") == "holder-1"
            assert text(browser, "#delivery-count") == "1"
            assert text(browser, "#message-value").startswith('{"job": ')
            kinds = [e.text for e in browser.find_elements(By.CSS_SELECTOR,
                                                           "#event-list td.type")]
            assert kinds[0] == "ENQUEUED" and kinds[-1] == "LEASED", kinds
            screenshot(browser, "05-message")
        finally:
            holder.close()

        # The close broke the two leases; delivered once on a max_deliveries 1 queue, those
        # entries may not be delivered again: dead-lettered too, five letters in all.
        wait_for_counters(settings, "Jobs", dead_lettered=5)
        browser.get(f"{base}/queues/Jobs")
        assert text(browser, "#dead-letter-total").endswith(": 2 max_deliveries, 3 rejected")
        before = admin.end_offsets([(journal, 0)])[(journal, 0)]
        browser.find_element(By.ID, "redrive").click()
        assert text(browser, "#would-move") == "5"  # the dry run moved nothing
        assert admin.end_offsets([(journal, 0)])[(journal, 0)] == before
        screenshot(browser, "06-redrive-confirm")
        browser.find_element(By.ID, "confirm").click()
        assert text(browser, "#moved").startswith("moved 5 dead letter(s) of Jobs")
        screenshot(browser, "07-redrive-done")

        # The letters moved: none waits, and the five are back in the journal and the queue.
        assert list_dead_letters(settings, "Jobs").total == 0
        # Back in the journal (once each: one transaction, whose commit marker takes an
        # offset too) and taken in by the coordinator again.
        assert admin.end_offsets([(journal, 0)])[(journal, 0)] == before + 5 + 1
        wait_for_counters(settings, "Jobs", enqueued=8 + 5)
        browser.find_element(By.ID, "back").click()

        shown: list[tuple[str, int, str, int]] = []

        def back_in_the_queue() -> bool:
            browser.refresh()
            real = queue_stats(settings, ["Jobs"], now=time.time())[0].depth
            shown.append((text(browser, "#figures td.depth"),
                          len(browser.find_elements(By.CSS_SELECTOR, "#entries tr.entry")),
                          text(browser, "#dead-letter-total"), real))
            return shown[-1][1] == 8 and shown[-1][2].startswith("0 dead letter(s)")

        try:
            wait_until(back_in_the_queue, timeout=30, what="8 entries, no dead letter shown")
        except TimeoutError:
            raise AssertionError("the page showed (depth, entries, letters, real depth) "
                                 f"{shown[-3:]}") from None
        # The depth is `qlayer stats`' figure: journal records past the recovery point not
        # done, so the redrive's commit marker counts as one (docs/console.md).
        assert shown[-1][0] == str(shown[-1][3]) == "9"
        screenshot(browser, "08-queue-after-redrive")

        browser.get(f"{base}/coordinators")
        # The coordinator of this test runs in this process, on every shard.
        processes = browser.find_elements(By.CSS_SELECTOR, "#processes tr.process")
        assert [[c.text for c in p.find_elements(By.TAG_NAME, "td")][2:4]
                for p in processes] == [[str(os.getpid()), "0,1,2,3"]]
        screenshot(browser, "09-coordinators")
        browser.get(f"{base}/consumers")
        assert text(browser, "#no-consumers") == "no consumers"  # the holder closed
        screenshot(browser, "10-consumers")
    shots = sorted(p.name for p in SCREENSHOTS.glob("*.png"))
    assert len(shots) == 10, shots
