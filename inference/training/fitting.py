"""How ``freshrec train`` fits its ranking models: Adam on shuffled mini-batches with early
stopping on a validation split, chunked prediction, and the AUC it reports."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from inference.models.ranking import widened_call

Progress = Callable[[str], None]


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve by ranks (ties averaged)."""
    labels = labels.astype(bool)
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def optimiser_step(opt, loss, step: int, progress: Progress, what: str, steps: int) -> int:
    """One optimiser step; the progress line every 20."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if step % 20 == 0:
        progress(f"{what}, step {step}/{steps}, loss {loss.item():.4f}")
    return step


def shuffled_batches(n: int, size: int, rng: np.random.Generator):
    order = rng.permutation(n)
    for lo in range(0, n, size):
        yield order[lo : lo + size]


def _loss(logit, y, w, soft=None):
    loss = nn.functional.binary_cross_entropy_with_logits(logit, y, weight=w)
    if soft is not None:
        loss = 0.5 * loss + 0.5 * nn.functional.mse_loss(logit, soft)
    return loss


def _from_numpy(a: np.ndarray | None) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(a)


def fit_ranker(model, data, valid, cfg, rng, progress, label) -> dict:
    """Adam on shuffled mini-batches, epoch after epoch, until the loss on ``valid`` has not
    improved for ``cfg.rank_patience`` epochs (``cfg.rank_epochs`` at most); the weights of the
    best epoch are kept. ``data`` and ``valid`` are (the model's input tensors, targets,
    weights, soft targets or None). Returns the epochs run, the best epoch and its validation
    loss."""
    if cfg.rank_epochs < 1:
        raise ValueError(f"rank_epochs must be at least 1, got {cfg.rank_epochs}")
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    tensors, y, w, soft = data[0], *map(_from_numpy, data[1:])
    v_tensors, v_y, v_w, v_soft = valid[0], *map(_from_numpy, valid[1:])
    per_epoch = -(-len(y) // cfg.batch)
    best, best_epoch, best_state = float("inf"), 0, None
    step = epoch = 0
    for epoch in range(1, cfg.rank_epochs + 1):
        model.train()
        what = f"{label}: epoch {epoch} (at most {cfg.rank_epochs})"
        for b in shuffled_batches(len(y), cfg.batch, rng):
            bt = torch.from_numpy(b)
            logit = model(*(t[bt] for t in tensors))
            loss = _loss(logit, y[bt], w[bt], None if soft is None else soft[bt])
            step = optimiser_step(opt, loss, step, progress, what, cfg.rank_epochs * per_epoch)
        model.eval()
        with torch.inference_mode():
            v_logits = torch.from_numpy(predict(model, v_tensors))
            v_loss = float(_loss(v_logits, v_y, v_w, v_soft))
        progress(f"{what}: validation loss {v_loss:.4f} (best {min(best, v_loss):.4f})")
        if v_loss < best:
            best, best_epoch = v_loss, epoch
            best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
        elif epoch - best_epoch >= cfg.rank_patience:
            break
    model.load_state_dict(best_state)
    model.eval()
    return {"epochs": epoch, "best_epoch": best_epoch, "validation_loss": round(best, 5)}


@torch.inference_mode()
def predict(model, tensors: tuple[torch.Tensor, ...], chunk: int = 8192) -> np.ndarray:
    """The model's logits over input tensors, ``chunk`` rows at a time (an attention
    ranker's sequences of a whole split would not fit in memory at once); a model holding
    float16 weights computes as it does when served (``ranking.widened_call``)."""
    n = len(tensors[0])
    parts = [
        widened_call(model, "forward", tuple(t[lo : lo + chunk] for t in tensors), {})
        for lo in range(0, n, chunk)
    ]
    return torch.cat(parts).numpy() if parts else np.empty(0, np.float32)
