"""Multi-channel recall: every channel runs concurrently for a whole batch of requests, each
with its own deadline and circuit breaker. The channels themselves are in ``channels.py``.

A channel that misses its deadline is dropped from that batch (its thread finishes in the
background; its result is discarded) and counted; its breaker sees a failure. Channels that
only read memory the worker holds (``inline``: the hot, regional and new lists, microseconds
each) run in the calling thread while the others work: a thread hand-off would cost more than
they do. Each one's deadline is checked against its own call's time when it returns (not the
time the inline channels before it took, nor the submissions); one with an injected delay goes
to the pool like the rest. An open breaker
skips the channel until its cool-down has passed. A ``delay`` per channel can be injected for
fault drills (``FRESHREC_RECALL_INJECT_DELAY_MS``).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from freshcore import clock
from freshcore import metrics as m
from inference.serving.breaker import BreakerConfig, CircuitBreaker

log = logging.getLogger("freshrec.recall")


@dataclass(frozen=True)
class ChannelConfig:
    quota: int
    deadline_ms: float


@dataclass(frozen=True)
class RecallQuery:
    user_id: str
    user_row: np.ndarray
    region: str | None


@dataclass(frozen=True)
class Recalled:
    """A channel's answer with what it read on the way: each query's slots, and the recent
    clicks it fetched per user (the i2i channel, for users the worker holds none of)."""

    slots: list[np.ndarray]
    recent: dict[str, list[str]] = field(default_factory=dict)
    scores: list[dict[int, float]] | None = None
    """Per query, the channel's score of every item it found (slot → score), not only of
    those within its quota: a ranking feature (the ``covisit`` channel's)."""


class Channel(Protocol):
    """What the runner calls (``channels.RecallChannel`` is the one implementation)."""

    inline: bool

    def recall(self, queries: Sequence[RecallQuery], n: int) -> list[np.ndarray] | Recalled: ...


@dataclass
class RecallResult:
    per_query: list[dict[str, np.ndarray]]
    timed_out: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Channels whose breaker was open."""
    recent: dict[str, list[str]] = field(default_factory=dict)
    """Recent clicks per user that channels which met their deadline read on the way."""
    scores: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    """Per channel that met its deadline and scored what it found: ``Recalled.scores``."""
    elapsed_ms: float = 0.0

    def spread(self, at: list[int], n: int) -> RecallResult:
        """This result, for queries ``at`` of a batch of ``n``, as the whole batch's: the
        other queries found nothing (they were not asked).

        >>> r = RecallResult([{"hot": 1}], scores={"covisit": [{3: 0.5}]}).spread([1], 3)
        >>> r.per_query, r.scores
        ([{}, {'hot': 1}, {}], {'covisit': [{}, {3: 0.5}, {}]})
        """
        per_query: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
        scores = {name: [{} for _ in range(n)] for name in self.scores}
        for k, j in enumerate(at):
            per_query[j] = self.per_query[k]
            for name, lists in self.scores.items():
                scores[name][j] = lists[k]
        return RecallResult(
            per_query,
            self.timed_out,
            self.failed,
            self.skipped,
            self.recent,
            scores,
            self.elapsed_ms,
        )


class RecallRunner:
    def __init__(
        self,
        channels: Mapping[str, Channel],
        configs: Mapping[str, ChannelConfig],
        breaker: BreakerConfig | None = None,
        delays_ms: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: seconds, monotonic; what deadlines are measured with."""
        unknown = set(configs) - set(channels)
        if unknown:
            raise ValueError(f"no such recall channel: {', '.join(sorted(unknown))}")
        self.channels = dict(channels)
        self.configs = dict(configs)
        self.breakers = {name: CircuitBreaker(breaker) for name in self.channels}
        self.delays_ms = dict(delays_ms or {})
        self.clock = clock
        self.inline = {
            name for name, c in self.channels.items() if c.inline and not self.delays_ms.get(name)
        }
        self.pool = cf.ThreadPoolExecutor(
            max_workers=2 * len(self.channels), thread_name_prefix="recall"
        )

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def use(self, configs: Mapping[str, ChannelConfig]) -> None:
        """The quotas and deadlines of the channels from ``configs`` (a serving mode's): the
        channels running stay those the runner was built with, and one ``configs`` does not
        name keeps its own."""
        self.configs = {name: configs.get(name, c) for name, c in self.configs.items()}

    def _call(self, name: str, queries: list[RecallQuery]) -> list[np.ndarray] | Recalled:
        delay = self.delays_ms.get(name)
        if delay:
            time.sleep(delay / 1000)
        return self.channels[name].recall(queries, self.configs[name].quota)

    def run_within(
        self, queries: list[RecallQuery], budgets_ms: list[float], share: float
    ) -> RecallResult:
        """``run`` for the queries with budget left, waiting at most ``share`` of the
        tightest of theirs; a query whose budget is spent (it waited in the topic or the
        queue) is not asked for and finds nothing: it neither cuts the others' recall to
        nothing nor times every channel out (and trips its breaker)."""
        live = [j for j, b in enumerate(budgets_ms) if b > 0]
        if len(live) == len(queries):
            return self.run(queries, budget_ms=min(budgets_ms) * share)
        if not live:
            return RecallResult([{} for _ in queries])
        budget = min(budgets_ms[j] for j in live) * share
        return self.run([queries[j] for j in live], budget).spread(live, len(queries))

    def run(self, queries: list[RecallQuery], budget_ms: float | None = None) -> RecallResult:
        """All allowed channels at once; waits at most each channel's deadline (capped by
        ``budget_ms``, the batch's remaining deadline budget)."""
        start = self.clock()
        now_ms = clock.now_ms()
        futures: dict[str, cf.Future] = {}
        result = RecallResult([{} for _ in queries])
        for name in self.configs:
            breaker = self.breakers[name]
            if not breaker.allow(now_ms):
                result.skipped.append(name)
                m.RECALL_CALLS.labels(name, "breaker_open").inc()
                continue
            if name in self.inline:
                futures[name] = cf.Future()
            else:
                futures[name] = self.pool.submit(self._call, name, queries)
        took: dict[str, float] = {}  # inline channel -> seconds its own call took
        for name, fut in futures.items():  # the inline ones, while the pool works
            if name in self.inline:
                called = self.clock()
                try:
                    fut.set_result(self._call(name, queries))
                except Exception as exc:
                    fut.set_exception(exc)
                took[name] = self.clock() - called
        for name, fut in futures.items():
            limit = self.configs[name].deadline_ms
            if budget_ms is not None:
                limit = min(limit, max(budget_ms, 0.0))
            remaining = limit / 1000 - (self.clock() - start)
            try:
                if name in took:
                    if took[name] > limit / 1000:
                        raise cf.TimeoutError  # it returned, but took longer than its deadline
                    remaining = 0.0  # done: waiting on other channels does not count
                lists = fut.result(timeout=max(remaining, 0.0))
            except cf.TimeoutError:
                fut.cancel()
                result.timed_out.append(name)
                self._record(name, False, "timeout")
                continue
            except Exception as exc:  # a failing channel must not fail the request
                log.warning("recall channel %s failed: %s", name, exc)
                result.failed.append(name)
                self._record(name, False, "error")
                continue
            self._record(name, True, "ok")
            if isinstance(lists, Recalled):
                result.recent.update(lists.recent)
                if lists.scores is not None:
                    result.scores[name] = lists.scores
                lists = lists.slots
            for j, items in enumerate(lists):
                result.per_query[j][name] = items
        result.elapsed_ms = (self.clock() - start) * 1000
        return result

    def _record(self, name: str, ok: bool, outcome: str) -> None:
        now_ms = clock.now_ms()
        self.breakers[name].record(ok, now_ms)
        m.RECALL_CALLS.labels(name, outcome).inc()

    def breaker_states(self) -> dict[str, str]:
        now_ms = clock.now_ms()
        return {name: b.state(now_ms) for name, b in self.breakers.items()}
