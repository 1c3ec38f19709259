"""The soak's hostile tenant (issue 36): what a client allowed to write the control and ack
topics can send, written with a plain Kafka producer and the protocol codec, as such a client
would (the SDK checks filters and names its own delivery topic; a hostile client does not).

Within a few seconds (`HostileTenant.attack`):

- **hostile filters**: Subscribes under the tenant's own consumer id whose filters exceed the
  limits of docs/expressions.md "Limits" (200 big LIKE patterns in 4.6 KB, a 6.9 KB filter, a
  300-deep expression, too many LIKE patterns, a pattern RE2 cannot fit, one of too many RE2
  instructions): each refused ``INVALID_FILTER`` on the tenant's own delivery topic;
- **an ack flood**: 30 ack records of ~0.9 MB naming no session, to every ack partition;
- **forgeries** against every live session of the soak's consumers (anonymous, authorization
  mode ``open``: stopped by session identity and the one consumer registry, not by
  credentials): Subscribes with the victim's consumer id to its queue without a secret,
  without a proof and with a wrong proof, one written to another shard's control partition,
  and one to a queue of another shard; Heartbeat, Unsubscribe, Replace and ack records naming
  the victim's id and session with a wrong proof and with none (some on another shard's
  partition); a Heartbeat and an Unsubscribe naming its id and a made-up session;
- **delivery topics not its own**: Subscribes (the tenant's id) naming the soak's journal, the
  events topic and a victim's delivery topic as their delivery topic;
- **malformed and oversized records** on every control and ack partition (the oversized ones
  over the topics' limits, 64 KiB and 1 MiB, with the producer's ``message.max.bytes`` raised:
  the broker refuses them, or the coordinators drop them unread);
- **credentials**: Subscribes to a queue granted to a principal (`GRANTED` in run.py, not one
  of the soak's own queues: a granted queue is closed to anonymous consumers) with a wrong
  credential, with a made-up principal's, with none, and under the principal's consumer id
  without its credential; and, so that those refusals mean something, the principal's own
  Subscribe with its credential, which must be accepted (then it unsubscribes).

What was written, what each record must add to the shards' stored refusal counters and the
replies read back are an `Attack`; `tests/soak/checks.py` (`hostile_problems`) judges them.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition

from layer.kafka.logs import logged
from layer.protocol import (
    AckItem,
    AckRecord,
    AckType,
    Codec,
    Heartbeat,
    Replace,
    Subscribe,
    SubscribeResult,
    TopicNames,
    Unsubscribe,
    is_reply,
    reply_shard,
)
from layer.protocol.headers import CREDENTIAL, PROOF, SECRET, new_session_secret
from tests.support.kafka import create_topic

#: Size limits of the control and ack topics (layer/coordinator/control.py, acks.py).
CONTROL_LIMIT, ACK_LIMIT = 64 << 10, 1 << 20
#: The ack flood: records of ~0.9 MB (9,000 items), none naming a session.
FLOOD_RECORDS, FLOOD_ITEMS = 30, 9_000
#: How long the tenant waits for the answers to its own Subscribes (seconds).
ANSWER_WAIT = 60.0


def hostile_filters(nonce: int) -> list[tuple[str, str]]:
    """(name, filter) over each limit of docs/expressions.md "Limits"; ``nonce`` makes every
    text new, as a hostile client varies it (no cache answers)."""
    like = "'\\pL{140}'"
    return [
        # The report's accepted filter: 200 LIKE patterns, 4.6 KB (MAX_LENGTH).
        ("200 LIKE patterns, 4.6 KB", f"/r = {nonce} AND ("
         + " OR ".join([f"/f{nonce % 10} LIKE {like}"] * 200) + ")"),
        # The report's refused one: 6.9 KB, 299 such patterns and one RE2 refuses.
        ("6.9 KB filter", f"/r = {nonce} AND (" + " OR ".join(
            [f"/g{nonce % 10} LIKE {like}"] * 299 + [f"/g{nonce % 10} LIKE '\\pL{{999}}'"])
         + ")"),
        # Every operator is a level: 300 additions (MAX_DEPTH, 200), within MAX_LENGTH.
        ("300-deep expression", f"/r = {nonce} OR /d" + " + 1" * 300 + " = 0"),
        # Under MAX_LENGTH with 170 patterns (MAX_LIKE_PATTERNS, 16): refused before RE2.
        ("170 LIKE patterns, 3.7 KB", " OR ".join([f"/h LIKE {like}"] * 169
                                                  + [f"/h LIKE '{nonce}'"])),
        # One pattern whose RE2 program does not fit its memory (PATTERN_MAX_MEM).
        ("a pattern over RE2's memory", f"/r = {nonce} OR /p LIKE '\\pL{{999}}'"),
        # One pattern of 23,924 RE2 instructions (MAX_INSTRUCTIONS, 10,000).
        ("a pattern of too many instructions", f"/r = {nonce} OR /q LIKE '\\pL{{20}}'"),
    ]


@dataclass(frozen=True)
class Victim:
    """A live, proven session of a soak consumer: its consumer id, session and queue, and the
    shard that holds it."""

    consumer_id: str
    session_id: str
    queue: str
    shard: int


@dataclass
class Attack:
    """What the tenant wrote and what came back.

    ``expected``: one entry per kind of record, ``[what, how many, counters]``: the shards'
    stored counters (``refused:KIND:REASON:PRINCIPAL``, ``identity_refused_*``, ...) whose
    increments, added up, must reach that many (each record refused and counted once; a
    record may count under any of them, as a Subscribe on another shard may be refused as
    ``consumer_id_live_elsewhere`` or settled by the store as a ``registry_conflicts``).
    ``answers``: request id → ``[what, the status it must get]`` for the Subscribes answered
    on the tenant's own delivery topics; ``replies``: request id → the status that came.
    ``broker_refused``: records the broker refused, by what → error names (the oversized
    ones may be; they are then expected from no shard). ``consumer_ids`` and ``sessions``:
    the ids and sessions its records named that are its own (the forgeries' sessions too),
    so their events can be told apart; ``control_id``: the principal's own consumer id."""

    expected: list[list[object]] = field(default_factory=list)
    answers: dict[str, list[str]] = field(default_factory=dict)
    replies: dict[str, str] = field(default_factory=dict)
    broker_refused: dict[str, list[str]] = field(default_factory=dict)
    consumer_ids: list[str] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)
    control_id: str = ""
    #: Seconds from the first record written to the last one flushed.
    wrote_for: float = 0.0
    records: int = 0

    def expect(self, what: str, count: int, *counters: str) -> None:
        if count:
            self.expected.append([what, count, list(counters)])


def refused(kind: str, reason: str, principal: str = "anonymous") -> str:
    """The stored counter of one refusal (layer/coordinator/faults.py `refusal_key`)."""
    return f"refused:{kind}:{reason}:{principal}"


class HostileTenant:
    """A client of the control and ack topics with no SDK: raw records, as a hostile tenant
    writes them. ``journal`` is the soak's journal and ``queue`` its at-least-once queue (the
    canary, which the hostile filters are sent to); ``granted`` a queue granted to the
    principal ``principal`` (credential ``credential``); ``elsewhere`` an open queue on a
    shard other than the victims'."""

    def __init__(self, bootstrap: str, prefix: str, shards: int, *, journal: str, queue: str,
                 granted: str, elsewhere: str, principal: str, credential: str,
                 say: Callable[[str], None]) -> None:
        self.bootstrap, self.shards, self.journal, self.queue = bootstrap, shards, journal, queue
        self.granted, self.elsewhere = granted, elsewhere
        self.principal, self.credential = principal, credential
        self.say = say
        self.topics = TopicNames(prefix)
        self.codec = Codec()
        self.tag = uuid.uuid4().hex[:8]
        self.attack = Attack()
        #: request id -> the shard that answered it (`qlayer.shard` of the reply).
        self.shards_answering: dict[str, int | None] = {}

    # --- records ---------------------------------------------------------------------------

    def _subscribe(self, consumer_id: str, queue: str, *, filter: str | None = None,
                   delivery_topic: str | None = None, secret: bool = True,
                   proof: bytes | None = None, credential: str | None = None,
                   hostile: bool = True) -> tuple[bytes, list[tuple[str, bytes]], str, str]:
        """A Subscribe's value, headers, request id and session id (one of the tenant's
        sessions, whose events must be refusals only, unless not ``hostile``)."""
        request_id = uuid.uuid4().hex
        session = uuid.uuid4().hex
        if hostile:
            self.attack.sessions.append(session)
        headers: list[tuple[str, bytes]] = []
        if secret:
            headers.append((SECRET, new_session_secret()))
        if proof is not None:
            headers.append((PROOF, proof))
        if credential is not None:
            headers.append((CREDENTIAL, credential.encode()))
        value = self.codec.encode_control(Subscribe(
            consumer_id=consumer_id, session_id=session, request_id=request_id, queue=queue,
            queue_is_regex=False, max_backlog=10, filter=filter,
            delivery_topic=delivery_topic or self.topics.delivery(consumer_id),
            session_timeout_ms=30_000, client_name="soak-hostile", client_version="0",
            sent_at_ms=int(time.time() * 1000)))
        return value, headers, request_id, session

    @staticmethod
    def _wrong_proof() -> list[tuple[str, bytes]]:
        # A well-formed secret that is not the session's: a guess.
        return [(PROOF, new_session_secret())]

    def _ack(self, consumer_id: str, session_id: str, queue: str, items: int = 1) -> bytes:
        item = AckItem(queue=queue, bookmark=f"{self.journal}/0/0", lease="0" * 32,
                       type=AckType.ACCEPT)
        return self.codec.encode_ack(AckRecord(consumer_id=consumer_id, session_id=session_id,
                                               sent_at_ms=int(time.time() * 1000),
                                               items=(item,) * items))

    # --- the attack ------------------------------------------------------------------------

    def run(self, victims: list[Victim]) -> Attack:
        """Every hostile record written (a few seconds), then the answers to the tenant's own
        Subscribes read back (`ANSWER_WAIT` at most). The counters are the caller's to read."""
        a = self.attack
        me = f"hostile-{self.tag}"
        # The principal's consumer ids (its default grant, PRINCIPAL-*), used without its
        # credential, with a wrong one, and once with it (the control).
        theirs, guessed = f"{self.principal}-{self.tag}-x", f"{self.principal}-{self.tag}-y"
        a.control_id = f"{self.principal}-{self.tag}-ok"
        own = [me, theirs, guessed, a.control_id]
        a.consumer_ids.extend([me, theirs, guessed])
        # Refusals go to a delivery topic only if it exists (a refusal makes no topic for
        # anonymous writers): the tenant makes its own, as the SDK does.
        for consumer_id in own:
            create_topic(self.bootstrap, self.topics.delivery(consumer_id), 1, exist_ok=True)
        reader = Consumer(logged({"bootstrap.servers": self.bootstrap,
                           "group.id": f"soak-hostile-{self.tag}", "enable.auto.commit": False,
                           "log_level": 2}))
        reader.assign([TopicPartition(self.topics.delivery(c), 0, 0) for c in own])
        producer = Producer(logged({"bootstrap.servers": self.bootstrap, "linger.ms": 5,
                             "enable.idempotence": True, "log_level": 2}))
        failed: dict[str, list[str]] = {}

        def send(topic: str, value: bytes, key: str, what: str,
                 headers: list[tuple[str, bytes]] | None = None,
                 partition: int | None = None, via: Producer = producer) -> None:
            def report(err: KafkaError | None, msg: Message) -> None:
                if err is not None:
                    failed.setdefault(what, []).append(err.name())

            route = {} if partition is None else {"partition": partition}
            via.produce(topic, value, key=key.encode(), headers=headers or [],
                        on_delivery=report, **route)
            via.poll(0)
            a.records += 1

        control, ack = self.topics.control, self.topics.ack
        began = time.monotonic()
        try:
            # Hostile filters, under its own id, to the canary's queue: compiled, they would
            # hold the thread that serves it.
            for name, text in hostile_filters(int(self.tag, 16) % 1_000_000):
                value, headers, request_id, _ = self._subscribe(me, self.queue, filter=text)
                send(control, value, me, f"filter: {name}", headers)
                a.answers[request_id] = [f"filter: {name}", "INVALID_FILTER"]
            a.expect("hostile filters", len(hostile_filters(0)),
                     refused("subscribe", "invalid_filter"))
            # Delivery topics not its own.
            targets = {"the journal": self.journal, "the events topic": self.topics.events}
            if victims:
                targets["a soak consumer's delivery topic"] = self.topics.delivery(
                    victims[0].consumer_id)
            for name, topic in targets.items():
                value, headers, request_id, _ = self._subscribe(me, self.queue,
                                                                delivery_topic=topic)
                send(control, value, me, f"delivery topic: {name}", headers)
                a.answers[request_id] = [f"delivery topic: {name}", "INVALID_REQUEST"]
            a.expect("Subscribes naming a delivery topic not their own", len(targets),
                     refused("subscribe", "delivery_topic_not_its_own"))
            # Credentials, against the principal's queue.
            wrong = f"{self.principal}:{uuid.uuid4().hex}"
            attempts = [(guessed, wrong, "wrong_credential", "unknown",
                         "the principal's id, a wrong credential"),
                        (me, f"nobody-{self.tag}:{uuid.uuid4().hex}", "wrong_credential",
                         "unknown", "a made-up principal's credential"),
                        (me, None, "queue_not_granted", "anonymous", "no credential"),
                        (theirs, None, "consumer_id_not_granted", "anonymous",
                         "the principal's id, no credential")]
            for consumer_id, credential, reason, label, name in attempts:
                value, headers, request_id, _ = self._subscribe(consumer_id, self.granted,
                                                                credential=credential)
                send(control, value, consumer_id, f"granted queue: {name}", headers)
                a.answers[request_id] = [f"granted queue: {name}", "INVALID_REQUEST"]
                a.expect(f"granted queue: {name}", 1, refused("subscribe", reason, label))
            # The ack flood: no session, every partition, as fast as the producer takes them.
            for i in range(FLOOD_RECORDS):
                nobody = f"nobody-{self.tag}-{i}"
                a.consumer_ids.append(nobody)
                send(ack, self._ack(nobody, uuid.uuid4().hex, self.queue, FLOOD_ITEMS),
                     nobody, "ack flood", partition=i % self.shards)
            a.expect("ack flood (no session)", FLOOD_RECORDS,
                     refused("ack", "unknown_session"))
            self._forge(victims, send)
            # Malformed records on every control and ack partition.
            for p in range(self.shards):
                send(control, b"\x00not a control record " + os.urandom(16), me,
                     "malformed control", partition=p)
                send(ack, b"\x00not an ack record " + os.urandom(16), me, "malformed ack",
                     partition=p)
            producer.flush(60)
            # Oversized records, from a producer of their own: a batch the broker refuses is
            # refused whole, so they share none with the records above.
            big = Producer(logged({"bootstrap.servers": self.bootstrap, "linger.ms": 0,
                            "message.max.bytes": 3_000_000, "log_level": 2}))
            for p in range(self.shards):
                send(control, os.urandom(CONTROL_LIMIT + 36_000), me, "oversized control",
                     partition=p, via=big)
                send(ack, os.urandom(ACK_LIMIT + 500_000), me, "oversized ack", partition=p,
                     via=big)
            big.flush(60)
            a.wrote_for = round(time.monotonic() - began, 2)
            a.broker_refused = failed
            for kind in ("control", "ack"):
                kept = self.shards - len(failed.get(f"oversized {kind}", []))
                a.expect(f"oversized {kind} records the broker took", kept,
                         refused(kind, "oversized"))
            for kind in ("control", "ack"):
                a.expect(f"malformed {kind} records", self.shards - len(
                    failed.get(f"malformed {kind}", [])), refused(kind, "malformed"))
            # The control: the principal's own Subscribe, with its credential.
            value, headers, control_request, control_session = self._subscribe(
                a.control_id, self.granted, credential=self.credential, hostile=False)
            secret = dict(headers)[SECRET]
            send(control, value, a.control_id, "control: the principal's Subscribe", headers)
            a.answers[control_request] = ["control: the principal's own Subscribe", "OK"]
            producer.flush(30)
            self._answers(reader)
            if a.replies.get(control_request) == "OK":
                # To the shard that answered (its reply's qlayer.shard), as the SDK does: by
                # key, another shard might not know the session yet and count it unknown.
                send(control, self.codec.encode_control(Unsubscribe(
                    consumer_id=a.control_id, session_id=control_session, reason="soak",
                    sent_at_ms=int(time.time() * 1000))), a.control_id, "control: Unsubscribe",
                    [(PROOF, secret)], partition=self.shards_answering.get(control_request))
                producer.flush(30)
        finally:
            reader.close()
        unexpected = {k: v for k, v in failed.items() if not k.startswith("oversized")}
        if unexpected:
            self.say(f"hostile records the broker refused: {unexpected}")
        return a

    def _forge(self, victims: list[Victim],
               send: Callable[..., None]) -> None:
        """Records naming each victim's consumer id (and its session), none proving its
        secret: none may change anything of the victim's."""
        a, control, ack = self.attack, self.topics.control, self.topics.ack
        n = len(victims)
        for v in victims:
            other = (v.shard + 1) % self.shards
            # Subscribes taking the id over: without a secret (an older client), with a fresh
            # secret and no proof, with a wrong proof; one on another shard's partition.
            for secret, proof, partition in ((False, None, v.shard), (True, None, v.shard),
                                             (True, new_session_secret(), v.shard),
                                             (True, new_session_secret(), other)):
                value, headers, _, _ = self._subscribe(v.consumer_id, v.queue, secret=secret,
                                                       proof=proof)
                send(control, value, v.consumer_id, "forged Subscribe", headers,
                     partition=partition)
            # A Subscribe of the id to an open queue of another shard (one registry).
            value, headers, _, _ = self._subscribe(v.consumer_id, self.elsewhere)
            send(control, value, v.consumer_id, "forged Subscribe elsewhere", headers,
                 partition=other)
            now = int(time.time() * 1000)
            heartbeat = self.codec.encode_control(Heartbeat(
                consumer_id=v.consumer_id, session_id=v.session_id, sent_at_ms=now))
            leave = self.codec.encode_control(Unsubscribe(
                consumer_id=v.consumer_id, session_id=v.session_id, reason="forged",
                sent_at_ms=now))
            # Its own queue with a filter nothing matches: accepted, it would starve the
            # victim. (A Replace goes to its queue's shard, so that shard checks the proof.)
            move = self.codec.encode_control(Replace(
                consumer_id=v.consumer_id, session_id=v.session_id,
                request_id=uuid.uuid4().hex, queue=v.queue, max_backlog=1,
                filter=f"/soak_hostile = '{self.tag}'",
                delivery_topic=self.topics.delivery(v.consumer_id), sent_at_ms=now))
            acks = self._ack(v.consumer_id, v.session_id, v.queue)
            for topic, value, what, partition in (
                    (control, heartbeat, "forged Heartbeat", v.shard),
                    (control, leave, "forged Unsubscribe", v.shard),
                    (control, move, "forged Replace", v.shard),
                    (ack, acks, "forged ack", v.shard)):
                send(topic, value, v.consumer_id, f"{what}, wrong proof", self._wrong_proof(),
                     partition=partition)
                # Without a proof, on another shard's partition: passed on to the session's
                # shard, which checks it.
                send(topic, value, v.consumer_id, f"{what}, no proof", partition=other)
            # Naming the id with a made-up session: unknown, whatever shard reads it.
            made_up = uuid.uuid4().hex
            a.sessions.append(made_up)
            send(control, self.codec.encode_control(Heartbeat(
                consumer_id=v.consumer_id, session_id=made_up, sent_at_ms=now)),
                v.consumer_id, "Heartbeat of a made-up session", partition=v.shard)
            send(control, self.codec.encode_control(Unsubscribe(
                consumer_id=v.consumer_id, session_id=made_up, reason="forged",
                sent_at_ms=now)), v.consumer_id, "Unsubscribe of a made-up session",
                partition=v.shard)
        a.expect("forged Subscribes of a live id (no secret, no proof, wrong proof, another "
                 "shard's partition)", 4 * n, refused("subscribe", "session_live"))
        a.expect("forged Subscribes of a live id to another shard's queue", n,
                 refused("subscribe", "consumer_id_live_elsewhere"), "registry_conflicts")
        for kind in ("heartbeat", "unsubscribe", "replace", "ack"):
            a.expect(f"forged {kind} records, wrong proof", n, refused(kind, "wrong_proof"))
            a.expect(f"forged {kind} records, no proof", n, refused(kind, "no_proof"))
        a.expect("Heartbeats of a made-up session", n, "unknown_session_heartbeats")
        a.expect("Unsubscribes of a made-up session", n, "unknown_session_unsubscribes")

    def _answers(self, reader: Consumer) -> None:
        """The SubscribeResults of the tenant's own Subscribes, read from its delivery topics
        (`ANSWER_WAIT` at most)."""
        a = self.attack
        deadline = time.monotonic() + ANSWER_WAIT
        while len(a.replies) < len(a.answers) and time.monotonic() < deadline:
            for m in reader.consume(100, 0.2):
                if m.error() is not None or not is_reply(m.headers() or []):
                    continue
                reply = self.codec.decode_reply(m.value())
                if isinstance(reply, SubscribeResult) and reply.request_id in a.answers:
                    a.replies[reply.request_id] = reply.status.value
                    self.shards_answering[reply.request_id] = reply_shard(m.headers())
