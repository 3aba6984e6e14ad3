"""Room in the item table when the device has no memory to grow it (``EmbeddingCache``'s
``items_bounded``): the table keeps its size, the catalogue's rows included, and the least
recently touched of the other rows go to host RAM (the level below, ``host.py``) to make room,
a tenth of them more than needed so that it happens once in many lookups; a row let go is
taken from host RAM again when it is next looked up.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

log = logging.getLogger("freshrec.worker")


def make_room(cache, n: int, busy: np.ndarray) -> int:
    """Let ``n`` item rows of ``cache`` (the ``EmbeddingCache`` asking: this module does not
    import it, which imports this) go, and a tenth of the rest, neither the catalogue's
    (``cache.kept_items``) nor ``busy`` (the slots the lookup asking for room uses); returns
    how many went. Raises ``torch.OutOfMemoryError`` where fewer than ``n`` may go: the
    catalogue and the lookup's own rows fill the device."""
    keep = np.zeros(len(cache.item_ids), bool)
    kept = cache.kept_items
    if kept is not None:
        k = min(len(kept), len(keep))
        keep[:k] = kept[:k]
    keep[np.asarray(busy, np.int64)] = True
    others = int(cache.evictable(keep).sum())
    if others < n:
        raise torch.OutOfMemoryError(
            f"item table: no device memory to grow past {len(cache.items.rows)} rows, and only"
            f" {others} of them may make room for {n} more"
        )
    gone = cache.evict_items(others - n, keep)
    log.warning(
        "item table: no device memory to grow past %d rows; %d least recently touched rows"
        " outside the catalogue let go to host RAM",
        len(cache.items.rows),
        gone,
    )
    return gone
