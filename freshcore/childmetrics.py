"""One /metrics endpoint for a service that runs part of its work in a child process.

A child process has its own Prometheus registry. It sends snapshots of its ``freshrec_``
families to the parent over a pipe (``send_snapshots``, every ``interval_s``); the parent's
endpoint serves its own registry merged with the latest snapshot of each child
(``MergedRegistry``), so dashboards and scrapers see one process. This is what
prometheus_client's multiprocess mode does with files, without its import-time environment
variable and its per-pid gauges.

Merging (``merge_families``, pure): a sample both sides have is summed for counters,
histograms and summaries (``_created``: the earlier time); a gauge keeps the parent's value.
Samples only a child has are appended, each label set's samples together, so a histogram's
buckets stay contiguous in the exposition.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)
PREFIX = "freshrec_"
SUMMED = ("counter", "histogram", "summary", "gaugehistogram", "unknown")


def _key(sample) -> tuple:
    return sample.name, tuple(sorted(sample.labels.items()))


def _combined(typ: str, name: str, mine: float, theirs: float) -> float:
    if typ not in SUMMED:
        return mine  # a gauge: the parent's own value
    if name.endswith("_created"):
        return min(mine, theirs)
    return mine + theirs


def merge_families(own: Iterable[Metric], children: Sequence[Sequence[Metric]]) -> list[Metric]:
    """The parent's families with every child's samples merged in (see the module text).

    >>> from prometheus_client.metrics_core import CounterMetricFamily as C
    >>> a = C("freshrec_x", "x", labels=["k"]); a.add_metric(["a"], 1.0)
    >>> b = C("freshrec_x", "x", labels=["k"]); b.add_metric(["a"], 2.0); b.add_metric(["b"], 5.0)
    >>> [(s.labels["k"], s.value) for s in merge_families([a], [[b]])[0].samples]
    [('a', 3.0), ('b', 5.0)]
    """
    merged: dict[str, Metric] = {}
    order: list[str] = []
    for family in own:
        merged[family.name] = _with_samples(family, family.samples)
        order.append(family.name)
    for snapshot in children:
        for family in snapshot:
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = _with_samples(family, [])
                order.append(family.name)
            index = {_key(s): i for i, s in enumerate(target.samples)}
            for s in family.samples:
                i = index.get(_key(s))
                if i is None:
                    target.samples.append(s)
                    continue
                old = target.samples[i]
                value = _combined(family.type, s.name, old.value, s.value)
                target.samples[i] = old._replace(value=value)
    return [merged[name] for name in order]


def snapshot(registry=REGISTRY, prefix: str = PREFIX) -> list[Metric]:
    """This process's families whose names start with ``prefix`` (picklable)."""
    return [f for f in registry.collect() if f.name.startswith(prefix)]


def send_snapshots(conn, stop: threading.Event, interval_s: float = 0.25) -> None:
    """Child side: send a snapshot over ``conn`` every ``interval_s`` until ``stop`` is set
    (and once more then) or the parent has gone."""
    while True:
        stopping = stop.wait(interval_s)
        try:
            conn.send(snapshot())
        except (BrokenPipeError, EOFError, OSError):
            return
        if stopping:
            return


class MergedRegistry:
    """Parent side: what ``start_http_server(registry=...)`` serves — this process's registry
    and the newest snapshot of each child (``receive`` runs on a thread per child)."""

    def __init__(self, registry=REGISTRY) -> None:
        self.registry = registry
        self.children: dict[str, list[Metric]] = {}
        self._lock = threading.Lock()

    def receive(self, name: str, conn) -> None:
        """Store snapshots from ``conn`` until it closes; the last one stays (the child's
        counters keep counting what it did)."""
        while True:
            try:
                families = conn.recv()
            except (EOFError, OSError):
                return
            with self._lock:
                self.children[name] = families

    def collect(self) -> list[Metric]:
        with self._lock:
            children = list(self.children.values())
        return merge_families(self.registry.collect(), children)

    def restricted_registry(self, names) -> _Restricted:
        """What ``/metrics?name[]=…`` serves: only samples with those names."""
        return _Restricted(self, set(names))


class _Restricted:
    def __init__(self, merged: MergedRegistry, names: set[str]) -> None:
        self.merged, self.names = merged, names

    def collect(self) -> list[Metric]:
        out = []
        for family in self.merged.collect():
            kept = [s for s in family.samples if s.name in self.names]
            if kept:
                out.append(_with_samples(family, kept))
        return out


def _with_samples(family: Metric, samples) -> Metric:
    """A family like ``family`` (name, help, type, unit) holding a list of ``samples``."""
    copy = Metric(family.name, family.documentation, family.type, family.unit)
    copy.samples = list(samples)
    return copy
