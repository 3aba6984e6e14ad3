"""The ranking stage of a serving batch: which model scores each request's candidates, and
one forward pass per model over all the candidates it scores.

A request's ranker: the light model where the ladder chose the light tier; where it chose
the full tier, its experiment variant's ``ranking``, else the worker's ``FRESHREC_RANKER``
(``wide_deep`` by default). The attention rankers read the user's sequence (their last
clicked items, ``inference/models/attention.py``); ``tiered`` routes each candidate by its item's
heat to the full, pruned or light model (``inference/models/tiers.py``). A model the loaded set
lacks (models trained before it existed) is replaced by Wide&Deep, and the reply says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import redis
import torch

from freshcore import clock
from freshcore import metrics as m
from freshcore.hotscore import PRIOR_CTR, PRIOR_CVR
from freshcore.rediskeys import RedisKeys
from inference.device import release_cached, to_device
from inference.models.attention import gather_sequences, sequence_index
from inference.models.features import (
    RECENT,
    FeatureEncoder,
    recent_category_share,
    recent_similarity,
)
from inference.models.kinds import TIER_MODELS, TIERED
from inference.models.modelfile import ModelSet
from inference.models.ranking import score
from inference.models.tiers import HeatSplit, route, thresholds
from inference.serving.arms import Arm, ranker_of
from inference.serving.degrade import FULL_UNAVAILABLE, HOT, LIGHT, Choice, ewma
from inference.serving.devicetime import BatchTotal, DeviceClock
from inference.serving.snapshot import Snapshot, read_features
from inference.tables.cache import EmbeddingCache
from schemas.rows import TABLE_ITEM

log = logging.getLogger("freshrec.serving")
HOST_CLOCK = DeviceClock(torch.device("cpu"))
"""The host's clock, for a model timed without a ranking stage's (``timed_score``)."""
MODEL_ERROR = "model error"
NO_DEVICE_MEMORY = "out of device memory"
"""What a tier reason says of a request ``rank`` sent to the hot list because its model
failed on the batch, or had no device memory for the request even alone."""


def model_failures(reasons: Iterable[str]) -> list[str]:
    """The tier reasons of replies whose model failed (``RankingStage.rank`` serves such a
    request from the hot list, and the reply looks served), or that the ladder stepped down
    from the full tier because it had failed on a batch before: a check that saw one failed.

    >>> model_failures(["ok", "wide_deep model error", "tiered: out of device memory"])
    ['wide_deep model error', 'tiered: out of device memory']
    >>> model_failures(["low_end device: light model", "full model unavailable"])
    ['full model unavailable']
    """
    failed = (MODEL_ERROR, NO_DEVICE_MEMORY, FULL_UNAVAILABLE)
    return [r for r in reasons if any(f in r for f in failed)]


@dataclass(frozen=True)
class RankBatch:
    """What ranking a batch reads, all of it given: the requests, their user rows and merged
    candidates, their experiment arms, the catalogue snapshot the candidates' slots refer to,
    and per request the user's recent clicks (newest first: the real-time features) and
    sequence (the attention rankers' input)."""

    reqs: list
    user_rows: torch.Tensor
    merged: list
    arms: list
    snap: Snapshot
    slot_of: dict[str, int]
    cat_index: np.ndarray
    """Cache slot → the item's index in ``snap.catalogue`` (-1: not in it)."""
    name_of_slot: np.ndarray
    recent: list[list[str]]
    sequences: list[list[str]]
    covisit: list[dict[int, float]] | None = None
    """Per request, the co-visitation score of the items the ``covisit`` channel found (slot →
    score; ``freshcore.neighbours.recency_weighted``); None when it did not run or missed its
    deadline: every candidate's ``covisit`` feature is then 0."""
    sequel: list[dict[int, float]] | None = None
    """Per request, the sequential-rule score of the items the ``sequel`` channel found (slot →
    score; ``freshcore.sequels.successor_scores``); None as for ``covisit``: every
    candidate's ``sequel`` feature is then 0."""


class RankingStage:
    """The recommender's ranking: which model scores each request's candidates, one forward
    pass per model, and what the ladder needs to know of it (each tier's cost per batch, a
    full model that failed)."""

    def __init__(self, settings, cache: EmbeddingCache, client: redis.Redis, keys: RedisKeys):
        self.settings = settings  # ``ranker`` and ``heat_split`` of ``ServingSettings``
        self.cache = cache
        self.redis = client
        self.keys = keys
        self.encoder = FeatureEncoder()
        self._heat_cuts: dict = {}  # split -> (the features snapshot, its hot-score thresholds)
        self.clock = DeviceClock(cache.device)
        """Each model's time as the device spends it (CUDA events, read a batch later)."""
        self.full_cost_ms: float | None = None
        self.light_cost_ms: float | None = None
        self.full_failed_until = 0.0

    def use(self, settings) -> None:
        """Rank the next batches with these ``ServingSettings`` (a serving mode's ``ranker``
        and ``heat_split``); the tiers' measured costs stay."""
        self.settings = settings

    def rank(self, b: RankBatch, choices, ranked, models: ModelSet | None):
        """Fills ``ranked`` (request → probability per candidate); returns a features note
        (or None), each request's ranker (None where no model ranked it) and each request's
        share of the ranking time, ms (its model's time over the batch over the requests it
        scored: what an A/B variant's ranker costs; the host's time on a GPU, whose own the
        tiers' costs follow once the device has spent it, ``DeviceClock``)."""
        reqs, merged, arms = b.reqs, b.merged, b.arms
        rankers: list[str | None] = [None] * len(reqs)
        shares = [0.0] * len(reqs)
        if models is None:
            return None, rankers, shares
        for j, choice in enumerate(choices):
            kind = ranker_of(choice, arms[j], self.settings.ranker) if len(merged[j]) else None
            if kind is not None and kind != TIERED and models.get(kind) is None:
                note = f"no {kind} model in {models.version}: wide_deep"
                choices[j] = Choice(choice.tier, f"{choice.reason}; {note}")
                kind = "wide_deep"
            rankers[j] = kind
        self.collect_costs()
        note = None
        full = BatchTotal(self._full_cost)  # the full tier's models: what the ladder budgets
        for kind in dict.fromkeys(k for k in rankers if k is not None):
            group = [j for j, k in enumerate(rankers) if k == kind]
            started = self.clock.start()
            try:
                parts, no_memory, realtime_note = self._scored(b, kind, group, models)
                note = note or realtime_note
            except Exception as exc:  # a broken model must not stop serving
                log.error("%s model failed on a batch: %s", kind, exc)
                m.DEGRADED.labels(choices[group[0]].tier, "model_error").inc()
                if kind != LIGHT:
                    self.full_failed_until = time.monotonic() + 10
                for j in group:
                    choices[j], rankers[j] = Choice(HOT, f"{kind} {MODEL_ERROR}"), None
                continue
            ranked.update(parts)
            for j in no_memory:
                m.DEGRADED.labels(choices[j].tier, "out_of_memory").inc()
                choices[j], rankers[j] = Choice(HOT, f"{kind}: {NO_DEVICE_MEMORY}"), None
            cost = self.clock.stop(started, self._light_cost if kind == LIGHT else full.part())
            for j in group:
                shares[j] = cost / len(group)
        full.close()
        return note, rankers, shares

    def collect_costs(self) -> None:
        """The tiers' costs (``full_cost_ms``, ``light_cost_ms``) given the times of earlier
        batches the device has spent since (``DeviceClock.collect``): the ladder reads them
        before a batch is ranked."""
        self.clock.collect()

    def _light_cost(self, ms: float) -> None:
        self.light_cost_ms = ewma(self.light_cost_ms, ms)

    def _full_cost(self, ms: float) -> None:
        self.full_cost_ms = ewma(self.full_cost_ms, ms)

    def _scored(self, b: RankBatch, kind: str, group: list[int], models: ModelSet):
        """Per request of ``group``, its candidates' probabilities; the requests the device
        had no memory for even alone; the features note. A batch that does not fit is split
        in halves, each scored alone (``freshrec_ranking_oom_total`` counts each refusal)."""
        try:
            inputs, note, dense = self._inputs(b, group, realtime_features=kind != LIGHT)
            if kind == TIERED:
                arms = [b.arms[j] for j in group]
                probs = self._score_tiered(models, inputs, dense, arms, b.snap.features)
            else:
                probs = self._score(models.get(kind), kind, inputs, b, group)
        except torch.OutOfMemoryError:
            m.RANKING_OOM.labels(kind).inc()
            m.DEVICE_OOM.labels("ranking").inc()
            release_cached(self.cache.device)
            if len(group) == 1:
                log.warning("%s ranking: out of device memory for one request", kind)
                return {}, set(group), None
            log.warning(
                "%s ranking: out of device memory for %d requests, scoring them in halves",
                kind,
                len(group),
            )
            half = len(group) // 2
            parts, failed, note = self._scored(b, kind, group[:half], models)
            more, failed_too, note_too = self._scored(b, kind, group[half:], models)
            return {**parts, **more}, failed | failed_too, note or note_too
        lens = [len(b.merged[j]) for j in group]
        return dict(zip(group, torch.split(probs, lens), strict=True)), set(), note

    def _score(self, model, kind: str, inputs, b: RankBatch, group) -> torch.Tensor:
        if getattr(model, "uses_sequence", False):
            inputs = inputs.with_sequences(*self._sequences(b, group, model.length))
        return timed_score(model, kind, inputs, self.cache.device, self.clock)

    def _sequences(self, b: RankBatch, group, length: int):
        """Each request's user sequence as item rows: their last clicked items the worker
        holds (or Redis gave recall), newest first, those in the catalogue."""
        slot_of = b.slot_of
        sequences = []
        for j in group:
            items = b.sequences[j]
            sequences.append([slot_of[x] for x in items[: 4 * length] if x in slot_of][:length])
        index = sequence_index(sequences, length)
        rows = self.cache.items.rows
        return gather_sequences(lambda ix: rows.index_select(0, ix).float(), index, rows.device)

    def _score_tiered(self, models: ModelSet, inputs, dense, arms: list[Arm | None], features):
        """Each candidate scored by its heat tier's model: one forward pass per tier."""
        owner = inputs.owner
        tiers = np.empty(len(inputs), np.int8)
        for r, arm in enumerate(arms):
            mine = owner == r
            tiers[mine] = route(dense[mine, 3], self._heat_cut(self._split_of(arm), features))
        return score_by_tiers(models, inputs, tiers, self.cache.device, self.clock)

    def _split_of(self, arm: Arm | None) -> HeatSplit:
        v = arm.variant if arm is not None else None
        base = self.settings.heat_split
        if v is None or (v.head_share is None and v.mid_share is None):
            return base
        return HeatSplit(
            base.head_share if v.head_share is None else v.head_share,
            base.mid_share if v.mid_share is None else v.mid_share,
        )

    def _heat_cut(self, split: HeatSplit, features) -> tuple[float, float]:
        """The split's hot-score thresholds over the catalogue snapshot's items, computed once
        per features snapshot and split."""
        held = self._heat_cuts.get(split)
        if held is not None and held[0] is features:
            return held[1]
        cut = thresholds(features[:, 2] if features is not None else np.zeros(0), split)
        if len(self._heat_cuts) > 16:  # splits come from the experiment file: a few
            self._heat_cuts.clear()
        self._heat_cuts[split] = (features, cut)
        return cut

    def _inputs(self, b: RankBatch, group, realtime_features: bool):
        """The ranking inputs of the requests ``group`` (grouped form), with the features
        note, and the items' [price, ctr, cvr, hot] per candidate (the tiers route by hot).
        ``realtime_features``: high_end devices' CTR/CVR/hot read from Redis now."""
        reqs, user_rows, merged = b.reqs, b.user_rows, b.merged
        lens = [len(merged[j]) for j in group]
        slots = np.concatenate([merged[j].slots for j in group])
        owner = np.repeat(np.asarray(group, np.int64), lens)
        n = len(slots)
        items = self.cache.rows(TABLE_ITEM, slots)
        cat_idx = b.cat_index[slots]
        cat = b.snap.catalogue
        dense = np.zeros((n, 4), np.float32)
        dense[:, 1], dense[:, 2] = PRIOR_CTR, PRIOR_CVR  # items no event has touched yet
        known = cat_idx >= 0
        dense[known, 0] = cat.price[cat_idx[known]]
        if b.snap.features is not None:
            dense[known, 1:4] = b.snap.features[cat_idx[known]]
        note = None
        realtime = [j for j in group if (reqs[j].context and reqs[j].context.device == "high_end")]
        if realtime_features and realtime:
            note = self._realtime_features(b, group, lens, realtime, dense)
        categories = np.zeros(n, np.int64)
        categories[known] = cat.category[cat_idx[known]]
        now_ms = clock.now_ms()
        ctx = self.encoder.context(
            [r.context.device if r.context else None for r in reqs],
            [r.context.region if r.context else None for r in reqs],
            [(r.context.ts_ms if r.context and r.context.ts_ms else now_ms) for r in reqs],
        )
        shares, sims = self._recent_features(b, group, lens, categories, items)
        covisit = channel_scores(b.covisit, b, group, lens, n)
        sequel = channel_scores(b.sequel, b, group, lens, n)
        local = np.repeat(np.arange(len(group)), lens)  # grouped: user rows once per request
        inputs = self.encoder.encode(
            user_rows.index_select(0, self.cache.to_device(np.asarray(group, np.int64))),
            items,
            dense,
            categories,
            ctx[owner],
            shares,
            owner=local,
            recent_similarity=sims,
            covisit=covisit,
            sequel=sequel,
        )
        return inputs, note, dense

    def _recent_features(self, b: RankBatch, group, lens, categories: np.ndarray, items):
        """Per candidate (``group``'s, ``lens`` per request, in order): the share of its
        user's recent clicks in its category, and its row's similarity to those clicks'
        rows (0 for a user with no recent clicks in the catalogue)."""
        n, cat = len(categories), b.snap.catalogue
        shares, sims = np.zeros(n, np.float32), torch.zeros(n, device=items.device)
        lo = 0
        for j, size in zip(group, lens, strict=True):
            recent = b.recent[j]
            recent_slots = [b.slot_of[x] for x in recent[:RECENT] if x in b.slot_of]
            if recent_slots:
                ci = b.cat_index[recent_slots]
                recent_cats = cat.category[ci[ci >= 0]].tolist()
                shares[lo : lo + size] = recent_category_share(
                    recent_cats, categories[lo : lo + size]
                )
                rows = self.cache.rows(TABLE_ITEM, np.asarray(recent_slots, np.int64))
                sims[lo : lo + size] = recent_similarity(
                    rows, items[lo : lo + size], self.cache.dim
                )
            lo += size
        return shares, sims

    def _realtime_features(self, b: RankBatch, group, lens, realtime, dense) -> str | None:
        """high_end devices: CTR/CVR/hot read from Redis now, not from the snapshot."""
        offsets = dict(
            zip(group, np.concatenate([[0], np.cumsum(lens)[:-1]]).tolist(), strict=True)
        )
        cand_names = {j: b.name_of_slot[b.merged[j].slots].tolist() for j in realtime}
        names = sorted({name for j in realtime for name in cand_names[j]})
        try:
            fresh = read_features(self.redis, self.keys, names, b.snap.feature_shards)
        except redis.RedisError:
            return "redis unavailable: cached features for high_end"
        for j in realtime:
            base = offsets[j]
            for k, name in enumerate(cand_names[j]):
                got = fresh.get(name)
                if got is not None:
                    dense[base + k, 1:4] = got
        return None


def channel_scores(scored, b: RankBatch, group, lens, n: int) -> np.ndarray:
    """Per candidate (``group``'s, ``lens`` per request, in order): the score a recall
    channel gave it (``scored``: per request, slot → score, as ``RankBatch.covisit`` and
    ``RankBatch.sequel`` hold them), 0 where it found none, or where the channel missed its
    deadline (``scored`` None)."""
    out = np.zeros(n, np.float32)
    if scored is None:
        return out
    lo = 0
    for j, size in zip(group, lens, strict=True):
        found = scored[j]
        if found:
            get = found.get
            out[lo : lo + size] = [get(x, 0.0) for x in b.merged[j].slots.tolist()]
        lo += size
    return out


def timed_score(
    model, kind: str, inputs, device: torch.device, clock: DeviceClock | None = None
) -> torch.Tensor:
    """``score`` on ``device``, its time (as the device spends it: ``clock``; the host's
    without one) and candidates counted under ``kind``."""
    clock = clock or HOST_CLOCK
    started = clock.start()
    probs = score(model, inputs, device, on_device=True)
    seconds = m.RANKING_SECONDS.labels(kind)
    clock.stop(started, lambda ms: seconds.observe(ms / 1000))
    m.RANKED_CANDIDATES.labels(kind).inc(len(inputs))
    return probs


def score_by_tiers(
    models: ModelSet,
    inputs,
    tiers: np.ndarray,
    device: torch.device,
    clock: DeviceClock | None = None,
):
    """Each candidate scored by the model of its tier (``tiers``: ``route``'s), one forward
    pass per tier; the pruned tier's by the full model where the set has no pruned one."""
    probs = torch.empty(len(inputs), device=device)
    for tier, kind in enumerate(TIER_MODELS):
        keep = tiers == tier
        if not keep.any():
            continue
        model = models.get(kind) or models.full
        picked = to_device(np.flatnonzero(keep), device)
        probs[picked] = timed_score(model, kind, inputs.subset(keep), device, clock)
    return probs
