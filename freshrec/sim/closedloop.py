"""The closed loop of ``freshrec run``: simulated users ask for recommendations over Kafka,
look at the reply, and click or convert as the synthetic world's ground truth says; what they
did goes to ``events``, which feeds online learning, hot lists and features — and so the next
replies.

Users are drawn like the world's active users (Zipf), or uniformly from a fixed cohort, with
their region and device class. Each reply becomes one impression per shown item (position =
rank), a click with the world's click probability and a conversion with its conversion
probability. CTR of served recommendations = clicks / impressions of the items the workers
chose; ``CtrWindows`` keeps it per time window and per group of users (those whose interest
drifts, ``drifted``, and the others, ``steady``), the curve ``tools/bench_freshness.py``
reports.

>>> w = CtrWindows(window_s=10.0)
>>> w.add(3.0, "steady", 10, 2); w.add(9.9, "steady", 10, 1); w.add(12.0, "drifted", 10, 5)
>>> [(c["from_s"], c["impressions"], c["ctr"]) for c in w.curve("steady")]
[(0.0, 20, 0.15)]
>>> w.ctr("drifted", 10.0, 20.0), w.ctr("steady", 10.0, 20.0)
(0.5, None)
>>> [c["ctr"] for c in w.curve()]  # all groups
[0.15, 0.5]
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
from confluent_kafka import Producer

from freshcore import clock
from freshcore.kafka import produce, producer_config
from freshcore.settings import ConnectionSettings
from freshcore.topics import TopicNames
from freshrec.client import RecommendClient, RecommendError, RecommendTimeout
from freshrec.sim.world import World
from schemas.codec import encode_event
from schemas.records import DEVICE_CLASSES, Event

log = logging.getLogger("freshrec.loop")


@dataclass
class CtrWindows:
    """Impressions and clicks per (time window, group of users). Pure."""

    window_s: float = 10.0
    cells: dict[tuple[int, str], list[int]] = field(default_factory=dict)

    def add(self, elapsed_s: float, group: str, impressions: int, clicks: int) -> None:
        cell = self.cells.setdefault((int(elapsed_s // self.window_s), group), [0, 0])
        cell[0] += impressions
        cell[1] += clicks

    def curve(self, group: str | None = None) -> list[dict]:
        """The group's windows (every group's, summed, for None) in time order: start (s),
        impressions, clicks, CTR."""
        sums: dict[int, list[int]] = {}
        for (n, g), (imps, clicks) in self.cells.items():
            if group is None or g == group:
                cell = sums.setdefault(n, [0, 0])
                cell[0] += imps
                cell[1] += clicks
        return [
            {
                "from_s": n * self.window_s,
                "impressions": imps,
                "clicks": clicks,
                "ctr": round(clicks / imps, 4) if imps else None,
            }
            for n, (imps, clicks) in sorted(sums.items())
        ]

    def ctr(self, group: str, from_s: float, to_s: float) -> float | None:
        """CTR over the windows that start in [from_s, to_s); None without impressions."""
        inside = [c for c in self.curve(group) if from_s <= c["from_s"] < to_s]
        imps = sum(c["impressions"] for c in inside)
        clicks = sum(c["clicks"] for c in inside)
        return round(clicks / imps, 4) if imps else None


@dataclass
class LoopStats:
    sent: int = 0
    replied: int = 0
    timeouts: int = 0
    errors: int = 0
    impressions: int = 0
    clicks: int = 0
    conversions: int = 0
    tiers: Counter = field(default_factory=Counter)
    modes: Counter = field(default_factory=Counter)
    """Replies by the serving mode they name (``-`` where a reply names none)."""
    latencies_ms: deque = field(default_factory=lambda: deque(maxlen=5000))
    all_latencies_ms: list = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    windows: CtrWindows = field(default_factory=CtrWindows)
    by_tier: dict[str, list[int]] = field(default_factory=dict)
    """Impressions and clicks per serving tier: what degradation costs in clicks."""
    shown: set[int] = field(default_factory=set)
    """Item indices shown at least once (the only items with feedback from the loop)."""
    last_list: dict[int, frozenset[int]] = field(default_factory=dict)
    """Per user, the items of their last list."""
    repeat: list[int] = field(default_factory=lambda: [0, 0])
    """Items of a list that the same user's previous list held, and the items of lists that
    had a previous one: how much a refresh shows again."""
    diversity: list[float] = field(default_factory=lambda: [0.0, 0])
    """The sum of lists' intra-list diversity (the share of a list's item pairs from
    different categories) and how many lists: their mean is ``intra_list_diversity``."""

    def diverse(self, categories: np.ndarray) -> None:
        n = len(categories)
        if n > 1:
            same = np.unique(categories, return_counts=True)[1]
            self.diversity[0] += 1.0 - float((same * (same - 1)).sum()) / (n * (n - 1))
            self.diversity[1] += 1

    @property
    def intra_list_diversity(self) -> float | None:
        return self.diversity[0] / self.diversity[1] if self.diversity[1] else None

    def consecutive(self, user: int, items: list[int]) -> None:
        now = frozenset(items)
        before = self.last_list.get(user)
        if before is not None:
            self.repeat[0] += len(now & before)
            self.repeat[1] += len(now)
        self.last_list[user] = now

    @property
    def repeat_share(self) -> float | None:
        """The share of a list's items the same user's previous list held."""
        return self.repeat[0] / self.repeat[1] if self.repeat[1] else None

    def tier_ctr(self) -> dict[str, float]:
        return {t: round(c / i, 4) for t, (i, c) in sorted(self.by_tier.items()) if i}

    @property
    def ctr(self) -> float:
        return self.clicks / self.impressions if self.impressions else 0.0

    def p(self, q: float, recent: bool = True) -> float:
        data = self.latencies_ms if recent else self.all_latencies_ms
        return float(np.percentile(np.asarray(data), q)) if data else float("nan")

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return (
            f"requests {self.replied / elapsed:,.0f}/s p99 {self.p(99):,.0f}ms"
            f" | CTR {100 * self.ctr:.1f}%"
            + (f" | timeouts {self.timeouts}" if self.timeouts else "")
        )

    def final(self) -> str:
        tiers = ", ".join(f"{k} {v:,}" for k, v in self.tiers.most_common())
        modes = ", ".join(f"{k} {v:,}" for k, v in self.modes.most_common())
        curve = " ".join(
            f"{100 * c['ctr']:.1f}%" for c in self.windows.curve() if c["ctr"] is not None
        )
        by_tier = ", ".join(f"{t} {100 * v:.1f}%" for t, v in self.tier_ctr().items())
        again = "-" if self.repeat_share is None else f"{100 * self.repeat_share:.1f}%"
        return (
            f"served {self.replied:,} of {self.sent:,} requests ({self.timeouts} timeouts, "
            f"{self.errors} errors), latency p50 {self.p(50, False):,.1f}ms p99 "
            f"{self.p(99, False):,.1f}ms; modes: {modes or '-'}; tiers: {tiers or '-'}; "
            "CTR of served "
            f"recommendations {100 * self.ctr:.2f}% ({self.clicks:,} clicks / "
            f"{self.impressions:,} impressions, {self.conversions:,} conversions); CTR per "
            f"{self.windows.window_s:g} s: {curve or '-'}; CTR by tier: {by_tier or '-'}; "
            f"items a user's previous list also held: {again}"
        )


class ClosedLoop:
    """``users``: draw requests uniformly from these user indices instead of the world's
    active users. ``drift_after_s``: the world's interest drift happens that many seconds
    after the loop's first request (``drift_fraction`` of the users switch their main
    category; ``World.drifts`` names them). ``window_s``: the CTR windows of ``stats``."""

    def __init__(
        self,
        conn: ConnectionSettings,
        world: World,
        rate_per_s: float,
        *,
        k: int = 10,
        seed: int = 1,
        timeout_s: float = 2.0,
        concurrency: int = 256,
        users: np.ndarray | None = None,
        drift_after_s: float | None = None,
        drift_fraction: float = 0.5,
        window_s: float = 10.0,
    ) -> None:
        if users is not None and len(users) == 0:
            raise ValueError("a cohort needs at least one user")
        if not 0.0 <= drift_fraction <= 1.0:
            raise ValueError(f"drift_fraction must be in [0, 1], got {drift_fraction}")
        self.conn = conn
        self.world = world
        self.rate = rate_per_s
        self.k = k
        self.rng = np.random.default_rng(seed)
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self.users = None if users is None else np.asarray(users, np.int64)
        self.drift_after_s, self.drift_fraction = drift_after_s, drift_fraction
        self.stats = LoopStats(windows=CtrWindows(window_s))
        self.topic = TopicNames(conn.topic_prefix).events
        self._seq = 0

    def run_in_thread(self, stop: threading.Event) -> threading.Thread:
        t = threading.Thread(target=lambda: asyncio.run(self.run(stop)), daemon=True, name="loop")
        t.start()
        return t

    async def run(self, stop: threading.Event) -> None:
        producer = Producer(producer_config(self.conn))
        sem = asyncio.Semaphore(self.concurrency)
        tasks: set[asyncio.Task] = set()
        async with RecommendClient(
            self.conn.kafka_bootstrap_servers,
            topic_prefix=self.conn.topic_prefix,
            timeout_s=self.timeout_s,
            profile=self.conn.kafka_profile,
            security=self.conn.kafka_security,
        ) as client:
            self.stats.started = time.monotonic()
            if self.drift_after_s is not None:
                at_ms = int(time.time() * 1000 + 1000 * self.drift_after_s)
                self.world = self.world.with_drift(at_ms, self.drift_fraction)
            sent = 0
            while not stop.is_set():
                due = int((time.monotonic() - self.stats.started) * self.rate) - sent
                for _ in range(max(due, 0)):
                    await sem.acquire()
                    task = asyncio.create_task(self._one(client, producer, sem))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    sent += 1
                producer.poll(0)
                await asyncio.sleep(0.005)
            if tasks:
                await asyncio.wait(tasks, timeout=self.timeout_s + 1)
        producer.flush(10)

    async def _one(self, client: RecommendClient, producer: Producer, sem: asyncio.Semaphore):
        try:
            w = self.world
            if self.users is None:
                user = int(w.sample_users(self.rng, 1)[0])
            else:
                user = int(self.users[self.rng.integers(0, len(self.users))])
            region = w.config.regions[int(w.user_region(np.array([user]))[0])]
            device = DEVICE_CLASSES[int(w.user_device(np.array([user]))[0])]
            uid = World.user_id(user)
            self.stats.sent += 1
            started = time.monotonic()
            try:
                reply = await client.recommend(
                    uid,
                    self.k,
                    context={"device": device, "region": region, "ts_ms": clock.now_ms()},
                )
            except RecommendTimeout:
                self.stats.timeouts += 1
                return
            except RecommendError:
                self.stats.errors += 1
                return
            ms = (time.monotonic() - started) * 1000
            self.stats.replied += 1
            self.stats.latencies_ms.append(ms)
            self.stats.all_latencies_ms.append(ms)
            self.stats.tiers[reply.tier] += 1
            self.stats.modes[reply.mode or "-"] += 1
            self._behave(producer, user, uid, region, device, reply)
        finally:
            sem.release()

    def _behave(self, producer, user, uid, region, device, reply) -> None:
        w = self.world
        items = []
        for it in reply.items:
            try:
                items.append(World.index_of(it.item_id))
            except ValueError:
                continue
        if not items:
            return
        now = clock.now_ms()
        idx = np.asarray(items)
        users = np.full(len(idx), user)
        clicked = self.rng.random(len(idx)) < w.click_probability(users, idx, now)
        p_conv = w.conversion_probability(users, idx, now)
        converted = clicked & (self.rng.random(len(idx)) < p_conv)
        self._seq += 1
        rid = reply.request_id
        for pos, (i, c, v) in enumerate(
            zip(idx.tolist(), clicked.tolist(), converted.tolist(), strict=True)
        ):
            iid = World.item_id(i)
            base = f"{rid}-{pos}"
            out = [Event(base + "i", "impression", uid, iid, now, region, device, rid, pos)]
            if c:
                out.append(Event(base + "c", "click", uid, iid, now + 1, region, device, rid, pos))
            if v:
                price = float(w.item_price[i])
                out.append(
                    Event(
                        base + "v", "conversion", uid, iid, now + 2, region, device, rid, pos, price
                    )
                )
            for e in out:
                self._produce(producer, e)
        self.stats.shown.update(items)
        self.stats.consecutive(user, items)
        self.stats.diverse(w.item_category[idx])
        shown, hits = len(idx), int(clicked.sum())
        self.stats.impressions += shown
        self.stats.clicks += hits
        self.stats.conversions += int(converted.sum())
        group = "drifted" if w.drifts(users[:1])[0] else "steady"
        self.stats.windows.add(time.monotonic() - self.stats.started, group, shown, hits)
        tier = self.stats.by_tier.setdefault(reply.tier, [0, 0])
        tier[0] += shown
        tier[1] += hits

    def _produce(self, producer: Producer, e: Event) -> None:
        produce(producer, self.topic, encode_event(e), e.user_id.encode())
