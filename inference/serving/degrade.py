"""The degradation ladder: which tier serves a request, and why. Pure.

Tiers, best first: ``full`` (Wide&Deep over fresh candidates), ``cached`` (this user's last
full result for the same context, while their embedding version is unchanged), ``light`` (the
distilled model), ``hot`` (the hot list, no model). A request falls down the ladder when its
deadline budget cannot fit the full path, when the request queue is deep, or when a component
fails; low-end devices get the light model by design (the seeds' device adaptation). A user
with fewer known interactions than ``cold_history`` gets the hot list by design too: what
works for a user the models know nothing about (recent popularity, on most logs).

>>> ladder = Ladder(LadderConfig(queue_depth_limit=100))
>>> ladder.choose(Situation(device="pc", budget_ms=200, queue_depth=3)).tier
'full'
>>> ladder.choose(Situation(device="pc", budget_ms=200, queue_depth=500, cached=True))
Choice(tier='cached', reason='queue depth 500 > 100')
>>> ladder.choose(Situation(device="low_end", budget_ms=200)).tier
'light'
>>> Ladder(LadderConfig(cold_history=3)).choose(Situation(device="pc", budget_ms=200, history=1))
Choice(tier='hot', reason='history 1 < 3: the hot list')
"""

from __future__ import annotations

from dataclasses import dataclass

FULL, CACHED, LIGHT, HOT = "full", "cached", "light", "hot"
FULL_UNAVAILABLE = "full model unavailable"
"""The reason of a request stepped down because the full model failed on a recent batch (or
none is loaded)."""


@dataclass(frozen=True)
class LadderConfig:
    queue_depth_limit: int = 256
    """More requests than this waiting: serve from the cache or the light model."""
    full_cost_ms: float = 40.0
    """What the full path is assumed to cost before it has been measured."""
    light_cost_ms: float = 15.0
    safety: float = 1.5
    """The budget must exceed the measured cost by this factor."""
    cold_history: int = 0
    """A user with fewer known interactions than this gets the hot list (0: nobody)."""


@dataclass(frozen=True)
class Situation:
    device: str | None
    budget_ms: float
    """Milliseconds left until the request's deadline."""
    queue_depth: int = 0
    cached: bool = False
    """A valid cached result exists for this user and context."""
    full_ok: bool = True
    """The full model is loaded and its last batches did not fail."""
    light_ok: bool = True
    full_cost_ms: float | None = None
    """Measured (EWMA) cost of the full path per batch, if known."""
    light_cost_ms: float | None = None
    history: int | None = None
    """The user's interactions the worker knows of (its recent clicks, at most ten read from
    Redis); None: not known (the channels that read them missed their deadline)."""


@dataclass(frozen=True)
class Choice:
    tier: str
    reason: str


class Ladder:
    def __init__(self, config: LadderConfig | None = None) -> None:
        self.config = config or LadderConfig()

    def choose(self, s: Situation) -> Choice:
        c = self.config
        full_cost = (s.full_cost_ms or c.full_cost_ms) * c.safety
        light_cost = (s.light_cost_ms or c.light_cost_ms) * c.safety
        if s.history is not None and s.history < c.cold_history:
            return Choice(HOT, f"history {s.history} < {c.cold_history}: the hot list")
        if s.device == "low_end":
            return self._light_or_down(s, "low_end device: light model", light_cost)
        if not s.full_ok:
            return self._fallback(s, FULL_UNAVAILABLE, light_cost)
        if s.queue_depth > c.queue_depth_limit:
            return self._fallback(
                s, f"queue depth {s.queue_depth} > {c.queue_depth_limit}", light_cost
            )
        if s.budget_ms < full_cost:
            return self._fallback(
                s, f"budget {s.budget_ms:.0f} ms < full path {full_cost:.0f} ms", light_cost
            )
        return Choice(FULL, "ok")

    def _fallback(self, s: Situation, reason: str, light_cost: float) -> Choice:
        if s.cached:
            return Choice(CACHED, reason)
        return self._light_or_down(s, reason, light_cost)

    @staticmethod
    def _light_or_down(s: Situation, reason: str, light_cost: float) -> Choice:
        if not s.light_ok:
            return Choice(HOT, f"{reason}; light model unavailable")
        if s.budget_ms < light_cost:
            return Choice(HOT, f"{reason}; budget {s.budget_ms:.0f} ms < light path")
        return Choice(LIGHT, reason)


def ewma(old: float | None, new: float, alpha: float = 0.2) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


def reason_label(reason: str, degraded: list[str]) -> str:
    text = reason if reason != "ok" else (degraded[0] if degraded else "ok")
    for key in (
        "history",
        "low_end",
        "queue depth",
        "budget",
        "unavailable",
        "error",
        "redis",
        "recall",
    ):
        if key in text:
            return key.replace(" ", "_")
    return "other"
