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


def test_run_with_duration_produces_events_and_cleans_up(tmp_path):
    proc = freshrec(tmp_path, "run", "--duration", "4", "--items", "2000", "--users", "10000",
                    "--rate", "1000")  # fmt: skip
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    m = re.search(r"run finished: ([\d,]+) events delivered", out)
    assert m and int(m.group(1).replace(",", "")) > 2000, out
    assert "items: 2,000 loaded" in out
    pids = [int(p) for p in PIDS.findall(out.split("embedded stack stopped")[1])]
    assert len(pids) == 2
    assert not any(pid_alive(p) for p in pids)


def test_ctrl_c_stops_the_run_and_its_stack(tmp_path):
    proc = freshrec(tmp_path, "run", "--items", "500", "--users", "1000", "--rate", "200")
    lines: list[str] = []
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("events:") or time.monotonic() > deadline:
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
