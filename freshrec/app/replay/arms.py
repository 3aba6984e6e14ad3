"""One live arm of ``freshrec replay``: a log's replayed part through a whole FreshRec
pipeline (streams app, parameter server, worker, each its own process), asked about over the
public request/reply protocol.

Per arm, on a stack of its own (the embedded broker and Redis; or, with
``KAFKA_BOOTSTRAP_SERVERS``/``REDIS_URL``, topics and keys under a prefix of its own):
the topics are created, the starting rows trained on the log's training part are written to
Redis, the streams app (and the parameter server) start, the catalogue goes to ``items``,
and the training part's interactions to ``events`` (``_history``: the streams app counts
them, as it would have had it run through that part; the workers' group is committed past
them, so the worker does not learn again what its starting rows were trained on). Then the
worker starts, and once it lists the catalogue the steps run (``evaluation/protocol.py``):
the step's users ask for k items (their training-part items, the newest 1,000, in
``exclude``; ``exclude_seen`` for the rest), the lists are scored, the step's interactions
go to ``events`` as clicks (conversions stay conversions) stamped with their re-timed event
time, and the next step waits until the worker has read them.

Event times are the log's, moved onto the present: the replayed part starts now and runs
``speed`` times faster than it happened; a step never sends an event stamped in the future
(it waits), and a replay slower than its speed stamps events in the past.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from freshcore import clock
from freshcore.settings import ConnectionSettings, load_environment
from freshrec.app.stack import EmbeddedStack, external_services, free_port

log = logging.getLogger("freshrec.replay")

ARMS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    # the services an arm runs, and its settings
    "frozen": (
        ("streams", "param-server", "worker"),
        {"FRESHREC_LOCAL_LR": "0", "FRESHREC_LOCAL_USER_LR": "0", "FRESHREC_GLOBAL_LR": "0"},
    ),
    "local": (("streams", "worker"), {}),
    "full": (("streams", "param-server", "worker"), {}),
}
SERVING = {"FRESHREC_MMR_LAMBDA": "1.0"}
"""Every live arm serves by relevance alone, as the baselines do: the arms compare learners,
not diversity policies (``--set FRESHREC_MMR_LAMBDA=0.7`` measures what diversity costs)."""
BARE_SAMPLE = 10
"""One user in this many (by a hash of the id) also asks as a client sending no exclusions."""
EXCLUDE_MAX = 1000
"""The request schema's bound on ``exclude``."""
MIN_EVENT_MS = 946_684_800_000
"""The events schema's earliest time, 2000-01-01."""


@dataclass
class ReplayData:
    """What every arm replays: the log, its plan, and what the training part left behind."""

    users: np.ndarray
    items: np.ndarray
    types: np.ndarray
    t_ms: np.ndarray
    plan: object
    """``evaluation.protocol.Plan``."""
    window_of: np.ndarray
    catalogue: list[str]
    """Items listed from the start (the training part's, and the item file's)."""
    category: dict[str, str]
    price: dict[str, float]
    history: dict[str, list[str]] = field(default_factory=dict)
    """Per replayed user, their training-part items, newest first."""
    speed: float = 1.0


@dataclass
class ArmResult:
    name: str
    scores: object
    """``evaluation.metrics.ArmScores``."""
    wall_s: float = 0.0
    sent: int = 0
    answered: int = 0
    timeouts: int = 0
    errors: int = 0
    tiers: Counter = field(default_factory=Counter)
    channels: Counter = field(default_factory=Counter)
    """Items of the replies per recall channel that found them (an item may have several)."""
    items_listed: int = 0
    events: int = 0
    late_steps: int = 0
    """Steps whose events the worker had not read within the wait."""
    read_before: int = 0
    """Events the worker had read before the first step: 0 when the training part's events
    were committed past, as they should be."""
    bare: Counter = field(default_factory=Counter)
    """Lists as a client that sends neither ``exclude`` nor ``exclude_seen`` gets them (the
    deployment's ``FRESHREC_EXCLUDE_SEEN`` decides), asked for a tenth of the users: items
    listed, and of those how many the user had consumed during the replay (the worker read
    those events) or before it (the training part, which the worker never read)."""

    def without_exclude(self) -> dict:
        n = self.bare["items"]
        return {
            "lists": self.bare["lists"],
            "items": n,
            "consumed_in_replay_share": round(self.bare["consumed_in_replay"] / n, 4)
            if n
            else None,
            "consumed_before_share": round(self.bare["consumed_before"] / n, 4) if n else None,
        }


def prepare(inter, items_table, plan, windows: int, duration_s: float, speed: float | None):
    """The ``ReplayData`` of a log and its plan."""
    from evaluation.protocol import windows as window_index
    from inference.models.coldstart import UNKNOWN_CATEGORY

    train_end = plan.train_end
    users, items = inter.users, inter.items
    catalogue = list(dict.fromkeys([*items[:train_end].tolist(), *items_table.ids]))
    replayed = {u for s in plan.steps for u in s.users}
    history: dict[str, list[str]] = {}
    for u, i in zip(
        users[:train_end][::-1].tolist(), items[:train_end][::-1].tolist(), strict=True
    ):
        if u in replayed:
            h = history.setdefault(u, [])
            if len(h) < EXCLUDE_MAX and i not in h:
                h.append(i)
    span = max(int(inter.t_ms[-1]) - int(inter.t_ms[train_end]), 1) if train_end < len(inter) else 1
    return ReplayData(
        users=users,
        items=items,
        types=inter.types,
        t_ms=inter.t_ms,
        plan=plan,
        window_of=window_index(inter.t_ms, train_end, windows),
        catalogue=catalogue,
        category={i: items_table.category.get(i, UNKNOWN_CATEGORY) for i in set(items.tolist())},
        price=dict(items_table.price),
        history=history,
        speed=speed or max(span / (duration_s * 1000.0), 1.0),
    )


@contextlib.contextmanager
def arm_stack(name: str, workdir: Path, run_id: str) -> Iterator[ConnectionSettings]:
    """A broker and Redis for the arm: its own embedded ones, or the configured services
    under a topic prefix of its own."""
    if external_services():
        base = ConnectionSettings.from_env(load_environment())
        yield base.with_prefix(f"{base.topic_prefix}replay-{run_id}-{name}.")
        return
    stack = EmbeddedStack(workdir / f"stack-{name}")
    stack.down()  # a previous replay killed half-way
    state = stack.up(detach=False)
    try:
        env = dict(os.environ)
        env.update(state.env)
        yield ConnectionSettings.from_env(env)
    finally:
        stack.down()


def _produce_catalogue(producer, topic: str, data: ReplayData, names, created_ms: int) -> None:
    from freshcore.kafka import produce
    from schemas.codec import encode_item
    from schemas.records import Item

    for item_id in names:
        item = Item(
            item_id,
            data.category.get(item_id, "unknown"),
            float(data.price.get(item_id, 0.0)),
            created_ms,
        )
        produce(producer, topic, encode_item(item), item_id.encode())


def _worker_total(port: int, name: str) -> float:
    from freshrec.promtext import scrape_port, total

    return total(scrape_port(port), name)


async def _wait_for(check: Callable[[], bool], timeout_s: float, every_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(every_s)
    return True


def run_arm(
    name: str,
    data: ReplayData,
    models: Path,
    manifest: dict,
    workdir: Path,
    run_id: str,
    *,
    k: int = 10,
    windows: int = 10,
    timeout_s: float = 10.0,
    progress: Callable[[str], None] = lambda line: None,
    overrides: dict[str, str] | None = None,
) -> ArmResult:
    """Replay ``data`` through a pipeline set up as arm ``name`` says (``ARMS``)."""
    from evaluation.metrics import ArmScores
    from freshrec.app.commands import provision_topics
    from freshrec.app.runstatus import wait_until_assigned
    from freshrec.app.supervisor import ServiceGroup
    from freshrec.app.training import load_starting_embeddings

    services_of, settings = ARMS[name]
    result = ArmResult(name, ArmScores(name, k, windows))
    with arm_stack(name, workdir, run_id) as conn:
        provision_topics(conn)
        load_starting_embeddings(conn, models, manifest)
        env = {
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": conn.kafka_bootstrap_servers,
            "REDIS_URL": conn.redis_url,
            "FRESHREC_TOPIC_PREFIX": conn.topic_prefix,
            "FRESHREC_KAFKA_PROFILE": conn.kafka_profile,
            "FRESHREC_MODEL_DIR": str(models),
            "FRESHREC_EMBEDDING_DIM": str(manifest["dim"]),
            "FRESHREC_SEEN_PER_USER": str(EXCLUDE_MAX),
            # a step's requests arrive at once: the tiers plan to the request's timeout, not to
            # a latency objective, so a list's quality does not depend on the machine's speed
            "FRESHREC_REQUEST_BUDGET_MS": str(int(timeout_s * 1000)),
            **SERVING,
            **(overrides or {}),
            **settings,  # the arm's own (frozen's learning rates of 0) win
        }
        group = ServiceGroup(env, workdir / f"logs-{name}")
        ports = {s: free_port() for s in services_of}
        try:
            for service in services_of:
                if service != "worker":
                    group.start(service, service, FRESHREC_METRICS_PORT=str(ports[service]))
            others = {s: p for s, p in ports.items() if s != "worker"}
            progress(f"{name}: waiting for {', '.join(others)} to join")
            wait_until_assigned(others, 120, lambda waiting: group.check())
            wall0 = clock.now_ms()
            _history(conn, data, wall0, ports["streams"], group, progress, name)
            group.start("worker", "worker", FRESHREC_METRICS_PORT=str(ports["worker"]))
            wait_until_assigned({"worker": ports["worker"]}, 120, lambda waiting: group.check())
            started = time.monotonic()
            asyncio.run(
                _replay(
                    name, data, conn, ports["worker"], result, k, timeout_s, progress, group, wall0
                )
            )
            result.wall_s = round(time.monotonic() - started, 1)
            group.check()
        finally:
            group.stop_all()
    return result


def _stamp(data: ReplayData, wall0: int, pos: int) -> int:
    """The event time of log position ``pos`` on the present: the replayed part starts at
    ``wall0``; the training part lies before it (never before 2000-01-01)."""
    t0 = int(data.t_ms[data.plan.train_end]) if data.plan.train_end < len(data.t_ms) else 0
    return max(wall0 + int((int(data.t_ms[pos]) - t0) / data.speed), MIN_EVENT_MS)


def _history(conn, data: ReplayData, wall0: int, streams_port: int, group, progress, name) -> None:
    """The catalogue, then the training part's interactions on ``events`` before the worker
    starts: the streams app counts them (hot lists, item features, users' recent clicks: what
    it would hold had it run through that part), and the workers' group is committed past
    them, so the worker does not learn again what its starting rows were trained on."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from freshcore.kafka import consumer_config, produce, producer_config
    from freshcore.topics import TopicNames
    from schemas.codec import encode_event
    from schemas.records import Event

    names = TopicNames(conn.topic_prefix)
    producer = Producer(producer_config(conn, **{"linger.ms": 20}))
    _produce_catalogue(producer, names.items, data, data.catalogue, wall0 - 30 * 86_400_000)
    ends: dict[int, int] = {}

    def delivered(err, msg) -> None:
        if err is None:
            ends[msg.partition()] = max(ends.get(msg.partition(), -1), msg.offset())

    n = data.plan.train_end
    for pos in range(n):
        kind = "conversion" if data.types[pos] == "conversion" else "click"
        event = Event(
            f"history-{pos}",
            kind,
            str(data.users[pos]),
            str(data.items[pos]),
            _stamp(data, wall0, pos),
        )
        produce(
            producer,
            names.events,
            encode_event(event),
            event.user_id.encode(),
            on_delivery=delivered,
        )
        if pos % 5000 == 0:
            producer.poll(0)
            progress(f"{name}: the training part to the streams app, {pos:,}/{n:,}")
    if producer.flush(60):
        raise TimeoutError(f"{name}: the training part was not delivered within 60 s")
    committer = Consumer(consumer_config(conn, f"{conn.topic_prefix}freshrec-workers"))
    try:
        committer.commit(
            offsets=[TopicPartition(names.events, p, o + 1) for p, o in sorted(ends.items())],
            asynchronous=False,
        )
    finally:
        committer.close()
    names_counted = (
        "freshrec_streams_counted_events_total",
        "freshrec_streams_late_events_total",
        "freshrec_streams_replayed_events_total",
    )

    def counted() -> float:
        from freshrec.promtext import scrape_port, total

        samples = scrape_port(streams_port)
        return sum(total(samples, m) for m in names_counted)

    deadline = time.monotonic() + max(120.0, n / 500)
    while (done := counted()) < n:
        group.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: the streams app counted {done:,.0f} of {n:,} events")
        progress(f"{name}: the streams app counted {done:,.0f} of the training part's {n:,}")
        time.sleep(0.5)


async def _replay(
    name, data, conn, worker_port, result, k, timeout_s, progress, group, wall0
) -> None:
    from confluent_kafka import Producer

    from freshcore.kafka import produce, producer_config
    from freshcore.topics import TopicNames
    from freshrec.client import RecommendClient, RecommendTimeout
    from schemas.codec import encode_event
    from schemas.records import Event

    names = TopicNames(conn.topic_prefix)
    producer = Producer(producer_config(conn, **{"linger.ms": 5}))
    listed = set(data.catalogue)
    consumed: dict[str, set[str]] = {}  # what each user consumed during the replay so far
    have = len(listed)
    progress(f"{name}: waiting for the worker to list the catalogue ({have:,} items)")
    ok = await _wait_for(
        lambda: _worker_total(worker_port, "freshrec_catalogue_items") >= have, 120, 0.2
    )
    if not ok:
        group.check()
        raise TimeoutError(f"{name}: the worker did not list the catalogue within 120 s")
    plan = data.plan
    scores = result.scores
    read_before = _worker_total(worker_port, "freshrec_worker_events_total")
    result.read_before = int(read_before)
    steps = len(plan.steps)
    last_line = 0.0
    async with RecommendClient(
        conn.kafka_bootstrap_servers,
        topic_prefix=conn.topic_prefix,
        timeout_s=timeout_s,
        profile=conn.kafka_profile,
        security=conn.kafka_security,
    ) as client:
        for step in plan.steps:
            stamp = [_stamp(data, wall0, p) for p in range(step.start, step.end)]
            ahead_ms = stamp[-1] - clock.now_ms()  # no event stamped in the future
            if ahead_ms > 0:
                await asyncio.sleep(ahead_ms / 1000)
            bare_users = [u for u in step.users if zlib.crc32(str(u).encode()) % BARE_SAMPLE == 0]
            bare_asks = [
                client.recommend(u, k, context={"ts_ms": max(stamp[0], 946_684_800_000)})
                for u in bare_users
            ]
            asks = [
                client.recommend(
                    user,
                    k,
                    exclude=data.history.get(user, ()),
                    exclude_seen=True,
                    context={"ts_ms": max(stamp[0], 946_684_800_000)},
                )
                for user in step.users
            ]
            result.sent += len(asks)
            replies = await asyncio.gather(*asks, *bare_asks, return_exceptions=True)
            replies, bare_replies = replies[: len(asks)], replies[len(asks) :]
            for user, reply in zip(bare_users, bare_replies, strict=True):
                if isinstance(reply, BaseException):
                    continue
                listed_items = [it.item_id for it in reply.items[:k]]
                before = set(data.history.get(user, ()))
                during = consumed.get(user, set())
                result.bare["lists"] += 1
                result.bare["items"] += len(listed_items)
                result.bare["consumed_in_replay"] += sum(i in during for i in listed_items)
                result.bare["consumed_before"] += sum(i in before for i in listed_items)
            for user, reply in zip(step.users, replies, strict=True):
                targets = step.targets[user]
                window = int(data.window_of[targets[0][0]])
                got: list[str] = []
                if isinstance(reply, RecommendTimeout):
                    result.timeouts += 1
                elif isinstance(reply, BaseException):
                    if not result.errors:
                        log.warning("%s: a request failed: %r", name, reply)
                    result.errors += 1
                else:
                    result.answered += 1
                    result.tiers[reply.tier] += 1
                    got = [it.item_id for it in reply.items]
                    for it in reply.items[:k]:
                        result.channels.update(it.channels)
                    result.items_listed += min(len(reply.items), k)
                scores.add_request(
                    window, got, [item for _, item in targets], user, [pos for pos, _ in targets]
                )
            for j, pos in enumerate(range(step.start, step.end)):
                consumed.setdefault(str(data.users[pos]), set()).add(str(data.items[pos]))
                item = str(data.items[pos])
                if item not in listed:  # first seen now: listed as a new item
                    listed.add(item)
                    _produce_catalogue(producer, names.items, data, [item], stamp[j])
                kind = "conversion" if data.types[pos] == "conversion" else "click"
                event = Event(f"replay-{pos}", kind, str(data.users[pos]), item, stamp[j])
                produce(producer, names.events, encode_event(event), event.user_id.encode())
            producer.flush(30)
            result.events += step.end - step.start
            target = read_before + result.events
            learnt = await _wait_for(
                lambda t=target: _worker_total(worker_port, "freshrec_worker_events_total") >= t,
                timeout_s,
            )
            result.late_steps += not learnt
            now = time.monotonic()
            if now - last_line > 0.5 or step.index == steps - 1:
                last_line = now
                hr = scores.total.values()["hr"]
                progress(
                    f"{name}: step {step.index + 1}/{steps}, {result.events:,} events, "
                    f"HR@{k} {hr if hr is not None else 0:.4f}"
                    + (f", {result.timeouts} timeouts" if result.timeouts else "")
                )
    producer.flush(10)
