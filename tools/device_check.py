"""The device check: the worker's device paths on a GPU host as it is — its Python and torch,
no network, no broker, no Redis — in one bounded run that writes its figures to one JSON file.

What it runs is ``tools/devicechecks.py`` (tables, learning slices, ranking with every model
and precision, re-ranking, the host round-trip count, the out-of-memory paths). What it needs
besides torch are the wheels ``WHEELS`` names, for the modules the worker's code imports: on
a host that lacks one, the wheel is taken from ``--wheels`` (default
``artifacts/device-wheels``: git-ignored, a few tens of MB, under the 64 MiB a device host is
sent) and unpacked beside the run, nothing installed. Fetch them here, for that host's Python
and platform, before sending the checkout there:

    python tools/device_check.py --fetch-wheels               # for CPython 3.12, x86-64 Linux
    python tools/device_check.py                              # on the GPU host: cuda, full size
    python tools/device_check.py --device cpu:0 --size small  # here: the CPU standing in

It stops itself after ``--budget-s`` (480: 8 minutes), writing what it has, and exits 0 when
every check passed, 1 when one failed, 2 when the device is not there, 3 when out of time.
The JSON (``--out``, default ``artifacts/device_check.json``) is rewritten after each check.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = {
    "numpy": "numpy==2.4.6",
    "prometheus_client": "prometheus-client==0.26.0",
    "msgspec": "msgspec==0.23.0",
    "orjson": "orjson==3.13.0",
    "safetensors": "safetensors==0.8.0",
    "redis": "redis==8.2.0",
}
"""Module the worker's device code imports → the wheel that holds it (the versions the
development machine runs; ``hiredis`` is optional to ``redis`` and left out)."""
HOST_PYTHON = "3.12"
HOST_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
WHEEL_DIR = ROOT / "artifacts" / "device-wheels"
CARRIED_BYTES = 64 * 2**20
"""What a device host is sent at most, the checkout's own files aside."""
BUDGET_S = 480


def fetch_wheels(dest: Path, python: str = HOST_PYTHON, platforms=HOST_PLATFORMS) -> int:
    """``WHEELS`` downloaded into ``dest`` for CPython ``python`` on ``platforms`` (here, where
    the network is); their bytes. Raises ``SystemExit`` past ``CARRIED_BYTES``."""
    dest.mkdir(parents=True, exist_ok=True)
    tags = [f"--platform={p}" for p in platforms]
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps"]
    cmd += [f"--python-version={python}", "--implementation=cp", *tags, "-d", str(dest)]
    subprocess.run([*cmd, *WHEELS.values()], check=True)
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    if size > CARRIED_BYTES:
        raise SystemExit(f"device_check: the wheels take {size} bytes, past {CARRIED_BYTES}")
    print(f"device_check: {len(list(dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {dest}")
    return size


def use_wheels(wheel_dir: Path, wanted: dict[str, str] = WHEELS) -> list[str]:
    """For each module of ``wanted`` this Python cannot import, its wheel from ``wheel_dir``
    unpacked (once, under ``wheel_dir/site-<python>``) and put first on ``sys.path``; the
    wheels used. Raises ``SystemExit`` naming what is missing and how to fetch it."""
    missing = [mod for mod in wanted if importlib.util.find_spec(mod) is None]
    if not missing:
        return []
    site = wheel_dir / f"site-{sys.implementation.cache_tag}"
    used, absent = [], []
    for mod in missing:
        dist = wanted[mod].split("==")[0].replace("-", "_").lower()
        found = sorted(wheel_dir.glob(f"{dist}-*.whl"), key=lambda p: p.name.lower())
        if not found:
            absent.append(wanted[mod])
            continue
        with zipfile.ZipFile(found[-1]) as wheel:
            wheel.extractall(site)
        used.append(found[-1].name)
    if absent:
        raise SystemExit(
            f"device_check: this Python lacks {', '.join(absent)} and {wheel_dir} holds no"
            " wheel of it: run `python tools/device_check.py --fetch-wheels` where the"
            " network is, and send that folder with the checkout"
        )
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return used


class Report:
    """The run's figures, written to ``path`` after each check (and by the watchdog)."""

    def __init__(self, path: Path, head: dict) -> None:
        self.path, self.started = path, time.monotonic()
        self.data = {**head, "checks": {}, "ok": False, "timed_out": False}
        self.lock = threading.Lock()

    def add(self, name: str, result: dict) -> None:
        with self.lock:
            self.data["checks"][name] = result
            self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        os.replace(tmp, self.path)


def watchdog(report: Report, budget_s: float) -> threading.Timer:
    """After ``budget_s``: the report written as it stands, marked timed out, and the process
    ended (exit 3) wherever it is — a check stuck on the device included."""

    def out_of_time() -> None:
        with report.lock:
            report.data["timed_out"] = True
            report.write()
        print(f"device_check: out of time after {budget_s:.0f} s", file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(budget_s, out_of_time)
    timer.daemon = True
    timer.start()
    return timer


def run_checks(device, size: str, report: Report, names: list[str]) -> bool:
    """The checks of ``tools/devicechecks.py`` named, in order, each timed and its result
    (figures, or the error) added to ``report``; whether every one passed."""
    from tools.devicechecks import CHECKS, SCALES, Context

    # the out-of-memory checks' warnings are what they provoke: the report has their counts
    logging.getLogger("freshrec").setLevel(logging.ERROR)
    ctx = Context(device, SCALES[size])
    ok = True
    for name in names:
        t0 = time.monotonic()
        try:
            result = {"ok": True, "figures": CHECKS[name](ctx)}
        except Exception as exc:  # a failed check is reported, and the others still run
            ok = False
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            result["traceback"] = traceback.format_exc(limit=8)
        result["seconds"] = round(time.monotonic() - t0, 2)
        report.add(name, result)
        print(f"device_check: {name}: {'ok' if result['ok'] else result['error']}", flush=True)
    return ok


def arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cpu:0 (the stand-in), cpu")
    ap.add_argument("--size", default="full", choices=("small", "full"))
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "device_check.json")
    ap.add_argument("--wheels", type=Path, default=WHEEL_DIR)
    ap.add_argument("--budget-s", type=float, default=BUDGET_S)
    ap.add_argument("--checks", default=None, help="a comma-separated subset of the checks")
    ap.add_argument("--fetch-wheels", action="store_true", help="download the wheels and stop")
    ap.add_argument("--host-python", default=HOST_PYTHON, help="the wheels' Python (X.Y)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if args.fetch_wheels:
        fetch_wheels(args.wheels, args.host_python)
        return 0
    report = Report(args.out, {"python": platform.python_version(), "argv": sys.argv[1:]})
    watchdog(report, args.budget_s)
    # before torch: a numpy torch does not find at its import is never bridged to
    report.data["wheels_used"] = use_wheels(args.wheels)
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("device_check: torch sees no CUDA device here; nothing to check", file=sys.stderr)
        return 2
    report.data["torch"] = torch.__version__
    report.data["device"] = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    )
    report.data["size"] = args.size
    if str(ROOT) not in sys.path:  # run as a file: tools/ is on the path, not the checkout
        sys.path.insert(0, str(ROOT))
    from tools.devicechecks import CHECKS  # the wheels first: it imports the worker's code

    names = args.checks.split(",") if args.checks else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"device_check: no check {unknown}; the checks are {list(CHECKS)}", file=sys.stderr)
        return 2
    ok = run_checks(device, args.size, report, names)
    with report.lock:
        report.data["ok"] = ok
        report.write()
    print(f"device_check: {'every check passed' if ok else 'a check failed'}; see {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
