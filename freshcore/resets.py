"""What a consumer skips when the offset it resumes from is no longer retained.

Every FreshRec consumer resets to the earliest retained offset (``auto.offset.reset=earliest``,
``freshcore/kafka.py``): a partition with no offset to resume from is read from its start,
and one whose offset (its group's committed offset; the parameter server's applied offset in
Redis, plus one) lies below the partition's log start offset, because the broker's retention
(``retention.ms``, ``retention.bytes``) deleted the segments holding it while no one read
them, resumes at the log start. The messages in between are gone unread. librdkafka resets on
its own and says so only in a log line; ``count_resets``, called from a consumer's assign
callback, asks the broker for the log start offset of each partition that resumes from an
offset, counts the difference where the log start is the higher
(``freshrec_consumer_skipped_messages_total{group,topic}``) and logs one line per partition.

Counted at assignment, against the log start offset then: messages the broker deletes between
that answer and the consumer's first fetch (milliseconds) are skipped uncounted, and so are
those deleted ahead of a consumer that falls behind the retention while it reads (librdkafka
resets it at that fetch, with no assignment to count it at).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition

from freshcore import metrics as m

log = logging.getLogger("freshcore.resets")
Partition = tuple[str, int]
"""(topic, partition)."""
ASK_TIMEOUT_S = 5.0
"""How long an assign callback waits for each answer (the committed offsets, the log
starts); a broker that does not answer in time leaves the reset uncounted, not the group
waiting."""


def skipped_by_reset(
    starts: Mapping[Partition, int], log_starts: Mapping[Partition, int]
) -> dict[Partition, int]:
    """Per partition, the messages a reset to the earliest offset skips: from the offset it
    was to resume from up to the log start offset, where that is the higher. A partition
    with no offset to resume from (negative: none committed, or the client's "beginning")
    is read from its start and skips nothing; so does one whose log start is unknown.

    >>> skipped_by_reset(
    ...     {("events", 0): 3, ("events", 1): 40, ("events", 2): -1001, ("events", 3): 5},
    ...     {("events", 0): 20, ("events", 1): 20, ("events", 2): 20},
    ... )
    {('events', 0): 17}
    """
    return {
        key: log_starts[key] - start
        for key, start in starts.items()
        if 0 <= start < log_starts.get(key, -1)
    }


def committed_offsets(consumer, parts: list[TopicPartition]) -> dict[Partition, int]:
    """The group's committed offset of each of ``parts`` (negative where it has none)."""
    found = consumer.committed(parts, timeout=ASK_TIMEOUT_S)
    return {(tp.topic, tp.partition): tp.offset for tp in found}


def log_start_offsets(consumer, keys: list[Partition]) -> dict[Partition, int]:
    """Each partition's log start offset, the broker's answer now. A ListOffsets request for
    the protocol's "earliest" timestamp (-2, ``OFFSET_BEGINNING``) answers every partition of
    a leader at once, where ``get_watermark_offsets`` asks one partition at a time."""
    asked = [TopicPartition(t, p, OFFSET_BEGINNING) for t, p in keys]
    found = consumer.offsets_for_times(asked, timeout=ASK_TIMEOUT_S)
    return {(tp.topic, tp.partition): tp.offset for tp in found if tp.error is None}


def count_resets(
    consumer,
    group: str,
    parts: list[TopicPartition],
    starts: Mapping[Partition, int] | None = None,
) -> dict[Partition, int]:
    """In ``consumer``'s assign callback: the messages each of ``parts`` skips by resuming at
    its log start offset (``skipped_by_reset``), counted under ``group`` and logged. Where
    ``starts`` (partition -> the offset it resumes from) is not given, the group's committed
    offsets are. Returns what was counted; a broker that does not answer counts nothing."""
    try:
        if starts is None:
            starts = committed_offsets(consumer, parts)
        asked = [key for key, start in starts.items() if start >= 0]
        if not asked:
            return {}
        skipped = skipped_by_reset(starts, log_start_offsets(consumer, asked))
    except KafkaException as exc:
        log.warning(
            "%s: could not read the offsets of its new partitions (%s); a reset past messages "
            "retention deleted would go uncounted",
            group,
            exc,
        )
        return {}
    for (topic, partition), n in sorted(skipped.items()):
        m.CONSUMER_SKIPPED.labels(group, topic).inc(n)
        log.warning(
            "%s: %s [%d] resumes at its log start offset %d: the %d messages from offset %d "
            "were deleted by the broker's retention unread",
            group,
            topic,
            partition,
            starts[(topic, partition)] + n,
            n,
            starts[(topic, partition)],
        )
    return skipped
