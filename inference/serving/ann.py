"""Vector search for the vector channel: the exact search (one product over the whole table,
then a partial sort) and an inverted-file (IVF) index for catalogues where that is too slow on
a CPU — spherical k-means cells over the item rows and a cell-ordered copy of them, built in
the background; a query scans its ``nprobe`` nearest cells in that copy, and its best
candidates are re-scored with the *current* rows, so an index a few minutes old chooses the
candidates and fresh vectors rank them. No I/O.

>>> g = torch.Generator().manual_seed(0)
>>> rows = torch.nn.functional.normalize(torch.randn(2000, 8, generator=g), dim=1)
>>> index = IVFIndex.build(rows, torch.ones(2000, dtype=torch.bool), cells=16, seed=0)
>>> found = index.search(rows[:3], rows, k=5, nprobe=4)
>>> [int(f[0]) for f in found]  # unit rows: each is its own best match
[0, 1, 2]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inference.device import on_accelerator, to_host

SCAN = 0.04
MIN_NPROBE = 64
"""By default a query probes ``MIN_NPROBE`` cells or enough for ``SCAN`` of the catalogue,
whichever is more: recall@250 0.92–0.94 from 200k to 1M items at 27–96 ms for a batch of
32 on one core, where exact search takes 74–593 ms (``tools.bench_ann``, docs/benchmarks.md)."""
SCAN_BLOCK = 8192
"""Rows of a float16 table widened to float32 at a time by ``exact_search``."""


def ivf_cells(n: int) -> int:
    """Cells for an index of ``n`` items: 2·√n, between 16 and 4,096 (632 cells of ~160
    items at 100k, 1,414 of ~350 at 500k). At the same share of the catalogue scanned, 2·√n
    cells recalled more than √n and √n/2 (scratch runs at 100k and 500k, docs/benchmarks.md)."""
    return int(max(16, min(4096, 2 * np.sqrt(n))))


def auto_nprobe(cells: int, scan: float = SCAN, least: int = MIN_NPROBE) -> int:
    """Cells to probe: enough for ``scan`` of the catalogue, at least ``least`` (and at
    most every cell).

    >>> auto_nprobe(2000), auto_nprobe(894), auto_nprobe(20)
    (80, 64, 20)
    """
    return int(min(cells, max(least, round(scan * cells))))


def exact_search(
    queries: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor, k: int
) -> np.ndarray:
    """Exact top-``k`` slots per query: one fused op for the scores of every row
    (``bias`` per row: 0, or −∞ for rows that must not be found), then ``top_k_rows``."""
    if rows.dtype == queries.dtype:
        return top_k_rows(torch.addmm(bias, queries, rows.T), k)
    # float16 rows, scored in float32 a block at a time: the widened copy stays small
    scores = torch.cat(
        [
            torch.addmm(bias[lo : lo + SCAN_BLOCK], queries, rows[lo : lo + SCAN_BLOCK].float().T)
            for lo in range(0, len(rows), SCAN_BLOCK)
        ],
        dim=1,
    )
    return top_k_rows(scores, k)


def top_k_rows(scores: torch.Tensor | np.ndarray, k: int) -> np.ndarray:
    """Indices of each row's ``k`` largest scores, best first. On the CPU (or for a numpy
    array) a partial sort (``argpartition``) and a sort of the k, about twice as fast as
    ``torch.topk`` for 250 of 20,000; on an accelerator ``torch.topk``.

    >>> top_k_rows(torch.tensor([[0.1, 0.9, 0.5], [3.0, 1.0, 2.0]]), 2).tolist()
    [[1, 2], [0, 2]]
    """
    if isinstance(scores, torch.Tensor) and on_accelerator(scores.device):
        return to_host(torch.topk(scores, k, dim=1).indices)  # the candidates, to the merge
    s = scores if isinstance(scores, np.ndarray) else scores.numpy()
    if k >= s.shape[1]:
        return np.argsort(-s, axis=1, kind="stable")[:, :k]
    idx = np.argpartition(s, -k, axis=1)[:, -k:]
    order = np.argsort(-np.take_along_axis(s, idx, 1), axis=1, kind="stable")
    return np.take_along_axis(idx, order, 1)


@dataclass
class IVFIndex:
    """Cells of items, with a cell-ordered copy of their rows as they were at the build.

    A search scores each query's ``nprobe`` nearest cells from that copy — a probed cell's
    rows are one contiguous slice of it, scored against the queries of the batch that probe
    it in one small product — keeps the ``overfetch`` × k best per query, and re-scores
    those with the *current* rows: the copy chooses candidates, fresh rows rank them.
    On the host (numpy): on an accelerator the exact search is the fast one.
    """

    centroids: np.ndarray  # (cells, w), unit length
    order: np.ndarray  # slots sorted by cell
    offsets: np.ndarray  # cell c holds order[offsets[c]:offsets[c + 1]]
    block: np.ndarray  # rows[order] at the build, in the table's dtype (float16: half the copy)
    size: int  # table rows covered (slots beyond are newer than the index)

    @classmethod
    def build(
        cls,
        rows: torch.Tensor,
        eligible: torch.Tensor,
        cells: int,
        *,
        iters: int = 8,
        sample: int = 50_000,
        seed: int = 0,
        chunk: int = 65_536,
    ) -> IVFIndex:
        """Spherical k-means on a sample of the eligible rows (directions only: assigned
        by inner product, rows of large norm pulled most of the table into a few cells —
        1,000 rows a probed cell at 500k items where the mean is 177), then every eligible
        row assigned to its nearest centroid; empty cells dropped."""
        rows = rows.detach().cpu()
        slots = torch.nonzero(eligible[: len(rows)].cpu()).squeeze(1)
        if len(slots) == 0:
            raise ValueError("no eligible rows to index")
        g = torch.Generator().manual_seed(seed)
        cells = max(1, min(cells, len(slots)))
        pick = slots[torch.randperm(len(slots), generator=g)[: max(sample, cells)]]
        train = _unit(rows[pick].float())
        centroids = train[torch.randperm(len(train), generator=g)[:cells]].clone()
        for _ in range(iters):
            assign = (train @ centroids.T).argmax(1)
            sums = torch.zeros_like(centroids).index_add_(0, assign, train)
            moved = torch.bincount(assign, minlength=cells) > 0
            centroids[moved] = _unit(sums[moved])
        labels = torch.empty(len(slots), dtype=torch.long)
        for lo in range(0, len(slots), chunk):
            part = _unit(rows[slots[lo : lo + chunk]].float())
            labels[lo : lo + chunk] = (part @ centroids.T).argmax(1)
        # a centroid no row is nearest to is dropped, or a query near it would probe nothing
        counts = torch.bincount(labels, minlength=cells)
        held = counts > 0
        if not bool(held.all()):
            labels = (torch.cumsum(held, 0) - 1)[labels]
            centroids, counts = centroids[held], counts[held]
        order = slots[torch.argsort(labels, stable=True)]
        offsets = np.concatenate([[0], np.cumsum(counts.numpy())])
        block = rows[order].numpy()
        return cls(centroids.numpy(), order.numpy(), offsets, block, len(rows))

    def search(
        self,
        queries: torch.Tensor,
        rows: torch.Tensor,
        k: int,
        nprobe: int = 8,
        extra: torch.Tensor | None = None,
        overfetch: int = 2,
    ) -> list[np.ndarray]:
        """Top-``k`` slots per query, best first, by the current ``rows``: the
        ``overfetch`` × k best of its ``nprobe`` nearest cells by the build's rows, plus
        every ``extra`` slot (items added since the build), re-scored with ``rows``."""
        q = queries.detach().cpu().numpy().astype(np.float32, copy=False)
        n_q = len(q)
        if n_q == 0 or k <= 0:
            return [np.empty(0, np.int64) for _ in range(n_q)]
        nprobe = min(nprobe, len(self.centroids))
        probe = np.argpartition(-(q @ self.centroids.T), nprobe - 1, axis=1)[:, :nprobe]
        # (query, cell) pairs grouped by cell: a cell's rows are one slice of ``block``,
        # scored against the queries that probe it — only the pairs' products
        pair_query = np.repeat(np.arange(n_q), nprobe)
        pair_cell = probe.ravel()
        pair_size = np.diff(self.offsets)[pair_cell]
        per_query = pair_size.reshape(n_q, nprobe).sum(1)
        width = int(per_query.max())
        # where a pair's scores start in its query's row of candidates
        pair_col = _exclusive_cumsum(pair_size) - np.repeat(_exclusive_cumsum(per_query), nprobe)
        by_cell = np.argsort(pair_cell, kind="stable")
        cells, first = np.unique(pair_cell[by_cell], return_index=True)
        bounds = np.append(first, len(by_cell)).tolist()
        q_sorted = q[pair_query[by_cell]]
        offsets, block = self.offsets, self.block
        parts = [
            (
                q_sorted[bounds[u] : bounds[u + 1]] @ wide(block[offsets[c] : offsets[c + 1]]).T
            ).ravel()
            for u, c in enumerate(cells.tolist())
        ]
        sorted_size = pair_size[by_cell]
        dest = _runs(pair_query[by_cell] * width + pair_col[by_cell], sorted_size)
        stale = np.full(n_q * width, -np.inf, np.float32)
        stale[dest] = np.concatenate(parts)
        slot_at = np.zeros(n_q * width, np.int64)
        slot_at[dest] = self.order[_runs(offsets[pair_cell[by_cell]], sorted_size)]
        stale = stale.reshape(n_q, width)
        top = top_k_rows(stale, min(overfetch * k, width))
        cands = np.take_along_axis(slot_at.reshape(n_q, width), top, 1)
        valid = np.isfinite(np.take_along_axis(stale, top, 1))
        return _rescored(q, cands, valid, rows, extra, k)


def _rescored(
    q: np.ndarray,
    cands: np.ndarray,
    valid: np.ndarray,
    rows: torch.Tensor,
    extra: torch.Tensor | None,
    k: int,
) -> list[np.ndarray]:
    """Per query (a row of ``q``), the best ``k`` of its candidate slots (``cands``, where
    ``valid``) and of the ``extra`` slots, by the current ``rows``, best first."""
    n_q = len(q)
    if extra is not None and len(extra):
        ex = extra.detach().cpu().numpy()
        cands = np.concatenate([cands, np.broadcast_to(ex, (n_q, len(ex)))], axis=1)
        valid = np.concatenate([valid, np.ones((n_q, len(ex)), bool)], axis=1)
    fresh_rows = rows.detach().cpu().numpy()
    gathered = np.take(fresh_rows, cands.ravel(), axis=0)  # 3.5x faster than rows[cands]
    gathered = wide(gathered)
    fresh = np.matmul(gathered.reshape(*cands.shape, -1), q[:, :, None])[:, :, 0]
    fresh[~valid] = -np.inf
    best = top_k_rows(fresh, min(k, cands.shape[1]))
    picked = np.take_along_axis(cands, best, 1)
    ok = np.take_along_axis(valid, best, 1)
    return [picked[j][ok[j]] for j in range(n_q)]


def _runs(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``starts[i] + 0 .. sizes[i] - 1`` for every run, concatenated.

    >>> _runs(np.array([10, 3]), np.array([2, 3])).tolist()
    [10, 11, 3, 4, 5]
    """
    within = np.arange(int(sizes.sum())) - np.repeat(_exclusive_cumsum(sizes), sizes)
    return np.repeat(starts, sizes) + within


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    return np.cumsum(x) - x


def wide(a: np.ndarray) -> np.ndarray:
    """``a`` in float32 (a float16 block's slice widened; float32 as it is)."""
    return a.astype(np.float32, copy=False)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)
