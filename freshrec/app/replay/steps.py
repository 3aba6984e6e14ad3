"""The replayed part through a live arm's worker, step by step (``evaluation/protocol.py``):
the step's users ask for k items (their training-part items, the newest 1,000, in
``exclude``; ``exclude_seen`` for the rest), the lists are scored, the step's interactions go
to ``events`` as clicks (conversions stay conversions) stamped with their re-timed event time,
and the next step waits until the worker has read them. A step never sends an event stamped in
the future (it waits); what the arm measured is its ``ArmResult``."""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from freshcore import clock
from freshrec.app.replay.data import MIN_EVENT_MS, ReplayData, stamp
from freshrec.app.replay.feed import log_event, produce_catalogue

log = logging.getLogger("freshrec.replay")

BARE_SAMPLE = 10
"""One user in this many (by a hash of the id) also asks as a client sending no exclusions."""
WORKER_EVENTS = "freshrec_worker_events_total"


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
    hits_by_channel: Counter = field(default_factory=Counter)
    """Scored interactions whose item the list held, by each recall channel that found it
    (an item may have several): each channel's own share of the hits."""
    unlisted: int = 0
    """Items of the lists that were not yet on ``items`` when the list was asked for: 0, as
    nothing may be recommended before it exists."""
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


def worker_total(port: int, name: str) -> float:
    from freshrec.promtext import scrape_port, total

    return total(scrape_port(port), name)


async def wait_for(check: Callable[[], bool], timeout_s: float, every_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(every_s)
    return True


async def replay_steps(
    name,
    data: ReplayData,
    conn,
    worker_port,
    result: ArmResult,
    k,
    timeout_s,
    progress,
    group,
    wall0,
) -> None:
    """Every step of ``data``'s plan through the worker on ``worker_port``, into ``result``."""
    from confluent_kafka import Producer

    from freshcore.kafka import producer_config
    from freshcore.topics import TopicNames
    from freshrec.client import RecommendClient

    topics = TopicNames(conn.topic_prefix)
    producer = Producer(producer_config(conn, **{"linger.ms": 5}))
    listed = set(data.catalogue)
    consumed: dict[str, set[str]] = {}  # what each user consumed during the replay so far
    await _catalogue_listed(name, worker_port, len(listed), group, progress)
    read_before = worker_total(worker_port, WORKER_EVENTS)
    result.read_before = int(read_before)
    steps = len(data.plan.steps)
    last_line = 0.0
    async with RecommendClient(
        conn.kafka_bootstrap_servers,
        topic_prefix=conn.topic_prefix,
        timeout_s=timeout_s,
        profile=conn.kafka_profile,
        security=conn.kafka_security,
    ) as client:
        for step in data.plan.steps:
            stamps = [stamp(data, wall0, p) for p in range(step.start, step.end)]
            ahead_ms = stamps[-1] - clock.now_ms()  # no event stamped in the future
            if ahead_ms > 0:
                await asyncio.sleep(ahead_ms / 1000)
            await _ask_and_score(client, name, data, step, stamps, result, k, consumed, listed)
            _send_step(producer, topics, data, step, stamps, listed, consumed)
            result.events += step.end - step.start
            target = read_before + result.events
            learnt = await wait_for(
                lambda t=target: worker_total(worker_port, WORKER_EVENTS) >= t, timeout_s
            )
            result.late_steps += not learnt
            now = time.monotonic()
            if now - last_line > 0.5 or step.index == steps - 1:
                last_line = now
                progress(_step_line(name, step.index, steps, result, k))
    producer.flush(10)


async def _catalogue_listed(name, worker_port: int, have: int, group, progress) -> None:
    """Wait until the worker lists the ``have`` items of the catalogue (a dead service raises)."""
    progress(f"{name}: waiting for the worker to list the catalogue ({have:,} items)")
    ok = await wait_for(
        lambda: worker_total(worker_port, "freshrec_catalogue_items") >= have, 120, 0.2
    )
    if not ok:
        group.check()
        raise TimeoutError(f"{name}: the worker did not list the catalogue within 120 s")


async def _ask_and_score(
    client, name, data, step, stamps, result: ArmResult, k, consumed, listed: set[str]
):
    """The step's users ask for ``k`` items (their training-part items in ``exclude``,
    ``exclude_seen`` for the rest); one in ``BARE_SAMPLE`` asks again as a client sending no
    exclusions. Both kinds of lists are scored into ``result``."""
    bare_users = [u for u in step.users if zlib.crc32(str(u).encode()) % BARE_SAMPLE == 0]
    bare_asks = [
        client.recommend(u, k, context={"ts_ms": max(stamps[0], MIN_EVENT_MS)}) for u in bare_users
    ]
    asks = [
        client.recommend(
            user,
            k,
            exclude=data.history.get(user, ()),
            exclude_seen=True,
            context={"ts_ms": max(stamps[0], MIN_EVENT_MS)},
        )
        for user in step.users
    ]
    result.sent += len(asks)
    replies = await asyncio.gather(*asks, *bare_asks, return_exceptions=True)
    replies, bare_replies = replies[: len(asks)], replies[len(asks) :]
    _count_bare(result, data, bare_users, bare_replies, k, consumed)
    _score(result, name, data, step, replies, k)
    for reply in replies:
        if not isinstance(reply, BaseException):
            result.unlisted += sum(it.item_id not in listed for it in reply.items)


def _count_bare(result: ArmResult, data, users, replies, k, consumed) -> None:
    """How many of each bare list's items the user had consumed, during the replay or before."""
    for user, reply in zip(users, replies, strict=True):
        if isinstance(reply, BaseException):
            continue
        listed_items = [it.item_id for it in reply.items[:k]]
        before = set(data.history.get(user, ()))
        during = consumed.get(user, set())
        result.bare["lists"] += 1
        result.bare["items"] += len(listed_items)
        result.bare["consumed_in_replay"] += sum(i in during for i in listed_items)
        result.bare["consumed_before"] += sum(i in before for i in listed_items)


def _score(result: ArmResult, name, data, step, replies, k) -> None:
    """Each user's list scored against the items they consume in the step; a timeout or an
    error scores as an empty list."""
    from freshrec.client import RecommendTimeout

    scores = result.scores
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
            found = {it.item_id: it.channels for it in reply.items[:k]}
            for it in reply.items[:k]:
                result.channels.update(it.channels)
            for _, item in targets:
                result.hits_by_channel.update(found.get(item, ()))
            result.items_listed += min(len(reply.items), k)
        scores.add_request(
            window, got, [item for _, item in targets], user, [pos for pos, _ in targets]
        )


def _send_step(producer, topics, data, step, stamps, listed: set, consumed) -> None:
    """The step's interactions as events, each item first seen now listed first; delivered."""
    from freshcore.kafka import produce
    from schemas.codec import encode_event

    for j, pos in enumerate(range(step.start, step.end)):
        consumed.setdefault(str(data.users[pos]), set()).add(str(data.items[pos]))
        item = str(data.items[pos])
        if item not in listed:  # first seen now: listed as a new item
            listed.add(item)
            produce_catalogue(producer, topics.items, data, [item], stamps[j])
        event = log_event(data, pos, f"replay-{pos}", stamps[j])
        produce(producer, topics.events, encode_event(event), event.user_id.encode())
    producer.flush(30)


def _step_line(name: str, index: int, steps: int, result: ArmResult, k: int) -> str:
    hr = result.scores.total.values()["hr"]
    return (
        f"{name}: step {index + 1}/{steps}, {result.events:,} events, "
        f"HR@{k} {hr if hr is not None else 0:.4f}"
        + (f", {result.timeouts} timeouts" if result.timeouts else "")
    )
