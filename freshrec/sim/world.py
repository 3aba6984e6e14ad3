"""A seeded synthetic world: users, items, latent preferences and a behaviour model. Pure.

The world is the ground truth that benchmarks score recommendations against. Items are
materialised (1M items ≈ 100 MB); users are not: every user attribute is a pure function of
``(seed, user index)`` through a counter-based hash, so 10M users cost no memory at all.

Behaviour: P(click | impression of i to u at t) = σ(a·⟨p_u(t), q_i⟩ + w·pop_i + b), where p_u
and q_i are unit vectors near their category centroids and pop_i is the item's log Zipf
popularity, centred. A click converts with P = σ(a_c·⟨p_u, q_i⟩ + b_c). At ``drift_at_ms`` a
fraction of users switch their main interest to another category (interest drift).

>>> w = World(WorldConfig(seed=1, n_users=1000, n_items=500))
>>> p = w.click_probability(np.array([0, 1]), np.array([3, 4]), t_ms=w.config.start_ms)
>>> bool(((p > 0) & (p < 1)).all())
True
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from schemas.hashing import hash_normal, hash_uniform
from schemas.records import DEVICE_CLASSES


def zipf_rank(u: np.ndarray, n: int, s: float) -> np.ndarray:
    """Ranks 0..n-1 with P(rank r) ∝ (r+1)^-s, by inverting the continuous approximation."""
    if abs(s - 1.0) < 1e-9:
        r = np.exp(u * np.log(n + 1.0)) - 1.0
    else:
        a = 1.0 - s
        r = (u * ((n + 1.0) ** a - 1.0) + 1.0) ** (1.0 / a) - 1.0
    return np.minimum(r.astype(np.int64), n - 1)


def _normalise(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


@dataclass(frozen=True)
class WorldConfig:
    """The world's size and behaviour; everything derives from ``seed``."""

    seed: int = 7
    n_users: int = 1_000_000
    n_items: int = 100_000
    n_categories: int = 40
    regions: tuple[str, ...] = ("north", "south", "east", "west")
    latent_dim: int = 16
    start_ms: int = 1_767_225_600_000  # 2026-01-01T00:00:00Z; item ages are relative to it
    affinity: float = 5.0
    """a: how strongly preference alignment drives clicks."""
    popularity_weight: float = 0.4
    click_bias: float = -3.8
    conversion_affinity: float = 2.0
    conversion_bias: float = -2.5
    zipf_items: float = 1.05
    zipf_users: float = 1.0
    new_item_fraction: float = 0.01
    """Share of items created in the hour before start_ms (the 'new items' channel)."""
    drift_at_ms: int | None = None
    drift_fraction: float = 0.5
    device_mix: tuple[float, float, float] = (0.3, 0.4, 0.3)
    """Shares of high_end, pc, low_end users."""


# streams of hash_uniform/hash_normal; each attribute its own, so they are independent
_S_REGION, _S_DEVICE, _S_CAT1, _S_CAT2, _S_NOISE, _S_DRIFTS, _S_CAT_DRIFT = range(1, 8)


@dataclass
class World:
    """Ground truth: item attributes as arrays, user attributes as functions of the index."""

    config: WorldConfig
    centroids: np.ndarray = field(init=False, repr=False)
    item_category: np.ndarray = field(init=False, repr=False)
    item_vectors: np.ndarray = field(init=False, repr=False)
    item_price: np.ndarray = field(init=False, repr=False)
    item_created_ms: np.ndarray = field(init=False, repr=False)
    item_region: np.ndarray = field(init=False, repr=False)
    """Index into config.regions, or -1 for 'sold everywhere'."""
    item_popularity: np.ndarray = field(init=False, repr=False)
    """Centred log Zipf popularity: the term w·pop_i of the click model."""
    category_items: list[np.ndarray] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        c = self.config
        if c.n_users < 1 or c.n_items < 1 or c.n_categories < 1:
            raise ValueError("a world needs at least one user, item and category")
        rng = np.random.default_rng(c.seed)
        self.centroids = _normalise(rng.standard_normal((c.n_categories, c.latent_dim)))
        n = c.n_items
        self.item_category = rng.integers(0, c.n_categories, n).astype(np.int32)
        noise = rng.standard_normal((n, c.latent_dim), dtype=np.float32) * 0.35
        self.item_vectors = _normalise(
            self.centroids[self.item_category].astype(np.float32) + noise
        ).astype(np.float32)
        category_price = rng.uniform(2.5, 5.5, c.n_categories)
        self.item_price = np.round(
            np.exp(category_price[self.item_category] + 0.5 * rng.standard_normal(n)), 2
        )
        age_ms = rng.uniform(3_600_000, 90 * 86_400_000, n)
        new = rng.random(n) < c.new_item_fraction
        age_ms[new] = rng.uniform(0, 3_600_000, int(new.sum()))
        self.item_created_ms = (c.start_ms - age_ms).astype(np.int64)
        region = rng.integers(0, len(c.regions), n)
        self.item_region = np.where(rng.random(n) < 0.7, -1, region).astype(np.int8)
        # Popularity: a random permutation assigns Zipf ranks to items.
        rank = rng.permutation(n)
        self._item_by_rank = np.argsort(rank).astype(np.int64)
        logp = -c.zipf_items * np.log1p(rank.astype(np.float64))
        self.item_popularity = (logp - logp.mean()) / max(logp.std(), 1e-9)
        order = np.argsort(self.item_category, kind="stable")
        bounds = np.searchsorted(self.item_category[order], np.arange(c.n_categories + 1))
        self.category_items = [order[bounds[k] : bounds[k + 1]] for k in range(c.n_categories)]
        # An affine bijection spreads user activity ranks over user indices.
        self._user_mult = self._coprime_multiplier(c.n_users, rng)

    @staticmethod
    def _coprime_multiplier(n: int, rng: np.random.Generator) -> int:
        import math

        while True:
            m = int(rng.integers(1, max(n, 2))) | 1
            if n == 1 or math.gcd(m, n) == 1:
                return m

    # ---------------------------------------------------------------------------- ids
    @staticmethod
    def user_id(index: int) -> str:
        return f"u{index}"

    @staticmethod
    def item_id(index: int) -> str:
        return f"i{index}"

    @staticmethod
    def index_of(entity_id: str) -> int:
        """The index of ``u123`` / ``i123``; ValueError for ids not of this world."""
        if len(entity_id) < 2 or entity_id[0] not in "ui" or not entity_id[1:].isdigit():
            raise ValueError(f"{entity_id!r} is not a synthetic-world id")
        return int(entity_id[1:])

    # -------------------------------------------------------------------------- users
    def user_region(self, users: np.ndarray) -> np.ndarray:
        u = hash_uniform(self.config.seed, _S_REGION, users)
        return (u * len(self.config.regions)).astype(np.int64)

    def user_device(self, users: np.ndarray) -> np.ndarray:
        """Index into DEVICE_CLASSES."""
        u = hash_uniform(self.config.seed, _S_DEVICE, users)
        return np.searchsorted(np.cumsum(self.config.device_mix)[:-1], u, side="right")

    def with_drift(self, at_ms: int, fraction: float) -> World:
        """This world (same seed, items and users) with its interest drift at ``at_ms``; the
        item arrays are shared, not rebuilt (user attributes read the config when asked)."""
        drifted = copy.copy(self)
        drifted.config = replace(self.config, drift_at_ms=at_ms, drift_fraction=fraction)
        return drifted

    def drifts(self, users: np.ndarray) -> np.ndarray:
        """Which of ``users`` switch their main interest at ``drift_at_ms`` (a fixed
        ``drift_fraction`` of all users, by hash); all False in a world without drift."""
        c = self.config
        if c.drift_at_ms is None:
            return np.zeros(len(users), bool)
        return hash_uniform(c.seed, _S_DRIFTS, np.asarray(users, np.int64)) < c.drift_fraction

    def user_main_category(self, users: np.ndarray, t_ms: int) -> np.ndarray:
        c = self.config
        cat = (hash_uniform(c.seed, _S_CAT1, users) * c.n_categories).astype(np.int64)
        if c.drift_at_ms is not None and t_ms >= c.drift_at_ms:
            drifts = self.drifts(users)
            shift = 1 + (hash_uniform(c.seed, _S_CAT_DRIFT, users) * (c.n_categories - 1))
            cat = np.where(drifts, (cat + shift.astype(np.int64)) % c.n_categories, cat)
        return cat

    def user_vectors(self, users: np.ndarray, t_ms: int) -> np.ndarray:
        """p_u(t): unit preference vectors, shape (len(users), latent_dim)."""
        c = self.config
        users = np.asarray(users, np.int64)
        main = self.user_main_category(users, t_ms)
        second = (hash_uniform(c.seed, _S_CAT2, users) * c.n_categories).astype(np.int64)
        noise = hash_normal(c.seed, _S_NOISE, users, c.latent_dim) * 0.3
        return _normalise(self.centroids[main] + 0.5 * self.centroids[second] + noise)

    def sample_users(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """Active users: Zipf over activity ranks, spread over indices by a bijection."""
        ranks = zipf_rank(rng.random(size), self.config.n_users, self.config.zipf_users)
        return (ranks * self._user_mult) % self.config.n_users

    # -------------------------------------------------------------------------- items
    def sample_popular_items(self, rng: np.random.Generator, size: int) -> np.ndarray:
        ranks = zipf_rank(rng.random(size), self.config.n_items, self.config.zipf_items)
        return self._item_by_rank[ranks]

    def sample_category_items(self, rng: np.random.Generator, categories: np.ndarray) -> np.ndarray:
        out = np.empty(len(categories), np.int64)
        for k in np.unique(categories):
            pool = self.category_items[k]
            mask = categories == k
            if len(pool) == 0:
                out[mask] = self.sample_popular_items(rng, int(mask.sum()))
            else:
                out[mask] = pool[rng.integers(0, len(pool), int(mask.sum()))]
        return out

    # ---------------------------------------------------------------------- behaviour
    def affinity(self, users: np.ndarray, items: np.ndarray, t_ms: int) -> np.ndarray:
        """⟨p_u(t), q_i⟩ for aligned arrays of user and item indices."""
        p = self.user_vectors(users, t_ms)
        return np.einsum("ij,ij->i", p, self.item_vectors[items])

    def click_probability(self, users: np.ndarray, items: np.ndarray, t_ms: int) -> np.ndarray:
        c = self.config
        logit = (
            c.affinity * self.affinity(users, items, t_ms)
            + c.popularity_weight * self.item_popularity[items]
            + c.click_bias
        )
        return 1.0 / (1.0 + np.exp(-logit))

    def conversion_probability(self, users: np.ndarray, items: np.ndarray, t_ms: int) -> np.ndarray:
        """P(conversion | click)."""
        c = self.config
        logit = c.conversion_affinity * self.affinity(users, items, t_ms) + c.conversion_bias
        return 1.0 / (1.0 + np.exp(-logit))

    def device_name(self, index: int) -> str:
        return DEVICE_CLASSES[index]

    # ------------------------------------------------------------------------- logs
    def fingerprint(self) -> str:
        """Identifies the world (its whole configuration): models trained on its logs are
        reused for it and only for it."""
        cfg = json.dumps(asdict(self.config), sort_keys=True, default=str)
        return hashlib.sha256(cfg.encode()).hexdigest()[:16]

    def logged_impressions(
        self,
        n: int,
        rng: np.random.Generator,
        slate: int = 10,
        users: np.ndarray | None = None,
    ) -> dict[str, object]:
        """``n`` logged impressions over the 24 hours before the world's start, for offline
        training (the columns of ``inference.training.train.TrainingLog``;
        ``freshrec.app.training.world_log`` makes one): active users (or ``users``,
        uniformly) see slates (half from their interests, half popular); the click and
        conversion model labels them."""
        n_slates = max(1, n // slate)
        c = self.config
        source = self.source(users)
        who = (
            self.sample_users(rng, n_slates)
            if users is None
            else np.asarray(users, np.int64)[rng.integers(0, len(users), n_slates)]
        )
        users = np.repeat(who, slate)
        t = np.repeat(c.start_ms - rng.integers(0, 86_400_000, n_slates), slate)
        main = self.user_main_category(users, c.start_ms)
        items = self.sample_popular_items(rng, len(users))
        relevant = rng.random(len(users)) < 0.5
        items[relevant] = self.sample_category_items(rng, main[relevant])
        p = self.click_probability(users, items, c.start_ms)
        clicked = rng.random(len(users)) < p
        converted = np.zeros_like(clicked)
        if clicked.any():
            pc = self.conversion_probability(users[clicked], items[clicked], c.start_ms)
            converted[clicked] = rng.random(int(clicked.sum())) < pc
        distinct, numbers = np.unique(users, return_inverse=True)
        regions = np.array(c.regions, object)[self.user_region(users)]
        return dict(
            user_ids=np.array([World.user_id(int(u)) for u in distinct], object),
            item_ids=np.array([World.item_id(i) for i in range(c.n_items)], object),
            item_category=np.array([f"c{int(k)}" for k in self.item_category], object),
            item_price=self.item_price,
            users=numbers.astype(np.int64),
            items=items,
            t_ms=t,
            clicked=clicked,
            converted=converted,
            device=self.user_device(users).astype(np.int64),
            region=regions,
            source=source,
        )

    def source(self, users: np.ndarray | None = None) -> str:
        """The ``source`` a manifest names for models trained on this world's logs (of
        ``users`` only, when given): models are reused for the same source only."""
        if users is None:
            return f"world:{self.fingerprint()}"
        ids = np.unique(np.asarray(users, np.int64))
        return f"world:{self.fingerprint()}:users:{hashlib.sha256(ids.tobytes()).hexdigest()[:12]}"
