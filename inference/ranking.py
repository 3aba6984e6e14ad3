"""The ranking models: Wide&Deep (Cheng et al., 2016) and a light model distilled from it.

Wide: a linear model over the dense features plus one learned weight per hashed cross
feature (category × device, × hour, × region), so memorised interactions need no depth.
Deep: an MLP over the user and item rows, their element-wise product, the dense features and
embeddings of category, device, hour and region.
Light: a small MLP over the dense features and the device only; it serves degraded mode and
low-end devices, and is trained to match the Wide&Deep logits (distillation).

Every candidate of a whole dynamic batch is scored in one ``forward``; on CUDA in half
precision (``score``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from inference.features import (
    CATEGORY_BUCKETS,
    CROSS_BUCKETS,
    DENSE,
    DEVICE_UNKNOWN,
    HOUR_UNKNOWN,
    REGION_BUCKETS,
    RankInputs,
)

MODEL_KINDS = ("wide_deep", "light")


class WideDeep(nn.Module):
    kind = "wide_deep"

    def __init__(self, dim: int = 64, hidden: tuple[int, ...] = (128, 64)) -> None:
        super().__init__()
        self.dim = dim
        n_dense = len(DENSE)
        self.wide_dense = nn.Linear(n_dense, 1)
        self.wide_cross = nn.EmbeddingBag(CROSS_BUCKETS, 1, mode="sum")
        self.cat = nn.Embedding(CATEGORY_BUCKETS, 8)
        self.device = nn.Embedding(DEVICE_UNKNOWN + 1, 4)
        self.hour = nn.Embedding(HOUR_UNKNOWN + 1, 4)
        self.region = nn.Embedding(REGION_BUCKETS, 4)
        layers: list[nn.Module] = []
        width = 3 * dim + n_dense + 8 + 4 + 4 + 4
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.deep = nn.Sequential(*layers)
        nn.init.zeros_(self.wide_cross.weight)

    def forward(self, user, item, dense, sparse, cross) -> torch.Tensor:
        u, v = user[:, : self.dim], item[:, : self.dim]
        deep_in = torch.cat(
            [
                u * v, u, v, dense,
                self.cat(sparse[:, 0]), self.device(sparse[:, 1]),
                self.hour(sparse[:, 2]), self.region(sparse[:, 3]),
            ],
            dim=1,
        )  # fmt: skip
        wide = self.wide_dense(dense) + self.wide_cross(cross)
        return (wide + self.deep(deep_in)).squeeze(1)


class LightRanker(nn.Module):
    kind = "light"

    def __init__(self, dim: int = 64, hidden: int = 16) -> None:
        super().__init__()
        self.dim = dim
        self.device = nn.Embedding(DEVICE_UNKNOWN + 1, 2)
        self.net = nn.Sequential(nn.Linear(len(DENSE) + 2, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, user, item, dense, sparse, cross) -> torch.Tensor:
        return self.net(torch.cat([dense, self.device(sparse[:, 1])], dim=1)).squeeze(1)


def build(kind: str, dim: int) -> nn.Module:
    if kind == "wide_deep":
        return WideDeep(dim)
    if kind == "light":
        return LightRanker(dim)
    raise ValueError(f"unknown model kind {kind!r}; expected one of {MODEL_KINDS}")


def as_tensors(x: RankInputs, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(
        torch.as_tensor(a, device=device) for a in (x.user, x.item, x.dense, x.sparse, x.cross)
    )


@torch.inference_mode()
def score(model: nn.Module, x: RankInputs, device: torch.device) -> np.ndarray:
    """Click probabilities for every row of ``x`` in one forward pass (fp16 on CUDA)."""
    if len(x) == 0:
        return np.empty(0, np.float32)
    user, item, dense, sparse, cross = as_tensors(x, device)
    if device.type == "cuda":
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(user, item, dense, sparse, cross)
    else:
        logits = model(user, item, dense, sparse, cross)
    return torch.sigmoid(logits.float()).cpu().numpy()
