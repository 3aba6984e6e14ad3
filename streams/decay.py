"""Forward decay (Cormode, Shkapenyuk, Srivastava, Xu; ICDE 2009), exponential form. Pure.

A count decayed at rate ``r`` per hour is, at time ``t``, Σⱼ r^((t − tⱼ)/h). Forward decay
stores instead Σⱼ g(tⱼ − L) with g(x) = r^(−x/h) and a landmark L, so adding an event never
touches other rows and time passing rewrites nothing; the decayed value at any t is
``stored / g(t − L)``. g grows without bound, so the landmark is moved forward (every stored
value divided by g(L' − L)) well before floats lose range.

Time is event time in milliseconds, passed in; nothing here reads a clock.

>>> d = ForwardDecay(rate_per_hour=0.5, landmark_ms=0)
>>> stored = d.weight(0) + d.weight(3_600_000)   # one event at t=0, one an hour later
>>> round(d.value_at(stored, 3_600_000), 12)     # 1·0.5 + 1·1
1.5
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from freshcore.hotscore import HOUR_MS, decay_factor, decay_ln_per_ms

__all__ = ["HOUR_MS", "ForwardDecay"]


@dataclass
class ForwardDecay:
    """The decay function and its landmark; arrays of stored values live with the caller."""

    rate_per_hour: float = 0.95
    landmark_ms: int = 0
    time_scale: float = 1.0
    """Milliseconds of the world one of event time stands for (``decay_ln_per_ms``)."""
    renormalise_above: float = 1e12
    """Move the landmark when g(t − L) exceeds this (~22 days at 0.95/h): far below overflow,
    and float64 keeps ~4 more digits than the counts need."""

    def __post_init__(self) -> None:
        self._ln = decay_ln_per_ms(self.rate_per_hour, self.time_scale)  # ln g per ms

    def weight(self, t_ms: int | float) -> float:
        """g(t − L): what one event at ``t_ms`` adds to a stored count."""
        return math.exp(self._ln * (t_ms - self.landmark_ms))

    def weights(self, t_ms: np.ndarray) -> np.ndarray:
        return np.exp(self._ln * (np.asarray(t_ms, np.float64) - self.landmark_ms))

    def value_at(self, stored: float | np.ndarray, t_ms: int | float):
        """The decayed count at ``t_ms`` of a stored forward-decayed sum."""
        return stored / self.weight(t_ms)

    def factor(self, from_ms: int | float, to_ms: int | float) -> float:
        """How much a decayed value shrinks from ``from_ms`` to ``to_ms``: r^((to − from)/h)."""
        return decay_factor(self.rate_per_hour, to_ms - from_ms, self.time_scale)

    def landmark_for(self, t_ms: int | float, lag_ms: int | float) -> float:
        """Where to move the landmark when an event at ``t_ms`` needs it: ``lag_ms`` behind
        (events within the lateness grace keep weights above 1), but no further than the
        stored weight of an event at ``t_ms`` stays far from overflow (a decay of seconds,
        as a replay at speed makes, against a grace of minutes).

        >>> d = ForwardDecay(rate_per_hour=0.95, time_scale=86_000.0)
        >>> 0 < 1_000_000 - d.landmark_for(1_000_000, 600_000) < 600_000
        True
        """
        if self._ln <= 0:
            return t_ms - lag_ms
        return t_ms - min(lag_ms, math.log(self.renormalise_above) / 2 / self._ln)

    def needs_renormalising(self, t_ms: int | float) -> bool:
        # in logs: after a quiet spell of a fast decay the weight itself would overflow
        return self._ln * (t_ms - self.landmark_ms) > math.log(self.renormalise_above)

    def shrink_to(self, new_landmark_ms: int | float) -> float:
        """What moving the landmark to ``new_landmark_ms`` multiplies stored values by:
        1 / g(L' − L), which only underflows (to 0: long decayed) and never overflows."""
        return math.exp(-self._ln * (new_landmark_ms - self.landmark_ms))

    def renormalise(self, new_landmark_ms: int, *arrays: np.ndarray) -> None:
        """Move the landmark to ``new_landmark_ms``, rescaling ``arrays`` in place."""
        scale = self.shrink_to(new_landmark_ms)
        for a in arrays:
            a *= scale
        self.landmark_ms = new_landmark_ms
