"""Model tiers by item heat: which model scores which candidate of a ``tiered`` request. Pure.

The seed serves hot items with the full model, the middle with a pruned one and the long
tail with a distilled one. Heat is the hot score the streams app publishes (clicks, CVR and
price, decayed); its thresholds adapt to the traffic, as the seed's P90 of item QPS does.
The split is by share of the warm catalogue — the items some event has given a hot score:
the ``head_share`` hottest of them are the head (Wide&Deep), the next ``mid_share`` the
middle (the pruned model), the rest the tail (the light model), with every item no event has
warmed (hot score 0). All three models output click probabilities (the pruned and light
models are distilled from the full one), so one ranking orders candidates of all three.

>>> split = HeatSplit(head_share=0.25, mid_share=0.5)
>>> cut = thresholds(np.array([9.0, 7.0, 5.0, 3.0, 0.0, 0.0, 0.0, 0.0]), split)
>>> cut
(9.0, 5.0)
>>> route(np.array([9.5, 7.0, 5.0, 4.0, 0.0]), cut).tolist()
[0, 1, 1, 2, 2]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HEAD, MIDDLE, TAIL = 0, 1, 2


@dataclass(frozen=True)
class HeatSplit:
    head_share: float = 0.1
    mid_share: float = 0.3

    def __post_init__(self) -> None:
        for name in ("head_share", "mid_share"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if self.head_share + self.mid_share > 1:
            raise ValueError(
                f"head_share + mid_share must be at most 1, got {self.head_share + self.mid_share}"
            )


def thresholds(catalogue_hot: np.ndarray, split: HeatSplit) -> tuple[float, float]:
    """The least hot score of the head and of the middle: the scores at ranks
    ⌈head_share·n⌉ and ⌈(head_share + mid_share)·n⌉ of the n warm items (hot score > 0),
    hottest first (inf where a share is 0 or nothing is warm)."""
    hot = np.asarray(catalogue_hot, np.float64)
    ordered = np.sort(hot[hot > 0])[::-1]
    n = len(ordered)
    if n == 0:
        return float("inf"), float("inf")

    def at(share: float) -> float:
        rank = int(np.ceil(share * n))
        return float(ordered[rank - 1]) if rank > 0 else float("inf")

    return at(split.head_share), at(split.head_share + split.mid_share)


def route(hot: np.ndarray, cut: tuple[float, float]) -> np.ndarray:
    """Per candidate: ``HEAD``, ``MIDDLE`` or ``TAIL`` (int8) by its hot score."""
    head_min, mid_min = cut
    hot = np.asarray(hot, np.float64)
    warm = hot > 0
    out = np.full(len(hot), TAIL, np.int8)
    out[warm & (hot >= mid_min)] = MIDDLE
    out[warm & (hot >= head_min)] = HEAD
    return out
