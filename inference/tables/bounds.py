"""The item table's two bounds, applied by the worker's housekeeping: an age (rows no event,
broadcast update or catalogue load touched for ``FRESHREC_ROW_TTL_S``) and a size (at most
``FRESHREC_MAX_ITEM_ROWS`` rows outside the catalogue). Rows the catalogue lists never leave.
"""

from __future__ import annotations

import logging

import numpy as np

from inference.tables.cache import EmbeddingCache

log = logging.getLogger("freshrec.worker")


def expire_items(cache: EmbeddingCache, keep: np.ndarray, row_ttl_s: int, now_ms: int) -> int:
    """Item rows untouched for ``row_ttl_s`` leave the table, their slots reused, unless
    ``keep`` (per slot: the catalogue lists it). The parameter server's rows expire after as
    long in Redis; touched again, such an item is loaded from Redis if its row is still
    there, else created from its id."""
    gone = cache.expire_items(now_ms - row_ttl_s * 1000, keep=keep)
    if gone:
        log.info(
            "item table: %d rows untouched for %d s let go, %d held",
            gone,
            row_ttl_s,
            cache.item_rows,
        )
    return gone


def evict_items(cache: EmbeddingCache, keep: np.ndarray, max_rows: int) -> int:
    """Past ``max_rows`` rows outside the catalogue, the least recently touched leave (as
    expired ones do: loaded from Redis again when touched)."""
    gone = cache.evict_items(max_rows, keep=keep)
    if gone:
        log.warning(
            "item table at its bound (FRESHREC_MAX_ITEM_ROWS=%d): %d least recently "
            "touched rows let go, %d held",
            max_rows,
            gone,
            cache.item_rows,
        )
    return gone
