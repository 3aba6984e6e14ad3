"""Liveness and readiness of a service, for its ``/healthz`` and ``/readyz`` endpoints (beside
``/metrics``). Pure: the service reports, the endpoints ask.

- **Live**: the service's loop has beaten within ``stall_s`` (a loop stuck that long — a
  deadlock, a call that never returns — is restarted by an orchestrator), or it is still
  starting (no beat yet).
- **Ready**: it owns input partitions in its consumer group and its last Redis check
  succeeded: traffic sent to it (requests keyed to its partitions) is served, not queued.

>>> h = Health(stall_s=30)
>>> h.live(now=100.0), h.ready()
((True, 'starting'), (False, 'no partitions assigned'))
>>> h.beat(now=100.0); h.assigned(4); h.redis(True)
>>> h.live(now=120.0), h.ready()
((True, 'loop beat 20.0 s ago'), (True, '4 partitions, Redis reachable'))
>>> h.live(now=131.0)[0], h.redis(False), h.ready()
(False, None, (False, 'Redis unreachable'))
"""

from __future__ import annotations

import time


class Health:
    def __init__(self, stall_s: float = 60.0) -> None:
        self.stall_s = stall_s
        self._beat: float | None = None
        self._partitions = 0
        self._redis_ok = True

    def beat(self, now: float | None = None) -> None:
        """The service's loop went round."""
        self._beat = time.monotonic() if now is None else now

    def assigned(self, partitions: int) -> None:
        self._partitions = partitions

    def redis(self, ok: bool) -> None:
        self._redis_ok = ok

    def live(self, now: float | None = None) -> tuple[bool, str]:
        if self._beat is None:
            return True, "starting"
        ago = (time.monotonic() if now is None else now) - self._beat
        if ago > self.stall_s:
            return False, f"loop stalled: last beat {ago:.1f} s ago"
        return True, f"loop beat {ago:.1f} s ago"

    def ready(self) -> tuple[bool, str]:
        if self._partitions <= 0:
            return False, "no partitions assigned"
        if not self._redis_ok:
            return False, "Redis unreachable"
        return True, f"{self._partitions} partitions, Redis reachable"


HEALTH = Health()
"""This process's health: its service beats and reports into it."""
