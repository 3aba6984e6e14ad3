"""Merging recall channels: per-channel quotas, deduplication, a candidate budget. Pure.

Channels are taken in priority order, each up to its quota; an item found by several channels
appears once and remembers all of them. Budget left by channels that returned fewer than their
quota is filled from the remaining candidates of all channels, in priority order. Where the
quotas add up to more than the budget they are its shares (``fitted_quotas``): each channel
keeps its part of the budget, so a smaller budget takes from every channel alike instead of
leaving the channels last in the order nothing.

>>> merge_channels({"vector": ["a", "b", "c"], "hot": ["b", "d"]}, {"vector": 2, "hot": 2}, 4)
[('a', ('vector',)), ('b', ('vector', 'hot')), ('d', ('hot',)), ('c', ('vector',))]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Sized

import numpy as np


def fitted_quotas(
    quotas: Mapping[str, int], budget: int, results: Mapping[str, Sized]
) -> dict[str, int]:
    """What each channel of ``results`` may take in the quotas' pass: its quota, or as many
    as it found where fewer; where those add up to more than ``budget``, each scaled to its
    share, q · budget / Σq rounded down, the budget's remainder to the largest fractions
    (ties in priority order). Channels without a quota are left out (in its turn such a
    channel may take what is left of the budget).

    >>> found = {"vector": range(300), "hot": range(300), "new": range(10)}
    >>> fitted_quotas({"vector": 250, "hot": 80, "new": 30}, 200, found)
    {'vector': 147, 'hot': 47, 'new': 6}
    >>> fitted_quotas({"vector": 250, "hot": 80, "new": 30}, 500, found)
    {'vector': 250, 'hot': 80, 'new': 10}
    """
    named = {
        c: max(min(int(quotas[c]), len(found)), 0) for c, found in results.items() if c in quotas
    }
    total = sum(named.values())
    if total <= budget:
        return named
    exact = {c: q * budget / total for c, q in named.items()}
    fitted = {c: int(x) for c, x in exact.items()}
    left = budget - sum(fitted.values())
    by_fraction = sorted(named, key=lambda c: fitted[c] - exact[c])  # stable: priority order
    for c in by_fraction[:left]:
        fitted[c] += 1
    return fitted


def merge_channels(
    results: Mapping[str, Sequence[str]],
    quotas: Mapping[str, int],
    budget: int,
    exclude: frozenset[str] = frozenset(),
) -> list[tuple[str, tuple[str, ...]]]:
    quotas = fitted_quotas(quotas, budget, results)
    found_by: dict[str, list[str]] = {}
    order: list[str] = []
    for with_quotas in (True, False):  # quotas first, then fill what they left, by priority
        for channel, items in results.items():
            quota = quotas.get(channel, budget) if with_quotas else budget
            used = 0
            for item in items:
                if item in exclude:
                    continue
                channels = found_by.get(item)
                if channels is not None:
                    if channel not in channels:
                        channels.append(channel)
                elif used < quota and len(order) < budget:
                    found_by[item] = [channel]
                    order.append(item)
                    used += 1
    return [(item, tuple(found_by[item])) for item in order]


def merge_slot_arrays(
    results: Mapping[str, np.ndarray],
    quotas: Mapping[str, int],
    budget: int,
    exclude: np.ndarray | None = None,
) -> np.ndarray:
    """``merge_channels`` on non-negative integer ids (cache slots), vectorised with one
    boolean mask over the id space: the same selection and order (each channel's list must be
    free of repeats, as top-k and hot lists are). Which channels found an item is left to
    ``found_by``, for the few items finally returned.

    >>> merge_slot_arrays({"v": np.array([1, 2, 3]), "h": np.array([2, 4])}, {"v": 2, "h": 2}, 4).tolist()
    [1, 2, 4, 3]
    """
    arrays = {c: np.asarray(a, np.int64) for c, a in results.items()}
    quotas = fitted_quotas(quotas, budget, arrays)
    universe = 1 + max((int(a.max()) for a in arrays.values() if len(a)), default=0)
    taken = np.zeros(universe, bool)
    if exclude is not None and len(exclude):
        ex = np.asarray(exclude, np.int64)
        taken[ex[ex < universe]] = True  # excluded ids count as taken: never chosen
    parts: list[np.ndarray] = []
    chosen = 0
    for passes in (True, False):  # quotas first, then fill what they left, in priority order
        for channel, a in arrays.items():
            room = budget - chosen
            if room <= 0:
                break
            limit = min(quotas.get(channel, budget), room) if passes else room
            new = a[~taken[a]][:limit]
            taken[new] = True
            parts.append(new)
            chosen += len(new)
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def found_by(items: np.ndarray, results: Mapping[str, np.ndarray]) -> list[tuple[str, ...]]:
    """For each item, the channels (in priority order) whose lists contain it.

    >>> found_by(np.array([2, 9]), {"v": np.array([1, 2]), "h": np.array([2, 9])})
    [('v', 'h'), ('h',)]
    """
    items = np.asarray(items, np.int64)
    hits = [
        (c, (np.asarray(a, np.int64)[None, :] == items[:, None]).any(axis=1))
        for c, a in results.items()
    ]
    return [tuple(c for c, hit in hits if hit[j]) for j in range(len(items))]
