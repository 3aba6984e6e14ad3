"""The ranking models FreshRec knows: one table, ``KINDS``, from which every other list of
them derives — what ``freshrec train --rankers`` may name, what ``FRESHREC_RANKER`` and an
experiment's ``ranking`` accept, which model scores which heat tier, how a saved model is
rebuilt before its weights load. Pure.

A new ranker is a class and a line: its ``nn.Module`` (``forward`` over ``RankInputs``, and
``uses_sequence``/``length`` if it reads the user's last clicks) and a ``RankerKind`` here;
its trainer is one line in ``inference/training/rankers.py``'s ``TRAINERS``. The conformance
tests (``tests/test_rankers_unit.py``) then build, save, reload and score it, and check that
it is trained and accepted wherever a ranker can be named.

>>> TIER_MODELS  # the head's, the middle's and the tail's model under ``tiered``
('wide_deep', 'pruned', 'light')
>>> served_rankers()
('wide_deep', 'pruned', 'attention', 'attention_window', 'attention_lowrank', 'tiered')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from inference.models.attention import SEQUENCE, AttentionRanker
from inference.models.features import DENSE
from inference.models.prune import PrunedWideDeep
from inference.models.ranking import LightRanker, WideDeep
from inference.models.tiers import HEAD, MIDDLE, TAIL

TIERED = "tiered"
"""The served ranking that routes each candidate by its item's heat to the model of its tier
(``inference/models/tiers.py``): not a model of its own."""
FULL_ALIAS = "full"
"""An experiment's name for Wide&Deep, the full tier's model."""


@dataclass(frozen=True)
class RankerKind:
    name: str
    build: Callable[[int, dict[str, torch.Tensor] | None, tuple[str, ...]], nn.Module]
    """An untrained model for ``dim``-wide rows reading the dense features named; the
    weights it will load (if given) size the models whose shape training chooses."""
    always_trained: bool = False
    """Trained by every ``freshrec train`` (Wide&Deep and the light model, which the ladder
    and the others need); the rest only when named in ``--rankers``."""
    served: bool = True
    """May rank the full tier (``FRESHREC_RANKER``, an experiment's ``ranking``). The light
    model ranks the light tier and is chosen by the ladder, not named."""
    tier: int | None = None
    """The heat tier it scores under ``tiered`` (``tiers.HEAD``/``MIDDLE``/``TAIL``)."""


def _pruned(dim: int, state: dict[str, torch.Tensor] | None, features) -> nn.Module:
    if state is None:  # the sizes ``prune`` gives at its default keep (half the units)
        hidden = tuple(h // 2 for h in WideDeep(dim).hidden)
    else:
        layers = sorted({int(k.split(".")[1]) for k in state if k.startswith("deep.")})
        hidden = tuple(int(state[f"deep.{i}.weight"].shape[0]) for i in layers[:-1])
    return PrunedWideDeep(dim, hidden, features=features)


def _attention(kind: str):
    def build(dim: int, state: dict[str, torch.Tensor] | None, features) -> nn.Module:
        length = SEQUENCE if state is None else int(state["position"].shape[0])
        if kind == "attention_lowrank" and state is not None:
            rank, length = (int(x) for x in state["project"].shape)
            return AttentionRanker(dim, kind, length=length, rank=rank, features=features)
        if kind == "attention_window":
            length, window = max(length, SEQUENCE), length
            return AttentionRanker(dim, kind, length=length, window=window, features=features)
        return AttentionRanker(dim, kind, length=length, features=features)

    return build


KINDS: dict[str, RankerKind] = {
    k.name: k
    for k in (
        RankerKind(
            "wide_deep",
            lambda dim, state, features: WideDeep(dim, features=features),
            always_trained=True,
            tier=HEAD,
        ),
        RankerKind(
            "light",
            lambda dim, state, features: LightRanker(dim, features=features),
            always_trained=True,
            served=False,
            tier=TAIL,
        ),
        RankerKind("pruned", _pruned, tier=MIDDLE),
        RankerKind("attention", _attention("attention")),
        RankerKind("attention_window", _attention("attention_window")),
        RankerKind("attention_lowrank", _attention("attention_lowrank")),
    )
}
MODEL_KINDS = tuple(KINDS)
"""Every model kind a model set may hold, in training order."""
OPTIONAL = tuple(k.name for k in KINDS.values() if not k.always_trained)
"""The models ``freshrec train --rankers`` may name (the others always train)."""
TIER_MODELS = tuple(
    k.name for k in sorted((k for k in KINDS.values() if k.tier is not None), key=lambda k: k.tier)
)
"""The model of the head, the middle and the tail under ``tiered``."""


def served_rankers() -> tuple[str, ...]:
    """What ``FRESHREC_RANKER`` accepts: every served model, and ``tiered``."""
    return (*(k.name for k in KINDS.values() if k.served), TIERED)


def experiment_rankings() -> tuple[str, ...]:
    """What an experiment variant's ``ranking`` accepts: ``full`` (Wide&Deep), every model
    (``light`` is the light tier), and ``tiered``."""
    return (FULL_ALIAS, *KINDS, TIERED)


def build(
    kind: str,
    dim: int,
    state: dict[str, torch.Tensor] | None = None,
    features: Sequence[str] = DENSE,
) -> nn.Module:
    """An untrained model of ``kind`` reading the dense ``features``; ``state`` (the weights
    it will load) gives the sizes of models whose shape is chosen by training (the pruned
    model's hidden units)."""
    found = KINDS.get(kind)
    if found is None:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {MODEL_KINDS}")
    return found.build(dim, state, tuple(features))
