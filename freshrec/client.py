"""Asking for recommendations over Kafka: ``RecommendClient`` (asyncio) and
``SyncRecommendClient`` (a thread-backed wrapper for scripts and notebooks).

A request goes to ``recommend.requests`` keyed by user id (so it lands on the partition — and
the worker — that also learns from that user's events) with headers ``reply-to`` and
``correlation-id``. The client reads its reply topic and resolves the waiting call by
correlation id. Replies that arrive after their call timed out (``late``), a second reply for
the same id (``duplicate``), replies it never asked for (``unknown``: another client's on a
shared topic, or a replayed tail) and replies that do not decode or carry a correlation id
nobody could have sent (``malformed``) are dropped and counted in ``stats``; the reader goes on
whatever a reply topic holds.

>>> async def main():  # doctest: +SKIP
...     async with RecommendClient("localhost:9092") as client:
...         reply = await client.recommend("u42", k=10, context={"device": "pc"})
...         print([i.item_id for i in reply.items])
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaConnectionError
from aiokafka.partitioner import DefaultPartitioner

from freshcore import clock
from freshcore.kafka import PROFILES, TopicMissing
from freshcore.settings import KafkaSecurity
from freshcore.topics import BrokerUnreachable, TopicNames
from schemas.codec import decode_reply, encode_request
from schemas.contract import Rejected
from schemas.errors import FreshRecError
from schemas.records import RecommendReply, RecommendRequest, RequestContext

log = logging.getLogger("freshrec.client")


class RecommendTimeout(FreshRecError, TimeoutError):
    retriable = True
    """No reply within the timeout (the worker may still answer; that reply is dropped)."""


class RecommendError(FreshRecError, RuntimeError):
    """The worker rejected the request (tier ``error``); the message is its reason."""

    def __init__(self, reply: RecommendReply) -> None:
        super().__init__(reply.tier_reason)
        self.reply = reply


@dataclass
class ClientStats:
    sent: int = 0
    replied: int = 0
    timeouts: int = 0
    late: int = 0
    duplicate: int = 0
    unknown: int = 0
    malformed: int = 0
    latencies_ms: list[float] = field(default_factory=list)


class RecommendClient:
    """``own_reply_topic=True`` creates a one-partition reply topic for this client (deleted
    on ``stop``); otherwise replies come on ``reply_topic`` (default: the shared
    ``recommend.replies``), which every client reads in full and filters by correlation id."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        topic_prefix: str = "",
        reply_topic: str | None = None,
        own_reply_topic: bool = False,
        timeout_s: float = 2.0,
        profile: str = "production",
        client_id: str | None = None,
        keep_latencies: bool = False,
        security: KafkaSecurity | None = None,
    ) -> None:
        """``security``: how to authenticate to Kafka and encrypt (default: plaintext, or
        ``KafkaSecurity.from_env(os.environ)`` for the deployment's settings). ``profile``:
        the client timings that suit the broker (``freshcore.kafka.PROFILES``; the embedded
        stack's ``stack.env`` names its own)."""
        self.bootstrap = bootstrap_servers
        self.security = security or KafkaSecurity()
        self.names = TopicNames(topic_prefix)
        self.client_id = client_id or f"freshrec-client-{uuid.uuid4().hex[:8]}"
        self.own_reply_topic = own_reply_topic
        if own_reply_topic:
            self.reply_topic = reply_topic or f"{self.names.recommend_replies}.{self.client_id}"
        else:
            self.reply_topic = reply_topic or self.names.recommend_replies
        self.timeout_s = timeout_s
        self.profile = PROFILES[profile]
        self.stats = ClientStats()
        self.keep_latencies = keep_latencies
        self._pending: dict[str, tuple[asyncio.Future, float]] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()  # corr -> "replied" | "timeout"
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: asyncio.Task | None = None
        self._seq = 0

    async def __aenter__(self) -> RecommendClient:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self) -> None:
        """Connect and take up the reply topic. No broker answering raises
        ``BrokerUnreachable``, a missing reply topic ``TopicMissing`` (both ``FreshRecError``);
        whatever was connected by then is closed again."""
        try:
            await self._start()
        except BaseException as exc:
            await self._close_clients()
            if isinstance(exc, KafkaConnectionError):
                raise BrokerUnreachable(
                    f"no Kafka broker answered at {self.bootstrap} ({exc}): is it running, and "
                    "are the bootstrap servers and the security settings right?"
                ) from None
            raise

    async def _close_clients(self) -> None:
        for client in (self._consumer, self._producer):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.stop()
        self._consumer = self._producer = None

    async def _start(self) -> None:
        if self.own_reply_topic:
            await asyncio.get_running_loop().run_in_executor(None, self._create_reply_topic)
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            client_id=self.client_id,
            linger_ms=0,
            partitioner=DefaultPartitioner(),
            **self.security.aiokafka(),
        )
        await self._producer.start()
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            client_id=self.client_id,
            group_id=None,
            enable_auto_commit=False,
            fetch_max_wait_ms=self.profile.fetch_wait_max_ms,
            auto_offset_reset="latest",
            **self.security.aiokafka(),
        )
        await self._consumer.start()
        parts = await self._partitions(self.reply_topic)
        tps = [TopicPartition(self.reply_topic, p) for p in parts]
        self._consumer.assign(tps)
        await self._consumer.seek_to_end(*tps)
        for tp in tps:  # resolve the positions now, before the first request goes out
            await self._consumer.position(tp)
        self._reader = asyncio.create_task(self._read(), name="freshrec-replies")

    async def _partitions(self, topic: str) -> list[int]:
        deadline = time.monotonic() + 10
        while True:
            parts = self._consumer.partitions_for_topic(topic)
            if not parts:
                await self._consumer._client.force_metadata_update()
                parts = self._consumer.partitions_for_topic(topic)
            if parts:
                return sorted(parts)
            if time.monotonic() > deadline:
                raise TopicMissing(
                    f"reply topic {topic} does not exist: run `freshrec topics create`"
                )
            await asyncio.sleep(0.2)

    def _create_reply_topic(self) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap, **self.security.librdkafka()})
        # the broker's replication factor: one replica on a cluster whose min.insync.replicas
        # is 2 refuses every reply produced with acks=all
        for fut in admin.create_topics([NewTopic(self.reply_topic, 1)]).values():
            try:
                fut.result(15)
            except Exception as exc:
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise

    def _delete_reply_topic(self) -> None:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap, **self.security.librdkafka()})
        for fut in admin.delete_topics([self.reply_topic]).values():
            try:
                fut.result(10)
            except Exception as exc:  # best effort: an orphan topic is harmless
                log.debug("could not delete %s: %s", self.reply_topic, exc)

    async def stop(self) -> None:
        if self._reader:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        for fut, _ in self._pending.values():
            if not fut.done():
                fut.cancel()
        if self._consumer:
            await self._consumer.stop()
        if self._producer:
            await self._producer.stop()
        if self.own_reply_topic:
            await asyncio.get_running_loop().run_in_executor(None, self._delete_reply_topic)

    # ---------------------------------------------------------------------------- calls
    async def recommend(
        self,
        user_id: str,
        k: int = 20,
        *,
        context: Mapping[str, Any] | RequestContext | None = None,
        exclude: Iterable[str] = (),
        exclude_seen: bool | None = None,
        timeout_s: float | None = None,
        deadline_ms: int | None = None,
        request_id: str | None = None,
    ) -> RecommendReply:
        """Send one request and await its reply; ``RecommendTimeout`` after ``timeout_s``
        (the request's deadline defaults to the same moment, so the worker does not work on
        a request nobody waits for)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        now_ms = clock.now_ms()
        if isinstance(context, Mapping):
            context = RequestContext(**context)
        self._seq += 1
        request = RecommendRequest(
            request_id=request_id or f"{self.client_id}-{self._seq}",
            user_id=user_id,
            k=k,
            context=context,
            exclude=tuple(exclude),
            exclude_seen=exclude_seen,
            deadline_ms=deadline_ms if deadline_ms is not None else now_ms + int(timeout * 1000),
        )
        return await self.send(request, timeout)

    async def send(
        self, request: RecommendRequest, timeout_s: float | None = None
    ) -> RecommendReply:
        """Send a prepared request (its ``request_id`` is the idempotency key)."""
        if self._producer is None:
            raise RuntimeError("client not started: use `async with RecommendClient(...)`")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        corr = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        started = time.monotonic()
        self._pending[corr] = (fut, started)
        try:
            await self._producer.send(
                self.names.recommend_requests,
                encode_request(request),
                key=request.user_id.encode(),
                headers=[
                    ("reply-to", self.reply_topic.encode()),
                    ("correlation-id", corr.encode()),
                ],
            )
            self.stats.sent += 1
            reply = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            self.stats.timeouts += 1
            self._finish(corr, "timeout")
            raise RecommendTimeout(
                f"no reply to {request.request_id} within {timeout:.3f}s"
            ) from None
        finally:
            self._pending.pop(corr, None)
        if reply.tier == "error":
            raise RecommendError(reply)
        return reply

    def _finish(self, corr: str, how: str) -> None:
        self._finished[corr] = how
        while len(self._finished) > 100_000:
            self._finished.popitem(last=False)

    async def _read(self) -> None:
        assert self._consumer is not None
        while True:
            batches = await self._consumer.getmany(timeout_ms=100, max_records=1000)
            now_ms = clock.now_ms()
            for records in batches.values():
                for rec in records:
                    try:
                        self._on_reply(rec, now_ms)
                    except Exception as exc:  # nothing a stranger writes may stop the reader
                        self.stats.malformed += 1
                        log.warning("reply at offset %s dropped: %s", rec.offset, exc)

    def _on_reply(self, rec, now_ms: int) -> None:
        corr = _correlation_id(rec.headers)
        if corr is False:  # not UTF-8, not bytes, given twice: nobody's reply
            self.stats.malformed += 1
            return
        waiting = self._pending.get(corr) if corr else None
        if waiting is None:
            how = self._finished.get(corr) if corr else None
            if how == "timeout":
                self.stats.late += 1
            elif how == "replied":
                self.stats.duplicate += 1
            else:
                self.stats.unknown += 1
            return
        fut, started = waiting
        if fut.done():
            self.stats.duplicate += 1
            return
        try:
            reply = decode_reply(rec.value, now_ms)
        except Rejected as rej:  # dropped: the call waits on for a reply that decodes
            self.stats.malformed += 1
            log.warning("malformed reply for %s dropped: %s", corr, rej)
            return
        self.stats.replied += 1
        if self.keep_latencies:
            self.stats.latencies_ms.append((time.monotonic() - started) * 1000)
        self._finish(corr, "replied")
        fut.set_result(reply)


def _correlation_id(headers) -> str | bool | None:
    """A reply's correlation id: None when it has none, False when it has one nobody could
    have sent (not UTF-8 text, or two different ones)."""
    values = {v for k, v in (headers or ()) if k == "correlation-id"}
    if not values:
        return None
    if len(values) > 1:
        return False
    (value,) = values
    if not isinstance(value, bytes | bytearray):
        return False
    try:
        return value.decode()
    except UnicodeDecodeError:
        return False


class SyncRecommendClient:
    """``RecommendClient`` on a private event loop thread, for synchronous code."""

    def __init__(self, bootstrap_servers: str, **kwargs) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="recommend"
        )
        self._thread.start()
        self.client = RecommendClient(bootstrap_servers, **kwargs)
        self._call(self.client.start(), 30)

    def _call(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def recommend(self, user_id: str, k: int = 20, **kwargs) -> RecommendReply:
        timeout = kwargs.get("timeout_s") or self.client.timeout_s
        return self._call(self.client.recommend(user_id, k, **kwargs), timeout + 5)

    @property
    def stats(self) -> ClientStats:
        return self.client.stats

    def close(self) -> None:
        try:
            self._call(self.client.stop(), 30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> SyncRecommendClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
