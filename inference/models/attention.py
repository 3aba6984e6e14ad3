"""Behaviour-sequence ranking: target attention of each candidate over the user's last clicked
items (DIN, Zhou et al., 2018), with the seed's two cheaper variants for long sequences.

The sequence is the user's last ``SEQUENCE`` clicked or converted items, newest first, an
item clicked again counted once where it was clicked last: what the worker keeps per user
(``inference/tables/recent.py``) and what ``freshrec train`` rebuilds from a log
(``logfeatures.recent_context``). Each item enters as its row of the item table, as the other
features do; ``sequence_index`` and ``gather_sequences`` turn item positions into model
inputs for training and serving alike. Positions past a user's length are padding, masked
out whatever they hold.

Kinds (``ATTENTION_KINDS``), per candidate and sequence of length N, embedding width d and
attention width h:

- ``attention``: every position, O(N·d·h);
- ``attention_window``: the newest ``WINDOW`` positions only, O(w·d·h);
- ``attention_lowrank``: the sequence projected once per request to ``RANK`` pseudo-items by
  a learned RANK × N matrix (projected keys and values, Linformer, Wang et al., 2020), the
  candidate attending to those, O(k·d·h).

The attention unit scores position i as a_i = MLP([h_i, v, h_i − v, h_i ⊙ v]) + p_i, with a
learned weight p_i per position (recency), and no softmax: as in DIN, the weights' sum keeps
how much of the history matches the candidate. The interest Σ a_i·h_i and its product with
the candidate's row join Wide&Deep's deep input (``WideDeep(extra=2·d)``). The first layer is
split by input block, so the history's part is computed once per request and only the
product h_i ⊙ v is per candidate.

>>> m = AttentionRanker(dim=4, kind="attention_window", length=6)
>>> m.span, m.positions
(6, 6)
>>> sequence_index([[5, 3], []], 3).tolist()
[[5, 3, -1], [-1, -1, -1]]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from inference.device import to_device
from inference.models.features import DENSE
from inference.models.ranking import WideDeep

SEQUENCE = 50
"""Items of a user's history the attention rankers read (N)."""
WINDOW = 10
"""Positions ``attention_window`` attends to: the newest."""
RANK = 8
"""Pseudo-items ``attention_lowrank`` projects the sequence to."""
ATTENTION_KINDS = ("attention", "attention_window", "attention_lowrank")
ATTENTION_WIDTH = 32


class AttentionRanker(WideDeep):
    """Wide&Deep with the candidate's attention over the user's sequence as a further deep
    input. ``forward`` takes one sequence per pair; ``forward_grouped`` one per request."""

    uses_sequence = True

    def __init__(
        self,
        dim: int = 64,
        kind: str = "attention",
        length: int = SEQUENCE,
        window: int = WINDOW,
        rank: int = RANK,
        hidden: tuple[int, ...] = (128, 64),
        features: Sequence[str] = DENSE,
    ) -> None:
        if kind not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention kind {kind!r}; expected one of {ATTENTION_KINDS}")
        super().__init__(dim, hidden, extra=2 * dim, features=features)
        self.kind = kind
        self.length = length
        self.span = min(window, length) if kind == "attention_window" else length
        """Positions of the sequence read: the newest ``span``."""
        self.att_first = nn.Linear(4 * dim, ATTENTION_WIDTH)
        self.att_out = nn.Linear(ATTENTION_WIDTH, 1)
        self.project: nn.Parameter | None = None
        if kind == "attention_lowrank":
            self.project = nn.Parameter(block_average(rank, length))
        self.positions = rank if self.project is not None else self.span
        self.position = nn.Parameter(torch.zeros(self.positions))

    def interest(self, item, seq, seq_len, owner=None) -> torch.Tensor:
        """(n, d): each candidate's attention-weighted sum over its sequence. ``seq`` (rows,
        N, ≥ d) newest first, ``seq_len`` (rows,); rows are pairs, or requests with
        ``owner`` (n,) naming each candidate's."""
        d = self.dim
        h = seq[:, : self.span, :d]
        span = h.shape[1]
        valid = torch.arange(span, device=h.device)[None, :] < seq_len[:, None]
        h = h * valid.unsqueeze(2).to(h.dtype)  # padding is zero whatever it held
        if self.project is not None:
            h = torch.einsum("kl,rld->rkd", self.project[:, :span].to(h.dtype), h)
        v = item[:, :d]
        w_h, w_v, w_diff, w_prod = torch.split(self.att_first.weight, d, dim=1)
        per_position = h @ (w_h + w_diff).T + self.att_first.bias  # once per row of ``seq``
        per_candidate = v @ (w_v - w_diff).T
        if owner is not None:
            h, per_position = h.index_select(0, owner), per_position.index_select(0, owner)
        z = per_position + per_candidate.unsqueeze(1) + (h * v.unsqueeze(1)) @ w_prod.T
        a = self.att_out(torch.relu(z)).squeeze(2) + self.position[: h.shape[1]]
        if self.project is None:
            keep = valid if owner is None else valid.index_select(0, owner)
            a = a * keep.to(a.dtype)
        return torch.einsum("nl,nld->nd", a, h)

    def forward(self, user, item, dense, sparse, cross, seq, seq_len) -> torch.Tensor:
        interest = self.interest(item, seq, seq_len)
        extra = torch.cat([interest, interest * item[:, : self.dim]], dim=1)
        return super().forward(user, item, dense, sparse, cross, extra)

    def forward_grouped(self, users, owner, item, dense, sparse, cross, seq, seq_len, width=None):
        interest = self.interest(item, seq, seq_len, owner)
        extra = torch.cat([interest, interest * item[:, : self.dim]], dim=1)
        return super().forward_grouped(users, owner, item, dense, sparse, cross, extra, width=width)


def block_average(rank: int, length: int) -> torch.Tensor:
    """The low-rank projection's start: pseudo-item r the mean of the r-th block of
    consecutive positions (the newest block first).

    >>> block_average(2, 4).tolist()
    [[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]]
    """
    block = np.minimum(np.arange(length) * rank // length, rank - 1)
    out = np.zeros((rank, length), np.float32)
    out[block, np.arange(length)] = 1.0
    counts = out.sum(1, keepdims=True)
    return torch.from_numpy(np.divide(out, counts, out=np.zeros_like(out), where=counts > 0))


def sequence_index(sequences: list, length: int) -> np.ndarray:
    """(len(sequences), length) int64 positions (item numbers, cache slots), newest first,
    -1 past each sequence's end; longer sequences keep their newest ``length``."""
    out = np.full((len(sequences), length), -1, np.int64)
    for j, s in enumerate(sequences):
        s = list(s)[:length]
        out[j, : len(s)] = s
    return out


def gather_sequences(
    rows_of: Callable[[torch.Tensor], torch.Tensor], index, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's sequence inputs from an index of ``sequence_index``'s form (array or
    tensor): (rows (n, N, width), lengths (n,)). ``rows_of`` maps positions to rows (the
    item table; padding reads position 0, masked later). A sequence's valid positions come
    first, so its length is their count."""
    index = torch.as_tensor(index) if device is None else to_device(np.asarray(index), device)
    n, length = index.shape
    rows = rows_of(index.clamp_min(0).reshape(-1))
    return rows.reshape(n, length, -1), (index >= 0).sum(1)
