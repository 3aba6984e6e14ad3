"""Merging recall channels: per-channel quotas, deduplication, a candidate budget. Pure.

Channels are taken in priority order, each up to its quota; an item found by several channels
appears once and remembers all of them. Budget left by channels that returned fewer than their
quota is filled from the remaining candidates of all channels, in priority order.

>>> merge_channels({"vector": ["a", "b", "c"], "hot": ["b", "d"]}, {"vector": 2, "hot": 2}, 4)
[('a', ('vector',)), ('b', ('vector', 'hot')), ('d', ('hot',)), ('c', ('vector',))]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def merge_channels(
    results: Mapping[str, Sequence[str]], quotas: Mapping[str, int], budget: int,
    exclude: frozenset[str] = frozenset(),
) -> list[tuple[str, tuple[str, ...]]]:  # fmt: skip
    found_by: dict[str, list[str]] = {}
    order: list[str] = []
    used: dict[str, int] = {}

    def take(channel: str, item: str) -> None:
        if item in found_by:
            if channel not in found_by[item]:
                found_by[item].append(channel)
            return
        if len(order) >= budget:
            return
        found_by[item] = [channel]
        order.append(item)

    for channel, items in results.items():
        quota = quotas.get(channel, budget)
        for item in items:
            if item in exclude:
                continue
            if used.get(channel, 0) >= quota:
                if item in found_by and channel not in found_by[item]:
                    found_by[item].append(channel)
                continue
            new = item not in found_by
            take(channel, item)
            if new and item in found_by:
                used[channel] = used.get(channel, 0) + 1
    for channel, items in results.items():
        for item in items:
            if len(order) >= budget:
                break
            if item not in exclude:
                take(channel, item)
    return [(item, tuple(found_by[item])) for item in order]
