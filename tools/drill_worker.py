"""Drill: one of two workers SIGKILLed under a steady event rate; the other takes over.

A private embedded stack, a parameter server and two workers as their own processes, events at
``--rate`` from the synthetic world for ``--duration`` seconds. ``--kill-at`` seconds in,
worker A's metrics are read and it is SIGKILLed at once; worker B takes its partitions over
once the group notices (the session timeout, then a rebalance) and resumes them from A's last
committed offsets. When B has learnt everything, the workers' group's committed offsets are
compared with the end of each ``events`` partition (read back from the topic): equal means
every event was learnt and its gradients delivered (a worker commits an event only once the
broker holds its gradients). Reported: the events produced, learnt by A (up to its last
metrics read) and by B, how many at least were learnt twice (learning is at-least-once: the
events A learnt after its last commit), and when B's learning resumed.

    .venv/bin/python -m tools.drill_worker [--rate 2000] [--duration 30] [--kill-at 10]
                                           [--every 1.0]

Writes artifacts/drill_worker.json (`--out`). Needs nothing running.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from freshcore.topics import TopicNames
from freshrec.app.stack import free_port
from freshrec.promtext import scrape_port_now, total
from freshrec.sim.produce import produce_events
from tools.benchlib import (
    bench_connection,
    committed,
    learning_world,
    partition_ends,
    save,
    service_process,
)

LEARNT = "freshrec_worker_events_total"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=2000.0, help="events per second")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of events")
    ap.add_argument("--kill-at", type=float, default=10.0, help="seconds before worker A dies")
    ap.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("--out", type=Path, default=Path("artifacts"))
    args = ap.parse_args()
    if not 0 < args.kill_at < args.duration:
        ap.error("--kill-at must fall inside --duration")
    world = learning_world()
    logs = Path(tempfile.mkdtemp(prefix="freshrec-drill-"))
    ports = {"a": free_port(), "b": free_port()}
    with bench_connection(f"dw{int(time.time())}.") as conn:
        names = TopicNames(conn.topic_prefix)
        group = f"{conn.topic_prefix}freshrec-workers"
        with (
            service_process(conn, "param-server", free_port(), log=logs / "param-server.log"),
            service_process(
                conn, "worker", ports["a"], {"FRESHREC_WORKER_ID": "a"}, log=logs / "worker-a.log"
            ) as worker_a,
            service_process(
                conn, "worker", ports["b"], {"FRESHREC_WORKER_ID": "b"}, log=logs / "worker-b.log"
            ),
        ):
            wait_both_assigned(ports)
            run = kill_and_watch(conn, world, worker_a, ports, args)
            ends = partition_ends(conn, names.events)
            offsets = committed(conn, group, names.events, ends)
    save("drill_worker", report(run, ends, offsets, args.rate, logs), args.out)


def wait_both_assigned(ports: dict[str, int]) -> None:
    """Until both workers are in the group, each with its share of the partitions."""
    deadline = time.monotonic() + 60
    while not all(
        total(scrape_port_now(port), "freshrec_assigned_partitions") > 0 for port in ports.values()
    ):
        if time.monotonic() > deadline:
            raise SystemExit("the two workers did not both get partitions within 60 s")
        time.sleep(0.5)


@dataclass
class KillRun:
    """What the drill saw: the events produced, worker A's count at its last read and when
    it was killed, and worker B's samples."""

    produced: int
    a_last: float
    killed_at: float
    samples: list[dict]


def kill_and_watch(conn, world, worker_a, ports: dict[str, int], args) -> KillRun:
    """Events at ``--rate`` for ``--duration``; worker A SIGKILLed ``--kill-at`` seconds in;
    worker B sampled every ``--every`` seconds until it has learnt everything."""
    samples: list[dict] = []
    stats: list = []
    feed = threading.Thread(
        target=lambda: stats.append(
            produce_events(conn, world, rate_per_s=args.rate, duration_s=args.duration, seed=2)
        )
    )
    t0 = time.monotonic()
    feed.start()
    a_last = None
    while True:
        time.sleep(args.every)
        now = time.monotonic() - t0
        if a_last is None and now >= args.kill_at:
            a_last = total(scrape_port_now(ports["a"]), LEARNT, outcome="valid")
            os.kill(worker_a.pid, signal.SIGKILL)
            killed_at = now
            print(f"{now:5.1f} s  worker A SIGKILLed after learning {a_last:,.0f}", flush=True)
        s = scrape_port_now(ports["b"])
        sample = {
            "t_s": round(now, 1),
            "b_learnt": total(s, LEARNT, outcome="valid"),
            "b_partitions": total(s, "freshrec_assigned_partitions"),
        }
        samples.append(sample)
        print(
            f"{now:5.1f} s  worker B: learnt {sample['b_learnt']:>8,.0f}  partitions "
            f"{sample['b_partitions']:.0f}",
            flush=True,
        )
        if (
            not feed.is_alive()
            and len(samples) > 3
            and all(x["b_learnt"] == sample["b_learnt"] for x in samples[-3:])
        ):
            break
        if now > args.duration + 120:
            raise SystemExit("worker B did not finish within two minutes of the feed")
    feed.join()
    return KillRun(stats[0].delivered, a_last, killed_at, samples)


def report(run: KillRun, ends: dict, offsets: dict, rate: float, logs: Path) -> dict:
    """The drill's results (the module's docstring)."""
    b_final = run.samples[-1]["b_learnt"]
    partitions = int(max(s["b_partitions"] for s in run.samples))
    resumed = next(
        (
            s["t_s"]
            for s in run.samples
            if s["t_s"] > run.killed_at and s["b_partitions"] == partitions
        ),
        None,
    )
    return {
        "rate_events_per_s": rate,
        "killed_at_s": round(run.killed_at, 1),
        "events_produced": run.produced,
        "learnt_by_a_at_its_last_read": run.a_last,
        "learnt_by_b": b_final,
        "learnt_twice_at_least": run.a_last + b_final - run.produced,
        "b_owns_every_partition_after_s": (
            None if resumed is None else round(resumed - run.killed_at, 1)
        ),
        "partition_ends": ends,
        "committed_offsets": offsets,
        "every_event_committed": all(offsets.get(p) == end for p, end in ends.items()),
        "note": "learnt_twice_at_least: A's count is read just before the kill, so the "
        "events it learnt in between count as once here; every_event_committed: the "
        f"group's committed offsets equal each partition's end. Logs in {logs}",
        "samples": run.samples,
    }


if __name__ == "__main__":
    main()
