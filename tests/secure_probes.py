"""What the secure broker lets a principal do, asked of the broker itself: for each topic,
whether a record it produces is taken (WRITE), whether a fetch is answered (READ), whether
it may create a topic or delete one. A refusal counts only as the broker's authorization
error (``TOPIC_AUTHORIZATION_FAILED``); any other failure fails the probe, so that a broker
that is merely slow or a topic that is missing never passes for a refusal.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

DEADLINE_S = 90.0
REFUSED = KafkaError.TOPIC_AUTHORIZATION_FAILED


class ProbeFailed(AssertionError):
    """The broker neither allowed nor refused: another error, or no answer in time."""


def _verdict(topic: str, op: str, err) -> bool:
    """True: allowed; False: refused for want of a grant; else ``ProbeFailed``."""
    if err is None:
        return True
    if not isinstance(err, KafkaError) and err.args and isinstance(err.args[0], KafkaError):
        err = err.args[0]  # a KafkaException from an admin call
    if isinstance(err, KafkaError) and err.code() == REFUSED:
        return False
    raise ProbeFailed(f"{op} {topic}: neither allowed nor refused: {err}")


def writes(config: dict, topics: Iterable[str]) -> dict[str, bool]:
    """Whether a record produced to each topic is taken (one record each, with a key)."""
    answers: dict[str, object] = {}
    producer = Producer({**config, "linger.ms": 0, "message.timeout.ms": int(DEADLINE_S * 1000)})
    topics = list(topics)
    for topic in topics:
        producer.produce(
            topic, b"{}", b"probe", on_delivery=lambda err, msg, t=topic: answers.setdefault(t, err)
        )
    producer.flush(DEADLINE_S)
    producer.close()
    missing = set(topics) - set(answers)
    if missing:
        raise ProbeFailed(f"no delivery report for {sorted(missing)} in {DEADLINE_S:.0f}s")
    return {t: _verdict(t, "WRITE", answers[t]) for t in topics}


def reads(config: dict, topics: Iterable[str], group: str) -> dict[str, bool]:
    """Whether a fetch of each topic's partition 0 is answered (a record, or its end). A
    principal without even DESCRIBE on a topic is refused its metadata (a consumer assigned
    it would wait in silence), so that is asked first."""
    consumer = Consumer(
        {**config, "group.id": group, "enable.auto.commit": False, "enable.partition.eof": True}
    )
    topics = list(topics)
    answers: dict[str, object] = {}
    try:
        for topic in topics:
            err = consumer.list_topics(topic, timeout=DEADLINE_S).topics[topic].error
            if err is not None:
                answers[topic] = err
        fetched = [t for t in topics if t not in answers]
        consumer.assign([TopicPartition(t, 0, OFFSET_BEGINNING) for t in fetched])
        deadline = time.monotonic() + DEADLINE_S
        while set(answers) != set(topics) and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or msg.topic() is None:
                continue  # e.g. the group's coordinator refused: this consumer never joins
            err = msg.error()
            ended = err is not None and err.code() == KafkaError._PARTITION_EOF
            answers.setdefault(msg.topic(), None if err is None or ended else err)
    finally:
        consumer.close()
    missing = set(topics) - set(answers)
    if missing:
        raise ProbeFailed(f"no fetch answered for {sorted(missing)} in {DEADLINE_S:.0f}s")
    return {t: _verdict(t, "READ", answers[t]) for t in topics}


def creates(config: dict, topics: Iterable[str]) -> dict[str, bool]:
    """Whether each (new) topic may be created: created, or refused."""
    admin = AdminClient(config)
    futures = admin.create_topics([NewTopic(t, 1) for t in topics], operation_timeout=30)
    return {t: _verdict(t, "CREATE", _exception(f)) for t, f in futures.items()}


def deletes(config: dict, topics: Iterable[str]) -> dict[str, bool]:
    """Whether each topic may be deleted: deleted (so only topics the test may lose), or
    refused."""
    admin = AdminClient(config)
    futures = admin.delete_topics(list(topics), operation_timeout=30)
    return {t: _verdict(t, "DELETE", _exception(f)) for t, f in futures.items()}


def _exception(future):
    try:
        future.result(DEADLINE_S)
    except Exception as exc:
        return exc
    return None


def first_error(config: dict, timeout_s: float = 30.0) -> KafkaError | None:
    """The first error a client with ``config`` meets on asking for metadata (its error
    callback, served by polling: librdkafka reports a refused login there within a second,
    while ``list_topics`` alone would wait out its timeout); None if metadata came back."""
    errors: list[KafkaError] = []
    admin = AdminClient({**config, "error_cb": errors.append})
    deadline = time.monotonic() + timeout_s
    while not errors and time.monotonic() < deadline:
        admin.poll(0.1)
        try:
            admin.list_topics(timeout=0.5)
            return None
        except Exception:
            pass
    admin.poll(0.1)
    if not errors:
        raise ProbeFailed(f"no metadata and no error within {timeout_s:.0f}s")
    return errors[0]


def joins(config: dict, group: str, topic: str) -> int | None:
    """The error code a member of ``group`` subscribing to ``topic`` meets first (None: it
    joined and was assigned partitions)."""
    assigned: list = []
    consumer = Consumer({**config, "group.id": group, "enable.auto.commit": False})
    try:
        consumer.subscribe([topic], on_assign=lambda c, parts: assigned.extend(parts))
        deadline = time.monotonic() + DEADLINE_S
        while not assigned and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            err = msg.error() if msg is not None else None
            if err is not None and err.code() != KafkaError._PARTITION_EOF:
                return err.code()
    finally:
        consumer.close()
    if not assigned:
        raise ProbeFailed(f"joining {group} neither succeeded nor failed in {DEADLINE_S:.0f}s")
    return None
