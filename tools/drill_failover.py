"""Drill: a Redis Cluster master dies and its replica takes over; how long until FreshRec's
packed commands (``freshrec.redisconn.run_packed``) read everything again.

Starts four cluster-mode servers of the embedded binary on loopback (three masters with the
slots split, and a replica of the first), writes 2,000 keys spread over every slot range,
SIGKILLs the first master, and reads all keys back through the client that knew the old
slot map until every read succeeds. ``run_packed`` reloads the slot map after a node
fails; the services wait out the ``ConnectionError`` it raises while no node serves the
slots (``cluster-node-timeout`` 5 s here). Results go to ``artifacts/drill_failover.json``.

    python -m tools.drill_failover
"""

from __future__ import annotations

import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from freshrec.app.stack import form_cluster, free_cluster_port, redis_argv, redis_binary, stop_pid
from freshrec.redisconn import Packed, connect, run_packed
from freshrec.resp import pack
from tools.benchlib import save, wait_until

KEYS = 2000


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="freshrec-failover-") as tmp:
        ports: list[int] = []
        for _ in range(4):
            ports.append(free_cluster_port(set(ports)))
        procs = []
        try:
            for port in ports:
                (Path(tmp) / str(port)).mkdir()
                argv = redis_argv(redis_binary(), port, Path(tmp) / str(port), cluster=True)
                procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
            wait_until(lambda: all(_pings(p) for p in ports), 20, "the servers")
            form_cluster(ports[:3], 20)
            replica = redis.Redis(port=ports[3])
            replica.execute_command("CLUSTER", "MEET", "127.0.0.1", ports[0])
            first = redis.Redis(port=ports[0]).execute_command("CLUSTER", "MYID").decode()
            wait_until(lambda: _knows(replica, first), 20, "the replica to learn the cluster")
            replica.execute_command("CLUSTER", "REPLICATE", first)
            wait_until(
                lambda: replica.info("replication").get("master_link_status") == "up",
                30,
                "the replica to sync",
            )
            client = connect(f"redis+cluster://127.0.0.1:{ports[1]}")
            keys = [f"drill:{n}".encode() for n in range(KEYS)]
            run_packed(client, [Packed(k, pack(b"SET", k, b"1"), 1) for k in keys])
            print(f"{KEYS:,} keys written; SIGKILL of the master on port {ports[0]}")
            killed = time.monotonic()
            procs[0].send_signal(signal.SIGKILL)
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
            for proc in procs:
                stop_pid(proc.pid)
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


def _pings(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def _knows(client: redis.Redis, node_id: str) -> bool:
    return node_id in client.execute_command("CLUSTER", "NODES").decode()


if __name__ == "__main__":
    main()
