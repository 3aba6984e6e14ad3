"""Every Kafka client setting FreshRec uses, in one place.

The timings differ per broker, so they come in profiles (``PROFILES``; the variable
``FRESHREC_KAFKA_PROFILE`` names one, and the embedded stack's ``stack.env`` names the one
that suits the broker it started):

- ``production`` (the default): Apache Kafka in a cluster. Longer sessions (fewer spurious
  rebalances); fetches wait up to 100 ms, since Apache Kafka answers a waiting fetch as soon
  as data arrives anyway.
- ``kafka``: Apache Kafka on this machine (``freshrec stack up`` where Java runs it). The
  same fetches; a 6 s session (the least Apache Kafka accepts by default) with 500 ms
  heartbeats, so a member that dies is replaced, and a rebalance is noticed, within seconds;
  metadata refreshed every few seconds, so a topic created on a laptop is seen soon.
- ``tansu``: the embedded Tansu broker, whose quirks (``docs/brokers.md``) ask for more: a
  group join takes about half of ``session.timeout.ms``, and a waiting fetch is only
  answered when ``fetch.wait.max.ms`` runs out, so both are short (5-20 ms fetch waits are
  also every round trip's floor there). ``local`` is its former name.

Consumer groups run the classic protocol, or KIP-848's where ``FRESHREC_KAFKA_GROUP_PROTOCOL``
says ``consumer`` (``group_config``: the broker then owns the session and the assignment, and
rebalances hand partitions over incrementally, ``take_assignment``).

Keyed producers always use ``murmur2_random`` so a key lands on the partition the Java client
and kafkajs would choose: ``events`` and ``recommend.requests`` must agree on a user's partition.

>>> cfg = consumer_config(ConnectionSettings("k:9092", "redis://r", kafka_profile="tansu"), "g1")
>>> cfg["session.timeout.ms"], cfg["fetch.wait.max.ms"], cfg["partition.assignment.strategy"]
(6000, 5, 'range')
>>> consumer_config(ConnectionSettings("k:9092", "redis://r"), "g1")["session.timeout.ms"]
45000
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from typing import Any

from confluent_kafka import Consumer, KafkaError

from freshcore.logrepeat import hold_repeats
from freshcore.settings import ConnectionSettings, SettingsError
from freshcore.topics import metadata
from schemas.errors import FreshRecError

REBOOTSTRAP_AFTER_MS = 10_000
"""How long a producer or consumer goes without metadata from any broker before it asks
``bootstrap.servers`` again (librdkafka's ``metadata.recovery.rebootstrap.trigger.ms``, 5 min
by default). A broker frozen longer than its controller's ``broker.session.timeout.ms`` (9 s)
is fenced when it comes back, and for a moment the metadata lists no broker: a client that
refreshed its metadata then forgot every broker, and in the broker-pause drill on one Apache
Kafka node (``tests/test_faults_e2e.py``) the parameter server's consumer stood still until
the end (a rejoin it could not send: "no broker available for coordinator query")."""

#: librdkafka's own lines from FreshRec's producers and consumers, through Python's logging
#: (``freshrec.librdkafka``, served when the client is polled) instead of straight to stderr,
#: each kind at most once per 30 s: with no broker answering, librdkafka logs every refused
#: connection, ~19 lines a second from each consumer (``logrepeat``)
CLIENT_LOG = logging.getLogger("freshrec.librdkafka")
CLIENT_LOG_REPEATS = hold_repeats([CLIENT_LOG])


@dataclass(frozen=True)
class ClientProfile:
    """The timing knobs that differ between brokers."""

    session_timeout_ms: int
    heartbeat_interval_ms: int
    fetch_wait_max_ms: int
    """How long a fetch waits for data; on Tansu also the floor of every round trip."""
    producer_linger_ms: int
    background_fetch_wait_ms: int
    """Fetch wait of consumers off the request path (gradients, the broadcast): on Tansu each
    idle consumer costs broker CPU per fetch, so these poll less often."""
    worker_fetch_wait_ms: int
    """Fetch wait of the worker's events-and-requests consumer. It reads both the request path
    and the event stream; on Tansu, whose fetches cost CPU in proportion to the record batches
    the fetched partitions hold, its fetch rate shows in the event lag's tail (5 → 10 ms:
    docs/operations.md)."""
    metadata_max_age_ms: int
    topic_metadata_refresh_ms: int


TANSU = ClientProfile(
    session_timeout_ms=6000,
    heartbeat_interval_ms=500,
    fetch_wait_max_ms=5,
    producer_linger_ms=2,
    background_fetch_wait_ms=20,
    # 10, not 5: at 5,000 events/s the worker's local lag p99 was 43-48 ms against 57-67
    # at 5 (three alternating runs each, tools/bench_learning --only lag); a request waits
    # up to 5 ms longer at an idle worker (docs/benchmarks.md)
    worker_fetch_wait_ms=10,
    metadata_max_age_ms=30_000,
    topic_metadata_refresh_ms=5_000,
)

PROFILES: dict[str, ClientProfile] = {
    "production": ClientProfile(
        session_timeout_ms=45_000,
        heartbeat_interval_ms=3_000,
        fetch_wait_max_ms=100,
        producer_linger_ms=5,
        background_fetch_wait_ms=100,
        worker_fetch_wait_ms=100,  # Apache Kafka answers a waiting fetch when data arrives
        metadata_max_age_ms=300_000,
        topic_metadata_refresh_ms=300_000,
    ),
    "kafka": ClientProfile(
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
        fetch_wait_max_ms=100,
        producer_linger_ms=2,
        background_fetch_wait_ms=100,
        worker_fetch_wait_ms=100,
        metadata_max_age_ms=30_000,
        topic_metadata_refresh_ms=5_000,
    ),
    "tansu": TANSU,
    "local": TANSU,  # the former name of ``tansu``, still accepted
}


def profile(conn: ConnectionSettings) -> ClientProfile:
    """The connection's profile, with its session timeout where the settings give one (the
    heartbeat then at most a third of it).

    >>> profile(ConnectionSettings("k:9092", "r", kafka_session_timeout_ms=3000)).heartbeat_interval_ms
    1000
    """
    try:
        p = PROFILES[conn.kafka_profile]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise SettingsError(
            f"FRESHREC_KAFKA_PROFILE={conn.kafka_profile!r} is unknown (known: {known})"
        ) from None
    session = conn.kafka_session_timeout_ms
    if session is None:
        return p
    return replace(
        p,
        session_timeout_ms=session,
        heartbeat_interval_ms=min(p.heartbeat_interval_ms, session // 3),
    )


def admin_config(conn: ConnectionSettings, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"bootstrap.servers": conn.kafka_bootstrap_servers, "logger": CLIENT_LOG}
    cfg.update(conn.kafka_security.librdkafka())
    cfg.update(overrides)
    return cfg


def producer_config(conn: ConnectionSettings, **overrides: Any) -> dict[str, Any]:
    """An idempotent producer partitioning keys like the Java client (murmur2)."""
    p = profile(conn)
    cfg: dict[str, Any] = {
        "bootstrap.servers": conn.kafka_bootstrap_servers,
        "partitioner": "murmur2_random",
        "enable.idempotence": True,
        "linger.ms": p.producer_linger_ms,
        "compression.type": "none",
        "topic.metadata.refresh.interval.ms": p.topic_metadata_refresh_ms,
        "metadata.max.age.ms": p.metadata_max_age_ms,
        "metadata.recovery.rebootstrap.trigger.ms": REBOOTSTRAP_AFTER_MS,
        "logger": CLIENT_LOG,
    }
    if conn.message_timeout_ms is not None:
        cfg["message.timeout.ms"] = conn.message_timeout_ms
    cfg.update(conn.kafka_security.librdkafka())
    cfg.update(overrides)
    return cfg


def consumer_config(
    conn: ConnectionSettings,
    group_id: str | None,
    *,
    background: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    """A consumer; ``group_id=None`` makes a group-less one for ``assign()`` (broadcast reads);
    ``background`` ones (off the request path) use the profile's longer fetch wait."""
    p = profile(conn)
    cfg: dict[str, Any] = {
        "bootstrap.servers": conn.kafka_bootstrap_servers,
        "fetch.wait.max.ms": p.background_fetch_wait_ms if background else p.fetch_wait_max_ms,
        "enable.auto.commit": False,
        # no offset to resume from, or one retention has deleted: the oldest record kept
        # (what a reset skips is counted where a service is assigned: freshcore/resets.py)
        "auto.offset.reset": "earliest",
        # librdkafka stops fetching a partition whose prefetched queue is full
        # (queued.min.messages) and looks again only after this long, 1 s by default: a
        # worker working off a backlog, which pauses and resumes its event partitions, stood
        # still for ~1 s at a time and learnt 45k events/s instead of ~100k (scratch runs of
        # tools/bench_learning's event path, 150,000 events).
        "fetch.queue.backoff.ms": 20,
        "topic.metadata.refresh.interval.ms": p.topic_metadata_refresh_ms,
        "metadata.max.age.ms": p.metadata_max_age_ms,
        "metadata.recovery.rebootstrap.trigger.ms": REBOOTSTRAP_AFTER_MS,
        "logger": CLIENT_LOG,
    }
    if group_id is not None:
        cfg.update(group_config(conn, group_id, p))
    else:
        # librdkafka wants a group.id even for assign()-only consumers; it never joins it.
        cfg["group.id"] = "freshrec-unjoined"
    cfg.update(conn.kafka_security.librdkafka())
    cfg.update(overrides)
    return cfg


def group_config(conn: ConnectionSettings, group_id: str, p: ClientProfile) -> dict[str, Any]:
    """A group member's settings under the connection's group protocol. Range either way: it
    gives a member the same partition numbers of every co-partitioned topic it subscribes
    to, so a user's clicks and requests meet in one process. Under KIP-848's ``consumer``
    protocol the broker assigns (``group.remote.assignor``) and owns the session and the
    heartbeat (``group.consumer.session.timeout.ms``, ``group.consumer.heartbeat.interval.ms``):
    librdkafka refuses ``session.timeout.ms``, ``heartbeat.interval.ms`` and
    ``partition.assignment.strategy`` there, so they are left out.

    >>> conn = ConnectionSettings("k:9092", "r", kafka_group_protocol="consumer")
    >>> group_config(conn, "g1", profile(conn))
    {'group.id': 'g1', 'group.protocol': 'consumer', 'group.remote.assignor': 'range'}
    """
    if conn.kafka_group_protocol == "consumer":
        return {
            "group.id": group_id,
            "group.protocol": "consumer",
            "group.remote.assignor": "range",
        }
    return {
        "group.id": group_id,
        "session.timeout.ms": p.session_timeout_ms,
        "heartbeat.interval.ms": p.heartbeat_interval_ms,
        "partition.assignment.strategy": "range",
    }


def incremental(conn: ConnectionSettings) -> bool:
    """Whether the connection's groups rebalance incrementally (KIP-848's ``consumer``
    protocol always does): an assign or revoke callback is then handed only the partitions
    added or taken away, not the whole assignment (the classic range assignor is eager)."""
    return conn.kafka_group_protocol == "consumer"


def take_assignment(consumer, partitions: list, conn: ConnectionSettings) -> None:
    """Start reading ``partitions`` (with the offsets set on them) from an assign callback:
    under an eager protocol they are the whole new assignment (``assign``); under an
    incremental one only the partitions added (``incremental_assign``), where ``assign``
    would drop the partitions the member keeps."""
    if incremental(conn):
        consumer.incremental_assign(partitions)
    else:
        consumer.assign(partitions)


def aiokafka_consumer_kwargs(conn: ConnectionSettings) -> dict[str, Any]:
    """The same timings for aiokafka-based clients (faust)."""
    p = profile(conn)
    return {
        "session_timeout_ms": p.session_timeout_ms,
        "heartbeat_interval_ms": p.heartbeat_interval_ms,
        "fetch_max_wait_ms": p.fetch_wait_max_ms,
    }


def lag_statistics(group: str) -> dict[str, Any]:
    """Consumer settings that export consumer lag per partition to
    ``freshrec_consumer_lag_messages``, computed by librdkafka from its own fetch responses
    (the embedded broker's ListOffsets answers are wrong, so lag is never asked for)."""
    import json

    from freshcore import metrics as m

    def on_stats(raw: str) -> None:
        try:
            stats = json.loads(raw)
        except ValueError:
            return
        for topic, t in stats.get("topics", {}).items():
            for pid, p in t.get("partitions", {}).items():
                if pid == "-1":
                    continue
                # what the application has been handed vs the partition end the last fetch
                # saw; librdkafka's own consumer_lag needs Kafka-committed offsets, which
                # services keeping their offsets in Redis never write
                hi, app = p.get("hi_offset", -1), p.get("app_offset", -1)
                lag = hi - app if hi >= 0 and app >= 0 else p.get("consumer_lag", -1)
                if lag is not None and lag >= 0:
                    m.CONSUMER_LAG.labels(group, topic, pid).set(lag)

    return {"statistics.interval.ms": 1000, "stats_cb": on_stats}


def consume_available(consumer, n: int, timeout_s: float) -> list:
    """Up to ``n`` messages, returned as soon as there is one (or after ``timeout_s`` with
    none). librdkafka's batch consume, ``consume(n, timeout)``, returns only when ``n`` have
    arrived or the whole timeout has passed — one message produced 10 ms into a 1 s timeout
    came back after 1,002 ms — so at a steady trickle every message waited out the timeout
    in the local queue. Here: what is queued already, at once; else ``poll``, which returns
    with the first message, and whatever queued behind it."""
    msgs = consumer.consume(n, 0)
    if msgs or timeout_s <= 0:
        return msgs
    first = consumer.poll(timeout_s)
    if first is None:
        return []
    return [first, *consumer.consume(n - 1, 0)] if n > 1 else [first]


def consume_batch(
    consumer, batch_max: int, timeout_s: float, what: str, *, fill: bool = False
) -> list:
    """Up to ``batch_max`` messages, without the error events: a partition EOF is dropped
    silently, any other error logged with ``what`` (the topic's role). Back with the first
    message (``consume_available``), or with ``fill`` once ``batch_max`` are in or
    ``timeout_s`` has passed (librdkafka's batch consume: a linger, for stages whose cost is
    per batch)."""
    if fill:
        msgs = consumer.consume(batch_max, timeout_s)
    else:
        msgs = consume_available(consumer, batch_max, timeout_s)
    good = []
    for msg in msgs:
        err = msg.error()
        if err is None:
            good.append(msg)
        elif err.code() != KafkaError._PARTITION_EOF:
            logging.getLogger("freshcore.kafka").warning("%s consumer error: %s", what, err)
    return good


def background_consumer(conn: ConnectionSettings, group: str, role: str, **overrides: Any):
    """A group consumer off the request path (``{prefix}{group}``, the profile's background
    fetch wait) that reports its lag as ``role`` (``lag_statistics``)."""
    group_id = f"{conn.topic_prefix}{group}"
    cfg = consumer_config(conn, group_id, background=True, **overrides, **lag_statistics(role))
    return Consumer(cfg)


def close_producer(producer, timeout_s: float) -> int:
    """Flush, then close the producer if nothing is left undelivered; returns what is left.
    A producer left open after its broker stops logs failed reconnects until the process
    exits; one still holding messages is left to the process's exit (closing it would wait
    for them)."""
    left = producer.flush(timeout_s)
    if not left:
        producer.close()
    return left


def produce(
    producer,
    topic: str,
    value: bytes | None,
    key: bytes | None = None,
    *,
    partition: int | None = None,
    headers=None,
    on_delivery=None,
) -> None:
    """``producer.produce``, waiting for deliveries to drain while librdkafka's local queue
    is full (``BufferError``) instead of failing. Other errors (a message the client
    refuses, an invalid topic name: ``KafkaException``) are the caller's to handle."""
    kwargs: dict[str, Any] = {"value": value, "key": key}
    if partition is not None:
        kwargs["partition"] = partition
    if headers:
        kwargs["headers"] = headers
    if on_delivery is not None:
        kwargs["on_delivery"] = on_delivery
    while True:
        try:
            producer.produce(topic, **kwargs)
            return
        except BufferError:
            producer.poll(0.05)


_TRANSIENT_DELIVERY = frozenset(
    {
        KafkaError._MSG_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NOT_LEADER_FOR_PARTITION,
    }
)


def delivery_retriable(err) -> bool:
    """Whether a failed delivery may pass on its own (a timeout, a broker away): the same
    message produced again may be delivered (``freshcore/retry.py``)."""
    code = err.code() if hasattr(err, "code") else None
    return code in _TRANSIENT_DELIVERY or bool(getattr(err, "retriable", lambda: False)())


class ProducerFailed(FreshRecError, RuntimeError):
    """A producer reported a fatal error (e.g. an idempotent producer fenced by the broker):
    it can deliver nothing more. The worker exits; restarted, it resumes from its committed
    offsets, so the events behind the undelivered messages are learnt again."""


class TopicMissing(FreshRecError, RuntimeError):
    """A topic a service needs does not exist (``freshrec topics create`` makes them)."""


def partition_count(client, topic: str, timeout_s: float = 15.0) -> int:
    """How many partitions ``topic`` has, read from ``client`` (a producer, consumer or admin
    client). All topics' metadata is asked for: a request naming one topic may create it on a
    broker that auto-creates topics."""
    found = metadata(client, timeout_s).topics.get(topic)
    if found is None or found.error is not None or not found.partitions:
        raise TopicMissing(f"topic {topic} is missing: run `freshrec topics create` first")
    return len(found.partitions)


def gradients_partitions(conn: ConnectionSettings, env=None, timeout_s: float = 10.0) -> int:
    """How many partitions ``gradients`` has: the broker's count where the topic exists,
    else the count ``freshrec topics create`` would give it (``FRESHREC_PARTITIONS`` or the
    catalogue's). Rows in Redis are laid out by it (``freshcore.rowstore.row_shards``)."""
    import os

    from confluent_kafka.admin import AdminClient

    from freshcore.topics import BY_NAME, TopicNames, partitions_from_env

    name = TopicNames(conn.topic_prefix).gradients
    with contextlib.suppress(TopicMissing):
        return partition_count(AdminClient(admin_config(conn)), name, timeout_s)
    overrides = partitions_from_env(os.environ if env is None else env)
    return overrides.get("gradients", BY_NAME["gradients"].partitions)
