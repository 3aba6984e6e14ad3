"""Count what makes the host wait for the device, on any device (the CPU included).

A GPU shows a hidden device→host round trip only when it runs (``tools/gpu_sync_check.py``,
under ``torch.cuda.set_sync_debug_mode``). ``counting()`` finds them on the CPU too, so a new
one fails ``make test`` without a GPU:

- operators that read a tensor's values back to decide a shape or a Python value —
  ``.item()``/``int()``/``bool()`` on a tensor (``aten._local_scalar_dense``), ``nonzero``,
  ``masked_select``, indexing by a boolean tensor, ``unique``, ``repeat_interleave`` without
  its output size, ``equal``, ``allclose`` — caught under a ``TorchDispatchMode`` whatever
  the device;
- ``Tensor.numpy``/``.cpu``/``.tolist``/``.item`` calls, by the line that made them: on a
  GPU each is a copy back if its tensor lives there, so each line is reviewed and named in
  the budget the test holds (``docs/design.md``, "Host round trips");
- ``inference.device.to_host`` copies, the sanctioned ones (``HOST_COPIES``).

    with counting() as c:
        worker.learn(examples)
    c.syncs, c.calls, c.host_copies
"""

from __future__ import annotations

import collections
import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from inference.device import HOST_COPIES

ROOT = Path(__file__).resolve().parents[1]
SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense.default",
        "aten.item.default",
        "aten.nonzero.default",
        "aten.nonzero_static.default",
        "aten.masked_select.default",
        "aten.is_nonzero.default",
        "aten.equal.default",
        "aten.allclose.default",
        "aten._unique2.default",
        "aten.unique_dim.default",
        "aten.unique_consecutive.default",
        "aten.repeat_interleave.Tensor",
    }
)
METHODS = ("numpy", "cpu", "tolist", "item")


def _site() -> str:
    """The project line (not torch's, not this module's) that led here."""
    here = Path(__file__).resolve()
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path == here or ".venv" in path.parts or "site-packages" in path.parts:
            continue
        if ROOT in path.parents:
            return f"{path.relative_to(ROOT)}:{frame.lineno}"
    return "?"


def _bool_index(func, args) -> bool:
    name = str(func)
    if not (name.startswith("aten.index.Tensor") or name.startswith("aten.index_put")):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool
        for i in (indices or ())
        if i is not None
    )


@dataclass
class Counts:
    syncs: collections.Counter = field(default_factory=collections.Counter)
    """(operator, line) → times: operators that wait for the device's values."""
    calls: collections.Counter = field(default_factory=collections.Counter)
    """(method, line) → times: ``Tensor.numpy``/``cpu``/``tolist``/``item`` calls."""
    host_copies: int = 0
    """``to_host`` copies."""


class _Mode(TorchDispatchMode):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in SYNC_OPS or _bool_index(func, args):
            self.counts.syncs[(name, _site())] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting() -> Iterator[Counts]:
    counts = Counts()
    original = {name: getattr(torch.Tensor, name) for name in METHODS}

    def counted(name: str):
        method = original[name]

        def call(self, *args, **kwargs):
            counts.calls[(name, _site())] += 1
            return method(self, *args, **kwargs)

        return call

    before = HOST_COPIES["count"]
    for name in METHODS:
        setattr(torch.Tensor, name, counted(name))
    try:
        with _Mode(counts):
            yield counts
    finally:
        for name, method in original.items():
            setattr(torch.Tensor, name, method)
        counts.host_copies = HOST_COPIES["count"] - before
