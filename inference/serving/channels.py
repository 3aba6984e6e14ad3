"""Recall channels: one class each, registered in ``CHANNELS``.

The contract (``RecallChannel``): a channel is built once per worker around the
``ServingState`` — the item table, the catalogue as cache slots, the hot lists — which the
recommender keeps current (a new catalogue or hot list replaces its fields between batches).
``recall(queries, n)`` answers, for each query of a batch, up to ``n`` cache slots of items
(an ``int64`` numpy array, best first) drawn from catalogue items only — or a ``Recalled``
with those lists and the users' recent clicks it read on the way, which the ranking uses only
if the channel met its deadline (a channel writes no shared state); it may read Redis
(then it must tolerate ``redis.RedisError`` by raising: the runner counts it as a failure).
``inline = True`` declares a channel that only slices memory the worker holds
(microseconds): the runner calls it on its own thread instead of handing it to the pool.
``default`` is its quota of candidates and its deadline, both settings
(``FRESHREC_RECALL_CHANNELS`` chooses which channels run).

Adding a channel is a class and a line: subclass ``RecallChannel`` with a ``name``, a
``default`` and ``recall``, and add the class to ``CHANNELS`` (``docs/serving.md`` shows one).

- ``vector``: the user's row against the resident item table — one matmul and top-k on the
  device for the whole batch (exact; the IVF index of ``ann.py`` on large catalogues);
- ``i2i``: the user's recent clicks as a query: the mean of those items' rows, weighted
  towards the newest, searched within the clicked items' categories;
- ``covisit``: the user's recent clicks' co-visitation neighbours, learnt from the stream by
  the streams app (item-to-item collaborative filtering);
- ``sequel``: what followed the user's last items for other users (sequential rules, counted
  by the streams app);
- ``hot``, ``region``: the merged global and regional hot lists;
- ``new``: items created within the new-item window.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import redis
import torch

from freshcore.neighbours import ANCHORS, read_serving_list, recency_weighted
from freshcore.partitioner import str_partitions
from freshcore.rediskeys import RedisKeys
from freshcore.sequels import SEQUEL_ANCHORS, successor_scores
from inference.device import to_device
from inference.serving.ann import IVFIndex
from inference.serving.recall import ChannelConfig, Recalled, RecallQuery
from inference.serving.searches import category_members, search_within_categories, top_k_slots
from inference.tables.cache import EmbeddingCache
from schemas.rowbatch import TABLE_ITEM

NONE = np.empty(0, np.int64)
NEW_ITEMS = "\0new"
"""The new-items list among ``ServingState.lists`` (beside the hot lists' scopes)."""


class BatchMemo:
    """One value per batch of queries, computed once for every channel that asks (the i2i
    and co-visitation channels both need the batch's recent clicks, from their own threads:
    the first to ask reads them, the other waits for that read instead of making its own).
    A batch is known by its query list's identity: the runner gives every channel the same
    list, a new one each batch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: object = None
        self._value: object = None

    def get(self, queries: object, compute: Callable[[], object]):
        with self._lock:
            if self._key is not queries:
                self._value, self._key = compute(), queries
            return self._value


@dataclass
class ServingState:
    """What recall channels read. The recommender owns it and replaces its fields when it
    adopts a snapshot (between batches, never during one)."""

    cache: EmbeddingCache
    redis: redis.Redis
    keys: RedisKeys
    recent_clicks: Callable[[str], list[str]]
    """The worker's own view of a user's recent clicks, newest first."""
    ann_nprobe: int = 0
    slot_of: dict[str, int] = field(default_factory=dict)
    """Catalogue item id → its cache slot."""
    named: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    """Per slot: is the item in the catalogue?"""
    unnamed_bias: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """0 for catalogue items, -inf for rows not (yet) in the catalogue, per slot."""
    named_count: int = 0
    slot_category: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Per slot: its category bucket (-1: not in the catalogue)."""
    category_slots: dict[int, np.ndarray] = field(default_factory=dict)
    """Catalogue slots per category (the i2i channel searches only these)."""
    lists: dict[str, np.ndarray] = field(default_factory=dict)
    """Hot lists per scope (``global``, a region) and the new items (``NEW_ITEMS``), as
    cache slots, best first."""
    ann: IVFIndex | None = None
    item_shards: int = 0
    """``events.by_item`` partitions: where an item's neighbour list is (0: not known yet)."""
    recents: BatchMemo = field(default_factory=BatchMemo)
    """The batch's recent clicks (``recent_clicks``), read once for the channels that use them."""

    def adopt_catalogue(
        self, names: Sequence[str], category: np.ndarray, slots: np.ndarray, n: int
    ) -> None:
        """A new catalogue: its items ``names`` (of categories ``category``) at ``slots`` of
        an item table of ``n`` slots."""
        device = self.cache.device
        named = torch.zeros(n, dtype=torch.bool, device=device)
        named[self.cache.to_device(slots)] = True
        slot_category = np.full(n, -1, np.int64)
        slot_category[slots] = category
        self.slot_category = slot_category
        self.category_slots = category_members(category, slots)
        self.unnamed_bias = torch.zeros(n, device=device).masked_fill(~named, float("-inf"))
        self.slot_of = dict(zip(names, slots.tolist(), strict=True))
        self.named, self.named_count = named, len(names)

    def adopt_index(self, index: IVFIndex) -> None:
        """A newly built IVF index for the vector channel (from the build's thread: a batch
        reads the one it finds, whole)."""
        self.ann = index

    def adopt_lists(
        self, hot: Mapping[str, Sequence[str]], new: Sequence[str], item_shards: int
    ) -> None:
        """A snapshot's hot lists (per scope) and new items, as the catalogue's slots (items
        it does not list are left out), and its ``events.by_item`` partitions."""
        self.item_shards = item_shards
        lists = dict(hot)
        lists[NEW_ITEMS] = new
        get = self.slot_of.get
        self.lists = {
            scope: np.fromiter((s for s in (get(x) for x in names) if s is not None), np.int64)
            for scope, names in lists.items()
        }


class RecallChannel(abc.ABC):
    """A recall channel (see the module's docstring for the contract)."""

    name: ClassVar[str]
    default: ClassVar[ChannelConfig]
    inline: ClassVar[bool] = False

    def __init__(self, state: ServingState) -> None:
        self.state = state

    @abc.abstractmethod
    def recall(self, queries: Sequence[RecallQuery], n: int) -> list[np.ndarray]:
        """For each query, up to ``n`` cache slots of catalogue items, best first."""


class VectorChannel(RecallChannel):
    name = "vector"
    default = ChannelConfig(250, 80.0)

    def recall(self, queries, n):
        dev = self.state.cache.device
        rows = torch.stack([to_device(q.user_row, dev) for q in queries])
        return top_k_slots(self.state, rows, n)


class I2IChannel(RecallChannel):
    """Recent clicks: this worker's own (it sees every event of its users' partitions, so a
    click counts here before any other service has seen it), else the streams app's list in
    Redis; their recency-weighted mean row searched within their categories."""

    name = "i2i"
    default = ChannelConfig(100, 60.0)

    def recall(self, queries, n):
        st = self.state
        recents, fetched = recent_clicks(st, queries)
        dim = st.cache.dim
        out: list[np.ndarray] = [NONE for _ in queries]
        items = st.cache.items.rows
        size = min(len(st.named), len(items), len(st.slot_category))
        users = [j for j, r in enumerate(recents) if r]
        if not users or size == 0:
            return Recalled(out, fetched)
        get = st.slot_of.get
        clicked = [
            [x for x in (get(name) for name in recents[j][:10]) if x is not None] for j in users
        ]
        keep = [row for row, c in enumerate(clicked) if c]
        if not keep:
            return Recalled(out, fetched)
        users, clicked = [users[r] for r in keep], [clicked[r] for r in keep]
        # one query row per user, on the tables' device: the clicked items' mean row, each
        # weighted 0.8^age (newest first), searched within the clicked items' categories
        lens = [len(c) for c in clicked]
        flat = np.concatenate([np.asarray(c, np.int64) for c in clicked])
        weights = np.concatenate([0.8 ** np.arange(n_, dtype=np.float32) for n_ in lens])
        owner = np.repeat(np.arange(len(users)), lens)
        weights /= np.bincount(owner, weights)[owner].astype(np.float32)
        vecs = st.cache.rows(TABLE_ITEM, flat)
        vecs[:, dim:] = 0.0  # the query carries no bias column
        q = torch.zeros((len(users), st.cache.w), device=items.device).index_add_(
            0, st.cache.to_device(owner), vecs * st.cache.to_device(weights)[:, None]
        )
        allowed = np.split(st.slot_category[flat], np.cumsum(lens)[:-1])
        found = search_within_categories(items[:size], q, allowed, st.category_slots, n)
        for row, j in enumerate(users):
            out[j] = found[row]
        return Recalled(out, fetched)


class HotChannel(RecallChannel):
    name = "hot"
    default = ChannelConfig(80, 20.0)
    inline = True

    def recall(self, queries, n):
        top = self.state.lists.get("global", NONE)[:n]
        return [top for _ in queries]


class RegionChannel(RecallChannel):
    name = "region"
    default = ChannelConfig(40, 20.0)
    inline = True

    def recall(self, queries, n):
        lists = self.state.lists
        return [lists.get(q.region, NONE)[:n] if q.region else NONE for q in queries]


class NewItemsChannel(RecallChannel):
    name = "new"
    default = ChannelConfig(30, 20.0)
    inline = True

    def recall(self, queries, n):
        top = self.state.lists.get(NEW_ITEMS, NONE)[:n]
        return [top for _ in queries]


class CoVisitChannel(RecallChannel):
    """Co-visitation (item-to-item collaborative filtering learnt from the stream): the
    neighbour lists the streams app keeps for the user's last clicked items (``covisit:{sN}``,
    P(b | a) of the items clicked after a by the same users), scored by
    ``freshcore.neighbours.recency_weighted`` (each anchor weighted 0.9^age, newest first,
    summed per candidate; the anchors themselves left out). Every neighbour's score, not
    only the quota's, goes to ranking as the ``covisit`` feature (``Recalled.scores``)."""

    name = "covisit"
    default = ChannelConfig(100, 60.0)

    def recall(self, queries, n):
        recents, fetched = recent_clicks(self.state, queries)
        anchors = [r[:ANCHORS] for r in recents]
        lists = anchor_lists(self.state, anchors, self.state.keys.covisit)
        return scored_slots(self.state, recents, fetched, n, recency_weighted, lists)


class SequelChannel(RecallChannel):
    """Sequential rules (what followed an item for other users, Ludewig & Jannach 2018): the
    successor lists the streams app keeps (``sequel:{sN}``, each successor's share of the
    anchor's rules) for the user's newest ``SEQUEL_ANCHORS`` distinct clicks, scored by
    ``freshcore.sequels.successor_scores`` (the item just consumed weighs 1, the two before
    it 0.5 and 0.25; the user's recent items left out). Every successor's score goes to
    ranking as the ``sequel`` feature."""

    name = "sequel"
    # the rules' hits are the first few successors of the last item, and the merge's budget
    # is shared with the hot, regional and new lists after it
    default = ChannelConfig(50, 60.0)

    def recall(self, queries, n):
        recents, fetched = recent_clicks(self.state, queries)
        anchors = [list(dict.fromkeys(r))[:SEQUEL_ANCHORS] for r in recents]
        lists = anchor_lists(self.state, anchors, self.state.keys.sequel)
        return scored_slots(self.state, recents, fetched, n, successor_scores, lists)


def anchor_lists(
    st: ServingState, anchors: list[list[str]], key_of: Callable[[int], str]
) -> dict[str, list[tuple[str, float]]]:
    """The published lists (``freshcore.neighbours.serving_list``) of every query's
    ``anchors``, each from the hash ``key_of(partition)`` of its ``events.by_item``
    partition: one Redis round trip for the batch (none without anchors)."""
    wanted = list(dict.fromkeys(a for mine in anchors for a in mine))
    if not wanted or st.item_shards <= 0:
        return {}
    shards = str_partitions(wanted, st.item_shards).tolist()
    pipe = st.redis.pipeline(transaction=False)
    for a, shard in zip(wanted, shards, strict=True):
        pipe.hget(key_of(shard), a)
    return dict(zip(wanted, map(read_serving_list, pipe.execute()), strict=True))


def scored_slots(st: ServingState, recents, fetched, n: int, score, lists) -> Recalled:
    """Each query's best ``n`` catalogue slots by ``score(recent, lists)`` (item → score),
    with every found item's score (slot → score: the ranking feature)."""
    out: list[np.ndarray] = [NONE for _ in recents]
    scored: list[dict[int, float]] = [{} for _ in recents]
    if not lists:
        return Recalled(out, fetched, scored)
    get = st.slot_of.get
    for j, recent in enumerate(recents):
        scores = scored[j]
        for b, value in score(recent, lists).items():
            slot = get(b)
            if slot is not None:
                scores[slot] = value
        if scores:
            best = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
            out[j] = np.fromiter((s for s, _ in best), np.int64, len(best))
    return Recalled(out, fetched, scored)


def recent_clicks(st: ServingState, queries) -> tuple[list[list[str]], dict[str, list[str]]]:
    """Each query's user's recent clicks, newest first: the worker's own, else the streams
    app's list in Redis (one round trip for those, once a batch: ``ServingState.recents``);
    and those read from Redis, by user."""
    return st.recents.get(queries, lambda: _read_recent_clicks(st, queries))


def _read_recent_clicks(st: ServingState, queries):
    recents: list[list[str]] = [st.recent_clicks(q.user_id) for q in queries]
    missing = [j for j, r in enumerate(recents) if not r]
    if missing:
        pipe = st.redis.pipeline(transaction=False)
        for j in missing:
            pipe.lrange(st.keys.user_recent(queries[j].user_id), 0, 9)
        for j, raw in zip(missing, pipe.execute(), strict=True):
            recents[j] = [r.decode().partition("|")[0] for r in raw]
    return recents, {queries[j].user_id: recents[j] for j in missing if recents[j]}


CHANNELS: dict[str, type[RecallChannel]] = {
    c.name: c
    for c in (
        VectorChannel,
        I2IChannel,
        CoVisitChannel,
        SequelChannel,
        HotChannel,
        RegionChannel,
        NewItemsChannel,
    )
}
"""Every recall channel, by name, in the order the runner starts them."""


def default_channels() -> dict[str, ChannelConfig]:
    """Every registered channel with its default quota and deadline (all of them run unless
    ``FRESHREC_RECALL_CHANNELS`` names a subset)."""
    return {name: c.default for name, c in CHANNELS.items()}


DEFAULT_CHANNELS = default_channels()
"""The channels FreshRec ships, with their defaults."""


def make_channels(
    configs: Mapping[str, ChannelConfig], state: ServingState
) -> dict[str, RecallChannel]:
    """The channels ``configs`` names, built around ``state``."""
    unknown = set(configs) - set(CHANNELS)
    if unknown:
        raise ValueError(f"no such recall channel: {', '.join(sorted(unknown))}")
    return {name: CHANNELS[name](state) for name in configs}


def parse_delays(spec: str) -> dict[str, float]:
    """``"i2i=300,hot=5"`` → {"i2i": 300.0, "hot": 5.0}."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in CHANNELS:
            raise ValueError(
                f"expected channel=ms with a channel of {tuple(CHANNELS)}, got {part!r}"
            )
        out[name] = float(value)
    return out


def parse_quotas(spec: str) -> dict[str, int]:
    """``"new=120,hot=60"`` → {"new": 120, "hot": 60}: candidates per recall channel.

    >>> parse_quotas("new=120, hot=60")
    {'new': 120, 'hot': 60}
    """
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in CHANNELS or not value.strip().isdigit():
            raise ValueError(
                f"expected channel=count with a channel of {tuple(CHANNELS)}, got {part!r}"
            )
        out[name] = int(value)
    return out
