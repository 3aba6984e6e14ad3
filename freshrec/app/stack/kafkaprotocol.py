"""What the stack asks of its broker over the Kafka protocol before it says it is up: that
every broker is in the metadata, and (Apache Kafka) that a group coordinator answers; after a
restart on its storage, that every partition it had answers again."""

from __future__ import annotations

import contextlib
import time

from freshrec.app.stack.errors import StackError


def wait_for_brokers(bootstrap: str, brokers: int, timeout_s: float) -> None:
    """Until the metadata at ``bootstrap`` lists ``brokers`` brokers."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = len(admin.list_topics(timeout=max(0.5, deadline - time.monotonic())).brokers)
        except Exception as exc:
            raise StackError(f"the broker at {bootstrap} did not answer metadata: {exc}") from None
        if found >= brokers:
            return
        if time.monotonic() > deadline:
            raise StackError(f"{found} of {brokers} brokers at {bootstrap} within {timeout_s}s")
        time.sleep(0.1)


def wait_for_partitions(bootstrap: str, timeout_s: float) -> None:
    """Until every partition in the metadata at ``bootstrap`` answers for its latest offset.
    An Apache Kafka node started again on its storage lists itself as its partitions' leader
    before it has taken the leadership up: with 100 partitions on one node, reads were
    answered ``NOT_LEADER_FOR_PARTITION`` for 0.6 s after it served."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient, OffsetSpec

    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout_s
    while True:
        wait_s = max(0.5, deadline - time.monotonic())
        topics = admin.list_topics(timeout=wait_s).topics
        asked = {
            TopicPartition(t, q): OffsetSpec.latest() for t in topics for q in topics[t].partitions
        }
        failure = None
        if asked:
            for tp, answer in admin.list_offsets(asked, request_timeout=wait_s).items():
                try:
                    answer.result()
                except Exception as exc:
                    failure = f"{tp.topic} [{tp.partition}]: {exc}"
                    break
        if failure is None:
            return
        if time.monotonic() > deadline:
            raise StackError(
                f"a partition at {bootstrap} did not answer within {timeout_s}s: {failure}"
            )
        time.sleep(0.1)


def warm_group_coordinator(bootstrap: str, timeout_s: float) -> None:
    """Ask a group's committed offsets once, so Apache Kafka creates and loads its offsets
    topic now: the first group join on a fresh broker otherwise takes 1-4 s longer."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "freshrec-stack-warm-up", "logger": _quiet}
    )
    try:
        with contextlib.suppress(Exception):  # a slow coordinator is no failure of the stack
            consumer.committed([TopicPartition("freshrec-stack-warm-up", 0)], timeout=timeout_s)
    finally:
        consumer.close()


class _Quiet:
    """A logger for librdkafka's lines while the coordinator loads: none of them matter."""

    def log(self, *args, **kwargs) -> None:
        pass


_quiet = _Quiet()
