"""The searches recall channels run over the item table: the ``n`` best catalogue slots for
query rows, exactly or through the IVF index (the ``vector`` channel), and within a few
categories (the ``i2i`` channel), with the slots of each category they search.
"""

from __future__ import annotations

import numpy as np
import torch

from inference.device import on_accelerator, to_device
from inference.serving.ann import auto_nprobe, exact_search, top_k_rows

NONE = np.empty(0, np.int64)


def top_k_slots(st, queries_rows: np.ndarray, n: int) -> list[np.ndarray]:
    """For each query row, the ``n`` catalogue slots of the highest ``row · item`` (exact, or
    through the IVF index when one is built); ``st``: the channels' ``ServingState``."""
    items = st.cache.items.rows
    named = st.named
    size = min(len(named), len(items))
    if size == 0 or n <= 0:
        return [np.empty(0, np.int64) for _ in range(len(queries_rows))]
    q = to_device(queries_rows, items.device)
    index = st.ann
    if index is not None:
        newer = torch.arange(index.size, size, device=items.device)
        newer = newer[named[index.size : size]]
        nprobe = st.ann_nprobe or auto_nprobe(len(index.centroids))
        found = index.search(q, items, n, nprobe, extra=newer)
        # the index holds what was in the catalogue when it was built: an item deleted
        # since stays in it until the next build, and is dropped here
        listed = named[:size].cpu().numpy()
        return [s[listed[s]] for s in found]
    return list(exact_search(q, items[:size], st.unnamed_bias[:size], min(n, st.named_count)))


def category_members(categories: np.ndarray, slots: np.ndarray) -> dict[int, np.ndarray]:
    """Slots per category (unknown, < 0, left out), each in ascending order.

    >>> {c: s.tolist() for c, s in category_members(np.array([2, 0, 2, -1]), np.array([7, 3, 5, 1])).items()}
    {0: [3], 2: [5, 7]}
    >>> category_members(np.array([-1]), np.array([4])), category_members(np.array([]), np.array([]))
    ({}, {})
    """
    categories, slots = np.asarray(categories, np.int64), np.asarray(slots, np.int64)
    known = categories >= 0
    categories, slots = categories[known], slots[known]
    if len(categories) == 0:  # e.g. a catalogue not loaded yet
        return {}
    order = np.lexsort((slots, categories))
    cats, first = np.unique(categories[order], return_index=True)
    return dict(zip(cats.tolist(), np.split(slots[order], first[1:]), strict=True))


def search_within_categories(
    items: torch.Tensor,
    queries: np.ndarray | torch.Tensor,
    allowed: list[np.ndarray],
    members: dict[int, np.ndarray],
    n: int,
) -> list[np.ndarray]:
    """For each query row, the ``n`` best slots by ``query · items[slot]`` (best first) among
    the members of its ``allowed`` categories (unknown ones, < 0, allow nothing). Cost is
    proportional to those members, not to the table: the i2i channel on a 100k-item
    catalogue scored every item for every user. On a device the rows' scores are padded into
    one tensor and their best come back in one copy (one a request was one round trip each).

    >>> items = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.8, 0.0]])
    >>> members = {0: np.array([0, 1]), 1: np.array([2, 3])}
    >>> [f.tolist() for f in search_within_categories(
    ...     items, np.array([[1.0, 0.0], [1.0, 0.0]], np.float32), [np.array([1]), np.array([-1])], members, 5)]
    [[3, 2], []]
    """
    out: list[np.ndarray] = []
    found: list[tuple[int, np.ndarray, torch.Tensor]] = []  # on a device: one top-k for all
    for row, cats in enumerate(allowed):
        cands = [members[c] for c in np.unique(cats).tolist() if c >= 0 and c in members]
        cand = np.concatenate(cands) if cands else NONE
        cand = cand[cand < len(items)]
        out.append(NONE)
        if len(cand) == 0 or n <= 0:
            continue
        at = to_device(cand, items.device)
        rows = items.index_select(0, at).float()  # several times faster than items[at] on a CPU
        scores = rows @ to_device(queries[row], items.device).float()
        if on_accelerator(scores.device):
            found.append((row, cand, scores))
        else:
            out[row] = cand[top_k_rows(scores[None], min(n, len(cand)))[0]]
    if found:
        # the rows' scores padded with -inf to the longest: their best in one copy back
        width = max(len(scores) for _, _, scores in found)
        padded = torch.full((len(found), width), -torch.inf, device=items.device)
        for r, (_, _, scores) in enumerate(found):
            padded[r, : len(scores)] = scores
        best = top_k_rows(padded, min(n, width))
        for (row, cand, _), top in zip(found, best, strict=True):
            out[row] = cand[top[: min(n, len(cand))]]
    return out
