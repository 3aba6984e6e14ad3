"""The vector channel's IVF index (``ann.py``), built on a thread of its own: for a catalogue
large enough on a CPU, when the index is missing or older than ``ann_refresh_s``. The worker
asks from its loop (cheap); the build hands the recall state its new index when done, and
until then exact search, or the previous index, serves.
"""

from __future__ import annotations

import logging
import threading
import time

from freshcore import metrics as m
from freshcore.lifecycle import lower_thread_priority
from inference.device import on_accelerator
from inference.serving.ann import IVFIndex, ivf_cells
from inference.serving.channels import ServingState
from inference.tables.cache import EmbeddingCache

log = logging.getLogger("freshrec.serving")


class IndexBuilds:
    """When the IVF index is built and whether a build is running."""

    def __init__(self) -> None:
        self.built_at = 0.0
        """When the last build finished (``time.monotonic``)."""
        self.building = False

    def maybe_rebuild(self, state: ServingState, cache: EmbeddingCache, settings) -> None:
        """Start a background build when the catalogue has at least ``ann_min_items`` items
        (``ServingSettings``) and the index is missing or older than ``ann_refresh_s``; the
        state adopts the new index when it is built."""
        if state.named_count < settings.ann_min_items or self.building:
            return
        if on_accelerator(cache.device):  # a device's exact search is the fast one
            return
        if state.ann is not None and time.monotonic() - self.built_at < settings.ann_refresh_s:
            return
        size = min(len(state.named), len(cache.items.rows))
        # no copy here (256 MB at 1M items would stall this loop): the build copies the rows
        # into cells on its own thread, and a row installed meanwhile may land half-updated
        # in that copy, which only chooses candidates; the live rows rank them
        rows = cache.items.rows[:size].detach()
        eligible = state.named[:size].clone().cpu()
        cells = ivf_cells(int(eligible.sum()))
        self.building = True

        def build() -> None:
            try:
                lower_thread_priority()  # the build yields the core to serving (Linux: per thread)
                started = time.monotonic()
                index = IVFIndex.build(rows, eligible, cells)
                state.adopt_index(index)
                self.built_at = time.monotonic()
                took = self.built_at - started
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
                self.building = False

        threading.Thread(target=build, daemon=True, name="ann-build").start()
