"""New catalogue items start where their category's learnt items are: on a catalogue's
adoption, the items this worker holds no learnt row for (none in Redis, no local step) take
their category's mean learnt row (``inference/models/coldstart.py``'s ``category_starts``),
in the cache and, through ``store``, in Redis.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from freshcore import clock
from freshcore import metrics as m
from inference.models.coldstart import category_starts, known_category
from inference.models.features import CATEGORY_BUCKETS
from inference.serving.snapshot import Catalogue
from inference.tables.cache import EmbeddingCache
from schemas.rows import TABLE_ITEM, initial_rows

StartRows = Callable[[np.ndarray, np.ndarray], None]
"""store(row_ids, rows): where the starting rows go (Redis: ``freshcore.rowstore.seed_starts``)."""


def start_cold_items(
    cache: EmbeddingCache, cat: Catalogue, slots: np.ndarray, store: StartRows
) -> None:
    """Catalogue items this worker holds no learnt row for (none in Redis, no local step)
    start from their category's mean learnt row, here and in Redis (where no row exists
    yet: another worker's start, or the parameter server's row, wins). Only the cold
    items' categories are read: a new item in a large catalogue costs its category's
    rows, not the catalogue's. ``cat``'s items are at ``slots``."""
    items = cache.items
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
    jitter = np.zeros((len(subset), cache.w), np.float32)
    is_cold = ~learnt[subset]
    jitter[is_cold] = initial_rows(cat.row_ids[subset[is_cold]], TABLE_ITEM, cache.dim)
    rows, changed = category_starts(
        cache.rows(TABLE_ITEM, slots[subset]),
        torch.from_numpy(category[subset]),
        torch.from_numpy(learnt[subset]),
        cache.to_device(jitter),
        CATEGORY_BUCKETS,
    )
    started = np.flatnonzero(changed.cpu().numpy())
    if not len(started):
        return
    at = slots[subset[started]]
    starts = rows[cache.to_device(started)]
    items.rows.index_copy_(0, cache.to_device(at), cache.stored(starts))
    items.set_version(at, 1)  # a starting row, as offline training's: any learnt row is newer
    items.event_ms[at] = clock.now_ms()
    m.COLD_ITEMS_STARTED.inc(len(started))
    store(cat.row_ids[subset[started]], starts.cpu().numpy())
