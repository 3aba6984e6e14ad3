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
from collections.abc import Iterable

import redis

from freshrec import metrics as m
from freshrec.kafka import produce
from freshrec.rediskeys import RedisKeys
from freshrec.topics import TopicNames
from inference.batching import BatchPolicy, split_expired
from inference.offsets import RequestOffsets
from inference.serving import Inbound, Recommender
from inference.settings import WorkerSettings
from schemas.codec import dead_letter, decode_request, encode_dead_letter, encode_reply
from schemas.contract import Rejected
from schemas.records import RecommendReply

log = logging.getLogger("freshrec.worker")


def _now_ms() -> int:
    return int(time.time() * 1000)


class RequestIntake:
    def __init__(
        self,
        settings: WorkerSettings,
        names: TopicNames,
        keys: RedisKeys,
        client: redis.Redis,
        producer,
        recommender: Recommender,
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
        self._answered_unsaved: list[str] = []

    def __len__(self) -> int:
        return len(self.queue)

    def wait_ms(self) -> float | None:
        """How long the oldest queued request may still wait for its batch (0: serve now;
        None: nothing queued)."""
        if not self.queue:
            return None
        d = self.policy.decide(len(self.queue), self.queue[0].enqueued_ms, _now_ms())
        return 0.0 if d.flush else d.wait_ms

    # --------------------------------------------------------------------------- intake
    def accept(self, msg) -> None:
        self.offsets.accepted(msg.partition(), msg.offset())
        headers = dict(msg.headers() or [])
        reply_to = (headers.get("reply-to") or b"").decode(errors="replace") or (
            self.names.recommend_replies
        )
        corr = headers.get("correlation-id")
        now = _now_ms()
        try:
            req = decode_request(msg.value(), now)
        except Rejected as rej:
            m.REQUESTS.labels("invalid").inc()
            letter = dead_letter(
                rej,
                topic=msg.topic(),
                partition=msg.partition(),
                offset=msg.offset(),
                key=msg.key(),
                value=msg.value(),
                now_ms=now,
                service="worker",
            )
            produce(self.producer, self.names.recommend_requests_dlq, encode_dead_letter(letter))
            error = RecommendReply(
                request_id=(corr or b"unknown").decode(errors="replace")[:128] or "unknown",
                user_id="unknown",
                items=(),
                tier="error",
                tier_reason=f"invalid request: {rej.reason}: {rej.detail}"[:256],
                served_at_ms=now,
                worker=self.settings.worker_id,
            )
            self._reply(reply_to, corr, error, msg.partition(), msg.offset())
            return
        self.queue.append(Inbound(req, reply_to, corr, now, msg.partition(), msg.offset()))

    # -------------------------------------------------------------------------- serving
    def serve_ready(self) -> None:
        """Serve every batch the policy says is ready."""
        while self.queue:
            d = self.policy.decide(len(self.queue), self.queue[0].enqueued_ms, _now_ms())
            if not d.flush:
                return
            take = [
                self.queue.popleft() for _ in range(min(len(self.queue), self.policy.max_batch))
            ]
            live, expired = split_expired(
                take, lambda b: b.deadline_ms(self.settings.serving.default_budget_ms), _now_ms()
            )
            for b in expired:
                m.REQUESTS.labels("expired").inc()
                self.offsets.done(b.partition, b.offset)
            live = self._drop_answered(live)
            if not live:
                continue
            m.REQUEST_BATCH_SIZE.observe(len(live))
            replies = self.recommender.serve(live, queue_depth=len(self.queue))
            for b, reply in zip(live, replies, strict=True):
                m.REQUESTS.labels("served").inc()
                self._reply(b.reply_to, b.correlation_id, reply, b.partition, b.offset)

    def _drop_answered(self, live: list[Inbound]) -> list[Inbound]:
        """The same request_id is answered once: ids answered here are remembered, and ids
        answered by any worker (before a crash or a rebalance) are looked up in Redis."""
        fresh, seen = [], set()
        for b in live:
            rid = b.request.request_id
            if rid in self.answered or rid in seen:
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

    def _reply(self, topic: str, corr, reply: RecommendReply, partition: int, offset: int) -> None:
        headers = [("correlation-id", corr)] if corr is not None else []
        rid = reply.request_id

        def delivered(err, msg) -> None:
            if err is not None:  # librdkafka gave up (message.timeout.ms, 5 min by default)
                log.warning("reply to %s lost: %s", topic, err)
                m.REQUESTS.labels("reply_failed").inc()
                # done all the same: long past its deadline, it would only expire if it were
                # read again, and an open request holds back its partition's commits
                self.offsets.done(partition, offset)
                return
            if reply.tier != "error":
                self._remember_answered(rid)
            self.offsets.done(partition, offset)

        produce(
            self.producer,
            topic,
            encode_reply(reply),
            corr,
            headers=headers,
            on_delivery=delivered,
        )

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
