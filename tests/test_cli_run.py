"""`freshrec run` end to end: produces through the embedded stack and leaves no process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from freshrec.stack import pid_alive

PIDS = re.compile(r"pid (\d+)")


def freshrec(tmp_path, *args: str, **kw) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL")}
    env["FRESHREC_HOME"] = str(tmp_path)
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "freshrec.cli", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw,
    )  # fmt: skip


def test_run_is_a_closed_loop_that_serves_learns_and_cleans_up(tmp_path):
    """`freshrec run --duration 30`: trains (small world), serves simulated users who click,
    and prints served requests, a nonzero CTR and freshness figures; nothing left behind."""
    proc = freshrec(tmp_path, "run", "--duration", "30", "--items", "2000", "--users", "10000",
                    "--rate", "100", "--requests", "20")  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    m = re.search(r"run finished: ([\d,]+) background events delivered", out)
    assert m and int(m.group(1).replace(",", "")) > 2000, out
    assert "items: 2,000 loaded" in out and "trained " in out
    served = re.search(r"closed loop: served ([\d,]+) of ([\d,]+) requests", out)
    assert served and int(served.group(1).replace(",", "")) > 300, out
    ctr = re.search(r"CTR of served recommendations ([\d.]+)%", out)
    assert ctr and float(ctr.group(1)) > 0, out
    fresh = re.search(r"p99 local ([\d,]+)ms global ([\d,]+)ms served ([\d,]+)ms", out)
    assert fresh, out
    assert (tmp_path / "models" / "manifest.json").exists()  # cached for the next run
    pids = [int(p) for p in PIDS.findall(out.split("embedded stack stopped")[1])]
    assert len(pids) == 2
    assert not any(pid_alive(p) for p in pids)


def test_ctrl_c_stops_the_run_and_its_stack(tmp_path):
    proc = freshrec(tmp_path, "run", "--items", "500", "--users", "1000", "--rate", "200",
                    "--train-impressions", "20000")  # fmt: skip
    lines: list[str] = []
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("background events:") or time.monotonic() > deadline:
            break
    up = next(x for x in lines if "embedded stack up" in x)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, "".join(lines) + out
    assert "embedded stack stopped" in out
    kafka_port = re.search(r"Kafka 127.0.0.1:(\d+)", up).group(1)
    state = tmp_path / "run" / "stack.json"
    assert not state.exists()
    import socket

    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", int(kafka_port))) != 0, "broker still listening"
