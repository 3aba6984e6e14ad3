"""The rules every gradient row obeys wherever it is applied (a worker's local step, the
parameter server's Adagrad): a row with a NaN or an infinity is rejected whole, and a row is
scaled down to at most ``max_norm``. Pure.

>>> import numpy as np
>>> import torch
>>> g = np.array([[3.0, 4.0], [0.3, 0.4], [np.nan, 0.0]], np.float32)
>>> finite_rows(g).tolist()
[True, True, False]
>>> [[round(float(x), 3) for x in row] for row in clip_rows(g[:2], 1.0)]
[[0.6, 0.8], [0.3, 0.4]]
>>> ok, clipped = clip_rows_torch(torch.from_numpy(g), 1.0)
>>> ok.tolist(), [[round(float(x), 3) for x in row] for row in clipped]
([True, True, False], [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]])

The numpy rules serve the parameter server, the torch rule the worker's tables wherever they
live (``clip_rows_torch``): the same arithmetic (squares summed in float64, the scale cast
back), so a row is clipped alike on both sides (a test compares them).
"""

from __future__ import annotations

import numpy as np
import torch


def finite_rows(g: np.ndarray) -> np.ndarray:
    return np.isfinite(g).all(axis=1)


def squared_norms(g: np.ndarray) -> np.ndarray:
    """Each row's squared L2 norm, summed in float64 (float32 squares overflow); NaN or
    infinity where the row has one."""
    return np.einsum("ij,ij->i", g, g, dtype=np.float64)


def scaled(g: np.ndarray, norms2: np.ndarray, max_norm: float) -> np.ndarray:
    scale = max_norm / np.maximum(np.sqrt(norms2), 1e-30)
    np.minimum(scale, 1.0, out=scale)
    return g * scale.astype(g.dtype)[:, None]


def clip_rows(g: np.ndarray, max_norm: float) -> np.ndarray:
    """Rows scaled to L2 norm ≤ ``max_norm`` (a copy; rows within the bound are unchanged)."""
    return scaled(g, squared_norms(g), max_norm)


def clip_rows_torch(g: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``finite_rows`` and ``clip_rows`` on a tensor, without leaving its device: (which
    rows are finite, the rows clipped with the non-finite ones zeroed). No boolean
    indexing, so nothing waits on the device."""
    norms2 = (g.double() * g.double()).sum(1)
    ok = torch.isfinite(norms2)
    scale = (max_norm / norms2.sqrt().clamp_min(1e-30)).clamp_max(1.0).to(g.dtype)
    return ok, torch.where(ok[:, None], g * scale[:, None], torch.zeros((), dtype=g.dtype))
