"""``freshrec train``'s further ranking models, trained after Wide&Deep on the same pairs: the
pruned tier (``inference/models/prune.py``, distilled from the full model after pruning) and the
attention rankers over users' sequences (``inference/models/attention.py``, on the labels).

``TrainConfig.rankers`` says which; each is stopped by the validation tenth like the others,
and its held-out AUC, and the pruned model's sparsity, go to the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from inference.models.attention import ATTENTION_KINDS, AttentionRanker, gather_sequences
from inference.models.kinds import OPTIONAL, TIERED
from inference.models.prune import prune, sparsity
from inference.training.fitting import auc, fit_ranker, predict

PRUNED = "pruned"
RANKERS = OPTIONAL
"""The models ``TrainConfig.rankers`` may name (Wide&Deep and the light model always train):
``inference/models/kinds.py``'s."""


def parse_rankers(text: str) -> tuple[str, ...]:
    """``"pruned,attention"`` → the names, checked; ``""`` → none.

    >>> parse_rankers("pruned, attention")
    ('pruned', 'attention')
    """
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in names if x not in RANKERS]
    if unknown:
        raise ValueError(f"unknown rankers {unknown}; expected some of {', '.join(RANKERS)}")
    return names


def rankers_for(ranker: str, rankings=()) -> str:
    """The further models a deployment serves, for ``TrainConfig.rankers``: the full tier's
    ``ranker`` (``FRESHREC_RANKER``) and an experiment's variants' ``rankings``; ``tiered``
    needs the pruned model. ``freshrec run`` and ``freshrec replay`` train these only.

    >>> rankers_for("wide_deep", ["full", "light", "tiered", "attention", None])
    'pruned,attention'
    >>> rankers_for("attention_window")
    'attention_window'
    """
    wanted = [ranker, *rankings]
    names = [PRUNED if k == TIERED else k for k in wanted if k is not None]
    return ",".join(k for k in RANKERS if k in names)


class WithTable(nn.Module):
    """Training's view of an attention ranker: sequences come as item numbers (-1 padding)
    and are read from the item table here, a batch at a time (the rows of every impression's
    sequence would not fit in memory). The table is not part of the model's state."""

    def __init__(self, model: AttentionRanker, table: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("table", table, persistent=False)

    def forward(self, user, item, dense, sparse, cross, seq_index) -> torch.Tensor:
        seq, seq_len = gather_sequences(lambda ix: self.table[ix], seq_index.long())
        return self.model(user, item, dense, sparse, cross, seq, seq_len)


@dataclass
class Split:
    """One part of the log as the ranking models see it: input tensors, labels, weights,
    and each impression's sequence (item numbers, newest first, -1 padding)."""

    tensors: tuple[torch.Tensor, ...]
    y: np.ndarray
    w: np.ndarray
    sequences: np.ndarray
    full_logits: np.ndarray
    """Wide&Deep's logits on this part: the pruned model's soft targets."""


def train_pruned(name, full, parts, table, cfg, rng, progress) -> tuple[nn.Module, object, dict]:
    """Wide&Deep's hidden units pruned (``cfg.prune_keep`` kept), then distilled from it."""
    train, valid, test = parts
    model = prune(full, cfg.prune_keep)
    found = {"sparsity": round(sparsity(full, model), 4)}
    fit = fit_ranker(
        model,
        (train.tensors, train.y, train.w, train.full_logits),
        (valid.tensors, valid.y, valid.w, valid.full_logits),
        cfg,
        rng,
        progress,
        name,
    )
    found["test_logits"] = predict(model, test.tensors)
    return model, fit, found


def train_attention(name, full, parts, table, cfg, rng, progress) -> tuple[nn.Module, object, dict]:
    """An attention ranker over each impression's sequence, on the labels."""
    train, valid, test = parts
    model = AttentionRanker(cfg.dim, name, length=cfg.sequence)
    view = WithTable(model, table)

    def inputs(part: Split) -> tuple[torch.Tensor, ...]:
        return (*part.tensors, torch.from_numpy(part.sequences))

    fit = fit_ranker(
        view,
        (inputs(train), train.y, train.w, None),
        (inputs(valid), valid.y, valid.w, None),
        cfg,
        rng,
        progress,
        name.replace("_", " "),
    )
    return model, fit, {"test_logits": predict(view, inputs(test))}


TRAINERS = {
    PRUNED: train_pruned,
    **dict.fromkeys(ATTENTION_KINDS, train_attention),
}
"""How each model of ``RankerKind``'s that ``--rankers`` names is trained (Wide&Deep and the
light model are fitted by ``train.py`` before these); one line per new ranker."""


def train_rankers(
    names: tuple[str, ...],
    full: nn.Module,
    parts: tuple[Split, Split, Split],
    item_rows: np.ndarray,
    cfg,
    rng: np.random.Generator,
    progress,
) -> dict[str, dict]:
    """Per name: {"model", "fit", "auc", "test_logits", ...}. ``parts``: train, valid, test."""
    table = torch.from_numpy(np.ascontiguousarray(item_rows, np.float32))
    out: dict[str, dict] = {}
    for name in names:
        torch.manual_seed(cfg.seed)
        model, fit, found = TRAINERS[name](name, full, parts, table, cfg, rng, progress)
        found["auc"] = auc(parts[2].y, found["test_logits"])
        out[name] = {"model": model.eval(), "fit": fit, **found}
    return out
