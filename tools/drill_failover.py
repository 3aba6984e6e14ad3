"""Drill: a Redis Cluster master dies and its replica takes over; how long until FreshRec's
packed commands (``freshcore.redisconn.run_packed``) read everything again.

Starts four cluster-mode servers of the embedded binary on loopback (three masters with the
slots split, and a replica of the first), writes 2,000 keys spread over every slot range,
SIGKILLs the first master, and reads all keys back through the client that knew the old
slot map until every read succeeds. ``run_packed`` reloads the slot map after a node
fails; the services wait out the ``ConnectionError`` it raises while no node serves the
slots (``cluster-node-timeout`` 5 s here). Results go to ``artifacts/drill_failover.json``.

    python -m tools.drill_failover
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from freshcore.redisconn import Packed, connect, run_packed
from freshcore.resp import pack
from freshrec.app.stack import form_cluster, free_cluster_port, redis_argv, redis_binary
from tools.benchlib import save, wait_until

KEYS = 2000


class FailoverCluster:
    """A Redis Cluster of the drill's own: three masters with the slots split and a replica
    of the first, which ``kill_first_master`` SIGKILLs; ``url`` names the second master."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ports: list[int] = []
        for _ in range(4):
            self.ports.append(free_cluster_port(set(self.ports)))
        self.url = f"redis+cluster://127.0.0.1:{self.ports[1]}"
        self.procs: list[subprocess.Popen] = []

    def start(self, timeout_s: float = 30.0) -> None:
        for port in self.ports:
            d = self.directory / str(port)
            d.mkdir(parents=True, exist_ok=True)
            argv = redis_argv(redis_binary(), port, d, cluster=True)
            self.procs.append(
                subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        wait_until(lambda: all(_pings(p) for p in self.ports), timeout_s, "the cluster nodes")
        form_cluster(self.ports[:3], timeout_s)
        replica = redis.Redis(port=self.ports[3])
        replica.execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[0])
        first = redis.Redis(port=self.ports[0]).execute_command("CLUSTER", "MYID").decode()
        wait_until(
            lambda: first.encode() in replica.execute_command("CLUSTER", "NODES"),
            timeout_s,
            "the replica to learn the cluster",
        )
        replica.execute_command("CLUSTER", "REPLICATE", first)
        wait_until(
            lambda: replica.info("replication").get("master_link_status") == "up",
            timeout_s,
            "the replica to sync",
        )

    def kill_first_master(self, timeout_s: float = 60.0) -> float:
        """SIGKILL the first master; seconds until its replica is a master."""
        killed = time.monotonic()
        self.procs[0].kill()
        self.procs[0].wait(10)
        replica = redis.Redis(port=self.ports[3])
        wait_until(
            lambda: replica.info("replication").get("role") == "master",
            timeout_s,
            "the replica's promotion",
        )
        return time.monotonic() - killed

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _pings(port: int) -> bool:
    with contextlib.suppress(redis.RedisError):
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    return False


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="freshrec-failover-") as tmp:
        cluster = FailoverCluster(Path(tmp))
        try:
            cluster.start()
            client = connect(cluster.url)
            keys = [f"drill:{n}".encode() for n in range(KEYS)]
            run_packed(client, [Packed(k, pack(b"SET", k, b"1"), 1) for k in keys])
            print(f"{KEYS:,} keys written; SIGKILL of the master on port {cluster.ports[0]}")
            killed = time.monotonic()
            cluster.procs[0].send_signal(signal.SIGKILL)
            failures = 0
            while True:
                try:
                    got = run_packed(client, [Packed(k, pack(b"GET", k), 1) for k in keys])
                    break
                except redis.exceptions.ConnectionError as exc:
                    failures += 1
                    print(f"  reads failed ({exc.__class__.__name__}); again")
                    if time.monotonic() - killed > 120:
                        raise SystemExit("the cluster did not recover within 120 s") from exc
            took = time.monotonic() - killed
            lost = sum(reply[0] != b"1" for reply in got)
        finally:
            cluster.stop()
    result = {
        "keys": KEYS,
        "cluster_node_timeout_ms": 5000,
        "seconds_to_read_everything_again": round(took, 1),
        "failed_rounds_meanwhile": failures,
        "keys_lost": lost,
    }
    save("drill_failover", result)
    print(
        f"every key read again {took:.1f} s after the kill ({failures} failed rounds), lost {lost}"
    )


if __name__ == "__main__":
    main()
