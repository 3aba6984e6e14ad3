"""The cost figures: CPU time of a process tree from /proc, and the arithmetic per 1,000."""

from __future__ import annotations

import subprocess
import sys

import pytest

from freshrec.app.proctime import cpu_seconds, own_cpu_seconds
from freshrec.cost import costs, line

from .conftest import wait_for


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_time_of_a_process_includes_its_children():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    # a parent that starts a child which burns 0.5 s of CPU, then both wait on stdin
    script = (
        "import subprocess, sys\n"
        f"c = subprocess.Popen([sys.executable, '-c', {burn + chr(10) + 'input()'!r}],"
        " stdin=subprocess.PIPE)\n"
        "print('started', flush=True)\ninput()\nc.communicate(b'\\n')\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout.readline().strip() == "started"
        # the child's burn shows in the tree's time (polled, with a deadline)
        wait_for(lambda: (cpu_seconds(parent.pid) or 0.0) >= 0.5, 30, 0.05, what="0.5 CPU-s")
        # the parent alone did not burn it (the flood drill's counting process, say)
        own = own_cpu_seconds(parent.pid)
        assert own is not None and own < 0.4, own
    finally:
        parent.communicate("\n", timeout=30)
    assert cpu_seconds(parent.pid) is None  # gone
    assert own_cpu_seconds(parent.pid) is None


def test_cost_per_thousand_is_cpu_over_count_and_none_without_traffic():
    c = costs({"worker": 3.6, "streams": 0.0}, requests=3_600, events=0, core_hour=1.0)
    assert c.per_thousand_requests == {"worker": 1.0, "streams": 0.0}
    assert c.per_thousand_events == {"worker": None, "streams": None}
    assert c.price_per_thousand_requests == pytest.approx(3.6 / 3600 * 1000 / 3600)
    assert costs({"worker": 1.0}, 0, 0, 1.0).price_per_thousand_requests is None


def test_a_held_gpu_is_priced_per_gpu_hour_over_the_requests():
    c = costs(
        {"worker": 36.0}, 1_000, 0, core_hour=1.0, gpu_seconds={"worker": 360.0}, gpu_hour=2.0
    )
    assert c.gpu_per_thousand_requests == {"worker": 360.0}
    # CPU 36 s at $1/h = $0.01, GPU 360 s at $2/h = $0.20: $0.21 per 1,000 requests
    assert c.price_per_thousand_requests == pytest.approx(0.21)
    assert costs({"worker": 36.0}, 1_000, 0, 1.0).gpu_seconds == {}
    assert "GPU-s held" in line(c, 1.0, 2.0) and "$2/GPU-hour" in line(c, 1.0, 2.0)
    assert "GPU" not in line(costs({"worker": 36.0}, 1_000, 0, 1.0), 1.0)


def test_the_scale_benchmark_reports_each_point_as_a_table_row_and_a_plot(tmp_path):
    from tools.scale_report import plot, table

    point = {
        "items": 10_000,
        "users": 100_000,
        "redis_bytes_per_row": 335.7,
        "worker_rss_mb": 98.0,
        "vector_recall_ms": 5.03,
        "vector_index": "exact",
        "request_p50_ms": 20.5,
        "request_p99_ms": 26.7,
        "param_server_rows_per_s": 174_232,
        "cache_levels": {
            "device_rows": 1_000,
            "configs": [
                {
                    "host_rows": host,
                    "device_share": 0.446,
                    "host_share": share,
                    "redis_share": 0.554 - share - 0.004,
                    "new_share": 0.004,
                    "redis_trips_per_batch": 1.0,
                    "lookup_mean_ms": 0.6,
                    "lookup_p99_ms": 0.8,
                }
                for host, share in ((0, 0.0), (10_000, 0.273))
            ],
        },
    }
    results = {"points": [point, {**point, "items": 100_000, "users": 1_000_000}]}
    rows = table(results).splitlines()
    assert len(rows) == 4 + 1 + 2 + 4  # sizes; a blank line; the levels, a row per configuration
    assert rows[2] == "| 10,000 | 100,000 | 335.7 | 98.0 | 5.03 (exact) | 20.5 / 26.7 | 174,232 |"
    assert (
        rows[8] == "| 10,000 | 100,000 | 1,000 / 10,000 | 44.6% / 27.3% / 28.1% | 1.0 | 0.6 / 0.8 |"
    )
    png = plot(results, tmp_path / "scale.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
