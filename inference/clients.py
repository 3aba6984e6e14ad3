"""The worker's connections to Kafka and Redis, built at the edge (``run_worker``) and passed
into ``Worker``: a test about the worker's logic can pass doubles instead (the real-broker
tests pass these)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
from confluent_kafka import Consumer, Producer

from freshcore.kafka import consumer_config, lag_statistics, producer_config, profile
from freshcore.redisconn import connect
from inference.settings import WorkerSettings


def events_consumer_config(settings: WorkerSettings, group: str) -> dict[str, Any]:
    """The config of the worker's consumer of ``events`` and ``recommend.requests``: a group
    member with the worker's fetch wait (its setting, else the Kafka profile's)."""
    fetch_wait = settings.fetch_wait_ms
    if fetch_wait is None:
        fetch_wait = profile(settings.conn).worker_fetch_wait_ms
    return consumer_config(
        settings.conn, group, **{"fetch.wait.max.ms": fetch_wait}, **lag_statistics("workers")
    )


def worker_group(settings: WorkerSettings) -> str:
    return f"{settings.conn.topic_prefix}freshrec-workers"


@dataclass
class WorkerClients:
    """The worker's connections to Redis and Kafka."""

    redis: redis.Redis
    """A single server's client or a cluster's (``freshcore.redisconn``)."""
    producer: Producer
    """Replies, dead letters and gradients."""
    events: Consumer
    """The group member reading ``events`` and ``recommend.requests``."""
    updates: Consumer
    """Group-less: every partition of ``embeddings.updates``."""

    @classmethod
    def connect(cls, settings: WorkerSettings) -> WorkerClients:
        conn = settings.conn
        return cls(
            # a stopped Redis must fail calls quickly (serving degrades, learning waits)
            # instead of hanging the loop that also answers requests
            redis=connect(
                conn.redis_url,
                socket_timeout=settings.redis_timeout_s,
                socket_connect_timeout=settings.redis_timeout_s,
            ),
            producer=Producer(producer_config(conn)),
            events=Consumer(events_consumer_config(settings, worker_group(settings))),
            updates=Consumer(consumer_config(conn, None, background=True)),
        )
