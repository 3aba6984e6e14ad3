"""Where the tables live, and the copies that leave it. Pure.

The worker keeps its tables on one device (CUDA when present, else the CPU) and does its
arithmetic there: a learning slice and a ranking batch each copy to the host only what must
leave the device — the gradient batch for Kafka, the candidates recall hands to the merge,
the reply. ``to_host`` is that copy: under ``torch.cuda.set_sync_debug_mode("error")``
(``tools/gpu_checks.sh``) it is the one sync allowed, so any other copy back, or any other
operation that makes the host wait for the device, fails the check.

>>> import numpy as np
>>> to_host(torch.tensor([1.0, 2.0])).tolist(), HOST_COPIES["count"] > 0
([1.0, 2.0], True)

``cpu:0`` is the CPU standing in for a device (``FRESHREC_DEVICE=cpu:0``): every copy to it
is a real copy, and what chooses by the worker's device (``on_accelerator``) takes a GPU's
path — torch re-ranking, autocast (in bfloat16, as a CPU's autocast runs). What chooses by a
tensor's device (the device top-k, the i2i search's one top-k for a batch) takes it under
``tools/hostsync.py``'s counter, which makes a tensor on the stand-in say so (torch reports
a ``cpu:0`` tensor's device as plain ``cpu``): the host round trips a GPU would make, seen
without one.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

HOST_COPIES = {"count": 0}
"""Designated device→host copies made so far (a GPU check counts them per slice and batch)."""


def pick_device(setting: str = "auto") -> torch.device:
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def on_accelerator(device: torch.device) -> bool:
    """Whether ``device`` takes an accelerator's paths: CUDA, or the CPU standing in for a
    device (``cpu:0``; plain ``cpu`` has no index).

    >>> on_accelerator(torch.device("cpu")), on_accelerator(torch.device("cpu:0"))
    (False, True)
    """
    return device.type != "cpu" or device.index is not None


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """The mixed precision a forward pass runs in on ``device``: float16 on CUDA, bfloat16
    on a CPU standing in for a device (the same branch, in the CPU's autocast), none on a
    CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.float16)
    if on_accelerator(device):
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def release_cached(device: torch.device) -> None:
    """After an out-of-memory error: the caching allocator's free blocks back to the driver
    (CUDA), so that a smaller retry can find room; nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16}
"""What ``FRESHREC_TABLE_DTYPE`` and ``FRESHREC_RANKING_DTYPE`` accept."""


def device_memory(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's memory on ``device``, bytes: ``allocated`` (in tensors),
    ``reserved`` (held from the driver), ``inactive_split`` (reserved in blocks that are split
    and unused: fragmentation, what ``max_split_size_mb`` bounds) and ``total`` (the device's);
    nothing on a CPU.

    >>> device_memory(torch.device("cpu"))
    {}
    """
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {
        "allocated": int(stats.get("allocated_bytes.all.current", 0)),
        "reserved": int(stats.get("reserved_bytes.all.current", 0)),
        "inactive_split": int(stats.get("inactive_split_bytes.all.current", 0)),
        "total": int(torch.cuda.get_device_properties(device).total_memory),
    }


def to_device(a, device: torch.device) -> torch.Tensor:
    """A host array (or tensor) on ``device``. ``non_blocking``: a copy to a GPU does not make
    the host wait (the source may be reused at once all the same)."""
    if isinstance(a, torch.Tensor):
        return a.to(device, non_blocking=True)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> np.ndarray:
    """The one sanctioned copy of ``t`` back to the host."""
    HOST_COPIES["count"] += 1
    if t.device.type != "cuda":
        return t.detach().numpy()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return t.detach().cpu().numpy()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
