"""Drill: the parameter server SIGKILLed under a steady event rate, restarted after an outage.

A private embedded stack, a worker and a parameter server as their own processes, events at
``--rate`` from the synthetic world. ``--before`` seconds in, the parameter server is
SIGKILLed; ``--outage`` seconds later a new one starts (it resumes from the offsets in Redis).
Every ``--every`` seconds the worker's metrics are sampled: events learnt, local steps pending
in its read-your-writes pool (``FRESHREC_MAX_PENDING_STEPS`` set to ``--bound``), steps let
go at the bound, broadcast rows installed, and how far the served rows are behind in event
time (``freshrec_freshness_event_timestamp_seconds``, local minus served). Reported: the
learning rate before, during and after the outage, the pool's peak, the steps let go, how
far the served rows fell behind, and how long after the restart the pool was back to its
size before the kill (the new server caught up with the gradients that waited in Kafka).

    .venv/bin/python -m tools.drill_param_server [--rate 5000] [--before 12] [--outage 20]
                                                 [--after 25] [--bound 50000] [--every 2.5]

Writes artifacts/drill_param_server.json (`--out`). Needs nothing running.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from freshrec.app.observe import behind
from freshrec.app.stack import free_port
from freshrec.promtext import scrape_port_now, total
from freshrec.sim.produce import produce_events
from tools.benchlib import bench_connection, learning_world, save, service_process


def _rate(samples: list[dict], since: float, until: float) -> float:
    """Events learnt per second between the samples nearest ``since`` and ``until``."""
    inside = [s for s in samples if since <= s["t_s"] <= until]
    if len(inside) < 2:
        return 0.0
    first, last = inside[0], inside[-1]
    return (last["events"] - first["events"]) / (last["t_s"] - first["t_s"])


def _most(samples) -> float | None:
    values = [s["served_behind_local_s"] for s in samples]
    values = [v for v in values if v is not None]
    return max(values, default=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=5000.0, help="events per second")
    ap.add_argument("--before", type=float, default=12.0, help="seconds before the kill")
    ap.add_argument("--outage", type=float, default=20.0, help="seconds without a server")
    ap.add_argument("--after", type=float, default=25.0, help="seconds of events after it")
    ap.add_argument("--bound", type=int, default=50_000, help="FRESHREC_MAX_PENDING_STEPS")
    ap.add_argument("--every", type=float, default=2.5, help="seconds between samples")
    ap.add_argument("--out", type=Path, default=Path("artifacts"))
    args = ap.parse_args()
    if args.bound < 1000 or min(args.before, args.outage, args.after) <= 0:
        ap.error("--bound must be >= 1000 and every phase longer than 0 s")
    world = learning_world()
    logs = Path(tempfile.mkdtemp(prefix="freshrec-drill-"))
    worker_port, ps_port = free_port(), free_port()
    with (
        bench_connection(f"dr{int(time.time())}.") as conn,
        service_process(
            conn,
            "worker",
            worker_port,
            {"FRESHREC_MAX_PENDING_STEPS": str(args.bound)},
            log=logs / "worker.log",
        ),
        contextlib.ExitStack() as servers,
    ):
        ps = servers.enter_context(
            service_process(conn, "param-server", ps_port, log=logs / "param-server-1.log")
        )
        produce_events(conn, world, rate_per_s=200, duration_s=3.0, seed=1)  # warm-up (joins)
        outage = kill_and_restart(conn, world, servers, ps, (worker_port, ps_port), logs, args)
    save("drill_param_server", report(outage, args, logs), args.out)


@dataclass
class Outage:
    """When the parameter server was killed and restarted, and the worker's samples."""

    killed_at: float
    restarted_at: float
    samples: list[dict]


def kill_and_restart(conn, world, servers, ps, ports: tuple[int, int], logs: Path, args):
    """Events at ``--rate`` through the three phases: the parameter server ``ps`` (on the
    exit stack ``servers``) SIGKILLed ``--before`` seconds in, a new one started
    ``--outage`` seconds later; the worker sampled every ``--every`` seconds."""
    worker_port, ps_port = ports
    samples: list[dict] = []
    feed = threading.Thread(
        target=produce_events,
        args=(conn, world),
        kwargs={
            "rate_per_s": args.rate,
            "duration_s": args.before + args.outage + args.after,
            "seed": 2,
        },
    )
    t0 = time.monotonic()
    feed.start()
    killed_at = restarted_at = None
    while True:
        time.sleep(args.every)
        now = time.monotonic() - t0
        if killed_at is None and now >= args.before:
            os.kill(ps.pid, signal.SIGKILL)
            ps.wait()
            killed_at = now
            print(f"{now:5.1f} s  parameter server SIGKILLed", flush=True)
        elif killed_at is not None and restarted_at is None and now >= killed_at + args.outage:
            servers.close()
            servers.enter_context(
                service_process(conn, "param-server", ps_port, log=logs / "param-server-2.log")
            )
            restarted_at = now
            print(f"{now:5.1f} s  parameter server restarted", flush=True)
        samples.append(worker_sample(worker_port, now))
        if not feed.is_alive() and restarted_at is not None:
            break
    feed.join()
    return Outage(killed_at, restarted_at, samples)


def worker_sample(port: int, now: float) -> dict:
    """The worker's figures ``now`` seconds into the feed, printed as they are taken."""
    s = scrape_port_now(port)
    sample = {
        "t_s": round(now, 1),
        "events": total(s, "freshrec_worker_events_total"),
        "pending_steps": total(s, "freshrec_pending_local_steps"),
        "let_go": total(s, "freshrec_pending_local_steps_let_go_total"),
        "rows_installed": total(s, "freshrec_updates_installed_total"),
        "served_behind_local_s": behind(s)["served"],
    }
    print(
        f"{now:5.1f} s  events {sample['events']:>9,.0f}  pending steps "
        f"{sample['pending_steps']:>7,.0f}  let go {sample['let_go']:>7,.0f}  rows "
        f"installed {sample['rows_installed']:>9,.0f}  served behind local "
        f"{sample['served_behind_local_s']} s",
        flush=True,
    )
    return sample


def report(outage: Outage, args, logs: Path) -> dict:
    """The drill's results (the module's docstring)."""
    samples, killed_at, restarted_at = outage.samples, outage.killed_at, outage.restarted_at
    events_s = args.before + args.outage + args.after
    before = [s for s in samples if s["t_s"] <= killed_at]
    level = max(s["pending_steps"] for s in before)
    back = next(
        (s["t_s"] for s in samples if s["t_s"] > restarted_at and s["pending_steps"] <= level),
        None,
    )
    return {
        "rate_events_per_s": args.rate,
        "bound_steps": args.bound,
        "killed_at_s": round(killed_at, 1),
        "restarted_at_s": round(restarted_at, 1),
        "learnt_events_per_s": {
            "before": round(_rate(samples, 0, killed_at)),
            "outage": round(_rate(samples, killed_at, restarted_at)),
            "after": round(_rate(samples, restarted_at, events_s)),
        },
        "pending_steps_before_kill_max": level,
        "served_behind_local_s_max": {
            "before": _most(before),
            # from the kill until the pool is back (the new server caught up)
            "outage": _most(
                s for s in samples if killed_at < s["t_s"] and (not back or s["t_s"] < back)
            ),
            "after_recovery": _most(s for s in samples if back and s["t_s"] >= back),
        },
        "pending_steps_max": max(s["pending_steps"] for s in samples),
        "steps_let_go": samples[-1]["let_go"],
        "pool_back_to_its_level_after_restart_s": (
            None if back is None else round(back - restarted_at, 1)
        ),
        "note": f"samples every {args.every} s; 'pool back': the first sample after the "
        "restart with no more pending steps than the most before the kill; logs in "
        f"{logs}",
        "samples": samples,
    }


if __name__ == "__main__":
    main()
