"""CPU time and resident memory of a process and its descendants, from ``/proc`` (Linux);
elsewhere none."""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds) of a live process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def _tree() -> tuple[dict[int, int], dict[int, float]]:
    """Every live process's parent and CPU seconds."""
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
            parents[int(entry.name)], used[int(entry.name)] = st
    return parents, used


def descendants(pid: int, parents: dict[int, int] | None = None) -> set[int]:
    """``pid`` and every live process below it (``parents``: from ``_tree``, or read now)."""
    if parents is None:
        parents = _tree()[0]
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, p in parents.items():
            if p == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return tree


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds used so far by ``pid`` and every live descendant (the streams app's
    validate process, say); None where /proc is not there."""
    if not Path("/proc/self/stat").exists():
        return None
    parents, used = _tree()
    if pid not in used:
        return None
    return sum(used.get(p, 0.0) for p in descendants(pid, parents))


def own_cpu_seconds(pid: int) -> float | None:
    """CPU seconds used so far by ``pid`` alone, not its descendants (the streams app's
    counting process without its validate child); None where it is not running."""
    st = _stat(pid)
    return None if st is None else st[1]


def rss_bytes(pid: int, own: bool = False) -> int:
    """Resident memory of ``pid`` and every live descendant, or of ``pid`` alone with
    ``own`` (0 where /proc is not there)."""
    total = 0
    pids = {pid} if own else descendants(pid)
    for p in pids if Path("/proc/self/stat").exists() else ():
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += sum(
            int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")
        )
    return total
