"""The pruned tier: structured pruning of Wide&Deep's hidden units. Pure.

A hidden unit's importance is the L1 norm of its incoming weights times that of its
outgoing ones (a unit that reads little or is read little changes the output little). Each
hidden layer keeps its most important ``keep`` share; the pruned model is a smaller
Wide&Deep (fewer units, not zeroed weights), so it is also faster. The wide part and the
embeddings are kept whole. ``masked`` is the full model with the dropped units' incoming
weights and biases zeroed: the pruned model computes exactly what it computes, which is
what pruning promises before any fine-tuning (``freshrec train`` then distils the pruned
model from the full one for a few epochs).

>>> full = WideDeep(dim=4, hidden=(8, 4))
>>> small = prune(full, 0.5)
>>> small.hidden, small.kind
((4, 2), 'pruned')
>>> round(sparsity(full, small), 3)
0.52
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from inference.models.ranking import WideDeep


class PrunedWideDeep(WideDeep):
    kind = "pruned"


def _linears(model: WideDeep) -> list[nn.Linear]:
    return [m for m in model.deep if isinstance(m, nn.Linear)]


def kept_units(model: WideDeep, keep: float) -> list[torch.Tensor]:
    """Per hidden layer, the sorted indices of the units kept (at least one each)."""
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    linears = _linears(model)
    kept = []
    for layer, after in itertools.pairwise(linears):
        importance = layer.weight.abs().sum(1) * after.weight.abs().sum(0)
        count = max(1, round(keep * layer.out_features))
        kept.append(torch.sort(torch.topk(importance, count).indices).values)
    return kept


@torch.no_grad()
def prune(model: WideDeep, keep: float) -> PrunedWideDeep:
    """A smaller copy of ``model`` with each hidden layer's ``keep`` share of units."""
    kept = kept_units(model, keep)
    hidden = tuple(len(k) for k in kept)
    small = PrunedWideDeep(model.dim, hidden, extra=model.extra, features=model.features)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("deep.")}
    rows = None  # the previous layer's kept units: this layer's kept inputs
    big, new = _linears(model), _linears(small)
    for i, (src, dst) in enumerate(zip(big, new, strict=True)):
        weight, bias = src.weight, src.bias
        if rows is not None:
            weight = weight[:, rows]
        if i < len(kept):
            weight, bias = weight[kept[i]], bias[kept[i]]
            rows = kept[i]
        dst.weight.copy_(weight)
        dst.bias.copy_(bias)
    small.load_state_dict({**small.state_dict(), **state})
    return small.eval()


@torch.no_grad()
def masked(model: WideDeep, keep: float) -> WideDeep:
    """A copy of ``model`` whose dropped units (``kept_units``) have zero incoming weights and
    bias: through the ReLU they output 0, so the layers after them never see them."""
    out = WideDeep(model.dim, model.hidden, extra=model.extra, features=model.features)
    out.load_state_dict(model.state_dict())
    for layer, kept in zip(_linears(out), kept_units(model, keep), strict=False):
        drop = torch.ones(layer.out_features, dtype=torch.bool)
        drop[kept] = False
        layer.weight[drop] = 0.0
        layer.bias[drop] = 0.0
    return out.eval()


def deep_parameters(model: WideDeep) -> int:
    return sum(p.numel() for p in model.deep.parameters())


def sparsity(full: WideDeep, pruned: WideDeep) -> float:
    """The share of the deep part's weights the pruned model does without."""
    return 1.0 - deep_parameters(pruned) / deep_parameters(full)
