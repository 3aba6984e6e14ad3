"""Benchmark: what each serving mode does in the closed loop, under a load ramp.

For each mode (``inference/serving/modes.py``) a pipeline of its own (``tools/pipeline.py``:
a private broker and Redis, the streams app, the parameter server and one worker as
processes, its ``FRESHREC_MODE`` set) serves simulated users who click (``ClosedLoop``) in
three phases: ``--phase`` seconds at the normal rate ``--requests``, as long at ``--spike``
times that rate, and as long at the normal rate again. Synthetic background events run at
``--rate`` throughout. Per phase: requests sent and answered, the client's latency p50 and
p99 (from the request to its reply), the share of replies per tier, CTR, catalogue coverage
(the share of items shown at least once), intra-list diversity (the share of a list's item
pairs from different categories), the share of a list's items the user's previous list
held, the worker's CPU-seconds per 1,000 requests with their price at
``--core-hour-price``, and the worker's own p99 per stage over the phase (its
``freshrec_request_seconds{stage}``: ``topic`` from the request's produce to the worker's
read, ``queue`` to the batch's start, then recall, rank, rerank and ``total``), so a client
p99 beyond the worker's ``total`` is time outside the worker (the reply's way back).

    .venv/bin/python -m tools.bench_modes [--modes daily,promo,acquisition] [--requests 20]
        [--spike 5] [--phase 40] [--rate 200]

Writes artifacts/bench_modes.json (``--out``). Needs nothing running.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from freshrec.app.observe import REQUEST_STAGES
from freshrec.app.proctime import cpu_seconds
from freshrec.cost import CORE_HOUR_PRICE, costs
from freshrec.promtext import histogram_quantile, scrape_port_now, subtract
from freshrec.sim.closedloop import ClosedLoop
from freshrec.sim.world import World
from tools.benchlib import save
from tools.pipeline import WORLD, BackgroundEvents, Pipeline, train_models

PHASES = ("normal", "spike", "after")


REQUEST_SECONDS = "freshrec_request_seconds"


def stage_p99_ms(before: dict, after: dict) -> dict:
    """The worker's p99 per request stage between two scrapes of its metrics."""
    window = subtract(after, before, REQUEST_SECONDS + "_bucket")
    out = {}
    for stage in REQUEST_STAGES:
        q = histogram_quantile(window, REQUEST_SECONDS, 0.99, stage=stage)
        out[stage] = None if q != q else round(q * 1000, 1)
    return out


def phase_figures(loop: ClosedLoop, seconds: float, cpu_s: float, core_hour: float) -> dict:
    st = loop.stats
    answered = max(st.replied, 1)
    cost = costs({"worker": cpu_s}, answered, 0, core_hour)
    return {
        "seconds": seconds,
        "sent": st.sent,
        "answered": st.replied,
        "timed_out": st.timeouts,
        "requests_per_s": round(st.replied / seconds, 1),
        "p50_ms": round(st.p(50, recent=False), 1) if st.replied else None,
        "p99_ms": round(st.p(99, recent=False), 1) if st.replied else None,
        "tiers": {t: round(n / answered, 4) for t, n in st.tiers.most_common()},
        "ctr": round(st.ctr, 4),
        "impressions": st.impressions,
        "coverage": round(len(st.shown) / WORLD.n_items, 4),
        "intra_list_diversity": None
        if st.intra_list_diversity is None
        else round(st.intra_list_diversity, 4),
        "repeat_share": None if st.repeat_share is None else round(st.repeat_share, 4),
        "worker_cpu_s": round(cpu_s, 2),
        "worker_cpu_s_per_1000": round(cost.per_thousand_requests["worker"], 2),
        "usd_per_1000": round(cost.price_per_thousand_requests, 7),
    }


def run_mode(
    mode: str,
    models: Path,
    *,
    requests: float,
    spike: float,
    phase_s: float,
    rate: float,
    core_hour: float,
) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"freshrec-mode-{mode}-"))
    pipe = Pipeline(workdir, models, message_timeout_ms=0)
    pipe.env["FRESHREC_MODE"] = mode
    pipe.env["FRESHREC_EXCLUDE_SEEN"] = "false"  # the synthetic world: users click again
    try:
        for name in ("streams", "param-server", "worker"):
            pipe.start(name, name)
        pipe.wait_assigned(["streams", "param-server", "worker"])
        events = BackgroundEvents(pipe.conn, rate)
        events.start()
        phases = {}
        for j, phase in enumerate(PHASES):
            rate_per_s = requests * (spike if phase == "spike" else 1.0)
            phases[phase] = f = run_phase(pipe, rate_per_s, 11 + j, phase_s, core_hour)
            print(
                f"   {mode:<12} {phase:<7} {f['requests_per_s']:>6}/s p99 {f['p99_ms']} ms, "
                f"CTR {f['ctr']:.2%}, coverage {f['coverage']:.1%}, diversity "
                f"{f['intra_list_diversity']}, repeat {f['repeat_share']}, tiers {f['tiers']}, "
                f"{f['worker_cpu_s_per_1000']} CPU-s/1k, worker p99 by stage "
                f"{f['worker_stage_p99_ms']}",
                flush=True,
            )
        events.stop(30)
        return {"mode": mode, "phases": phases, "alive": pipe.alive()}
    finally:
        pipe.close()


def run_phase(pipe: Pipeline, rate: float, seed: int, seconds: float, core_hour: float) -> dict:
    """A closed loop of simulated users at ``rate`` requests per second for ``seconds``; the
    phase's figures, the worker's CPU and its p99 per stage among them."""
    worker_pid = pipe.procs["worker"].pid
    loop = ClosedLoop(pipe.conn, World(WORLD), rate, seed=seed, timeout_s=5.0)
    stop = threading.Event()
    metrics0 = scrape_port_now(pipe.ports["worker"])
    cpu0, t0 = cpu_seconds(worker_pid) or 0.0, time.monotonic()
    thread = loop.run_in_thread(stop)
    time.sleep(seconds)
    stop.set()
    thread.join(30)
    took = time.monotonic() - t0
    cpu = (cpu_seconds(worker_pid) or 0.0) - cpu0
    figures = phase_figures(loop, took, cpu, core_hour)
    figures["worker_stage_p99_ms"] = stage_p99_ms(metrics0, scrape_port_now(pipe.ports["worker"]))
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="daily,promo,acquisition")
    ap.add_argument("--requests", type=float, default=20.0, help="normal requests per second")
    ap.add_argument("--spike", type=float, default=5.0, help="the spike's multiple of it")
    ap.add_argument("--phase", type=float, default=40.0, help="seconds per phase")
    ap.add_argument("--rate", type=float, default=200.0, help="background events per second")
    ap.add_argument("--core-hour-price", type=float, default=CORE_HOUR_PRICE)
    ap.add_argument("--out", type=Path, default=Path("artifacts"))
    args = ap.parse_args()
    models = train_models(Path(tempfile.mkdtemp(prefix="freshrec-modes-models-")))
    results = []
    for mode in [m for m in args.modes.split(",") if m]:
        print(f"== {mode}", flush=True)
        results.append(
            run_mode(
                mode,
                models,
                requests=args.requests,
                spike=args.spike,
                phase_s=args.phase,
                rate=args.rate,
                core_hour=args.core_hour_price,
            )
        )
    save(
        "bench_modes",
        {"settings": {k: str(v) for k, v in vars(args).items()}, "modes": results},
        args.out,
    )


if __name__ == "__main__":
    main()
