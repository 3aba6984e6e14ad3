"""The topic catalogue (DESIGN §2) and idempotent provisioning.

>>> names = TopicNames("t1.")
>>> names.events, names.recommend_requests
('t1.events', 't1.recommend.requests')
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from freshcore.declare import Setting
from freshcore.outage import STOP_SIGNALLED, StopRequested
from schemas.errors import FreshRecError, RetriableError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TopicSpec:
    """One topic of the catalogue."""

    name: str
    """Logical name; the deployed name is ``prefix + name``."""
    key: str
    """What the record key is; keyed topics use murmur2 partitioning."""
    partitions: int
    writers: str
    readers: str
    configs: Mapping[str, str] = field(default_factory=dict)
    """Configs a real Kafka honours; the embedded broker accepts and ignores them."""


# events and recommend.requests MUST have the same partition count: the range assignor then
# gives each worker the same partition numbers of both, so a user's click and the user's next
# request are handled by the same process.
CO_PARTITIONED = ("events", "recommend.requests")

CATALOGUE: tuple[TopicSpec, ...] = (
    TopicSpec("events", "user_id", 8, "any producer", "streams app, workers"),
    TopicSpec("events.dlq", "none", 1, "streams app", "operators"),
    TopicSpec(
        "items",
        "item_id",
        4,
        "catalogue producer",
        "streams app, workers",
        {"cleanup.policy": "compact"},
    ),
    TopicSpec("recommend.requests", "user_id", 8, "clients", "workers"),
    TopicSpec("recommend.requests.dlq", "none", 1, "workers", "operators"),
    TopicSpec("recommend.replies", "correlation id", 8, "workers", "clients"),
    TopicSpec("gradients", "row id", 8, "workers", "parameter servers"),
    TopicSpec("embeddings.updates", "row shard", 4, "parameter servers", "every worker"),
    TopicSpec("hot.items", "scope (global / region)", 1, "streams app", "workers"),
    # The streams app's repartition of valid events by item: batches of compact records.
    TopicSpec("events.by_item", "none (explicit partition)", 8, "streams app", "streams app"),
    # The serving mode every worker serves in (inference/serving/modes.py): the newest wins.
    TopicSpec(
        "control",
        "mode",
        1,
        "operators (`freshrec mode set`)",
        "every worker",
        {"cleanup.policy": "compact"},
    ),
)

BY_NAME: dict[str, TopicSpec] = {spec.name: spec for spec in CATALOGUE}


class TopicNames:
    """Deployed topic names for one prefix; attribute names use underscores for dots."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        for spec in CATALOGUE:
            setattr(self, spec.name.replace(".", "_"), prefix + spec.name)

    events: str
    events_dlq: str
    items: str
    recommend_requests: str
    recommend_requests_dlq: str
    recommend_replies: str
    gradients: str
    embeddings_updates: str
    hot_items: str
    events_by_item: str
    control: str

    def full(self, logical: str) -> str:
        return self.prefix + BY_NAME[logical].name


class TopicMismatchError(FreshRecError, RuntimeError):
    """An existing topic's partition count differs from the catalogue."""


@dataclass(frozen=True)
class ProvisionReport:
    created: tuple[str, ...]
    existing: tuple[str, ...]


def catalogue_with(partitions: Mapping[str, int] | None = None) -> tuple[TopicSpec, ...]:
    """The catalogue with some partition counts overridden (tests use fewer partitions)."""
    if not partitions:
        return CATALOGUE
    unknown = set(partitions) - set(BY_NAME)
    if unknown:
        raise ValueError(f"unknown topics: {sorted(unknown)}")
    specs = tuple(
        TopicSpec(
            s.name, s.key, partitions.get(s.name, s.partitions), s.writers, s.readers, s.configs
        )
        for s in CATALOGUE
    )
    counts = {s.name: s.partitions for s in specs}
    if len({counts[n] for n in CO_PARTITIONED}) != 1:
        raise ValueError(f"{' and '.join(CO_PARTITIONED)} must have the same partition count")
    return specs


class BrokerUnreachable(RetriableError):
    """No Kafka broker answered a metadata request in time: none is running at the
    bootstrap address, or the client may not reach it."""


def metadata(client, timeout_s: float, topic: str | None = None):
    """``client.list_topics`` (a producer, consumer or admin client), a broker that does not
    answer raised as ``BrokerUnreachable``, which says what to check, instead of
    librdkafka's ``KafkaException`` (a service starting without its broker then exits
    with that line, not a traceback).

    The request runs on another thread: inside it the main thread could run no signal
    handler for up to ``timeout_s``, so a service told to stop while its broker is away
    (``STOP_SIGNALLED``) would have stopped only when the wait ran out, with status 2. It
    raises ``StopRequested`` at once instead, and says so once when the broker is slow to
    answer."""
    answer: Future = Future()

    def ask() -> None:
        try:
            answer.set_result(client.list_topics(topic, timeout=timeout_s))
        except BaseException as exc:  # handed to the caller below
            answer.set_exception(exc)

    threading.Thread(target=ask, daemon=True, name="kafka-metadata").start()
    start = time.monotonic()
    said = False
    while True:
        try:
            return answer.result(0.2)
        except FutureTimeout:
            if STOP_SIGNALLED.is_set():
                raise StopRequested("asked to stop while waiting for the Kafka broker") from None
            if not said and time.monotonic() - start >= 1.0:
                said = True
                log.info("no Kafka broker answered yet; waiting up to %g s", timeout_s)
        except KafkaException as exc:
            with contextlib.suppress(Exception):  # the client's log lines: why (held if repeated)
                client.poll(0)
            err = exc.args[0] if exc.args else exc
            reason = err.str() if isinstance(err, KafkaError) else str(err)
            raise BrokerUnreachable(
                f"no Kafka broker answered within {timeout_s:g} s ({reason}): is it running, "
                "and are KAFKA_BOOTSTRAP_SERVERS and KAFKA_SECURITY_PROTOCOL / KAFKA_SASL_* right?"
            ) from None


def ensure_topics(
    admin: AdminClient,
    prefix: str = "",
    specs: Iterable[TopicSpec] = CATALOGUE,
    timeout_s: float = 15.0,
) -> ProvisionReport:
    """Create missing topics; refuse when an existing one has another partition count.

    Idempotent: a second call creates nothing. Checks every existing topic before creating
    any, so a mismatch leaves the broker as it was. A topic another creator made meanwhile
    (the broker says it exists already: on Apache Kafka also one created a moment ago that
    its metadata did not show yet) is checked once it is visible.
    """
    specs = tuple(specs)
    found = metadata(admin, timeout_s).topics
    missing = [s for s in specs if _absent(found.get(prefix + s.name))]
    existing = [prefix + s.name for s in specs if s not in missing]
    _refuse_mismatches(found, prefix, specs)
    created: list[str] = []
    if missing:
        futures = admin.create_topics(
            [
                NewTopic(prefix + s.name, num_partitions=s.partitions, config=dict(s.configs))
                for s in missing
            ],
            operation_timeout=timeout_s,
            request_timeout=timeout_s,
        )
        for name, future in futures.items():
            try:
                future.result()
                created.append(name)
            except Exception as exc:  # raced with another creator: fine if it matches
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise
                existing.append(name)
        _wait_until_visible(admin, [prefix + s.name for s in missing], timeout_s)
        raced = [s for s in missing if prefix + s.name not in created]
        if raced:
            _refuse_mismatches(metadata(admin, timeout_s).topics, prefix, raced)
    if created:
        log.info("created topics: %s", ", ".join(created))
    return ProvisionReport(tuple(created), tuple(existing))


def _absent(topic) -> bool:
    return topic is None or topic.error is not None


def _refuse_mismatches(topics: Mapping, prefix: str, specs: Iterable[TopicSpec]) -> None:
    """``TopicMismatchError`` naming every topic of ``specs`` that exists with another
    partition count than the catalogue's."""
    problems = []
    for spec in specs:
        name, topic = prefix + spec.name, topics.get(prefix + spec.name)
        if not _absent(topic) and len(topic.partitions) != spec.partitions:
            have = len(topic.partitions)
            problems.append(f"{name} has {have} partitions, the catalogue says {spec.partitions}")
    if problems:
        raise TopicMismatchError(
            "; ".join(problems)
            + ". events and recommend.requests must stay co-partitioned: recreate the topic"
            " or set FRESHREC_PARTITIONS to match."
        )


def _wait_until_visible(admin: AdminClient, names: list[str], timeout_s: float) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        topics = metadata(admin, timeout_s).topics
        if all(n in topics and topics[n].error is None for n in names):
            return
        time.sleep(0.05)
    raise TimeoutError(f"topics not visible after {timeout_s}s: {names}")


SCALED_TOPICS = ("events", "recommend.requests", "recommend.replies", "gradients")


PARTITIONS = Setting(
    "FRESHREC_PARTITIONS",
    None,
    "The partition count of the keyed, scaled topics: "
    + ", ".join(f"`{t}`" for t in SCALED_TOPICS)
    + ".",
    kind=int,
    minimum=1,
    shown="the catalogue's",
)


def partitions_from_env(env: Mapping[str, str]) -> dict[str, int]:
    """``FRESHREC_PARTITIONS=N`` sets the partition count of the keyed, scaled topics."""
    n = PARTITIONS.read(env)
    return {} if n is None else dict.fromkeys(SCALED_TOPICS, n)
