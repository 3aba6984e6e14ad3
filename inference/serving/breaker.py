"""A circuit breaker per recall channel: closed → open → half-open → closed. Pure.

Closed: calls go through; the outcomes of the last ``window`` calls are kept. When at least
``min_calls`` are in the window and the failure (timeout) rate exceeds ``threshold``, the
breaker opens. Open: calls are refused until ``cooldown_ms`` has passed, then it is half-open:
up to ``probes`` calls go through; if they all succeed it closes (window cleared), one failure
opens it again. Time is passed in.

>>> b = CircuitBreaker(BreakerConfig(window=10, min_calls=4, threshold=0.1, cooldown_ms=100))
>>> for ok in (True, True, True, False):
...     b.record(ok, now_ms=0)
>>> b.state(0), b.allow(50), b.allow(100), b.state(100)
('open', False, True, 'half_open')
>>> b.record(True, now_ms=101); b.state(101)
'closed'
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    window: int = 50
    min_calls: int = 10
    threshold: float = 0.10
    """The seeds' 10% timeout rate."""
    cooldown_ms: int = 2000
    probes: int = 1


class CircuitBreaker:
    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config or BreakerConfig()
        self._outcomes: deque[bool] = deque(maxlen=self.config.window)
        self._state = CLOSED
        self._opened_at = 0
        self._probes_left = 0

    def state(self, now_ms: int) -> str:
        if self._state == OPEN and now_ms - self._opened_at >= self.config.cooldown_ms:
            self._state = HALF_OPEN
            self._probes_left = self.config.probes
        return self._state

    def allow(self, now_ms: int) -> bool:
        """May a call go through now? (A half-open breaker lets ``probes`` calls through.)"""
        state = self.state(now_ms)
        if state == CLOSED:
            return True
        if state == HALF_OPEN and self._probes_left > 0:
            self._probes_left -= 1
            return True
        return False

    def record(self, ok: bool, now_ms: int) -> None:
        state = self.state(now_ms)
        if state == HALF_OPEN:
            if ok:
                self._state = CLOSED
                self._outcomes.clear()
            else:
                self._open(now_ms)
            return
        if state == OPEN:
            return
        self._outcomes.append(ok)
        n = len(self._outcomes)
        failures = n - sum(self._outcomes)
        if n >= self.config.min_calls and failures / n > self.config.threshold:
            self._open(now_ms)

    def failure_rate(self) -> float:
        n = len(self._outcomes)
        return 0.0 if n == 0 else (n - sum(self._outcomes)) / n

    def _open(self, now_ms: int) -> None:
        self._state = OPEN
        self._opened_at = now_ms
        self._probes_left = 0
