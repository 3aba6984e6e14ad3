"""Sparse Adagrad with clipping and rejection of non-finite gradients. Pure.

Only the rows of one gradient message are touched:
``G ← G + g²``; ``w ← w − lr · g / (√G + ε)``, element-wise, after each row's gradient is
clipped to ``max_norm``. A row whose gradient has a NaN or infinity is rejected whole.

>>> import numpy as np
>>> w, G = np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32)
>>> ok = adagrad_step(w, G, np.array([[3.0, 4.0]], np.float32), AdagradConfig(lr=0.1, max_norm=1.0))
>>> ok.tolist(), [round(float(x), 4) for x in w[0]]
([True], [-0.1, -0.1])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AdagradConfig:
    lr: float = 0.05
    eps: float = 1e-8
    max_norm: float = 1.0
    """Each row's (aggregated) gradient is scaled down to at most this L2 norm."""
    initial_accumulator: float = 0.0


def finite_rows(g: np.ndarray) -> np.ndarray:
    return np.isfinite(g).all(axis=1)


def clip_rows(g: np.ndarray, max_norm: float) -> np.ndarray:
    """Rows scaled to L2 norm ≤ ``max_norm`` (a copy)."""
    norms = np.linalg.norm(g.astype(np.float64), axis=1, keepdims=True)  # float32 overflows
    scale = np.minimum(1.0, max_norm / np.maximum(norms, 1e-30))
    return (g * scale).astype(g.dtype, copy=False)


def adagrad_step(
    rows: np.ndarray, accum: np.ndarray, grads: np.ndarray, cfg: AdagradConfig
) -> np.ndarray:
    """Update ``rows`` and ``accum`` in place; returns the mask of rows that were applied."""
    ok = finite_rows(grads)
    if ok.all():  # the usual case: the same arithmetic, without gathers and scatters
        g = clip_rows(grads, cfg.max_norm)
        accum += g * g
        rows -= cfg.lr * g / (np.sqrt(accum) + cfg.eps)
        return ok
    if not ok.any():
        return ok
    g = clip_rows(grads[ok], cfg.max_norm)
    accum[ok] += g * g
    rows[ok] -= cfg.lr * g / (np.sqrt(accum[ok]) + cfg.eps)
    return ok
