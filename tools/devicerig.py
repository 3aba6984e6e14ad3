"""The worker's device paths in one process, without a broker or Redis: the embedding cache on
a device, the local learner, the ranking and re-ranking stages, and a model of every kind —
what the device check (``tools/device_check.py``) and the round-trip and out-of-memory tests
drive.

Rows are created from their ids (the store holds none), the models are untrained (their
round trips, memory and times are a trained model's), and the catalogue is ``items`` items in
``categories`` categories, every one resident and kept; a ranking batch is ``requests``
requests of ``candidates`` candidates each, drawn at random.

    rig = DeviceRig(torch.device("cuda"), RigConfig())
    rig.learner.learn(rig.examples(4000, seed=1))
    choices, lists = rig.serve(rig.batch(seed=2), "wide_deep")
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, replace

import numpy as np
import torch

from freshcore import clock
from inference.device import STORAGE_DTYPES
from inference.learning.admission import AdmissionFilter
from inference.learning.learner import LearningSettings, LocalLearner
from inference.learning.outbox import GradientOutbox
from inference.learning.pending import PendingSteps
from inference.learning.steps import Examples, LabelConfig
from inference.models.features import DENSE
from inference.models.kinds import KINDS
from inference.models.modelfile import ModelSet
from inference.models.ranking import store_half
from inference.serving.batch import Candidates
from inference.serving.degrade import FULL, Choice
from inference.serving.rankstage import RankBatch, RankingStage
from inference.serving.rerankstage import RerankStage
from inference.serving.settings import ServingSettings
from inference.serving.snapshot import Catalogue, Snapshot
from inference.tables.cache import EmbeddingCache
from inference.tables.recent import RecentClicks
from schemas.ids import row_ids
from schemas.records import RecommendRequest, RequestContext
from schemas.rows import TABLE_ITEM, TABLE_USER


@dataclass(frozen=True)
class RigConfig:
    dim: int = 32
    users: int = 4000
    items: int = 20_000
    categories: int = 20
    requests: int = 32
    candidates: int = 300
    k: int = 20
    table_dtype: str = "float32"
    ranking_dtype: str = "float32"
    loss: str = "logistic"
    sampled_negatives: int = 4
    """``softmax``: the negatives of each positive's group."""
    seed: int = 0


def no_rows(table: int, ids: list[int]):
    """A store that holds no row: every row is created from its id."""
    return np.zeros(len(ids), bool), None, None, None


def every_model(device: torch.device, dim: int, dtype: str = "float32") -> ModelSet:
    """An untrained model of every kind (``KINDS``), on ``device``, its weights held in
    ``dtype`` as ``ModelWatcher`` holds them."""
    made = {}
    for name, kind in KINDS.items():
        torch.manual_seed(0)
        model = kind.build(dim, None, DENSE).to(device).eval()
        made[name] = store_half(model) if dtype == "float16" else model
    return ModelSet("untrained", made.pop("wide_deep"), made.pop("light"), made)


def catalogue(cfg: RigConfig) -> Catalogue:
    """``cfg.items`` items ``i0``… in ``cfg.categories`` categories, priced at random."""
    rng = np.random.default_rng(cfg.seed)
    names = [f"i{n}" for n in range(cfg.items)]
    category = rng.integers(0, cfg.categories, cfg.items)
    return Catalogue(
        names,
        row_ids(names),
        category,
        [f"c{c}" for c in range(cfg.categories)],
        rng.uniform(1, 100, cfg.items).astype(np.float32),
        [None] * cfg.items,
        {name: n for n, name in enumerate(names)},
    )


class DeviceRig:
    """The device parts of a worker, built as ``inference/assembly.py`` builds them."""

    def __init__(self, device: torch.device, cfg: RigConfig, host_rows: int = 0) -> None:
        """``host_rows``: the host RAM level's rows per table (``FRESHREC_HOST_*_ROWS``)."""
        self.cfg, self.device = cfg, device
        self.rng = np.random.default_rng(cfg.seed)
        self.cache = EmbeddingCache(
            cfg.dim,
            cfg.users,
            no_rows,
            device,
            host_users=host_rows,
            host_items=host_rows,
            dtype=STORAGE_DTYPES[cfg.table_dtype],
        )
        self.catalogue = catalogue(cfg)
        self.item_slots = self.cache.slots(TABLE_ITEM, self.catalogue.row_ids)
        self.cache.keep_items(self.item_slots)
        self.slot_of = dict(zip(self.catalogue.names, self.item_slots.tolist(), strict=True))
        n = len(self.cache.item_ids)
        self.name_of_slot = np.empty(n, object)
        self.name_of_slot[self.item_slots] = self.catalogue.names
        self.cat_index = np.full(n, -1, np.int64)
        self.cat_index[self.item_slots] = np.arange(cfg.items)
        features = self.rng.random((cfg.items, 3)).astype(np.float32)
        self.snapshot = Snapshot(self.catalogue, features, {}, [], 1, 0)
        labels = LabelConfig(sampled_negatives=cfg.sampled_negatives, loss=cfg.loss)
        self.learner = LocalLearner(
            LearningSettings(dim=cfg.dim, labels=labels),
            self.cache,
            PendingSteps(),
            GradientOutbox(1, AdmissionFilter(1, 3_600_000), linger_ms=0),
            RecentClicks(cfg.users),
            RecentClicks(cfg.users),
            lambda: self.slot_of,
            collections.defaultdict(int),
        )
        self.models = every_model(device, cfg.dim, cfg.ranking_dtype)
        self.settings = ServingSettings()
        self.ranking = RankingStage(self.settings, self.cache, None, None)
        self.reranking = RerankStage(self.cache)

    def users(self, n: int) -> list[str]:
        return [f"u{u}" for u in self.rng.integers(0, self.cfg.users, n)]

    def examples(self, n: int) -> Examples:
        """A slice of ``n`` labelled examples of the rig's loss: 30% positives (logistic);
        each positive with ``sampled_negatives`` items of the catalogue in its group
        (softmax)."""
        names = self.catalogue.names
        if self.cfg.loss == "softmax":
            size = 1 + self.cfg.sampled_negatives
            groups = np.repeat(np.arange(max(n // size, 1)), size)
            users = np.repeat(self.users(len(groups) // size), size).tolist()
            labels = (np.arange(len(groups)) % size == 0).astype(np.float32)
        else:
            groups, users = None, self.users(n)
            labels = (self.rng.random(n) < 0.3).astype(np.float32)
        items = [names[i] for i in self.rng.integers(0, len(names), len(users))]
        times = np.full(len(users), clock.now_ms(), np.int64)
        return Examples.of(users, items, labels, np.ones(len(users)), times, groups)

    def batch(self, requests: int | None = None) -> RankBatch:
        """A ranking batch: ``requests`` (``cfg.requests``) requests of pc users, each with
        ``cfg.candidates`` catalogue candidates, ten recent clicks and a sequence."""
        cfg, names = self.cfg, self.catalogue.names
        now = clock.now_ms()
        reqs = [
            RecommendRequest(f"r{j}", user, cfg.k, RequestContext("pc", "north", now))
            for j, user in enumerate(self.users(requests or cfg.requests))
        ]
        slots = self.cache.slots(TABLE_USER, row_ids([r.user_id for r in reqs]))
        merged = []
        for _ in reqs:
            picked = self.rng.choice(self.item_slots, cfg.candidates, replace=False)
            merged.append(Candidates(picked, {"vector": picked}))
        recent = [[names[i] for i in self.rng.integers(0, len(names), 10)] for _ in reqs]
        return RankBatch(
            reqs,
            self.cache.rows(TABLE_USER, slots),
            merged,
            [None] * len(reqs),
            self.snapshot,
            self.slot_of,
            self.cat_index,
            self.name_of_slot,
            recent,
            recent,
        )

    def serve(self, b: RankBatch, ranker: str, tier: str = FULL):
        """``b`` ranked by ``ranker`` (any served kind, ``tiered`` included; ``light``: the
        light tier) and re-ranked: each request's choice (a hot-list one where a model failed)
        and the re-ranked lists, as ``Recommender.serve`` makes them."""
        settings = replace(self.settings, ranker="wide_deep" if ranker == "light" else ranker)
        self.ranking.use(settings)
        choices = [Choice("light" if ranker == "light" else tier, "ok") for _ in b.reqs]
        ranked: dict[int, torch.Tensor] = {}
        self.ranking.rank(b, choices, ranked, self.models)
        ks = [r.k for r in b.reqs]
        lams = [settings.mmr_lambda] * len(b.reqs)
        lists = self.reranking.rerank(
            b.merged, ranked, ks, lams, self.name_of_slot, self.categories, settings
        )
        return choices, lists

    def categories(self, slots: np.ndarray) -> list[int]:
        index = self.cat_index[slots]
        return np.where(index >= 0, self.catalogue.category[np.maximum(index, 0)], -1).tolist()
