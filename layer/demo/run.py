"""`qlayer demo`: apply the sample queues, run a coordinator and consumers against real traffic.

The demo is a script of five short scenes, each on its own queue of ``queues.yaml`` (shipped
with the package), and returns a :class:`DemoReport` of what was observed:

1. **Jobs** — at-least-once with dead-lettering: a consumer process takes leases and is
   SIGKILLed; after its session timeout its messages go to the other workers. One job is
   rejected, one is released until ``max_cancels`` dead-letters it.
2. **OrderPriority** — orders published first, consumed by value (``/price * /qty``).
3. **Settlements** — a barrier waits for every earlier trade's ack, then reaches every consumer.
4. **Work** — proportional fairness: Inky, Blinky and Clyde hold work in proportion to their
   backlogs.
5. **ORDERS** — one publish, many queues: what ``default_publish_target`` routes where.

Decisions: every run uses fresh queue and journal names (a run id replaces ``{run}`` in the
queue file), so a re-run never sees an earlier run's records and reports the same facts. The
coordinator runs in a thread of the demo and stops with it (unless another coordinator already
owns the database's queues: then that one serves the demo); the local stack stays up.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from layer.coordinator.options import CoordinatorOptions, default_owner_id
from layer.coordinator.process import CoordinatorProcess
from layer.domain.definitions import QueueDefinition, load_queue_file
from layer.domain.errors import QlayerError
from layer.kafka import KafkaAdmin, TopicSpec
from layer.kafka.scan import RangeScanner
from layer.protocol.headers import DLQ_DETAIL, DLQ_REASON
from layer.sdk import (
    Message,
    NoCoordinatorError,
    QueueConsumer,
    QueuePublisher,
    UnknownQueueError,
)
from layer.sdk.identity import STATE_DIR_ENV
from layer.settings import Settings
from layer.store.store import Store

#: A registry row seen this recently is a running coordinator process (it reports every 2 s).
LIVE_PROCESS_AGE = 10.0
_RUN_ID = re.compile(r"d[0-9a-f]{6}")
T = TypeVar("T")
Progress = Callable[[str], None]


class DemoError(QlayerError):
    """A scene of the demo did not complete; the message says which and what to check."""


# --------------------------------------------------------------------------- the report


@dataclass
class JobsScene:
    published: int
    processed_by: dict[str, int]
    crashed_consumer: str
    crashed_held: list[int]
    redelivered_to: dict[str, str]
    acked: list[int]
    dead_letters: list[dict[str, Any]]
    counters: dict[str, int]


@dataclass
class PriorityScene:
    published_order: list[str]
    delivered_order: list[str]
    values: dict[str, float]


@dataclass
class BarrierScene:
    earlier: int
    acked_before_barrier: int
    later_delivered_before_barrier: int
    barrier_reached: list[str]
    processed_by: dict[str, int]


@dataclass
class FairnessScene:
    max_backlog: dict[str, int]
    leased: dict[str, int]


@dataclass
class OrdersRoute:
    published_to: str
    journal: str
    queues: list[str]


@dataclass
class DemoReport:
    run: str
    bootstrap_servers: str
    database_url: str
    topic_prefix: str
    coordinator: str
    #: True when the demo ran its own coordinator (stopped with the demo); False when one
    #: that was already running served the demo (and keeps running).
    own_coordinator: bool
    queues: dict[str, str]
    jobs: JobsScene
    priority: PriorityScene
    barrier: BarrierScene
    fairness: FairnessScene
    orders: list[OrdersRoute]
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False)


@dataclass(frozen=True)
class DemoOptions:
    settings: Settings
    #: Start the local stack (`qlayer dev up`) first; off when endpoints were given.
    start_stack: bool = True
    #: Session timeout of the crashing consumer: how long its leases outlive it.
    session_timeout: float = 3.0
    #: Seconds any one scene may take before the demo gives up.
    scene_timeout: float = 30.0
    run_id: str = field(default_factory=lambda: "d" + secrets.token_hex(3))


# --------------------------------------------------------------------------- set-up


def demo_queues(run_id: str) -> list[QueueDefinition]:
    """The sample queue file with ``{run}`` replaced by this run's id, validated."""
    text = resources.files("layer.demo").joinpath("queues.yaml").read_text()
    return load_queue_file(text.replace("{run}", run_id))


def earlier_demo_queues(names: Iterable[str], run_id: str) -> list[str]:
    """The queues earlier demo runs left behind: the sample file's names with another run id."""
    stems = {q.name.removesuffix(f"_{run_id}") for q in demo_queues(run_id)}
    found = []
    for name in names:
        stem, _, run = name.rpartition("_")
        if stem in stems and run != run_id and _RUN_ID.fullmatch(run):
            found.append(name)
    return sorted(found)


def _journals(queues: list[QueueDefinition], run_id: str) -> list[str]:
    """Every journal the demo writes to (regex queues name theirs in default_publish_target)."""
    names = {f"ORDERS_{run_id}"}
    for q in queues:
        names.add(q.default_publish_target or q.underlying_topic)
        if q.dead_letter_topic:
            names.add(q.dead_letter_topic)
    return sorted(names)


def _wait(probe: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise DemoError(f"demo: {what} did not happen within {timeout:g}s; the "
                            "coordinator's warnings, if any, are above")
        time.sleep(0.1)


@contextmanager
def _coordinator(settings: Settings, progress: Progress) -> Iterator[tuple[str, bool]]:
    """Our own coordinator in a thread, unless live ones run every shard already."""
    with Store(settings.database_url) as store:
        live = [p for p in store.processes() if p.seen_at > time.time() - LIVE_PROCESS_AGE]
        count = store.shard_count()
        owners = store.owners()
    if live and len(owners) == count:
        progress(f"using the running coordinator {live[0].owner_id}")
        yield live[0].owner_id, False
        return
    owner_id = f"qlayer-demo-{default_owner_id()}"
    # The coordinator's log lines (its Kafka clients' too: "GETPID [rdkafka#producer-7] ...
    # Coordinator load in progress") would land in the middle of the demo's story through
    # Python's last-resort handler: they go to a file of their own, named at the end.
    log_path = os.path.join(tempfile.gettempdir(), f"qlayer-demo-{os.getuid()}.log")
    handler = _quiet_layer_logs(log_path)
    # No Kafka transactions: the demo's coordinator is alone and lives for a minute; fencing
    # buys nothing here and transactions add latency to every delivery.
    coordinator = CoordinatorProcess(settings, CoordinatorOptions(
        owner_id=owner_id, transactional=False, refresh_interval=0.5))
    failures: list[BaseException] = []

    def target() -> None:
        try:
            coordinator.run(install_signals=False)
        except BaseException as exc:  # reported by the scene that waits for it
            failures.append(exc)

    thread = threading.Thread(target=target, name="qlayer-demo-coordinator", daemon=True)
    thread.start()
    try:
        with Store(settings.database_url) as store:
            def owned() -> bool:
                if failures:
                    raise DemoError(f"demo: the coordinator failed: {failures[0]}")
                return len(store.owners()) == count
            _wait(owned, 30, "the coordinators running every shard")
        progress(f"coordinator {owner_id} running")
        yield owner_id, True
    finally:
        coordinator.stop()
        thread.join(30)
        if handler is not None:
            logging.getLogger("layer").removeHandler(handler)
            handler.close()
            if os.path.getsize(log_path):
                progress(f"the coordinator's log lines are in {log_path}")


def _quiet_layer_logs(path: str) -> logging.Handler | None:
    """Send the `layer` loggers' lines (WARNING and up) to ``path`` instead of the terminal,
    unless the program set up logging itself (then its choice stands)."""
    layer = logging.getLogger("layer")
    if layer.handlers or logging.getLogger().handlers:
        return None
    handler = logging.FileHandler(path, mode="w")
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    layer.addHandler(handler)
    return handler


def _consumer(settings: Settings, queue: str, consumer_id: str, **kwargs: Any) -> QueueConsumer:
    """A consumer, retried while the coordinator has not picked the queue up yet."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return QueueConsumer(queue, settings.bootstrap_servers,
                                 topic_prefix=settings.topic_prefix,
                                 kafka_config=settings.kafka, consumer_id=consumer_id,
                                 **kwargs)
        except (UnknownQueueError, NoCoordinatorError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


# --------------------------------------------------------------------------- scene 1: Jobs


def _jobs(settings: Settings, options: DemoOptions, publisher: QueuePublisher,
          stack: ExitStack, progress: Progress) -> JobsScene:
    run = options.run_id
    queue, failed = f"Jobs_{run}", f"FailedJobs_{run}"
    poison, flaky, total, crasher_backlog = 4, 9, 12, 3
    crasher_id = f"crasher-{run}"
    progress(f"{queue}: a consumer process takes {crasher_backlog} leases, then is SIGKILLed")
    crasher = subprocess.Popen(
        [sys.executable, "-m", "layer.demo.crash", "--bootstrap-servers",
         settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix, "--queue", queue,
         "--consumer-id", crasher_id, "--max-backlog", str(crasher_backlog),
         "--session-timeout", str(options.session_timeout),
         "--kafka-config", json.dumps(settings.kafka)],
        stdout=subprocess.PIPE, text=True,
        # Its session secret in a directory of the demo's own: SIGKILLed, it never removes
        # the file, which would otherwise stay in the user's ~/.local/state for good.
        env={**os.environ, STATE_DIR_ENV: stack.enter_context(
            tempfile.TemporaryDirectory(prefix="qlayer-demo-"))})
    stack.callback(_kill, crasher)
    lines: list[dict[str, Any]] = []
    reader = threading.Thread(target=_read_lines, args=(crasher, lines), daemon=True)
    reader.start()
    _wait(lambda: any(line.get("subscribed") for line in lines) or crasher.poll() is not None,
          options.scene_timeout, "the crashing consumer subscribing")
    if crasher.poll() is not None:
        raise DemoError(f"demo: the crashing consumer exited with {crasher.returncode} "
                        "before it subscribed")
    for i in range(1, total + 1):
        kind = "poison" if i == poison else "flaky" if i == flaky else "resize-image"
        publisher.publish(queue, value=json.dumps({"id": i, "kind": kind}), key=f"job-{i}")
    publisher.flush()

    def crasher_holds() -> list[int] | None:
        got = [int(line["id"]) for line in lines if "id" in line]
        return got if len(got) >= crasher_backlog else None

    held = sorted(_wait(crasher_holds, options.scene_timeout, "the crashing consumer's leases"))
    _kill(crasher)
    progress(f"{queue}: killed {crasher_id} holding jobs {held}; its leases break after its "
             f"{options.session_timeout:g}s session timeout")

    processed: dict[str, int] = {}
    redelivered_to: dict[str, str] = {}
    acked: set[int] = set()
    settled_poison = threading.Event()
    releases: list[int] = []
    lock = threading.Lock()
    done = threading.Event()

    def work(name: str, consumer: QueueConsumer) -> None:
        while not done.is_set():
            msg = consumer.receive(timeout=0.2)
            if msg is None:
                continue
            job = msg.json()
            with lock:
                if job["id"] in held and msg.delivery_count > 1:
                    redelivered_to[str(job["id"])] = name
                if job["kind"] == "poison":
                    msg.reject(reason="no handler for kind 'poison'")
                    settled_poison.set()
                elif job["kind"] == "flaky":
                    msg.release()  # a transient failure, every time: max_cancels ends it
                    releases.append(job["id"])
                else:
                    msg.ack()
                    acked.add(job["id"])
                    processed[name] = processed.get(name, 0) + 1

    workers = [f"worker-{n}-{run}" for n in (1, 2)]
    threads = []
    for name in workers:
        consumer = stack.enter_context(_consumer(settings, queue, name, max_backlog=2))
        threads.append(threading.Thread(target=work, args=(name, consumer), daemon=True))
    for t in threads:
        t.start()
    expected = set(range(1, total + 1)) - {poison, flaky}
    try:
        _wait(lambda: acked >= expected and settled_poison.is_set() and len(releases) >= 2,
              options.scene_timeout + options.session_timeout, f"{queue} being worked off")
    finally:
        done.set()
        for t in threads:
            t.join(5)

    dead = _dead_letters(settings, failed, 2, options)
    with Store(settings.database_url) as store:
        # Acks travel asynchronously: wait until the coordinator has applied every one.
        counters = _wait(lambda: _counters_when(
            store, queue, lambda c: c["dead_lettered"] >= 2 and c["acked"] >= len(acked)),
            options.scene_timeout, f"{queue}'s counters")
    return JobsScene(published=total, processed_by={_short(k, run): v
                                                    for k, v in sorted(processed.items())},
                     crashed_consumer=_short(crasher_id, run), crashed_held=held,
                     redelivered_to={k: _short(v, run) for k, v in redelivered_to.items()},
                     acked=sorted(acked), dead_letters=dead, counters=counters)


def _read_lines(process: subprocess.Popen[str], into: list[dict[str, Any]]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        if line.strip():
            into.append(json.loads(line))


def _kill(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()  # SIGKILL: no close(), no Unsubscribe, no last heartbeat
        process.wait(10)


def _dead_letters(settings: Settings, topic: str, count: int,
                  options: DemoOptions) -> list[dict[str, Any]]:
    """Read the dead-letter journal without a queue: the records stay AVAILABLE in the
    dead-letter queue, for `qlayer view` and `qlayer dlq list` afterwards."""
    admin = KafkaAdmin(settings.kafka_config())
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + options.scene_timeout
    while len(got) < count and time.monotonic() < deadline:
        ends = admin.end_offsets([(topic, 0)])
        if ends.get((topic, 0), 0) < count:
            time.sleep(0.2)
            continue
        scanner = RangeScanner(settings.kafka_config(),
                               f"{settings.topic_prefix}demo-{options.run_id}")
        try:
            got = []
            for record in scanner.read({(topic, 0): 0}, ends):
                headers = dict(record.headers or [])
                got.append({"id": json.loads(record.value or b"{}").get("id"),
                            "reason": _text(headers.get(DLQ_REASON)),
                            "detail": _text(headers.get(DLQ_DETAIL))})
        finally:
            scanner.close()
    if len(got) < count:
        raise DemoError(f"demo: {len(got)} of {count} dead letters reached {topic}")
    return sorted(got, key=lambda d: int(d["id"]))


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _counters_when(store: Store, queue: str,
                   ready: Callable[[dict[str, int]], bool]) -> dict[str, int] | None:
    found = store.load_counters(queue).get(queue)
    if found is None:
        return None
    counts = {k: v for k, v in asdict(found).items() if isinstance(v, int) and k != "updated_at"}
    return counts if ready(counts) else None


def _short(consumer_id: str, run: str) -> str:
    return consumer_id.removesuffix(f"-{run}")


# --------------------------------------------------------------------------- scene 2: priority


def _priority(settings: Settings, options: DemoOptions, publisher: QueuePublisher,
              progress: Progress) -> PriorityScene:
    queue = f"OrderPriority_{options.run_id}"
    orders = {"A": (10.0, 1), "B": (5.0, 10), "C": (100.0, 2), "D": (1.0, 1), "E": (20.0, 5),
              "F": (50.0, 1)}
    progress(f"{queue}: {len(orders)} orders wait in the queue, then one consumer takes them "
             "highest /price * /qty first")
    for name, (price, qty) in orders.items():
        publisher.publish(queue, value=json.dumps({"order": name, "price": price, "qty": qty}))
    publisher.flush()
    with Store(settings.database_url) as store:
        _wait(lambda: _counters_when(store, queue, lambda c: c["enqueued"] >= len(orders)),
              options.scene_timeout, f"{queue} enqueueing the orders")
    delivered: list[str] = []
    with _consumer(settings, queue, f"pricer-{options.run_id}", max_backlog=1) as consumer:
        deadline = time.monotonic() + options.scene_timeout
        while len(delivered) < len(orders) and time.monotonic() < deadline:
            msg = consumer.receive(timeout=0.5)
            if msg is not None:
                delivered.append(msg.json()["order"])
                msg.ack()
    if len(delivered) < len(orders):
        raise DemoError(f"demo: {len(delivered)} of {len(orders)} orders came from {queue}")
    return PriorityScene(published_order=list(orders), delivered_order=delivered,
                         values={n: p * q for n, (p, q) in orders.items()})


# --------------------------------------------------------------------------- scene 3: barrier


def _barrier(settings: Settings, options: DemoOptions, publisher: QueuePublisher,
             stack: ExitStack, progress: Progress) -> BarrierScene:
    run = options.run_id
    queue = f"Settlements_{run}"
    earlier, later = 4, 2
    progress(f"{queue}: {earlier} trades, an end-of-day barrier, {later} more trades; two "
             "tellers")
    log: list[tuple[str, str, int]] = []  # (event, teller, trade)
    lock = threading.Lock()
    done = threading.Event()

    def teller(name: str, consumer: QueueConsumer) -> None:
        while not done.is_set():
            msg = consumer.receive(timeout=0.2)
            if msg is None:
                continue
            body = msg.json()
            if msg.is_barrier:
                with lock:
                    log.append(("barrier", name, 0))
                continue
            with lock:
                log.append(("got", name, int(body["trade"])))
            time.sleep(0.2)  # settling a trade takes a moment: the barrier has to wait
            with lock:
                # Logged before the ack is sent, so the log can never show the barrier
                # arriving before the ack that released it.
                log.append(("acked", name, int(body["trade"])))
            msg.ack()

    names = [f"teller-{n}-{run}" for n in (1, 2)]
    threads = []
    for name in names:
        consumer = stack.enter_context(_consumer(settings, queue, name, max_backlog=4))
        threads.append(threading.Thread(target=teller, args=(name, consumer), daemon=True))
    for t in threads:
        t.start()
    trade = 0
    for _ in range(earlier):
        trade += 1
        publisher.publish(queue, value=json.dumps({"type": "trade", "trade": trade}))
    publisher.publish(queue, value=json.dumps({"type": "end-of-day", "trade": 0}))
    for _ in range(later):
        trade += 1
        publisher.publish(queue, value=json.dumps({"type": "trade", "trade": trade}))
    publisher.flush()

    def finished() -> bool:
        with lock:
            barriers = {t for e, t, _ in log if e == "barrier"}
            acks = sum(1 for e, _, _ in log if e == "acked")
        return barriers == set(names) and acks == earlier + later

    try:
        _wait(finished, options.scene_timeout, f"{queue}'s barrier reaching both tellers")
    finally:
        done.set()
        for t in threads:
            t.join(5)
    first_barrier = next(i for i, (e, _, _) in enumerate(log) if e == "barrier")
    before = log[:first_barrier]
    return BarrierScene(
        earlier=earlier,
        acked_before_barrier=sum(1 for e, _, n in before if e == "acked" and n <= earlier),
        later_delivered_before_barrier=sum(1 for e, _, n in before if e == "got" and n > earlier),
        barrier_reached=sorted(_short(t, run) for e, t, _ in log if e == "barrier"),
        processed_by={_short(n, run): sum(1 for e, t, _ in log if e == "acked" and t == n)
                      for n in names})


# --------------------------------------------------------------------------- scene 4: fairness


def _fairness(settings: Settings, options: DemoOptions, publisher: QueuePublisher,
              stack: ExitStack, progress: Progress) -> FairnessScene:
    run = options.run_id
    queue = f"Work_{run}"
    backlogs = {"Inky": 2, "Blinky": 4, "Clyde": 8}
    work = sum(backlogs.values()) // 2
    progress(f"{queue}: {work} tasks for Inky, Blinky and Clyde (max_backlog 2, 4, 8), "
             "held unsettled")
    held: dict[str, list[Message]] = {name: [] for name in backlogs}
    consumers = {name: stack.enter_context(
        _consumer(settings, queue, f"{name}-{run}", max_backlog=backlog))
        for name, backlog in backlogs.items()}
    for i in range(work):
        publisher.publish(queue, value=json.dumps({"task": i}))
    publisher.flush()

    def take() -> bool:
        for name, consumer in consumers.items():
            msg = consumer.receive(timeout=0.05)
            if msg is not None:
                held[name].append(msg)
        return sum(len(v) for v in held.values()) >= work

    _wait(take, options.scene_timeout, f"{queue}'s tasks reaching the consumers")
    for messages in held.values():
        for msg in messages:
            msg.ack()
    return FairnessScene(max_backlog=backlogs,
                         leased={name: len(messages) for name, messages in held.items()})


# --------------------------------------------------------------------------- scene 5: ORDERS


def _orders(settings: Settings, options: DemoOptions, publisher: QueuePublisher,
            progress: Progress) -> list[OrdersRoute]:
    run = options.run_id
    analytics, risk = f"ORDERS_ANALYTICS_{run}", f"ORDERS_RISK_{run}"
    names = [f"ORDERS_{run}", analytics, risk]
    progress(f"ORDERS: publishing to {', '.join(names)}; one regex consumer reads both queues")
    # The publisher routes queue names with the directory the coordinator publishes; wait
    # until it lists the demo's queues, or a queue name would be taken for a journal.
    _wait(lambda: publisher.target(analytics) == f"ORDERS_ANALYTICS_DIRECT_{run}"
          and publisher.target(risk) == f"ORDERS_RISK_DIRECT_{run}",
          options.scene_timeout, "the queue directory listing the ORDERS queues")
    journals = {}
    for name in names:
        journals[name] = publisher.publish(name, value=json.dumps({"sent_to": name}))
    publisher.flush()
    seen: dict[str, list[str]] = {name: [] for name in names}
    expected = 4  # ORDERS reaches both queues; each direct publish one
    pattern = f"ORDERS_(ANALYTICS|RISK)_{run}"
    with _consumer(settings, pattern, f"orders-{run}", regex=True, max_backlog=10) as consumer:
        deadline = time.monotonic() + options.scene_timeout
        got = 0
        while got < expected and time.monotonic() < deadline:
            msg = consumer.receive(timeout=0.5)
            if msg is None:
                continue
            seen[msg.json()["sent_to"]].append(msg.queue)
            got += 1
            msg.ack()
        # Anything beyond the expected four would be a routing error worth showing.
        extra = consumer.receive(timeout=1.0)
        if extra is not None:
            seen[extra.json()["sent_to"]].append(extra.queue)
            extra.ack()
    return [OrdersRoute(published_to=_short_queue(n, run), journal=_short_queue(journals[n], run),
                        queues=sorted(_short_queue(q, run) for q in seen[n])) for n in names]


def _short_queue(name: str, run: str) -> str:
    return name.removesuffix(f"_{run}")


# --------------------------------------------------------------------------- the whole demo


def prepare(options: DemoOptions, progress: Progress) -> Settings:
    """Start the local stack when asked and migrate; the settings the demo runs with."""
    settings = options.settings
    if options.start_stack:
        from layer.localstack import LocalStack, StackConfig

        progress("starting the local Kafka and PostgreSQL (qlayer dev up) ...")
        endpoints = LocalStack(StackConfig.from_env()).up()
        settings = settings.model_copy(update={"bootstrap_servers": endpoints.bootstrap_servers,
                                               "database_url": endpoints.database_url})
    from layer.store.migrate import upgrade

    try:
        upgrade(settings.database_url)
    except (SQLAlchemyError, QlayerError) as exc:
        first_line = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        raise DemoError(f"demo: cannot migrate the database ({first_line}); is PostgreSQL "
                        "running? (qlayer dev status)") from exc
    return settings


def run_demo(options: DemoOptions, progress: Progress = lambda _: None) -> DemoReport:
    """Run every scene once against real services and report what was observed."""
    started = time.monotonic()
    settings = prepare(options, progress)
    run = options.run_id
    queues = demo_queues(run)
    try:
        KafkaAdmin(settings.kafka_config()).ensure_topics(
            [TopicSpec(name) for name in _journals(queues, run)], timeout=15)
    except QlayerError as exc:
        raise DemoError(f"demo: cannot create the journals on Kafka at "
                        f"{settings.bootstrap_servers} ({exc}); is it running? "
                        "(qlayer dev status)") from exc
    with Store(settings.database_url) as store:
        # Only the last run's queues stay for looking around; older ones would pile up.
        earlier = earlier_demo_queues([q.name for q in store.list_queues()], run)
        for name in earlier:
            store.delete_queue(name, time.time())
        for q in queues:
            store.put_queue(q.name, q.model_dump(mode="json"), time.time())
    if earlier:
        progress(f"deleted {len(earlier)} queues of earlier demo runs")
    progress(f"applied {len(queues)} queues (run {run}) and created their journals")
    with ExitStack() as stack:
        owner, own = stack.enter_context(_coordinator(settings, progress))
        publisher = stack.enter_context(QueuePublisher(
            settings.bootstrap_servers, topic_prefix=settings.topic_prefix,
            kafka_config=settings.kafka, directory_refresh=1.0))
        with ExitStack() as scene:
            jobs = _jobs(settings, options, publisher, scene, progress)
        priority = _priority(settings, options, publisher, progress)
        with ExitStack() as scene:
            barrier = _barrier(settings, options, publisher, scene, progress)
        with ExitStack() as scene:
            fairness = _fairness(settings, options, publisher, scene, progress)
        orders = _orders(settings, options, publisher, progress)
    return DemoReport(
        run=run, bootstrap_servers=settings.bootstrap_servers,
        database_url=settings.database_url, topic_prefix=settings.topic_prefix,
        coordinator=owner, own_coordinator=own,
        queues={_short_queue(q.name, run): q.name for q in queues},
        jobs=jobs, priority=priority, barrier=barrier, fairness=fairness, orders=orders,
        seconds=round(time.monotonic() - started, 1))
