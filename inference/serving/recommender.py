"""The serving path of the worker: a batch of requests in, one reply per request out.

recall (all channels concurrently, per-channel deadlines and breakers) → merge with quotas →
tier per request (``degrade.Ladder``) → one forward pass per model over every candidate of
the batch → MMR and category spacing → replies with versions, ages and per-stage timings.

Runs on the worker's thread, between event slices, so it reads the same EmbeddingCache that
online learning writes: a user's click is in their next recommendation.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import redis
import torch

from freshcore import clock
from freshcore import metrics as m
from freshcore.lifecycle import lower_thread_priority
from freshcore.rediskeys import RedisKeys
from inference.models.coldstart import category_starts, known_category
from inference.models.features import CATEGORY_BUCKETS
from inference.models.modelfile import ModelWatcher
from inference.models.tiers import HeatSplit
from inference.serving.ann import IVFIndex, ivf_cells
from inference.serving.arms import Arm, lambdas, quotas, reply_fields, steer
from inference.serving.arms import request as request_of
from inference.serving.channels import NEW_ITEMS, ServingState, category_members, default_channels
from inference.serving.degrade import (
    CACHED,
    FULL,
    HOT,
    Ladder,
    LadderConfig,
    Situation,
    reason_label,
)
from inference.serving.hotreply import HotReplies
from inference.serving.merge import merge_slot_arrays
from inference.serving.modes import DAILY
from inference.serving.rankstage import RankBatch, RankingStage
from inference.serving.recall import ChannelConfig, RecallQuery, RecallResult, RecallRunner
from inference.serving.rerankstage import RerankStage
from inference.serving.resultcache import ResultCache
from inference.serving.snapshot import Snapshot, SnapshotRefresher
from inference.tables.cache import EmbeddingCache
from inference.tables.shown import ShownItems, with_held
from schemas.ids import row_ids
from schemas.records import RecommendReply, RecommendRequest, ReplyItem
from schemas.rows import TABLE_ITEM, TABLE_USER, initial_rows

log = logging.getLogger("freshrec.serving")


@dataclass(frozen=True)
class ServingSettings:
    candidates: int = 500
    default_budget_ms: int = 250
    """Deadline budget of a request that names none."""
    mmr_lambda: float = 0.7
    category_gap: int = 2
    hold_shown_s: float = 0.0
    """Items a user was shown are held back from that user's lists for this long, so a
    refresh shows something new (0: not held back; ``inference/tables/shown.py``)."""
    hold_shown_users: int = 20_000
    """Users whose shown items are remembered (the most recently served)."""
    channels: dict[str, ChannelConfig] = field(default_factory=default_channels)
    ladder: LadderConfig = field(default_factory=LadderConfig)
    result_ttl_ms: int = 3_600_000
    result_cache_entries: int = 100_000
    mmr_pool_factor: int = 10
    """MMR re-ranks the best ``factor × k`` candidates (diversity among the relevant ones)."""
    ann_min_items: int = 200_000
    """Catalogues at least this large use the IVF index (``ann.py``) for the vector channel
    on a CPU; smaller ones, and every catalogue on an accelerator, are searched exactly."""
    ann_nprobe: int = 0
    """Cells a query probes; 0: ``ann.auto_nprobe`` (4% of the catalogue, at least 64 cells)."""
    ann_refresh_s: float = 300.0
    recall_share: float = 0.5
    """At most this share of the tightest budget in a batch is spent waiting for recall."""
    ranker: str = "wide_deep"
    """The model of the full tier (``inference/serving/rankstage.py``); a variant's ``ranking``
    overrides it for its users."""
    heat_split: HeatSplit = field(default_factory=HeatSplit)
    """The ``tiered`` ranker's head and middle shares of the warm catalogue by heat."""


@dataclass
class Candidates:
    """One request's merged candidates (cache slots) and each channel's list."""

    slots: np.ndarray
    per_channel: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.slots)


@dataclass
class Inbound:
    """A decoded request and where its reply goes."""

    request: RecommendRequest
    reply_to: str
    correlation_id: bytes | None
    enqueued_ms: int
    """When the request was produced (``intake.produced_ms``): its wait in the topic is part
    of its budget."""
    partition: int = -1
    offset: int = -1
    read_ms: int | None = None
    """When the worker read it (None: at ``enqueued_ms``)."""

    def deadline_ms(self, budget_ms: int) -> int:
        """What the ladder plans to: the serving budget from when the request was produced,
        or its own ``deadline_ms`` if earlier (a later one is how long the client waits)."""
        planned = self.enqueued_ms + budget_ms
        d = self.request.deadline_ms
        return planned if d is None else min(d, planned)


class Recommender:
    """Serves batches of requests from the worker's cache: recall (``channels.py``), the
    degradation ladder, ranking, re-ranking, replies."""

    def __init__(
        self,
        settings: ServingSettings,
        cache: EmbeddingCache,
        client: redis.Redis,
        keys: RedisKeys,
        snapshots: SnapshotRefresher,
        models: ModelWatcher,
        runner_factory: Callable[[ServingState], RecallRunner],
        worker_id: str,
        recent_clicks: Callable[[str], list[str]] = lambda user_id: [],
        sequence: Callable[[str], list[str]] = lambda user_id: [],
        seen: Callable[[RecommendRequest], RecommendRequest] = lambda request: request,
        arm_of: Callable[[str], Arm | None] = lambda user_id: None,
        start_items: Callable[[np.ndarray, np.ndarray], None] | None = None,
    ) -> None:
        self.settings = settings
        self.cache = cache
        self.redis = client
        self.keys = keys
        self.snapshots = snapshots
        self.models = models
        self.worker_id = worker_id
        self.with_seen = seen  # a request with the user's consumed items excluded, if it asks
        self.arm_of = arm_of  # the user's experiment variant (``arms.py``), if any
        # where the starting rows of new catalogue items go (Redis); None: items start from
        # their ids (``inference/models/coldstart.py``)
        self.start_items = start_items
        self.shown = ShownItems(round(settings.hold_shown_s * 1000), settings.hold_shown_users)
        self.sequence_of = sequence  # the user's last clicked items, newest first
        self.ranking = RankingStage(settings, cache, client, keys)
        """Which model scores which candidate, and what each tier costs (the ladder's input)."""
        self.reranking = RerankStage(cache)
        self.ladder = Ladder(settings.ladder)
        self.results = ResultCache(settings.result_cache_entries, settings.result_ttl_ms)
        self.snap = Snapshot()
        self.state = ServingState(cache, client, keys, recent_clicks, settings.ann_nprobe)
        """What the recall channels read (catalogue slots, hot lists, the IVF index)."""
        self.name_of_slot = np.empty(0, object)
        self.cat_index = np.empty(0, np.int64)  # slot -> catalogue index (-1: unknown)
        self._ann_built_at = 0.0
        self._ann_building = False
        self.hot_replies = HotReplies()
        self.runner: RecallRunner = runner_factory(self.state)
        self.quotas = {name: c.quota for name, c in self.runner.configs.items()}
        self.mode = DAILY
        """The serving mode whose settings serve (``modes.py``): named in every reply."""
        self.new_names: frozenset[str] = frozenset()
        """The catalogue's new items (the snapshot's), for ``freshrec_reply_items_total``."""

    def use(self, settings: ServingSettings, mode: str) -> None:
        """Serve the next batches with a mode's settings: the ladder's thresholds, the recall
        channels' quotas and deadlines, candidates, the ranker, MMR and the shown-items hold
        (the channels running stay those the worker started with)."""
        self.settings = settings
        self.ranking.use(settings)
        self.ladder = Ladder(settings.ladder)
        self.shown.hold_for(round(settings.hold_shown_s * 1000))
        self.runner.use(settings.channels)
        self.quotas = {name: c.quota for name, c in self.runner.configs.items()}
        self.mode = mode

    @property
    def slot_of(self) -> dict[str, int]:
        return self.state.slot_of

    @property
    def named(self) -> torch.Tensor:
        return self.state.named

    @property
    def ann(self) -> IVFIndex | None:
        return self.state.ann

    # ------------------------------------------------------------------------ snapshot
    def adopt_snapshot(self) -> None:
        snap = self.snapshots.take()
        if snap is None:
            return
        if snap.catalogue is not None and (
            self.snap.catalogue is not snap.catalogue or len(self.name_of_slot) == 0
        ):
            cat = snap.catalogue
            slots = self.cache.slots(TABLE_ITEM, cat.row_ids)
            if self.start_items is not None:
                self._start_cold_items(cat, slots)
            n = len(self.cache.item_ids)
            names = np.empty(n, object)
            names[slots] = cat.names
            cat_index = np.full(n, -1, np.int64)
            cat_index[slots] = np.arange(len(cat.names))
            named = torch.zeros(n, dtype=torch.bool, device=self.cache.device)
            named[self.cache.to_device(slots)] = True
            slot_category = np.full(n, -1, np.int64)
            slot_category[slots] = cat.category
            st = self.state
            st.slot_category = slot_category
            st.category_slots = category_members(cat.category, slots)
            st.unnamed_bias = torch.zeros(n, device=self.cache.device).masked_fill(
                ~named, float("-inf")
            )
            st.slot_of = dict(zip(cat.names, slots.tolist(), strict=True))
            st.named, st.named_count = named, len(cat.names)
            self.name_of_slot, self.cat_index = names, cat_index
            m.CATALOGUE_ITEMS.set(len(cat.names))
        self.snap = snap
        self.state.item_shards = snap.feature_shards or 0
        lists = dict(snap.hot)
        lists[NEW_ITEMS] = snap.new
        self.new_names = frozenset(snap.new)
        get = self.slot_of.get
        self.state.lists = {
            scope: np.fromiter((s for s in (get(x) for x in names) if s is not None), np.int64)
            for scope, names in lists.items()
        }

    def _start_cold_items(self, cat, slots: np.ndarray) -> None:
        """Catalogue items this worker holds no learnt row for (none in Redis, no local step)
        start from their category's mean learnt row, here and in Redis (where no row exists
        yet: another worker's start, or the parameter server's row, wins). Only the cold
        items' categories are read: a new item in a large catalogue costs its category's
        rows, not the catalogue's."""
        items = self.cache.items
        learnt = (items.version[slots] > 0) | (items.local_ms[slots] > 0)
        if learnt.all() or not learnt.any():
            return
        cold = np.flatnonzero(~learnt)
        names = cat.category_names
        known = np.fromiter((known_category(names[j]) for j in cold), bool, len(cold))
        cold = cold[known]
        if not len(cold):
            return
        category = cat.category
        subset = np.flatnonzero(np.isin(category, np.unique(category[cold])))
        subset = subset[learnt[subset] | np.isin(subset, cold)]
        jitter = np.zeros((len(subset), self.cache.w), np.float32)
        is_cold = ~learnt[subset]
        jitter[is_cold] = initial_rows(cat.row_ids[subset[is_cold]], TABLE_ITEM, self.cache.dim)
        rows, changed = category_starts(
            self.cache.rows(TABLE_ITEM, slots[subset]),
            torch.from_numpy(category[subset]),
            torch.from_numpy(learnt[subset]),
            self.cache.to_device(jitter),
            CATEGORY_BUCKETS,
        )
        started = np.flatnonzero(changed.cpu().numpy())
        if not len(started):
            return
        at = slots[subset[started]]
        starts = rows[self.cache.to_device(started)]
        items.rows.index_copy_(0, self.cache.to_device(at), self.cache.stored(starts))
        items.set_version(at, 1)  # a starting row, as offline training's: any learnt row is newer
        items.event_ms[at] = clock.now_ms()
        m.COLD_ITEMS_STARTED.inc(len(started))
        self.start_items(cat.row_ids[subset[started]], starts.cpu().numpy())

    def maybe_rebuild_index(self) -> None:
        """Start a background IVF build when the catalogue is large and the index is missing
        or older than ``ann_refresh_s`` (called from the worker loop; cheap)."""
        s = self.settings
        if self.state.named_count < s.ann_min_items or self._ann_building:
            return
        if self.cache.device.type != "cpu":  # a device's exact search is the fast one
            return
        if self.ann is not None and time.monotonic() - self._ann_built_at < s.ann_refresh_s:
            return
        size = min(len(self.named), len(self.cache.items.rows))
        # no copy here (256 MB at 1M items would stall this loop): the build copies the rows
        # into cells on its own thread, and a row installed meanwhile may land half-updated
        # in that copy, which only chooses candidates; the live rows rank them
        rows = self.cache.items.rows[:size].detach()
        eligible = self.named[:size].clone().cpu()
        cells = ivf_cells(int(eligible.sum()))
        self._ann_building = True

        def build() -> None:
            try:
                lower_thread_priority()  # the build yields the core to serving (Linux: per thread)
                started = time.monotonic()
                index = IVFIndex.build(rows, eligible, cells)
                self.state.ann = index
                self._ann_built_at = time.monotonic()
                took = self._ann_built_at - started
                m.ANN_INDEX_ITEMS.set(len(index.order))
                m.ANN_BUILD_SECONDS.set(took)
                m.ANN_BUILT_AT.set(time.time())
                log.info(
                    "IVF index: %d items in %d cells, built in %.1fs",
                    len(index.order),
                    len(index.centroids),
                    took,
                )
            except Exception as exc:  # exact search goes on
                log.error("IVF index build failed: %s", exc)
            finally:
                self._ann_building = False

        threading.Thread(target=build, daemon=True, name="ann-build").start()

    def rank_batch(self, reqs, user_rows, merged, arms, recall: RecallResult) -> RankBatch:
        """What ranking reads for these requests: the catalogue snapshot, and per request the
        user's recent clicks — the worker's own, else those a recall channel that met its
        deadline read from Redis (``recall.recent``) — sequence (their consumed items, else
        those clicks) and co-visitation scores (the ``covisit`` channel's, when it met its
        deadline)."""
        fetched_recent = recall.recent
        recent = [
            self.state.recent_clicks(r.user_id) or fetched_recent.get(r.user_id, []) for r in reqs
        ]
        return RankBatch(
            reqs,
            user_rows,
            merged,
            arms,
            self.snap,
            self.slot_of,
            self.cat_index,
            self.name_of_slot,
            recent,
            [self.sequence_of(r.user_id) or recent[j] for j, r in enumerate(reqs)],
            recall.scores.get("covisit"),
        )

    # --------------------------------------------------------------------------- serve
    def serve(self, batch: list[Inbound], queue_depth: int = 0) -> list[RecommendReply]:
        start = time.monotonic()
        now_ms = clock.now_ms()
        s = self.settings
        self.adopt_snapshot()
        degraded: list[str] = []
        if not self.snapshots.healthy:
            degraded.append("redis unavailable: cached features and lists")
        arms = [self.arm_of(b.request.user_id) for b in batch]
        reqs = [self.with_seen(request_of(b.request, a)) for b, a in zip(batch, arms, strict=True)]
        if self.shown.hold_ms:
            reqs = [with_held(r, self.shown.held(r.user_id, now_ms)) for r in reqs]
        user_rows, versions, ages, user_note, user_slots = self._users(reqs, now_ms)
        if user_note:
            degraded.append(user_note)
        budgets = [b.deadline_ms(s.default_budget_ms) - now_ms for b in batch]
        queries = [
            RecallQuery(r.user_id, user_rows[j], r.context.region if r.context else None)
            for j, r in enumerate(reqs)
        ]
        # a request whose budget is spent is not recalled for: the cache or the hot list
        recall = self.runner.run_within(queries, budgets, s.recall_share)
        t_recall = time.monotonic()
        if recall.timed_out or recall.failed:
            degraded.append(
                "recall channels dropped: " + ", ".join(recall.timed_out + recall.failed)
            )
        merged = [
            self._candidates(recall.per_query[j], r.exclude, quotas(self.quotas, arms[j]))
            for j, r in enumerate(reqs)
        ]
        models = self.models.current
        choices = []
        for j, r in enumerate(reqs):
            device = r.context.device if r.context else None
            key = self._cache_key(r)
            budget_left = budgets[j] - (t_recall - start) * 1000
            choices.append(
                steer(
                    self.ladder.choose(
                        Situation(
                            device=device,
                            budget_ms=budget_left,
                            queue_depth=queue_depth,
                            cached=self.results.peek_valid(key, versions[j], now_ms),
                            full_ok=models is not None
                            and time.monotonic() >= self.ranking.full_failed_until,
                            light_ok=models is not None,
                            full_cost_ms=self.ranking.full_cost_ms,
                            light_cost_ms=self.ranking.light_cost_ms,
                        )
                    ),
                    arms[j],
                )
            )
        ranked: dict[int, np.ndarray] = {}  # request -> probability per candidate
        batch_in = self.rank_batch(reqs, user_rows, merged, arms, recall)
        features_note, rankers, rank_ms = self.ranking.rank(batch_in, choices, ranked, models)
        if features_note:
            degraded.append(features_note)
        t_rank = time.monotonic()
        item_table_version = self.cache.items.newest
        reranked = self.reranking.rerank(
            merged,
            ranked,
            [r.k for r in reqs],
            lambdas(arms, s.mmr_lambda),
            self.name_of_slot,
            self._categories,
            s,
        )
        # each request's share of the batch's work: recall and re-ranking split evenly, and its
        # own ranker's time over the requests that ranker scored (an A/B variant's cost)
        shared_ms = ((t_recall - start) + (time.monotonic() - t_rank)) * 1000 / len(batch)
        replies = []
        cost_ms, listed, fresh = 0.0, 0, 0  # the batch's serving cost and listed (new) items
        for j, (b, r) in enumerate(zip(batch, reqs, strict=True)):
            tier, reason = choices[j].tier, choices[j].reason
            if j in ranked:
                items = reranked[j]
                if tier == FULL:
                    self.results.put(self._cache_key(r), versions[j], items, now_ms)
            elif tier == CACHED:
                items = self.results.get(self._cache_key(r), versions[j], now_ms) or []
                excluded = set(r.exclude)
                items = [i for i in items if i[0] not in excluded and self._listed(i[0])][: r.k]
            else:
                tier = HOT
                items = self.hot_replies.items(self.snap, r, self._listed)
            done = time.monotonic()
            read = b.enqueued_ms if b.read_ms is None else b.read_ms
            timings = {
                "topic": float(max(0, read - b.enqueued_ms)),
                "queue": float(max(0, now_ms - read)),
                "recall": (t_recall - start) * 1000,
                "rank": (t_rank - t_recall) * 1000 if j in ranked else 0.0,
                "rerank": (done - t_rank) * 1000,
            }
            timings["total"] = timings["topic"] + timings["queue"] + (done - start) * 1000
            timings["cost"] = shared_ms + rank_ms[j]
            reason_text = reason if not degraded else f"{reason}; degraded: {'; '.join(degraded)}"
            replies.append(
                RecommendReply(
                    request_id=r.request_id,
                    user_id=r.user_id,
                    items=tuple(ReplyItem(i, sc, ch) for i, sc, ch in items),
                    tier=tier,
                    tier_reason=reason_text[:256],
                    degraded=bool(degraded),
                    served_at_ms=clock.now_ms(),
                    model_version=models.version if models else None,
                    user_embedding_version=int(versions[j]),
                    user_embedding_age_ms=ages[j],
                    item_table_version=item_table_version,
                    timings_ms={k: round(v, 3) for k, v in timings.items()},
                    worker=self.worker_id,
                    ranker=rankers[j] if j in ranked else None,
                    mode=self.mode,
                    **reply_fields(arms[j]),
                )
            )
            m.REPLIES.labels(tier, self.mode).inc()
            cost_ms += timings["cost"]
            listed += len(items)
            fresh += sum(1 for i in items if i[0] in self.new_names)
            self.shown.shown(r.user_id, [i[0] for i in items], now_ms)
            for stage, value in timings.items():
                _stage_histogram(stage, tier, self.mode).observe(value / 1000)
            if tier != FULL or degraded:
                m.DEGRADED.labels(tier, reason_label(reason, degraded)).inc()
        # once a batch, not once a reply: each ``labels`` takes a lock and builds a key
        m.SERVING_COST.labels(self.mode).inc(cost_ms / 1000)
        m.REPLY_ITEMS.labels("true").inc(fresh)
        m.REPLY_ITEMS.labels("false").inc(listed - fresh)
        used = [self.slot_of.get(name, -1) for j in ranked for name, _, _ in reranked[j]]
        slots = (user_slots[list(ranked)], np.asarray(used, np.int64))  # rows the ranking used
        self.cache.observe_reply(*(x[x >= 0] for x in slots))
        return replies

    def _users(self, reqs: list[RecommendRequest], now_ms: int):
        ids = row_ids([r.user_id for r in reqs])
        note = None
        try:
            slots = self.cache.slots(TABLE_USER, ids)
            rows = self.cache.rows(TABLE_USER, slots)
            versions = self.cache.users.version[slots].astype(np.int64)
            event_ms = self.cache.users.event_ms[slots]
        except redis.RedisError:
            slots = np.full(len(ids), -1, np.int64)
            note = "redis unavailable: users not resident start from their initial rows"
            rows = self.cache.to_device(initial_rows(ids, TABLE_USER, self.cache.dim))
            versions = np.zeros(len(ids), np.int64)
            event_ms = np.zeros(len(ids), np.int64)
            for j, rid in enumerate(ids.tolist()):
                slot = self.cache.held(TABLE_USER, rid)
                if slot is not None:
                    slots[j] = slot
                    rows[j] = self.cache.users.rows[slot]
                    versions[j] = int(self.cache.users.version[slot])
                    event_ms[j] = int(self.cache.users.event_ms[slot])
        ages = [int(now_ms - t) if t > 0 else None for t in event_ms.tolist()]
        ages = [max(a, 0) if a is not None else None for a in ages]
        return rows, versions.tolist(), ages, note, slots

    def _candidates(self, per_channel: dict[str, np.ndarray], exclude: tuple[str, ...], quota):
        ex = None
        if exclude:
            ex = np.fromiter((self.slot_of[x] for x in exclude if x in self.slot_of), np.int64)
        slots = merge_slot_arrays(per_channel, quota, self.settings.candidates, ex)
        return Candidates(slots, per_channel)

    @staticmethod
    def _cache_key(r: RecommendRequest) -> tuple:
        ctx = r.context
        return (r.user_id, ctx.device if ctx else None, ctx.region if ctx else None, r.k)

    def _listed(self, name: str) -> bool:
        """Whether an item may be served: it is in the catalogue snapshot (any item before
        one is loaded). Hot lists and cached replies can still name an item the catalogue
        has deleted since; the channels that recall by slot see catalogue items only."""
        cat = self.snap.catalogue
        return cat is None or name in cat.index

    def _categories(self, slots: np.ndarray) -> list[int]:
        """Category numbers of cache slots (-1: not in the catalogue snapshot)."""
        cat = self.snap.catalogue
        inside = slots < len(self.cat_index)
        if cat is None or not inside.any():
            return [-1] * len(slots)
        ci = np.where(inside, self.cat_index[np.where(inside, slots, 0)], -1)
        return np.where(ci >= 0, cat.category[np.maximum(ci, 0)], -1).tolist()


@functools.cache
def _stage_histogram(stage: str, tier: str, mode: str):
    """The labelled child, looked up once (``labels`` takes a lock and builds a key each
    call: five stages a request)."""
    return m.REQUEST_SECONDS.labels(stage, tier, mode)
