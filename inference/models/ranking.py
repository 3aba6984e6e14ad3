"""The ranking models: Wide&Deep (Cheng et al., 2016) and a light model distilled from it.

Wide: a linear model over the dense features plus one learned weight per hashed cross
feature (category × device, × hour, × region), so memorised interactions need no depth.
Deep: an MLP over the user and item rows, their element-wise product, the dense features and
embeddings of category, device, hour and region.
Light: a small MLP over the dense features and the device only; it serves degraded mode and
low-end devices, and is trained to match the Wide&Deep logits (distillation).

Each model remembers the dense features it was trained with (``features``, by name): ``score``
hands it those, in its order, so a model trained before a feature was added serves without it
rather than reading misaligned columns.

Every candidate of a whole dynamic batch is scored in one ``forward``; on CUDA in half
precision (``score``). A model may hold its weights in float16 (``FRESHREC_RANKING_DTYPE``,
``store_half``): half the memory, widened to float32 for each forward pass, so it computes
as a float32 model would with its weights rounded (the arithmetic on the CPU stays float32,
where float16 products run several times slower; on CUDA autocast makes it float16 as for
any model).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from inference.device import autocast, to_device
from inference.models.features import (
    CATEGORY_BUCKETS,
    CROSS_BUCKETS,
    DENSE,
    DEVICE_UNKNOWN,
    HOUR_UNKNOWN,
    REGION_BUCKETS,
    RankInputs,
    dense_columns,
)


class WideDeep(nn.Module):
    kind = "wide_deep"

    def __init__(
        self,
        dim: int = 64,
        hidden: tuple[int, ...] = (128, 64),
        extra: int = 0,
        features: Sequence[str] = DENSE,
    ) -> None:
        """``extra``: the width of further deep inputs a subclass appends (the attention
        ranker's interest vector); ``features``: its dense inputs, by name."""
        super().__init__()
        self.dim = dim
        self.hidden = tuple(hidden)
        self.extra = extra
        self.features = tuple(features)
        n_dense = len(self.features)
        self.wide_dense = nn.Linear(n_dense, 1)
        self.wide_cross = nn.EmbeddingBag(CROSS_BUCKETS, 1, mode="sum")
        self.cat = nn.Embedding(CATEGORY_BUCKETS, 8)
        self.device = nn.Embedding(DEVICE_UNKNOWN + 1, 4)
        self.hour = nn.Embedding(HOUR_UNKNOWN + 1, 4)
        self.region = nn.Embedding(REGION_BUCKETS, 4)
        layers: list[nn.Module] = []
        width = 3 * dim + n_dense + 8 + 4 + 4 + 4 + extra
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.deep = nn.Sequential(*layers)
        nn.init.zeros_(self.wide_cross.weight)

    def forward(self, user, item, dense, sparse, cross, extra=None) -> torch.Tensor:
        u, v = user[:, : self.dim], item[:, : self.dim]
        deep_in = torch.cat(
            [
                u * v,
                u,
                v,
                dense,
                self.cat(sparse[:, 0]),
                self.device(sparse[:, 1]),
                self.hour(sparse[:, 2]),
                self.region(sparse[:, 3]),
                *(() if extra is None else (extra,)),
            ],
            dim=1,
        )
        wide = self.wide_dense(dense) + self.wide_cross(cross)
        return (wide + self.deep(deep_in)).squeeze(1)

    def forward_grouped(self, users, owner, item, dense, sparse, cross, extra=None, width=None):
        """``forward`` for candidates grouped by request (``RankInputs`` grouped form):
        ``users`` (requests, w), ``owner`` (n,) non-decreasing. The deep part's first layer
        is split by input block, W·x = W_p·(u⊙v) + W_u·u + W_v·v + W_d·dense + embeddings;
        the user and context blocks become one bias per request, and W_v + W_p·diag(u) one
        matrix per request, so per candidate only a dim × hidden product remains (a third
        of the first layer's work). Equal to ``forward`` on the expanded rows up to float
        round-off. ``extra``: (n, self.extra) per-candidate inputs, as in ``forward``.
        ``width``: the most candidates of one request, when the caller knows it on the host
        (``score`` does): otherwise read from the device, which makes the host wait for it.
        """
        d, n_dense = self.dim, len(self.features)
        first, rest = self.deep[0], self.deep[1:]
        w, b = first.weight, first.bias
        splits = [d, d, d, n_dense, 8, 4, 4, 4, self.extra]
        w_prod, w_user, w_item, w_dense, w_cat, w_dev, w_hour, w_region, w_extra = torch.split(
            w, splits, dim=1
        )
        n_req, n = users.shape[0], len(owner)
        # each request's first candidate and count, by binary search of the sorted owners:
        # CUDA's bincount copies the owners' min and max to the host to size its output
        requests = torch.arange(n_req, device=owner.device)
        starts = torch.searchsorted(owner, requests)
        counts = torch.searchsorted(owner, requests, right=True) - starts
        ctx = sparse[starts.clamp(max=max(n - 1, 0))]  # a request's context: its first pair's
        u = users[:, :d]
        per_request = (
            u @ w_user.T
            + b
            + self.device(ctx[:, 1]) @ w_dev.T
            + self.hour(ctx[:, 2]) @ w_hour.T
            + self.region(ctx[:, 3]) @ w_region.T
        )
        # per request: [W_v + W_p·diag(u) | W_d | W_cat] against [v | dense | cat embedding],
        # candidates padded to the longest request so one batched product does all of them
        mixed = torch.cat(
            [
                w_item.unsqueeze(0) + w_prod.unsqueeze(0) * u.unsqueeze(1),
                w_dense.unsqueeze(0).expand(n_req, -1, -1),
                w_cat.unsqueeze(0).expand(n_req, -1, -1),
                w_extra.unsqueeze(0).expand(n_req, -1, -1),
            ],
            dim=2,
        )  # (requests, H, d + n_dense + 8 + extra)
        pos = torch.arange(n, device=owner.device) - starts[owner]
        if width is None:
            width = int(counts.max()) if n else 0
        padded = item.new_zeros(n_req, width, mixed.shape[2])
        per_candidate = [item[:, :d], dense, self.cat(sparse[:, 0])]
        padded[owner, pos] = torch.cat([*per_candidate, *(() if extra is None else (extra,))], 1)
        hidden = torch.baddbmm(per_request.unsqueeze(1), padded, mixed.transpose(1, 2))
        out = rest(hidden.view(n_req * width, -1)).view(n_req, width)[owner, pos]
        wide = self.wide_dense(dense) + self.wide_cross(cross)
        return wide.squeeze(1) + out


class LightRanker(nn.Module):
    kind = "light"

    def __init__(self, dim: int = 64, hidden: int = 16, features: Sequence[str] = DENSE) -> None:
        super().__init__()
        self.dim = dim
        self.features = tuple(features)
        self.device = nn.Embedding(DEVICE_UNKNOWN + 1, 2)
        width = len(self.features) + 2
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, user, item, dense, sparse, cross) -> torch.Tensor:
        return self.net(torch.cat([dense, self.device(sparse[:, 1])], dim=1)).squeeze(1)


def as_tensors(x: RankInputs, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The inputs on ``device`` (those already there are not copied)."""
    return tuple(to_device(a, device) for a in (x.user, x.item, x.dense, x.sparse, x.cross))


@torch.inference_mode()
def score(model: nn.Module, x: RankInputs, device: torch.device, on_device: bool = False):
    """Click probabilities for every row of ``x`` in one forward pass (fp16 on CUDA); the
    grouped form goes through the model's ``forward_grouped`` where it has one. A numpy
    array, or with ``on_device`` a tensor left on ``device`` (serving re-ranks there)."""
    if len(x) == 0:
        return torch.empty(0, device=device) if on_device else np.empty(0, np.float32)
    columns = dense_columns(getattr(model, "features", DENSE))
    if columns is not None:  # trained with other features: it reads its own, in its order
        x = x.with_dense(columns)
    grouped = x.owner is not None and hasattr(model, "forward_grouped")
    if x.owner is not None and not grouped:
        x = x.expanded()
    user, item, dense, sparse, cross = as_tensors(x, device)
    seq: tuple[torch.Tensor, ...] = ()
    if getattr(model, "uses_sequence", False):
        if x.seq is None:
            raise ValueError(f"a {model.kind} model needs the users' sequences")
        seq = (to_device(x.seq, device), to_device(x.seq_len, device))

    def run() -> torch.Tensor:
        if grouped:
            owner = to_device(x.owner, device)
            width = int(np.bincount(x.owner).max())  # on the host: no wait for the device
            args = (user, owner, item, dense, sparse, cross, *seq)
            return widened_call(model, "forward_grouped", args, {"width": width})
        return widened_call(model, "forward", (user, item, dense, sparse, cross, *seq), {})

    with autocast(device):
        logits = run()
    probs = torch.sigmoid(logits.float())
    return probs if on_device else probs.cpu().numpy()


def store_half(model: nn.Module) -> nn.Module:
    """``model`` with its floating-point weights held in float16 (in place), marked so."""
    model.half()
    model.stores_half = True
    return model


def half_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` holding float16 weights (``store_half``), ``model`` untouched."""
    return store_half(copy.deepcopy(model))


def holds_half(model: nn.Module) -> bool:
    """Whether ``model``'s weights are held in float16 (``store_half``): a mark read once a
    pass, not a walk over its parameters (~20 µs, once per forward pass on a CPU)."""
    return getattr(model, "stores_half", False)


class _Method(nn.Module):
    """One of a module's methods as a module's ``forward``, for ``functional_call``."""

    def __init__(self, model: nn.Module, method: str) -> None:
        super().__init__()
        self.model, self.method = model, method

    def forward(self, *args, **kwargs):
        return getattr(self.model, self.method)(*args, **kwargs)


def widened_call(model: nn.Module, method: str, args: tuple, kwargs: dict):
    """``model.method(*args, **kwargs)``; a model that holds float16 weights runs it with
    float32 copies of them, made for this call and let go after it.

    >>> m = store_half(nn.Linear(2, 1))
    >>> widened_call(m, "forward", (torch.ones(1, 2),), {}).dtype, m.weight.dtype
    (torch.float32, torch.float16)
    """
    if not holds_half(model):
        return getattr(model, method)(*args, **kwargs)
    wide = {
        f"model.{name}": t.float() if t.is_floating_point() else t
        for name, t in (*model.named_parameters(), *model.named_buffers())
    }
    return functional_call(_Method(model, method), wide, args, kwargs)
