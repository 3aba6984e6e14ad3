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
    for channel, items in results.items():
        quota = quotas.get(channel, budget)
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
    for channel, items in results.items():  # fill what quotas left unused, in priority order
        for item in items:
            if item in exclude:
                continue
            channels = found_by.get(item)
            if channels is not None:
                if channel not in channels:
                    channels.append(channel)
            elif len(order) < budget:
                found_by[item] = [channel]
                order.append(item)
    return [(item, tuple(found_by[item])) for item in order]
