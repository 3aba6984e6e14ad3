"""What `freshrec run` shows about its services, read from their own /metrics endpoints."""

from __future__ import annotations

import math
import threading

from freshrec.promtext import Samples, histogram_quantile, scrape_port, total


def _scrape_all(ports: dict[str, int]) -> dict[str, Samples]:
    return {name: scrape_port(port) for name, port in ports.items()}


def summary(ports: dict[str, int]) -> str:
    s = _scrape_all(ports)
    streams, worker, ps = s.get("streams", {}), s.get("worker", {}), s.get("param-server", {})
    lag = "freshrec_freshness_lag_seconds"

    def p99(samples: Samples, stage: str) -> str:
        v = histogram_quantile(samples, lag, 0.99, stage=stage)
        return "–" if math.isnan(v) else f"{v * 1000:,.0f}ms"

    return (
        f"streams counted {total(streams, 'freshrec_streams_counted_events_total'):,.0f}"
        f" | worker learnt {total(worker, 'freshrec_worker_events_total', outcome='valid'):,.0f}"
        f" | ps applied {total(ps, 'freshrec_ps_rows_applied_total'):,.0f} rows"
        f" | p99 local {p99(worker, 'local')} global {p99(ps, 'global_applied')}"
        f" served {p99(worker, 'served')} reply {p99(worker, 'reply')}"
    )


def ranking_line(ports: dict[str, int]) -> str | None:
    """Each ranking model's forward pass per batch (p50 / p99) and the candidates it scored,
    over the run's workers; None when no model ranked."""
    worker = _scrape_all({k: v for k, v in ports.items() if k.startswith("worker")})
    samples: Samples = {}
    for one in worker.values():
        for name, rows in one.items():
            samples.setdefault(name, []).extend(rows)
    seen = sorted(
        {labels["ranker"] for labels, _ in samples.get("freshrec_ranked_candidates_total", [])}
    )
    parts = []
    for ranker in seen:
        n = total(samples, "freshrec_ranked_candidates_total", ranker=ranker)
        q = [
            histogram_quantile(samples, "freshrec_ranking_batch_seconds", x, ranker=ranker)
            for x in (0.5, 0.99)
        ]
        parts.append(f"{ranker} {q[0] * 1000:.1f}/{q[1] * 1000:.1f} ms ({n:,.0f} candidates)")
    return "ranking per batch, p50/p99: " + ", ".join(parts) if parts else None


def counts(ports: dict[str, int]) -> tuple[float, float]:
    """(requests served by every worker, events counted by the streams app) so far."""
    s = _scrape_all(ports)
    requests = sum(
        total(v, "freshrec_requests_total", outcome="served")
        for name, v in s.items()
        if name.startswith("worker")
    )
    return requests, total(s.get("streams", {}), "freshrec_streams_counted_events_total")


def gpu_services(ports: dict[str, int]) -> list[str]:
    """The services whose tables live on a GPU (``freshrec_device_info{device="cuda…"}``)."""
    return [name for name, samples in _scrape_all(ports).items() if holds_gpu(samples)]


def holds_gpu(samples: Samples) -> bool:
    """Whether a scrape says the service's tables live on a CUDA device.

    >>> from freshrec.promtext import parse
    >>> holds_gpu(parse('freshrec_device_info{device="cuda:0"} 1')), holds_gpu(parse(
    ...     'freshrec_device_info{device="cpu"} 1')), holds_gpu(parse(""))
    (True, False, False)
    """
    return any(
        labels.get("device", "").startswith("cuda") and value > 0
        for labels, value in samples.get("freshrec_device_info", [])
    )


def service_cpu(children) -> dict[str, float]:
    """CPU seconds so far of each (name, process) and its descendants; empty without /proc."""
    from freshrec.app.proctime import cpu_seconds

    out = {}
    for name, proc in children:
        used = cpu_seconds(proc.pid)
        if used is not None:
            out[name] = used
    return out


def cost_line(
    before,
    after,
    core_hour: float,
    gpu_seconds: dict[str, float] | None = None,
    gpu_hour: float | None = None,
) -> str | None:
    """The summary's cost line from two (cpu per service, (requests, events)) snapshots and
    the seconds between them that each GPU-holding service held its GPU."""
    from freshrec.cost import GPU_HOUR_PRICE, costs, line

    (cpu0, (req0, ev0)), (cpu1, (req1, ev1)) = before, after
    used = {name: max(cpu1[name] - cpu0.get(name, 0.0), 0.0) for name in cpu1}
    if not used:
        return None
    gpu_hour = GPU_HOUR_PRICE if gpu_hour is None else gpu_hour
    c = costs(used, req1 - req0, ev1 - ev0, core_hour, gpu_seconds, gpu_hour)
    return line(c, core_hour, gpu_hour)


def wait_until_assigned(ports: dict[str, int], timeout_s: float, on_wait=None) -> None:
    """Block until every service owns partitions in its group (joins take seconds)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        scraped = _scrape_all(ports)
        waiting = [
            name
            for name, samples in scraped.items()
            if total(samples, "freshrec_assigned_partitions") <= 0
        ]
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"services not ready after {timeout_s:.0f}s: {', '.join(waiting)}")
        if on_wait:
            on_wait(waiting)
        time.sleep(0.5)


class StatusPoller:
    """Refreshes ``text`` every ``interval_s`` in the background (scrapes are slow-ish)."""

    def __init__(self, ports: dict[str, int], interval_s: float = 2.0) -> None:
        self.ports, self.interval_s = ports, interval_s
        self.text = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="run-status")

    def __enter__(self) -> StatusPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.text = summary(self.ports)
