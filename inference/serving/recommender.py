"""The serving path of the worker: a batch of requests in, one reply per request out.

recall (all channels concurrently, per-channel deadlines and breakers) → merge with quotas →
tier per request (``degrade.Ladder``) → one forward pass per model over every candidate of
the batch → MMR and category spacing → replies with versions, ages and per-stage timings.

Runs on the worker's thread, between event slices, so it reads the same EmbeddingCache that
online learning writes: a user's click is in their next recommendation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import redis
import torch

from freshcore import clock
from freshcore import metrics as m
from freshcore.rediskeys import RedisKeys
from inference.models.modelfile import ModelWatcher
from inference.serving.ann import IVFIndex
from inference.serving.annbuild import IndexBuilds
from inference.serving.arms import Arm, lambdas, quotas, reply_fields, steer
from inference.serving.arms import request as request_of
from inference.serving.batch import BatchUsers, Candidates, Inbound, RankedBatch, StageClock
from inference.serving.channels import ServingState
from inference.serving.coldstarts import start_cold_items
from inference.serving.degrade import CACHED, FULL, HOT, Choice, Ladder, Situation
from inference.serving.hotreply import HotReplies
from inference.serving.merge import merge_slot_arrays
from inference.serving.modes import DAILY
from inference.serving.rankstage import RankBatch, RankingStage
from inference.serving.recall import RecallQuery, RecallResult, RecallRunner
from inference.serving.replycounts import ReplyCounts
from inference.serving.rerankstage import RerankStage
from inference.serving.resultcache import ResultCache
from inference.serving.settings import ServingSettings
from inference.serving.snapshot import Snapshot, SnapshotRefresher
from inference.tables.cache import EmbeddingCache
from inference.tables.shown import ShownItems, with_held
from schemas.ids import row_ids
from schemas.records import RecommendReply, RecommendRequest, ReplyItem
from schemas.rows import TABLE_ITEM, TABLE_USER, initial_rows

log = logging.getLogger("freshrec.serving")


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
        self.index_builds = IndexBuilds()
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
        """The refresher's newest snapshot, if one came: its catalogue (where new) as cache
        slots, its hot lists and new items for the channels."""
        snap = self.snapshots.take()
        if snap is None:
            return
        if snap.catalogue is not None and (
            self.snap.catalogue is not snap.catalogue or len(self.name_of_slot) == 0
        ):
            cat = snap.catalogue
            slots = self.cache.slots(TABLE_ITEM, cat.row_ids)
            self.cache.keep_items(slots)  # never let go to make room on the device
            if self.start_items is not None:
                start_cold_items(self.cache, cat, slots, self.start_items)
            n = len(self.cache.item_ids)
            names = np.empty(n, object)
            names[slots] = cat.names
            cat_index = np.full(n, -1, np.int64)
            cat_index[slots] = np.arange(len(cat.names))
            self.state.adopt_catalogue(cat.names, cat.category, slots, n)
            self.name_of_slot, self.cat_index = names, cat_index
            m.CATALOGUE_ITEMS.set(len(cat.names))
        self.snap = snap
        self.new_names = frozenset(snap.new)
        self.state.adopt_lists(snap.hot, snap.new, snap.feature_shards or 0)

    def maybe_rebuild_index(self) -> None:
        """Start a background IVF build when the catalogue is large and the index is missing
        or older than ``ann_refresh_s`` (called from the worker loop; cheap: ``annbuild.py``)."""
        self.index_builds.maybe_rebuild(self.state, self.cache, self.settings)

    def rank_batch(self, reqs, user_rows, merged, arms, recall: RecallResult) -> RankBatch:
        """What ranking reads for these requests: the catalogue snapshot, and per request the
        user's recent clicks — the worker's own, else those a recall channel that met its
        deadline read from Redis (``recall.recent``) — sequence (their consumed items, else
        those clicks), co-visitation and sequential-rule scores (the ``covisit`` and
        ``sequel`` channels', when they met their deadline)."""
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
            recall.scores.get("sequel"),
        )

    # --------------------------------------------------------------------------- serve
    def serve(self, batch: list[Inbound], queue_depth: int = 0) -> list[RecommendReply]:
        """One reply per request of ``batch``, in order, through the stages: the requests
        (their arms, seen and held-back items), their users' rows, recall, the merge, the
        ladder's tier, ranking, re-ranking, the replies. ``queue_depth``: requests still
        queued behind the batch (the ladder weighs them)."""
        start = time.monotonic()
        now_ms = clock.now_ms()
        self.adopt_snapshot()
        degraded: list[str] = []
        if not self.snapshots.healthy:
            degraded.append("redis unavailable: cached features and lists")
        arms, reqs = self._requests(batch, now_ms)
        users = self._users(reqs, now_ms)
        if users.note:
            degraded.append(users.note)
        budgets = [b.deadline_ms(self.settings.default_budget_ms) - now_ms for b in batch]
        recall = self._recall(reqs, users.rows, budgets, degraded)
        recalled_at = time.monotonic()
        merged = self._merge(recall, reqs, arms)
        models = self.models.current
        spent_ms = (recalled_at - start) * 1000
        left_ms = [budget - spent_ms for budget in budgets]
        history = self._history(reqs, recall)
        choices = self._tiers(
            reqs, arms, left_ms, users.versions, queue_depth, models, now_ms, history
        )
        ranked: dict[int, torch.Tensor] = {}  # request -> probability per candidate
        batch_in = self.rank_batch(reqs, users.rows, merged, arms, recall)
        features_note, rankers, rank_ms = self.ranking.rank(batch_in, choices, ranked, models)
        if features_note:
            degraded.append(features_note)
        times = StageClock(now_ms, start, recalled_at, time.monotonic())
        lists = self._rerank(merged, ranked, reqs, arms)
        outcome = RankedBatch(choices, ranked, lists, rankers, rank_ms)
        return self._replies(batch, reqs, arms, users, outcome, degraded, models, times)

    def _requests(self, batch: list[Inbound], now_ms: int):
        """Each request's experiment arm, and the request as served: steered by its arm,
        the user's consumed items excluded if it asks, the items just shown held back."""
        arms = [self.arm_of(b.request.user_id) for b in batch]
        reqs = [self.with_seen(request_of(b.request, a)) for b, a in zip(batch, arms, strict=True)]
        if self.shown.hold_ms:
            reqs = [with_held(r, self.shown.held(r.user_id, now_ms)) for r in reqs]
        return arms, reqs

    def _recall(self, reqs, user_rows, budgets: list[int], degraded: list[str]) -> RecallResult:
        """Every channel for every request at once, within a share of the tightest budget;
        the channels that timed out or failed are noted in ``degraded``."""
        queries = [
            RecallQuery(r.user_id, user_rows[j], r.context.region if r.context else None)
            for j, r in enumerate(reqs)
        ]
        # a request whose budget is spent is not recalled for: the cache or the hot list
        recall = self.runner.run_within(queries, budgets, self.settings.recall_share)
        if recall.timed_out or recall.failed:
            degraded.append(
                "recall channels dropped: " + ", ".join(recall.timed_out + recall.failed)
            )
        return recall

    def _merge(self, recall: RecallResult, reqs, arms) -> list[Candidates]:
        """Each request's candidates: its channels' lists merged by their quotas (its arm's
        where it has one), without the items it excludes."""
        return [
            self._candidates(recall.per_query[j], r.exclude, quotas(self.quotas, arms[j]))
            for j, r in enumerate(reqs)
        ]

    def _history(self, reqs, recall: RecallResult) -> list[int | None]:
        """How many interactions the worker knows of per request's user: its own recent
        clicks, else those a channel read from Redis (at most ten); None where no channel
        that reads them (i2i, co-visitation, sequel) met its deadline."""
        readers = {"i2i", "covisit", "sequel"} & set(self.runner.configs)
        known = bool(readers - set(recall.timed_out) - set(recall.failed))
        if not known:
            return [None] * len(reqs)
        return [
            len(self.state.recent_clicks(r.user_id) or recall.recent.get(r.user_id, ()))
            for r in reqs
        ]

    def _tiers(self, reqs, arms, left_ms, versions, queue_depth, models, now_ms, history):
        """Each request's tier (``degrade.Ladder``), steered by its arm: from its device, the
        budget it has ``left_ms`` after recall, the queue behind the batch, whether a valid
        cached reply exists, what the models can do and cost, and the user's history."""
        choices: list[Choice] = []
        self.ranking.collect_costs()  # the device's times of the batches before
        for j, r in enumerate(reqs):
            situation = Situation(
                device=r.context.device if r.context else None,
                budget_ms=left_ms[j],
                queue_depth=queue_depth,
                cached=self.results.peek_valid(self._cache_key(r), versions[j], now_ms),
                full_ok=models is not None and time.monotonic() >= self.ranking.full_failed_until,
                light_ok=models is not None,
                full_cost_ms=self.ranking.full_cost_ms,
                light_cost_ms=self.ranking.light_cost_ms,
                history=history[j],
            )
            choices.append(steer(self.ladder.choose(situation), arms[j]))
        return choices

    def _rerank(self, merged, ranked, reqs, arms):
        """The ranked requests' lists: MMR (each arm's λ) and category spacing."""
        s = self.settings
        lams = lambdas(arms, s.mmr_lambda)
        ks = [r.k for r in reqs]
        return self.reranking.rerank(
            merged, ranked, ks, lams, self.name_of_slot, self._categories, s
        )

    # --------------------------------------------------------------------------- reply
    def _replies(
        self,
        batch: list[Inbound],
        reqs: list[RecommendRequest],
        arms: list[Arm | None],
        users: BatchUsers,
        outcome: RankedBatch,
        degraded: list[str],
        models,
        times: StageClock,
    ) -> list[RecommendReply]:
        """The batch's replies, counted; the rows the ranking used are marked replied (the
        ``reply`` freshness stage)."""
        now_ms = times.now_ms
        item_table_version = self.cache.items.newest
        # each request's share of the batch's work: recall and re-ranking split evenly, and its
        # own ranker's time over the requests that ranker scored (an A/B variant's cost)
        shared_ms = times.shared_ms(time.monotonic(), len(batch))
        counts = ReplyCounts(self.mode, self.new_names)
        replies = []
        for j, (b, r) in enumerate(zip(batch, reqs, strict=True)):
            reason = outcome.choices[j].reason
            tier, items = self._items(j, r, outcome, users.versions[j], now_ms)
            ranked = j in outcome.probs
            cost_ms = shared_ms + outcome.rank_ms[j]
            timings = times.timings(b, ranked, time.monotonic(), cost_ms)
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
                    user_embedding_version=int(users.versions[j]),
                    user_embedding_age_ms=users.ages_ms[j],
                    item_table_version=item_table_version,
                    timings_ms={k: round(v, 3) for k, v in timings.items()},
                    worker=self.worker_id,
                    ranker=outcome.rankers[j] if ranked else None,
                    mode=self.mode,
                    **reply_fields(arms[j]),
                )
            )
            counts.reply(tier, reason, degraded, items, timings)
            self.shown.shown(r.user_id, [i[0] for i in items], now_ms)
        counts.close()
        used = [
            self.slot_of.get(name, -1) for j in outcome.probs for name, _, _ in outcome.lists[j]
        ]
        slots = (users.slots[list(outcome.probs)], np.asarray(used, np.int64))  # rows ranked
        self.cache.observe_reply(*(x[x >= 0] for x in slots))
        return replies

    def _items(self, j: int, r: RecommendRequest, outcome: RankedBatch, version, now_ms: int):
        """Request ``j``'s tier and items: its re-ranked list where a model ranked it (kept in
        the result cache where the tier is full), else the cached reply, else the hot list."""
        tier = outcome.choices[j].tier
        if j in outcome.probs:
            items = outcome.lists[j]
            if tier == FULL:
                self.results.put(self._cache_key(r), version, items, now_ms)
            return tier, items
        if tier == CACHED:
            items = self.results.get(self._cache_key(r), version, now_ms) or []
            excluded = set(r.exclude)
            return tier, [i for i in items if i[0] not in excluded and self._listed(i[0])][: r.k]
        return HOT, self.hot_replies.items(self.snap, r, self._listed)

    def _users(self, reqs: list[RecommendRequest], now_ms: int) -> BatchUsers:
        """The requests' users' rows from the cache; where Redis is away, those not resident
        start from their initial rows (noted)."""
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
        return BatchUsers(rows, versions.tolist(), ages, note, slots)

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
