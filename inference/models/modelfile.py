"""Versioned model files: safetensors with a SHA-256 checksum, and a manifest that names the
current set. The worker hot-reloads when the manifest changes.

Layout of a model directory (default ``$FRESHREC_HOME/models``)::

    manifest.json                      the current set (written last, atomically)
    wide_deep-<version>.safetensors    the full ranking model
    light-<version>.safetensors        the distilled model
    pruned-<version>.safetensors       the pruned tier (optional, as are the next three)
    attention-<version>.safetensors    the attention rankers (``inference/models/attention.py``)
    attention_window-<version>.safetensors
    attention_lowrank-<version>.safetensors
    two_tower-<version>.safetensors    starting embeddings (user_ids, user_rows, item_ids, item_rows)

``manifest.json``::

    {"version": "20261129T120000-3f2a", "dim": 64, "created_ms": ...,
     "files": {"wide_deep": {"file": "...", "sha256": "..."}, "light": {...},
               "two_tower": {...}},
     "training": {...}}

A file whose checksum does not match the manifest is refused (``ModelFileError``) and the
worker keeps the models it has.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from inference.models.kinds import OPTIONAL, build
from inference.models.ranking import store_half
from schemas.errors import FreshRecError

log = logging.getLogger("freshrec.models")
MANIFEST = "manifest.json"


class ModelFileError(FreshRecError, RuntimeError):
    """A model file or manifest is missing, corrupt, or does not match its checksum."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def save_tensors(directory: Path, name: str, tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """Write ``name`` atomically; returns its manifest entry (file name and checksum)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    contiguous = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    _atomic_write(
        path, lambda p: save_file(contiguous, str(p), metadata={"freshrec": json.dumps(meta)})
    )
    return {"file": name, "sha256": sha256_of(path)}


def save_model(directory: Path, model: nn.Module, version: str, dim: int) -> dict:
    meta = {"kind": model.kind, "version": version, "dim": dim}
    return save_tensors(directory, f"{model.kind}-{version}.safetensors", model.state_dict(), meta)


def write_manifest(directory: Path, manifest: dict) -> Path:
    path = directory / MANIFEST
    _atomic_write(path, lambda p: p.write_text(json.dumps(manifest, indent=2, sort_keys=True)))
    return path


def read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFileError(f"no {MANIFEST} in {directory}: run `freshrec train`") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ModelFileError(f"{path} is not valid JSON: {str(exc)[:200]}") from None
    except OSError as exc:
        raise ModelFileError(f"{path} cannot be read: {exc}") from None
    if not isinstance(manifest, dict):
        raise ModelFileError(f"{path} is not a JSON object")
    for key, kind in (("version", str), ("dim", int), ("files", dict)):
        if key not in manifest:
            raise ModelFileError(f"{path} lacks {key!r}")
        if not isinstance(manifest[key], kind) or isinstance(manifest[key], bool):
            raise ModelFileError(f"{path}: {key!r} must be a {kind.__name__}")
    if manifest["dim"] < 1:
        raise ModelFileError(f"{path}: 'dim' must be at least 1")
    return manifest


def load_tensors(directory: Path, entry: dict) -> dict[str, torch.Tensor]:
    path = directory / entry["file"]
    if not path.exists():
        raise ModelFileError(f"{path} is missing")
    actual = sha256_of(path)
    if actual != entry["sha256"]:
        raise ModelFileError(f"{path}: checksum {actual[:12]}… != manifest {entry['sha256'][:12]}…")
    return load_file(str(path))


def load_model(
    directory: Path, manifest: dict, kind: str, device: torch.device, dtype: str = "float32"
) -> nn.Module:
    """The ``kind`` model the manifest names, on ``device``; ``dtype`` ``float16``: its weights
    held in float16 (``ranking.store_half``)."""
    entry = manifest["files"].get(kind)
    if entry is None:
        raise ModelFileError(f"manifest {manifest['version']} has no {kind} model")
    state = load_tensors(directory, entry)
    try:
        model = build(kind, int(manifest["dim"]), state)
        model.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError) as exc:
        raise ModelFileError(f"{entry['file']} does not fit a {kind} model: {exc}") from None
    model = model.to(device).eval()
    return store_half(model) if dtype == "float16" else model


@dataclass(frozen=True)
class ModelSet:
    version: str
    full: nn.Module
    light: nn.Module
    others: dict[str, nn.Module] = field(default_factory=dict)
    """The further models the manifest names (``inference/training/rankers.py``): the pruned tier,
    the attention rankers."""

    def get(self, kind: str) -> nn.Module | None:
        if kind == "wide_deep":
            return self.full
        if kind == "light":
            return self.light
        return self.others.get(kind)


class ModelWatcher:
    """Holds the current ``ModelSet``; ``poll()`` (cheap: one stat) starts a background load
    when the manifest changed, and the new set replaces the old one between batches."""

    def __init__(
        self,
        directory: Path,
        device: torch.device,
        dim: int,
        dtype: str = "float32",
        on_change: Callable[[ModelSet], None] | None = None,
    ) -> None:
        """``on_change(models)``: called with every set loaded (``load_now`` and ``poll``'s,
        the latter on the loading thread)."""
        self.directory = directory
        self.device = device
        self.dtype = dtype
        """How the loaded models hold their weights (``FRESHREC_RANKING_DTYPE``)."""
        self.dim = dim
        self.current: ModelSet | None = None
        self.last_error: str | None = None
        self._seen: tuple[int, int] | None = None
        self._loading: threading.Thread | None = None
        self._lock = threading.Lock()
        self.on_change: Callable[[ModelSet], None] = on_change or (lambda s: None)

    def load_now(self) -> ModelSet | None:
        """Load synchronously (worker start); None, with ``last_error`` set, if unavailable."""
        self._stat_changed()
        self._load()
        return self.current

    def poll(self) -> None:
        if self._loading is not None and self._loading.is_alive():
            return
        if self._stat_changed():
            self._loading = threading.Thread(target=self._load, daemon=True, name="model-load")
            self._loading.start()

    def _stat_changed(self) -> bool:
        try:
            st = (self.directory / MANIFEST).stat()
        except FileNotFoundError:
            return False
        key = (st.st_mtime_ns, st.st_ino)
        if key == self._seen:
            return False
        self._seen = key
        return True

    def _load(self) -> None:
        try:
            manifest = read_manifest(self.directory)
            if self.current is not None and manifest["version"] == self.current.version:
                return
            if int(manifest["dim"]) != self.dim:
                raise ModelFileError(
                    f"models of dim {manifest['dim']} do not fit embeddings of dim {self.dim}"
                )
            full = load_model(self.directory, manifest, "wide_deep", self.device, self.dtype)
            light = load_model(self.directory, manifest, "light", self.device, self.dtype)
            others = {
                kind: load_model(self.directory, manifest, kind, self.device, self.dtype)
                for kind in manifest["files"]
                if kind in OPTIONAL
            }
        except (ModelFileError, OSError, KeyError, ValueError) as exc:
            self.last_error = str(exc)
            log.error("models not loaded, keeping %s: %s", self.version or "none", exc)
            return
        new = ModelSet(manifest["version"], full, light, others)
        with self._lock:
            self.current = new
            self.last_error = None
        log.info("models %s loaded from %s", new.version, self.directory)
        self.on_change(new)

    @property
    def version(self) -> str | None:
        return self.current.version if self.current else None
