"""Requests from the topic to their reply: decode, queue, batch, answer once, reply.

A request that does not decode gets a dead letter on ``recommend.requests.dlq`` and an
``error`` reply. The others wait in a queue that the batching policy (``batching.py``) flushes
into the recommender; an expired one is dropped and counted. A ``request_id`` is answered once:
ids answered here are remembered, and ids answered by any worker (before a crash or a
rebalance) are looked up in Redis. A request is done once its reply is delivered (or it
expired, or was a duplicate); ``RequestOffsets`` turns "done" into what may be committed.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis
from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, KafkaError, KafkaException

from freshcore import metrics as m
from freshcore.clock import now_ms
from freshcore.kafka import ProducerFailed, delivery_retriable, produce
from freshcore.rediskeys import RedisKeys
from freshcore.retry import RetryPolicy, RetryQueue
from freshcore.topics import TopicNames
from inference.batching import BatchPolicy, split_expired
from inference.feedback import Feedback
from inference.offsets import RequestOffsets
from inference.route import reply_topic_pattern, route
from inference.serving.batch import Inbound
from inference.serving.liveexperiment import LiveExperiment
from inference.serving.recommender import Recommender
from inference.settings import ModeSettings, WorkerSettings
from schemas.codec import dead_letter, decode_request, encode_dead_letter, encode_reply
from schemas.contract import Reason, Rejected
from schemas.records import RecommendReply

log = logging.getLogger("freshrec.worker")


MAX_ATTEMPTS = 3
"""Deliveries of a reply or dead letter tried before it counts as undeliverable."""


REPLY_RETRY = RetryPolicy(attempts=MAX_ATTEMPTS, first_wait_s=0.0)
"""A reply or dead letter is produced again at the loop's next round: its client waits."""


@dataclass(frozen=True)
class OutgoingMessage:
    """A reply or dead letter as produced: what a failed delivery needs to produce it again."""

    topic: str
    value: bytes
    key: bytes | None
    """The reply's correlation id (None for a dead letter)."""
    headers: list | None
    """The reply's ``correlation-id`` header (None or empty: no headers)."""
    report: Callable[[bool, object], None]
    """Called once with ``(delivered, error)``: delivered, or given up on."""
    what: str
    """``reply`` or ``dead letter``: in the fatal error and ``freshrec_produce_retries_total``."""


class _Countdown:
    """Calls ``then`` at the ``n``-th call: a request done once each of its messages is."""

    def __init__(self, n: int, then: Callable[[], None]) -> None:
        self.n, self.then = n, then

    def __call__(self) -> None:
        self.n -= 1
        if self.n == 0:
            self.then()


def produced_ms(msg, now: int) -> int:
    """When a request record was produced: its timestamp (the producer's create time, or the
    broker's append time on a topic configured so), or ``now`` when it has none or one later
    than ``now`` (a producer's clock ahead of this host's)."""
    kind, ts = msg.timestamp()
    if kind == TIMESTAMP_NOT_AVAILABLE or not 0 < ts <= now:
        return now
    return ts


class RequestIntake:
    def __init__(
        self,
        settings: WorkerSettings,
        names: TopicNames,
        keys: RedisKeys,
        client: redis.Redis,
        producer,
        recommender: Recommender,
        experiment: LiveExperiment | None = None,
    ) -> None:
        self.settings = settings
        self.names = names
        self.keys = keys
        self.redis = client
        self.producer = producer
        self.recommender = recommender
        self.policy = BatchPolicy(settings.max_batch, settings.max_wait_ms)
        self.queue: deque[Inbound] = deque()
        self.offsets = RequestOffsets()  # commit no request before an earlier open one
        self.answered: OrderedDict[str, None] = OrderedDict()
        self.answering: dict[str, int] = {}
        """Ids whose reply is produced and not yet acknowledged (→ its request's partition): a
        duplicate can arrive before the delivery report, the reply already on its way."""
        self._answered_unsaved: list[str] = []
        self.reply_topics = reply_topic_pattern(
            settings.conn.topic_prefix, settings.reply_topic_pattern
        )
        self._retries: RetryQueue[OutgoingMessage] = RetryQueue(REPLY_RETRY)
        self.feedback = Feedback()
        """The tiers of recent replies: events naming them are counted by tier."""
        self.experiment = experiment
        """The worker's ``LiveExperiment``: each reply's variant is recorded before it leaves."""

    def __len__(self) -> int:
        return len(self.queue)

    def use(self, mode: ModeSettings) -> None:
        """Batch the next requests as a serving mode says (``max_batch``, ``max_wait_ms``);
        the requests queued stay queued."""
        self.policy = BatchPolicy(mode.max_batch, mode.max_wait_ms)

    def wait_ms(self) -> float | None:
        """How long the oldest queued request may still wait for its batch (0: serve now;
        None: nothing queued)."""
        if not self.queue:
            return None
        d = self.policy.decide(len(self.queue), self.queue[0].enqueued_ms, now_ms())
        return 0.0 if d.flush else d.wait_ms

    # --------------------------------------------------------------------------- intake
    def accept(self, msg) -> None:
        """Take one message of ``recommend.requests``, whatever it holds: a request to serve,
        or a dead letter (headers that give no safe reply topic or correlation id: nothing
        else), or a dead letter and an ``error`` reply (a value that is not a request)."""
        partition, offset = msg.partition(), msg.offset()
        self.offsets.accepted(partition, offset)
        now = now_ms()
        try:
            where = route(msg.headers(), self.reply_topics, self.names.recommend_replies)
        except Rejected as rej:
            m.REQUESTS.labels("invalid").inc()
            self._dead_letter(rej, msg, now, done=lambda: self.offsets.done(partition, offset))
            return
        try:
            req = decode_request(msg.value(), now)
        except Rejected as rej:
            m.REQUESTS.labels("invalid").inc()
            both = _Countdown(2, lambda: self.offsets.done(partition, offset))
            self._dead_letter(rej, msg, now, done=both)
            corr = where.correlation_id
            error = RecommendReply(
                request_id=corr.decode()[:128] if corr else "unknown",
                user_id="unknown",
                items=(),
                tier="error",
                tier_reason=f"invalid request: {rej.reason}: {rej.detail}"[:256],
                served_at_ms=now,
                worker=self.settings.worker_id,
            )
            self._reply(where.reply_to, corr, error, partition, offset, done=both)
            return
        self.queue.append(
            Inbound(
                req,
                where.reply_to,
                where.correlation_id,
                produced_ms(msg, now),
                partition,
                offset,
                read_ms=now,
            )
        )

    def _dead_letter(self, rej: Rejected, msg, now: int, done: Callable[[], None]) -> None:
        """A request's dead letter: it is done once the letter is delivered (or given up)."""
        self._send_dead_letter(
            rej, msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(), now, done
        )

    def _send_dead_letter(
        self, rej: Rejected, topic, partition, offset, key, value, now: int, done
    ) -> None:
        letter = dead_letter(
            rej,
            topic=topic,
            partition=partition,
            offset=offset,
            key=key,
            value=value,
            now_ms=now,
            service="worker",
            limits=self.settings.dead_letters,
        )
        m.DEAD_LETTERS.labels(str(rej.reason)).inc()
        self._send(
            OutgoingMessage(
                self.names.recommend_requests_dlq,
                encode_dead_letter(letter),
                None,
                None,
                lambda ok, err: done(),
                "dead letter",
            )
        )

    # -------------------------------------------------------------------------- serving
    def serve_ready(self) -> None:
        """Serve every batch the policy says is ready."""
        while self.queue:
            d = self.policy.decide(len(self.queue), self.queue[0].enqueued_ms, now_ms())
            if not d.flush:
                return
            take = [
                self.queue.popleft() for _ in range(min(len(self.queue), self.policy.max_batch))
            ]
            # only a deadline the client set drops a request unanswered: past the default
            # budget it is still answered, by the cheapest tier the ladder finds time for
            live, expired = split_expired(take, lambda b: b.request.deadline_ms, now_ms())
            for b in expired:
                m.REQUESTS.labels("expired").inc()
                self.offsets.done(b.partition, b.offset)
            live = self._drop_answered(live)
            if not live:
                continue
            m.REQUEST_BATCH_SIZE.observe(len(live))
            replies = self.recommender.serve(live, queue_depth=len(self.queue))
            if self.experiment is not None:
                self.experiment.record(replies)
            for b, reply in zip(live, replies, strict=True):
                m.REQUESTS.labels("served").inc()
                self.feedback.served(reply.request_id, reply.tier)
                self._reply(b.reply_to, b.correlation_id, reply, b.partition, b.offset)

    def _drop_answered(self, live: list[Inbound]) -> list[Inbound]:
        """The same request_id is answered once: ids answered here are remembered, and ids
        answered by any worker (before a crash or a rebalance) are looked up in Redis."""
        fresh, seen = [], set()
        for b in live:
            rid = b.request.request_id
            if rid in self.answered or rid in self.answering or rid in seen:
                m.REQUESTS.labels("duplicate").inc()
                self.offsets.done(b.partition, b.offset)
            else:
                seen.add(rid)
                fresh.append(b)
        if not fresh:
            return fresh
        try:
            pipe = self.redis.pipeline(transaction=False)
            for b in fresh:
                pipe.exists(self.keys.answered(b.request.request_id))
            found = pipe.execute()
        except redis.RedisError:
            return fresh  # answer: a duplicate reply is dropped by the client
        out = []
        for b, hit in zip(fresh, found, strict=True):
            if hit:
                m.REQUESTS.labels("duplicate").inc()
                self.offsets.done(b.partition, b.offset)
            else:
                out.append(b)
        return out

    def _reply(
        self,
        topic: str,
        corr,
        reply: RecommendReply,
        partition: int,
        offset: int,
        done: Callable[[], None] | None = None,
    ) -> None:
        """Produce ``reply``; the request is done once it is delivered — or, if it cannot be
        (librdkafka gave up on it, and a retry too, or the topic refuses it), once its dead
        letter (``reply_undeliverable``, the reply as its value) is."""
        finish = done or (lambda: self.offsets.done(partition, offset))
        value = encode_reply(reply)
        headers = [("correlation-id", corr)] if corr is not None else []

        if reply.tier != "error":
            self.answering[reply.request_id] = partition

        def delivered(ok: bool, err) -> None:
            self.answering.pop(reply.request_id, None)
            if ok:
                if reply.tier != "error":
                    self._remember_answered(reply.request_id)
                finish()
                return
            log.warning("reply to %s not delivered: %s", topic, err)
            m.REQUESTS.labels("reply_failed").inc()
            rej = Rejected(Reason.REPLY_UNDELIVERABLE, f"reply to {topic[:200]}: {err}")
            self._send_dead_letter(
                rej,
                self.names.recommend_requests,
                partition,
                offset,
                corr,
                value,
                now_ms(),
                finish,
            )

        self._send(OutgoingMessage(topic, value, corr, headers, delivered, "reply"))

    def _send(self, message: OutgoingMessage, attempt: int = 1) -> None:
        """Produce and call ``message.report(ok, error)`` once: a delivery that failed for a
        reason that may pass (a timeout, a broker away) is tried again (``MAX_ATTEMPTS`` in
        all, from the loop: ``retry_failed``); a produce the client refuses at once (a topic
        name it will not take) is a failure."""
        report, what = message.report, message.what

        def delivered(err, msg) -> None:
            if err is None:
                report(True, None)
            elif err.fatal():
                raise ProducerFailed(f"producer failed for good delivering a {what}: {err}")
            elif err.code() == KafkaError._PURGE_QUEUE:
                pass  # taken back on a rebalance: the partition's next owner answers it
            elif delivery_retriable(err) and self._retries.add(message, attempt, time.monotonic()):
                m.PRODUCE_RETRIES.labels(what).inc()
            else:
                report(False, err)

        try:
            produce(
                self.producer,
                message.topic,
                message.value,
                message.key,
                headers=message.headers,
                on_delivery=delivered,
            )
        except KafkaException as exc:
            report(False, exc.args[0] if exc.args else exc)

    def retry_failed(self) -> None:
        """Produce again what failed for a reason that may pass (called from the loop, not
        from a delivery callback)."""
        for message, attempt in self._retries.due(time.monotonic()):
            self._send(message, attempt)

    # ---------------------------------------------------------------------- answer once
    def _remember_answered(self, rid: str) -> None:
        self.answered[rid] = None
        if len(self.answered) > self.settings.answered_memory:
            self.answered.popitem(last=False)
        self._answered_unsaved.append(rid)

    def save_answered(self) -> None:
        """Write the ids answered since the last call to Redis (kept for a retry when Redis
        is away)."""
        if not self._answered_unsaved:
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            for rid in self._answered_unsaved:
                pipe.set(self.keys.answered(rid), 1, ex=self.settings.answered_ttl_s)
            pipe.execute()
            self._answered_unsaved.clear()
        except redis.RedisError:
            del self._answered_unsaved[: -self.settings.answered_memory]  # retried later

    # ------------------------------------------------------------------------ rebalance
    def revoke(self, partitions: Iterable[int]) -> None:
        """The group took ``partitions`` away: their queued requests are another worker's."""
        gone = set(partitions)
        kept: deque[Inbound] = deque()
        for b in self.queue:
            if b.partition in gone:
                m.REQUESTS.labels("revoked").inc()
            else:
                kept.append(b)
        self.queue = kept
        self.offsets.forget(gone)
        for rid in [r for r, p in self.answering.items() if p in gone]:
            del self.answering[rid]  # a reply taken back (purged) is the next owner's to send
        self._retries.drain()  # their requests are answered again by the next owner
