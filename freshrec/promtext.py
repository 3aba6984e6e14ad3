"""Read Prometheus text exposition: scrape a /metrics endpoint, sum series, estimate quantiles.

Used by benchmarks, ``freshrec top`` and tests; no Prometheus server needed.

>>> text = 'x_bucket{le="0.1"} 5\\nx_bucket{le="1.0"} 10\\nx_bucket{le="+Inf"} 10\\n'
>>> round(histogram_quantile(parse(text), "x", 0.5), 3)
0.1
"""

from __future__ import annotations

import math
import re
import time
import urllib.request
from collections import defaultdict

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse(text: str) -> Samples:
    out: Samples = defaultdict(list)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m:
            labels = dict(_LABEL.findall(m.group(2) or ""))
            out[m.group(1)].append((labels, float(m.group(3))))
    return out


def scrape(url: str, timeout_s: float = 2.0) -> Samples:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return parse(resp.read().decode())


def total(samples: Samples, name: str, **match: str) -> float:
    return sum(
        v
        for labels, v in samples.get(name, [])
        if all(labels.get(k) == x for k, x in match.items())
    )


def histogram_quantile(samples: Samples, name: str, q: float, **match: str) -> float:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket (NaN if empty)."""
    buckets: dict[float, float] = defaultdict(float)
    for labels, v in samples.get(name + "_bucket", []):
        if all(labels.get(k) == x for k, x in match.items()):
            buckets[float(labels["le"])] += v
    if not buckets:
        return math.nan
    bounds = sorted(buckets)
    count = buckets[bounds[-1]]
    if count == 0:
        return math.nan
    rank = q * count
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if math.isinf(b):
                return prev_bound
            if c == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (c - prev_count)
        prev_bound, prev_count = b, c
    return bounds[-1]


def scrape_port(port: int, timeout_s: float = 1.0) -> Samples:
    """The /metrics of a local process, or nothing if it does not answer (yet)."""
    try:
        return scrape(f"http://127.0.0.1:{port}/metrics", timeout_s)
    except OSError:
        return {}


def scrape_port_now(port: int, within_s: float = 15.0) -> Samples:
    """The /metrics of a local process that must answer: asked again until it does (a busy
    process's metrics thread can miss ``scrape_port``'s 1 s), an error after ``within_s``.
    A phase's baseline must not be silently empty: the difference against it would then
    count everything since the process started (a lag run counted its ramp that way)."""
    deadline = time.monotonic() + within_s
    while True:
        samples = scrape_port(port, timeout_s=5.0)
        if samples:
            return samples
        if time.monotonic() > deadline:
            raise RuntimeError(f"the process on port {port} did not serve /metrics")
        time.sleep(0.1)


SCRAPE_LABEL = "__scrape"
"""The label ``merge`` adds: which of its scrapes (0, 1, ...) a series came from."""


def merge(*scrapes: Samples) -> Samples:
    """Samples of several processes under one name each, every process's series kept apart
    by a ``__scrape`` label (its position in ``scrapes``). Without it, two processes' series
    with the same labels were one key to ``subtract``: every process exposes an unlabelled
    histogram, zero where unused, so the parameter server's zeros stood in for the worker's
    baseline and its fetch-lag phase counted the warm-up and the ramp (p99 ~340 ms of
    2,000 events a second late in their first second, against ~60 ms over the phase).

    >>> m = merge({"h": [({}, 5.0)]}, {"h": [({}, 0.0)]})
    >>> subtract(merge({"h": [({}, 7.0)]}, {"h": [({}, 0.0)]}), m, "h")["h"][0][1]
    2.0
    """
    out: Samples = defaultdict(list)
    for index, samples in enumerate(scrapes):
        for name, series in samples.items():
            out[name].extend(({**labels, SCRAPE_LABEL: str(index)}, v) for labels, v in series)
    return out


def subtract(after: Samples, before: Samples, name: str) -> Samples:
    """``after - before`` for the series ``name`` (a histogram's buckets over one phase)."""
    base = {tuple(sorted(labels.items())): v for labels, v in before.get(name, [])}
    return {
        name: [
            (labels, v - base.get(tuple(sorted(labels.items())), 0.0))
            for labels, v in after.get(name, [])
        ]
    }
