"""Count what makes the host wait for the device, on any device (the CPU included).

A GPU shows a hidden device→host round trip only when it runs (``tools/gpu_sync_check.py``,
under ``torch.cuda.set_sync_debug_mode``). ``counting()`` finds them on the CPU too, so a new
one fails ``make test`` without a GPU. It follows which tensors live on the device — CUDA
tensors, and on a CPU those made on or copied to the worker's device or computed from such
tensors (the CPU standing in for a device, ``cpu:0``: ``inference/device.py``); tensors made
from host arrays (``torch.from_numpy``, ``torch.as_tensor``, ``torch.tensor`` without a device)
or by factories without one are the host's, and a tensor it did not see made is taken to be
the device's (the tables, the models) — and counts, per line of the project that made it:

- operators that read device values back to decide a shape or a Python value —
  ``.item()``/``int()``/``bool()`` (``aten._local_scalar_dense``), ``nonzero``,
  ``masked_select``, indexing by a boolean tensor, ``unique``, ``bincount`` (CUDA's copies
  its input's min and max back), ``repeat_interleave`` without its output size, ``equal``,
  ``allclose``;
- copies back: ``Tensor.numpy``/``cpu``/``tolist``/``to("cpu")`` of a device tensor, a
  ``copy_`` into a host tensor from a device one;
- blocking copies to the device: ``to(device)`` or ``copy_`` without ``non_blocking``,
  ``torch.tensor``/``torch.as_tensor`` with a device;
- a host tensor handed to an operator on device tensors (a GPU copies it there, blocking, or
  refuses).

The lines allowed to make one are ``ALLOWED``, each with its reason (matched by the line's
text, so edits elsewhere in a file do not move them); the rest are ``Counts.syncs``.

    with counting() as c:
        worker.learn(examples)
    c.syncs, c.allowed, c.host_copies
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import functools
import linecache
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from inference.device import HOST_COPIES

ROOT = Path(__file__).resolve().parents[1]
STAND_IN = torch.device("cpu", 0)
"""The CPU standing in for a device: what a worker under the counter runs on, without a GPU."""
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
        "aten.bincount.default",
    }
)
ALLOWED = {
    ("inference/device.py", "return t.detach().numpy()"): (
        "to_host, the sanctioned copy back (the gradient batch, recall's candidates, the"
        " reply), of a CPU's tensor"
    ),
    ("inference/device.py", "return t.detach().cpu().numpy()"): (
        "to_host, the sanctioned copy back, of a GPU's tensor"
    ),
}
"""(file, the line's text) → why that line may copy back or wait: the budget
``docs/design.md`` states ("Host round trips")."""
READS_BACK = ("numpy", "tolist", "cpu")
DISPATCH_FRAMES = frozenset(
    {"_dynamo", "_compile.py", "_python_dispatch.py", "_ops.py", "contextlib.py"}
)
"""Frames of torch's dispatch machinery, passed over to find who made a tensor."""
_DEVICE = torch.Tensor.device  # the real one: ``counting`` makes a device tensor's say more


def _real_device(t: torch.Tensor) -> torch.device:
    return _DEVICE.__get__(t)


def _site() -> str:
    """The project line (not torch's, not this module's, not code without a file: an
    ``eval``'s) that led here."""
    here = Path(__file__).resolve()
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith("<"):
            continue
        path = Path(frame.filename).resolve()
        if path == here or ".venv" in path.parts or "site-packages" in path.parts:
            continue
        if ROOT in path.parents:
            return f"{path.relative_to(ROOT)}:{frame.lineno}"
    return "?"


def allowed_reason(site: str) -> str | None:
    """Why ``site`` (``path:line``) may make a round trip, if ``ALLOWED`` names its line."""
    path, _, line = site.rpartition(":")
    if not line.isdigit():
        return None
    text = linecache.getline(str(ROOT / path), int(line)).strip()
    return ALLOWED.get((path, text))


def is_device(device) -> bool:
    """Whether ``device`` (a ``torch.device``, a string, None) names the device, not the host."""
    if device is None:
        return False
    device = torch.device(device)
    return device.type != "cpu" or device.index is not None


@dataclass
class Counts:
    syncs: collections.Counter = field(default_factory=collections.Counter)
    """(what, line) → times: round trips from lines ``ALLOWED`` does not name."""
    allowed: collections.Counter = field(default_factory=collections.Counter)
    """(what, line) → times: those from lines it names."""
    calls: collections.Counter = field(default_factory=collections.Counter)
    """(method, line) → times: ``Tensor.numpy``/``cpu``/``tolist``/``item`` of host tensors
    (no round trip: for inspection)."""
    host_copies: int = 0
    """``to_host`` copies."""

    def record(self, what: str) -> None:
        site = _site()
        (self.allowed if allowed_reason(site) else self.syncs)[(what, site)] += 1


class Placement:
    """Which tensors live on the device: CUDA ones, and on a CPU those marked so (weakly
    held). A CPU tensor not marked is the device's (made before the count: the tables, the
    models); one a factory made inside torch's own code (``pad_sequence``'s output) is
    placed where the first tensor it meets is (``None`` until then)."""

    def __init__(self) -> None:
        self._on_device = WeakIdKeyDictionary()

    def of(self, t: torch.Tensor) -> bool | None:
        if _real_device(t).type != "cpu":
            return True
        return self._on_device.get(t, True)

    def on_device(self, t: torch.Tensor) -> bool:
        return bool(self.of(t))

    def mark(self, out, on_device: bool | None, inputs=()) -> None:
        """Mark ``out``'s tensors (those not among ``inputs``: an in-place result stays)."""
        skip = {id(t) for t in inputs}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in skip and _real_device(t).type == "cpu":
                self._on_device[t] = on_device


def _bool_index(name: str, args) -> bool:
    if not (name.startswith("aten.index.Tensor") or name.startswith("aten.index_put")):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool
        for i in (indices or ())
        if i is not None
    )


def _made_by_torch() -> bool:
    """Whether the Python code that led here is torch's own (a factory inside a composite
    operator), not the project's."""
    here = Path(__file__).resolve()
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path == here or any(part in DISPATCH_FRAMES for part in path.parts):
            continue
        return "site-packages" in path.parts and "torch" in path.parts
    return False


class _Mode(TorchDispatchMode):
    def __init__(self, counts: Counts, place: Placement, free_bytes: int | None) -> None:
        super().__init__()
        self.counts, self.place, self.free_bytes = counts, place, free_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name.startswith(("aten._to_copy", "aten.copy_", "aten.to.")):
            where = self._copy(name, _bound(func, args, kwargs))
        else:
            where = self._operator(name, args, kwargs, tensors)
        out = func(*args, **kwargs)
        if name.startswith("aten.lift_fresh"):
            where = False  # torch.tensor's fresh tensor: the host's (see ``made_on_host``)
        self.place.mark(out, where, tensors)
        if where and self.free_bytes is not None:
            self._allocate(name, out, tensors)
        return out

    def _allocate(self, name: str, out, inputs) -> None:
        """A device with ``free_bytes`` for a tensor: a larger new one (not an input, nor a
        view of one) raises what CUDA's caching allocator raises."""
        held = {t.untyped_storage().data_ptr() for t in inputs}
        new = [
            t.untyped_storage().nbytes()
            for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held
        ]
        if sum(new) > self.free_bytes:
            raise torch.OutOfMemoryError(
                f"{name}: tried to allocate {sum(new)} bytes on a device with"
                f" {self.free_bytes} free (a fake allocator's failure, tools/hostsync.py)"
            )

    def _operator(self, name: str, args, kwargs, tensors) -> bool | None:
        """Where an operator's outputs are (the device's if any input is), its round trips
        counted; inputs not placed yet take its place."""
        placed = [self.place.of(t) for t in tensors]
        if True in placed:
            if name in SYNC_OPS or _bool_index(name, args):
                self.counts.record(f"reads back: {name}")
            if any(p is False and t.dim() > 0 for t, p in zip(tensors, placed, strict=True)):
                self.counts.record(f"host tensor into a device op: {name}")
            where = True
        elif False in placed:
            where = False
        elif tensors:
            return None
        elif is_device(kwargs.get("device")):
            return True
        else:
            return None if _made_by_torch() else False
        self.place.mark([t for t, p in zip(tensors, placed, strict=True) if p is None], where)
        return where

    def _copy(self, name: str, arg: dict) -> bool:
        """A copy's destination (on the device?), its crossing counted."""
        blocking = not arg.get("non_blocking", False)
        if name.startswith("aten.copy_"):
            dst, src = arg["self"], arg["src"]
            to_device, from_device = self.place.of(dst), self.place.of(src)
            if to_device is None or from_device is None:  # a tensor not placed: no crossing
                where = from_device if to_device is None else to_device
                self.place.mark([dst, src], where)
                return where
        else:
            from_device = self.place.on_device(arg["self"])
            other = arg.get("other")
            target = other.device if isinstance(other, torch.Tensor) else arg.get("device")
            to_device = from_device if target is None else is_device(target)
        if from_device and not to_device:
            self.counts.record(f"copy back: {name}")
        elif to_device and not from_device and blocking:
            self.counts.record(f"blocking copy to the device: {name}")
        return to_device


def _bound(func, args, kwargs) -> dict:
    """An operator's arguments by name (its schema's)."""
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _reading(name: str, method, counts: Counts, place: Placement):
    """``Tensor.numpy``/``tolist``/``cpu`` counted: a copy back of a device tensor, else a
    host call."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if _real_device(self).type == "cpu" and place.on_device(self):
            counts.record(f"copy back: Tensor.{name}")
            if name == "cpu":  # a GPU's would be a new tensor, on the host
                out = self.clone()
                place.mark(out, False)
                return out
        else:
            counts.calls[(name, _site())] += 1
        return method(self, *args, **kwargs)

    return call


def _moved(original, counts: Counts, place: Placement):
    """``Tensor.to`` counted: to the host from a CPU's device tensor is a copy back, as a
    GPU's (torch sees the same device and copies nothing: a copy is made here)."""

    @functools.wraps(original)
    def to(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if out is self and place.on_device(self) and _real_device(self).type == "cpu":
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            if device is not None and not is_device(device):
                counts.record("copy back: Tensor.to")
                out = self.clone()
                place.mark(out, False)
        return out

    return to


def _made_on_host(maker, counts: Counts, place: Placement):
    """``torch.from_numpy``/``as_tensor``/``tensor``: a host tensor, unless a device is
    named (a blocking copy there: neither takes ``non_blocking``)."""

    @functools.wraps(maker)
    def make(*args, **kwargs):
        out = maker(*args, **kwargs)
        data = args[0] if args else kwargs.get("data")
        if isinstance(data, torch.Tensor) and out is data:
            return out  # as_tensor of a tensor already there: that tensor
        device = kwargs.get("device", args[2] if len(args) > 2 else None)
        if is_device(device):
            counts.record(f"blocking copy to the device: torch.{maker.__name__}")
            place.mark(out, True)
        elif not isinstance(data, torch.Tensor):
            place.mark(out, False)
        return out

    return make


def _in_pools(counts: Counts, place: Placement, free_bytes: int | None):
    """``ThreadPoolExecutor.submit`` whose tasks are counted too (a dispatch mode holds on
    the thread that entered it: recall runs its channels on a pool)."""
    submit = cf.ThreadPoolExecutor.submit

    @functools.wraps(submit)
    def counted_submit(self, fn, /, *args, **kwargs):
        def counted(*a, **kw):
            with _Mode(counts, place, free_bytes):
                return fn(*a, **kw)

        return submit(self, counted, *args, **kwargs)

    return counted_submit


def _patches(counts: Counts, place: Placement, free_bytes: int | None) -> dict:
    """What ``counting`` puts in place of torch's: (owner, name) → replacement."""
    tensor = torch.Tensor
    patches = {
        (tensor, name): _reading(name, getattr(tensor, name), counts, place) for name in READS_BACK
    }
    item = tensor.item

    def counted_item(self, *args, **kwargs):
        if not place.on_device(self):
            counts.calls[("item", _site())] += 1
        return item(self, *args, **kwargs)  # a device tensor's: aten._local_scalar_dense

    def device(self):
        # on a CPU a device tensor says it is on the stand-in: ``device=t.device`` makes a
        # tensor there, ``.to(t.device)`` copies to it, as on a GPU
        real = _real_device(self)
        return STAND_IN if real.type == "cpu" and place.on_device(self) else real

    patches[(tensor, "item")] = counted_item
    patches[(tensor, "to")] = _moved(tensor.to, counts, place)
    patches[(tensor, "device")] = property(device)
    for name in ("from_numpy", "as_tensor", "tensor"):
        patches[(torch, name)] = _made_on_host(getattr(torch, name), counts, place)
    patches[(cf.ThreadPoolExecutor, "submit")] = _in_pools(counts, place, free_bytes)
    return patches


@contextlib.contextmanager
def counting(free_device_bytes: int | None = None) -> Iterator[Counts]:
    """Round trips made inside, counted (``Counts``). ``free_device_bytes``: a fake
    allocator's failure — a new device tensor larger than that raises
    ``torch.OutOfMemoryError`` (made, then refused: the out-of-memory paths, tested on a
    CPU)."""
    counts, place = Counts(), Placement()
    patches = _patches(counts, place, free_device_bytes)
    saved = {key: key[0].__dict__.get(key[1]) for key in patches}
    before = HOST_COPIES["count"]
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    try:
        with _Mode(counts, place, free_device_bytes):
            yield counts
    finally:
        for (owner, name), value in saved.items():
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        counts.host_copies = HOST_COPIES["count"] - before
