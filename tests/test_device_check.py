"""The device check (``tools/device_check.py``) starts, finishes and writes its JSON on the
CPU standing in for a device, stops itself at its time bound, and takes the modules a bare
GPU host lacks from the wheels it names, unpacked, nothing installed."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tools import device_check
from tools.devicechecks import CHECKS

SCRIPT = Path(__file__).parents[1] / "tools" / "device_check.py"


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    # as a file, as on the device host: not as a module of the checkout
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )


def test_the_device_check_runs_every_check_on_the_cpu_and_writes_its_figures(tmp_path):
    out = tmp_path / "device_check.json"
    done = run("--device", "cpu:0", "--size", "small", "--out", str(out), "--budget-s", "240")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and not report["timed_out"] and report["device"] == "cpu:0"
    assert list(report["checks"]) == list(CHECKS)
    assert all(c["ok"] and c["figures"] for c in report["checks"].values())
    figures = report["checks"]["learning"]["figures"]
    assert {f["host_copies"] for f in figures.values()} == {1}  # the budget, every slice
    oom = report["checks"]["out_of_memory"]["figures"]
    assert oom["table"]["refusals"] == 2 and oom["learning"]["refusals"] > 0


def test_it_stops_itself_at_its_time_bound_and_says_so_in_its_json(tmp_path):
    out = tmp_path / "device_check.json"
    done = run("--device", "cpu:0", "--size", "small", "--out", str(out), "--budget-s", "1")
    assert done.returncode == 3 and "out of time" in done.stderr
    report = json.loads(out.read_text())
    assert report["timed_out"] and not report["ok"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
def test_without_a_cuda_device_it_says_there_is_nothing_to_check(tmp_path):
    done = run("--out", str(tmp_path / "x.json"), timeout=120)
    assert done.returncode == 2 and "no CUDA device" in done.stderr


def test_a_module_this_python_lacks_is_taken_from_its_wheel_unpacked(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = "freshrec_wheel_probe"
    with zipfile.ZipFile(tmp_path / f"{name}-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{name}/__init__.py", "ANSWER = 42\n")
    wanted = {name: "freshrec-wheel-probe==1.0"}
    assert device_check.use_wheels(tmp_path, wanted) == [f"{name}-1.0-py3-none-any.whl"]
    assert importlib.import_module(name).ANSWER == 42
    sys.modules.pop(name)
    assert device_check.use_wheels(tmp_path, {"json": "json==0"}) == []  # here already
    with pytest.raises(SystemExit, match="--fetch-wheels"):
        device_check.use_wheels(tmp_path, {"freshrec_no_such_module": "no-such==1"})
