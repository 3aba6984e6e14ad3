"""What the worker caches from Redis for serving, refreshed on a background thread.

- the catalogue (category, price, region of every item), reloaded when the streams app
  writes to it (``items:version`` moves: items set or deleted), when its size changes, and
  every ``catalogue_refresh_s``;
- item features (smoothed CTR/CVR, hot score) every ``features_refresh_s`` — the "cached
  features" that ``pc`` devices rank with and everyone falls back to when Redis is down;
- the merged global and per-region hot lists every ``hot_refresh_s`` (the streams app
  publishes per-partition lists; ``freshcore.hotscore.merge_published`` gives the exact top-K);
- the newest items every ``hot_refresh_s``.

A failed refresh keeps the previous snapshot (serving goes on from it) and is retried; the
worker reads ``healthy`` to mark its replies degraded. The worker's thread adopts a new
snapshot between batches (``take``), so serving never sees one half-replaced.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import orjson
import redis

from freshcore import metrics as m
from freshcore.hotscore import PRIOR_CTR, PRIOR_CVR, HotWeights, merge_published
from freshcore.partitioner import str_partitions
from freshcore.rediskeys import RedisKeys
from inference.models.features import CATEGORY_BUCKETS, bucket
from schemas.ids import row_ids

log = logging.getLogger("freshrec.snapshot")


@dataclass
class Catalogue:
    names: list[str]
    row_ids: np.ndarray
    category: np.ndarray  # category buckets
    category_names: list[str]
    price: np.ndarray
    region: list[str | None]
    index: dict[str, int] = field(default_factory=dict)


@dataclass
class Snapshot:
    catalogue: Catalogue | None = None
    features: np.ndarray | None = None
    """(n, 3) [ctr, cvr, hot] aligned with the catalogue."""
    hot: dict[str, list[str]] = field(default_factory=dict)
    """Scope (``global`` or a region) → item ids, hottest first."""
    new: list[str] = field(default_factory=list)
    version: int = 0
    """Bumped when the catalogue is replaced (the worker then re-maps slots)."""
    feature_shards: int = 0
    """``events.by_item`` partitions the features are laid out by (0: none written yet)."""


def read_features(r, keys: RedisKeys, names: list[str], shards: int) -> dict[str, list[float]]:
    """[ctr, cvr, hot] of each of ``names`` that has features, read now: one HMGET per
    feature and ``events.by_item`` partition holding some of them, in one round trip."""
    if not names or shards <= 0:
        return {}
    part = str_partitions(names, shards).tolist()
    groups: dict[int, list[str]] = {}
    for name, p in zip(names, part, strict=True):
        groups.setdefault(p, []).append(name)
    pipe = r.pipeline(transaction=False)
    for p, mine in groups.items():
        for feature in ("ctr", "cvr", "hot"):
            pipe.hmget(keys.item_feature(feature, p), mine)
    replies = iter(pipe.execute())
    out = {}
    for mine in groups.values():
        ctr, cvr, hot = next(replies), next(replies), next(replies)
        for n, c, v, h in zip(mine, ctr, cvr, hot, strict=True):
            if c is not None:
                out[n] = [float(c), float(v or 0.0), float(h or 0.0)]
    return out


def _decode_hash(raw: dict) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


class SnapshotRefresher:
    def __init__(
        self,
        client: redis.Redis,
        keys: RedisKeys,
        hot_k: int = 500,
        *,
        weights: HotWeights | None = None,
        rate_per_hour: float = 0.95,
        time_scale: float = 1.0,
        hot_refresh_s: float = 0.5,
        features_refresh_s: float = 5.0,
        catalogue_refresh_s: float = 60.0,
        new_items: int = 200,
    ) -> None:
        self.redis = client
        self.keys = keys
        self.hot_k = hot_k
        self.hot_refresh_s = hot_refresh_s
        self.features_refresh_s = features_refresh_s
        self.catalogue_refresh_s = catalogue_refresh_s
        self.new_items = new_items
        self.weights = weights or HotWeights()
        self.rate_per_hour = rate_per_hour
        self.time_scale = time_scale
        self.snapshot = Snapshot()
        self.healthy = True
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._fresh = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._catalogue_at = 0.0
        self._features_at = 0.0
        self._catalogue_len = -1
        self._catalogue_version: bytes | None = b"?"  # never a stored value: the first load
        self._hot_cache: dict[str, tuple[int, list[str]]] = {}

    # ------------------------------------------------------------------------- thread
    def start(self) -> None:
        self.refresh_once()
        self._thread = threading.Thread(target=self._run, daemon=True, name="snapshot")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.hot_refresh_s):
            self.refresh_once()

    def take(self) -> Snapshot | None:
        """The snapshot if it changed since the last ``take``, else None."""
        with self._lock:
            if not self._fresh:
                return None
            self._fresh = False
            return self.snapshot

    # ------------------------------------------------------------------------ refresh
    def refresh_once(self) -> None:
        try:
            snap = self._refresh()
        except redis.RedisError as exc:
            if self.healthy:
                log.warning("snapshot refresh failed, serving from the last one: %s", exc)
            self.healthy = False
            self.last_error = str(exc)
            m.SNAPSHOT_REFRESHES.labels("failed").inc()
            return
        if not self.healthy:
            log.info("snapshot refresh recovered")
        self.healthy = True
        self.last_error = None
        m.SNAPSHOT_REFRESHES.labels("ok").inc()
        with self._lock:
            self.snapshot = snap
            self._fresh = True

    def _refresh(self) -> Snapshot:
        now = time.monotonic()
        old = self.snapshot
        cat = old.catalogue
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(k.catalogue_version)
        pipe.hlen(k.item_category)
        pipe.get(k.feature_shards)
        version, size, shards = pipe.execute()
        shards = int(shards or 0)
        if (
            cat is None
            or version != self._catalogue_version
            or size != self._catalogue_len
            or now - self._catalogue_at > self.catalogue_refresh_s
        ):
            cat = self._load_catalogue()
            self._catalogue_version = version
            self._catalogue_len = size
            self._catalogue_at = now
            self._features_at = 0.0
        features = old.features if cat is old.catalogue else None
        if features is None or now - self._features_at > self.features_refresh_s:
            features = self._load_features(cat, shards)
            self._features_at = now
        hot = self._load_hot()
        new = [v.decode() for v in self.redis.zrevrange(k.new_items, 0, self.new_items - 1)]
        version = old.version + (cat is not old.catalogue)
        return Snapshot(cat, features, hot, new, version, shards)

    def _load_catalogue(self) -> Catalogue:
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(k.item_category)
        pipe.hgetall(k.item_price)
        pipe.hgetall(k.item_region)
        cats, prices, regions = (_decode_hash(x) for x in pipe.execute())
        names = sorted(cats)
        index = {n: j for j, n in enumerate(names)}
        buckets: dict[str, int] = {}
        category = np.fromiter(
            (buckets.setdefault(cats[n], bucket(cats[n], CATEGORY_BUCKETS)) for n in names),
            np.int64,
            len(names),
        )
        price = np.fromiter((float(prices.get(n, 0.0)) for n in names), np.float32, len(names))
        return Catalogue(
            names=names,
            row_ids=row_ids(names),
            category=category,
            category_names=[cats[n] for n in names],
            price=price,
            region=[regions.get(n) for n in names],
            index=index,
        )

    def _load_features(self, cat: Catalogue, shards: int) -> np.ndarray:
        k = self.keys
        pipe = self.redis.pipeline(transaction=False)
        names = ("ctr", "cvr", "hot")
        for name in names:
            for shard in range(shards):
                pipe.hgetall(k.item_feature(name, shard))
        out = np.zeros((len(cat.names), 3), np.float32)
        out[:, 0] = PRIOR_CTR  # for items not seen in events yet
        out[:, 1] = PRIOR_CVR
        replies = pipe.execute() if shards else []
        for n, raw in enumerate(replies):
            col = n // shards
            for name, value in raw.items():
                j = cat.index.get(name.decode())
                if j is not None:
                    out[j, col] = float(value)
        return out

    def _load_hot(self) -> dict[str, list[str]]:
        """Merged lists per scope; a scope whose per-partition lists did not change since the
        last refresh keeps its merged list (parsing is what costs here)."""
        k = self.keys
        scopes = sorted(s.decode() for s in self.redis.smembers(k.hot_scopes()))
        if not scopes:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for scope in scopes:
            pipe.hgetall(k.hot(scope))
        out = {}
        for scope, raw in zip(scopes, pipe.execute(), strict=True):
            fingerprint = hash(tuple(sorted(raw.items())))
            cached = self._hot_cache.get(scope)
            if cached is not None and cached[0] == fingerprint:
                out[scope] = cached[1]
                continue
            merged = merge_published(
                [orjson.loads(v) for v in raw.values()],
                self.hot_k,
                self.weights,
                self.rate_per_hour,
                self.time_scale,
            )
            self._hot_cache[scope] = (fingerprint, merged)
            out[scope] = merged
        return out
