"""Replies from the hot lists alone (the ladder's last tier, no model): the regional list,
then the global one, each item at 1 / (1 + its position), minus exclusions and items the
catalogue has deleted. The merged order is kept per region until the snapshot changes."""

from __future__ import annotations

from collections.abc import Callable

from schemas.records import RecommendRequest


class HotReplies:
    def __init__(self) -> None:
        self._ranked: dict[str | None, list] = {}
        self._of = None

    def items(self, snap, r: RecommendRequest, listed: Callable[[str], bool]) -> list:
        """(item, score, channels) for ``r``, at most ``r.k``, from ``snap``'s hot lists."""
        region = r.context.region if r.context else None
        if self._of is not snap:
            self._ranked, self._of = {}, snap
        ranked = self._ranked.get(region)
        if ranked is None:
            lists = []
            if region and region in snap.hot:
                lists.append(("region", snap.hot[region]))
            lists.append(("hot", snap.hot.get("global", [])))
            best: dict[str, tuple[str, float, tuple[str, ...]]] = {}
            for channel, names in lists:
                for pos, name in enumerate(names):
                    if name not in best:
                        best[name] = (name, round(1.0 / (1 + pos), 6), (channel,))
            ranked = self._ranked[region] = sorted(best.values(), key=lambda x: -x[1])
        excluded = set(r.exclude)
        out = []
        for entry in ranked:
            if entry[0] not in excluded and listed(entry[0]):
                out.append(entry)
                if len(out) == r.k:
                    break
        return out
