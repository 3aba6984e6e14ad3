"""A serving batch's records, stage to stage (``Recommender.serve``): a request as it arrives
(``Inbound``), its user's row (``BatchUsers``), its merged candidates (``Candidates``), what
ranking and re-ranking made of it (``RankedBatch``) and when each stage ended
(``StageClock``, which gives a reply its per-stage timings).

>>> clock = StageClock(now_ms=1_000, start=10.0, recalled_at=10.002, ranked_at=10.005)
>>> b = Inbound(None, "replies", None, enqueued_ms=900, read_ms=950)
>>> t = clock.timings(b, ranked=True, done=10.006, cost_ms=1.5)
>>> {k: round(v, 3) for k, v in t.items()}
{'topic': 50.0, 'queue': 50.0, 'recall': 2.0, 'rank': 3.0, 'rerank': 1.0, 'total': 106.0, 'cost': 1.5}
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inference.serving.degrade import Choice
from schemas.records import RecommendRequest


@dataclass
class Inbound:
    """A decoded request and where its reply goes."""

    request: RecommendRequest
    reply_to: str
    correlation_id: bytes | None
    enqueued_ms: int
    """When the request was produced (``intake.produced_ms``): its wait in the topic is part
    of its budget."""
    partition: int = -1
    offset: int = -1
    read_ms: int | None = None
    """When the worker read it (None: at ``enqueued_ms``)."""

    def deadline_ms(self, budget_ms: int) -> int:
        """What the ladder plans to: the serving budget from when the request was produced,
        or its own ``deadline_ms`` if earlier (a later one is how long the client waits)."""
        planned = self.enqueued_ms + budget_ms
        d = self.request.deadline_ms
        return planned if d is None else min(d, planned)


@dataclass
class BatchUsers:
    """The batch's users, one per request: their rows as serving found them."""

    rows: torch.Tensor
    """Their rows, on the tables' device."""
    versions: list[int]
    """The version of each row (0: not yet learnt by the parameter server)."""
    ages_ms: list[int | None]
    """How old each row's newest event is (None: it has none)."""
    note: str | None
    """Why the rows are not all the cache's (Redis away), for the replies' reason."""
    slots: np.ndarray
    """Their cache slots (-1: not resident)."""


@dataclass
class Candidates:
    """One request's merged candidates (cache slots) and each channel's list."""

    slots: np.ndarray
    per_channel: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.slots)


@dataclass
class RankedBatch:
    """What ranking and re-ranking made of a batch, per request."""

    choices: list[Choice]
    """Each request's tier and its reason (ranking may send one down to the hot list)."""
    probs: dict[int, torch.Tensor]
    """Request → probability per candidate, for the requests a model ranked."""
    lists: dict[int, list[tuple[str, float, tuple[str, ...]]]]
    """Request → its re-ranked list, (item, score, channels), for the same requests."""
    rankers: list[str | None]
    """The model that ranked each request (None: none did)."""
    rank_ms: list[float]
    """Each request's share of the ranking time, ms."""


@dataclass(frozen=True)
class StageClock:
    """When a serving batch started and its stages ended (``time.monotonic`` seconds), and
    the wall clock at its start (ms)."""

    now_ms: int
    start: float
    recalled_at: float
    ranked_at: float

    def timings(self, b: Inbound, ranked: bool, done: float, cost_ms: float) -> dict[str, float]:
        """A reply's ``timings_ms``: its wait in the topic and the queue, the batch's recall,
        ranking (0 where no model ranked it) and re-ranking up to ``done``, the total, and
        its ``cost_ms`` (its share of the batch's work)."""
        read = b.enqueued_ms if b.read_ms is None else b.read_ms
        timings = {
            "topic": float(max(0, read - b.enqueued_ms)),
            "queue": float(max(0, self.now_ms - read)),
            "recall": (self.recalled_at - self.start) * 1000,
            "rank": (self.ranked_at - self.recalled_at) * 1000 if ranked else 0.0,
            "rerank": (done - self.ranked_at) * 1000,
        }
        timings["total"] = timings["topic"] + timings["queue"] + (done - self.start) * 1000
        timings["cost"] = cost_ms
        return timings

    def shared_ms(self, done: float, requests: int) -> float:
        """Each request's share of the batch's recall and re-ranking (split evenly), ms."""
        return ((self.recalled_at - self.start) + (done - self.ranked_at)) * 1000 / requests
