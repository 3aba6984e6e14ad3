"""The re-ranking stage of a serving batch: maximal marginal relevance over the head of each
request's ranking (all requests in one ``mmr_batch``), then category spacing, then the reply
items with the channels that found them.

Two ways to the same lists. On a GPU the heads are chosen, gathered and re-ranked where the
ranking left them, and the picks, their slots and scores come to the host in one copy (the
reply). On a CPU the same steps run in numpy (``on_host``): a dozen torch calls on a few
hundred candidates cost more in dispatch than in arithmetic there (~0.2 ms a batch), and a
CPU tensor is a numpy array already. The tests hold the two to the same replies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from freshcore import metrics as m
from inference.device import on_accelerator, release_cached, to_host
from inference.serving.merge import found_by
from inference.serving.rerank import mmr_batch, space_categories
from inference.tables.cache import EmbeddingCache
from schemas.rows import TABLE_ITEM

log = logging.getLogger("freshrec.serving")
GATHER_CHUNK = 256
"""Rows copied to the host at a time when re-ranking falls back to it (out of device memory)."""


class RerankStage:
    def __init__(self, cache: EmbeddingCache) -> None:
        self.cache = cache
        self.on_host = not on_accelerator(cache.device)
        """Choose heads and re-rank in numpy (a CPU's tables), else in torch on the device."""

    def rerank(
        self,
        merged: Sequence,
        ranked: dict[int, torch.Tensor],
        ks: Sequence[int],
        lams: Sequence[float],
        names: np.ndarray,
        categories: Callable[[np.ndarray], list[int]],
        settings,
    ) -> dict[int, list[tuple[str, float, tuple[str, ...]]]]:
        """Per ranked request ``j`` (its candidates ``merged[j]``, probabilities
        ``ranked[j]``, list length ``ks[j]``, MMR λ ``lams[j]``): [(item, score, channels)].
        ``names`` gives a slot's item id, ``categories`` slots' categories (-1: unknown);
        ``settings`` (the mode's ``ServingSettings``) the head, ``mmr_pool_factor`` × k
        candidates (at least 50), and the ``category_gap``."""
        if not ranked:
            return {}
        js = list(ranked)
        k = max(ks[j] for j in js)
        lens = [len(ranked[j]) for j in js]
        heads = np.array(
            [
                min(max(settings.mmr_pool_factor * ks[j], 50), n)
                for j, n in zip(js, lens, strict=True)
            ]
        )
        lam = lams[js[0]] if len(set(lams)) == 1 else [lams[j] for j in js]
        slots, probs = [merged[j].slots for j in js], [ranked[j] for j in js]
        if self.on_host:
            reply = self._on_host(slots, probs, heads, k, lam)
        else:
            reply = self._on_device_or_host(slots, probs, heads, k, lam)
        out = {}
        for row, j in enumerate(js):
            n = ks[j]
            picked = reply[0, row, :n] >= 0
            slots = reply[1, row, :n][picked].astype(np.int64)
            rel_row = reply[2, row, :n][picked]
            order = space_categories(categories(slots), settings.category_gap)
            final = slots[order]
            scores = np.round(rel_row[order], 6).tolist()
            channels = found_by(final, merged[j].per_channel)
            out[j] = list(zip(names[final].tolist(), scores, channels, strict=True))
        return out

    def _on_device(self, slots, probs, heads, k, lam) -> np.ndarray:
        """(3, requests, k) on the host: the picks (-1: none), their slots and scores."""
        width = int(heads.max())
        probs = torch.nn.utils.rnn.pad_sequence(probs, batch_first=True, padding_value=-torch.inf)
        by_score = torch.sort(-probs, dim=1, stable=True).indices[:, :width]
        padded = np.zeros((len(slots), probs.shape[1]), np.int64)
        for row, s in enumerate(slots):
            padded[row, : len(s)] = s
        head_slots = self.cache.to_device(padded).gather(1, by_score)
        rel = probs.gather(1, by_score).to(torch.float64)
        outside = np.arange(width)[None, :] >= heads[:, None]  # past a request's head
        rel.masked_fill_(self.cache.to_device(outside), -torch.inf)
        vecs = self.cache.rows(TABLE_ITEM, head_slots.reshape(-1))[:, : self.cache.dim]
        picks = mmr_batch(rel, vecs.reshape(len(slots), width, -1), k, lam, engine="torch")
        taken = picks.clamp_min(0)
        return to_host(
            torch.stack(
                [
                    picks.to(torch.float64),
                    head_slots.gather(1, taken).to(torch.float64),  # exact: slots < 2^53
                    rel.gather(1, taken),
                ]
            )
        )

    def _on_device_or_host(self, slots, probs, heads, k, lam) -> np.ndarray:
        """``_on_device``, else, where the device has no memory for it, ``_on_host`` on
        copies of the probabilities (the same picks)."""
        try:
            return self._on_device(slots, probs, heads, k, lam)
        except torch.OutOfMemoryError:
            m.DEVICE_OOM.labels("rerank").inc()
            release_cached(self.cache.device)
            log.warning("re-ranking: out of device memory for %d requests: on the host", len(slots))
            host = [torch.from_numpy(to_host(p)) for p in probs]
            return self._on_host(slots, host, heads, k, lam, self._gather_in_chunks)

    def _gather_in_chunks(self, table: int, slots: np.ndarray) -> np.ndarray:
        """``EmbeddingCache.gather``, ``GATHER_CHUNK`` rows at a time: little device memory."""
        parts = [
            self.cache.gather(table, slots[lo : lo + GATHER_CHUNK])
            for lo in range(0, len(slots), GATHER_CHUNK)
        ]
        return np.concatenate(parts) if parts else np.zeros((0, self.cache.w), np.float32)

    def _on_host(self, slots, probs, heads, k, lam, gather=None) -> np.ndarray:
        """``_on_device`` in numpy, for tables on a CPU (the same picks: a stable sort by
        probability, the same MMR steps); ``gather`` reads the candidates' rows
        (``EmbeddingCache.gather`` by default)."""
        width = int(heads.max())
        rel = np.full((len(slots), width), -np.inf)
        head_slots = np.zeros((len(slots), width), np.int64)
        for row, (s, p) in enumerate(zip(slots, host_views(probs), strict=True)):
            head = np.argsort(-p, kind="stable")[: heads[row]]
            rel[row, : len(head)] = p[head]
            head_slots[row, : len(head)] = s[head]
        vecs = (gather or self.cache.gather)(TABLE_ITEM, head_slots.ravel())[:, : self.cache.dim]
        picks = mmr_batch(rel, vecs.reshape(len(slots), width, -1), k, lam)
        taken = np.maximum(picks, 0)
        return np.stack(
            [
                picks.astype(np.float64),
                np.take_along_axis(head_slots, taken, 1).astype(np.float64),
                np.take_along_axis(rel, taken, 1),
            ]
        )


def host_views(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Host tensors as numpy arrays (views: no copy)."""
    return [t.numpy() for t in tensors]
