"""The catalogue stage of ``freshrec streams``, on confluent-kafka batches.

Item records (``items``) are decoded with the ``schemas/`` codec; rejects go to
``events.dlq``; good ones are written to Redis (price, category, creation time, region, the
new-items index) and their prices handed to the count stage. A tombstone (the item id as key,
a null value) removes the item from all of those (``catalogue_log``); every write bumps
``items:version``, which tells the workers to reload the catalogue. It runs as a confluent-kafka batch
consumer (group ``{prefix}freshrec-streams-catalogue``) on a thread of the streams process, not
as a faust agent: faust's agents share one consumer, and an agent that lags stops delivery to
the others, so loading a 100k-item catalogue through faust (a few thousand records per second)
held the count stage still for tens of seconds. Offsets are committed after the Redis write
(at-least-once; writing an item twice is harmless).
"""

from __future__ import annotations

import queue
from collections.abc import Sequence

from confluent_kafka import Producer

from freshcore import clock
from freshcore import metrics as m
from freshcore.kafka import background_consumer, consume_batch, produce, producer_config
from freshcore.redisconn import connect
from freshcore.rediskeys import RedisKeys
from freshcore.service import Service
from freshcore.topics import TopicNames
from schemas.codec import dead_letter, decode_item, encode_dead_letter
from schemas.contract import Rejected
from schemas.records import Item
from streams.catalogue_log import final_ops, tombstone_item_id
from streams.settings import StreamsSettings
from streams.validate import SERVICE, log

CATALOGUE_FETCH_WAIT_MS = 500


def queue_catalogue(pipe, keys: RedisKeys, items: Sequence[Item], new_since_ms: int) -> None:
    """The Redis writes for some catalogue records, queued on ``pipe`` (sync or asyncio)."""
    pipe.hset(keys.item_price, mapping={i.item_id: i.price for i in items})
    pipe.hset(keys.item_category, mapping={i.item_id: i.category for i in items})
    pipe.hset(keys.item_created_ms, mapping={i.item_id: i.created_at_ms for i in items})
    regional = {i.item_id: i.region for i in items if i.region}
    if regional:
        pipe.hset(keys.item_region, mapping=regional)
    fresh = {i.item_id: i.created_at_ms for i in items if i.created_at_ms >= new_since_ms}
    if fresh:
        pipe.zadd(keys.new_items, fresh)
    pipe.zremrangebyscore(keys.new_items, "-inf", f"({new_since_ms}")


def queue_deletions(pipe, keys: RedisKeys, item_ids: Sequence[str]) -> None:
    """The Redis writes that remove items from the catalogue, queued on ``pipe``. Their
    features and decayed counts stay (the count stage owns them; an event for the item would
    write them again): the catalogue is what serving reads."""
    for key in (keys.item_price, keys.item_category, keys.item_created_ms, keys.item_region):
        pipe.hdel(key, *item_ids)
    pipe.zrem(keys.new_items, *item_ids)


class CatalogueStage(Service):
    name = "catalogue"
    beats = False  # a thread of the streams app, whose event loop beats

    def __init__(self, settings: StreamsSettings, prices: queue.SimpleQueue) -> None:
        self.settings = settings
        conn = settings.conn
        self.names = TopicNames(conn.topic_prefix)
        self.keys = RedisKeys(conn.topic_prefix)
        self.prices = prices
        """Where each batch's {item: price} goes, for the count stage's hot scores."""
        # Catalogue records are rare next to events; a long fetch wait keeps this consumer
        # from costing the broker a fetch every few milliseconds.
        self.consumer = background_consumer(
            conn,
            "freshrec-streams-catalogue",
            "streams-catalogue",
            **{"fetch.wait.max.ms": CATALOGUE_FETCH_WAIT_MS},
        )
        self.producer = Producer(producer_config(conn))
        self.redis = connect(conn.redis_url)

    def start(self) -> None:
        self.consumer.subscribe([self.names.items])

    def poll_once(self) -> None:
        good = consume_batch(self.consumer, self.settings.batch_max, 0.05, "items", fill=True)
        if good:
            with m.STREAMS_BATCH_SECONDS.labels("catalogue").time():
                self.process(good)
            # dead letters out before the offsets move past their records
            while self.producer.flush(1) and not self.stopping:
                log.warning("catalogue dead letters not delivered yet; waiting")
            if not self.stopping:
                self._commit()
        self.producer.poll(0)

    def close(self, clean: bool) -> None:
        self.consumer.close()

    def process(self, msgs) -> None:
        now = clock.now_ms()
        ops: list[tuple[str, Item | None]] = []
        for msg in msgs:
            value = msg.value()
            try:
                if value is None:  # a tombstone: delete the key's item
                    ops.append((tombstone_item_id(msg.key()), None))
                else:
                    item = decode_item(value, now, self.settings.limits)
                    ops.append((item.item_id, item))
            except Rejected as rej:
                m.DEAD_LETTERS.labels(str(rej.reason)).inc()
                letter = dead_letter(
                    rej,
                    topic=msg.topic(),
                    partition=msg.partition(),
                    offset=msg.offset(),
                    key=msg.key(),
                    value=msg.value(),
                    now_ms=now,
                    service=SERVICE,
                    limits=self.settings.dead_letters,
                )
                produce(self.producer, self.names.events_dlq, encode_dead_letter(letter))
        if not ops:
            return
        sets, deleted = final_ops(ops)  # the batch's last record of each item decides
        items = list(sets.values())

        def write() -> None:  # idempotent: sent again until Redis takes it
            pipe = self.redis.pipeline(transaction=False)
            if items:
                queue_catalogue(pipe, self.keys, items, now - self.settings.new_item_window_ms)
            if deleted:
                queue_deletions(pipe, self.keys, deleted)
            pipe.incr(self.keys.catalogue_version)
            pipe.execute()

        self.wait_for_redis(write, "writing the catalogue")
        if items:
            self.prices.put({i.item_id: i.price for i in items})
            m.CATALOGUE_RECORDS.inc(len(items))
        if deleted:
            m.CATALOGUE_DELETES.inc(len(deleted))
            log.info("catalogue: %d item(s) deleted by tombstones", len(deleted))

    def _commit(self) -> None:
        try:
            self.consumer.commit(asynchronous=False)
        except Exception as exc:  # a rebalance in flight: the next commit catches up
            log.info("catalogue commit skipped: %s", exc)
