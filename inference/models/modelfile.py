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
     "features": ["uv", ..., "sequel"],
     "files": {"wide_deep": {"file": "...", "sha256": "..."}, "light": {...},
               "two_tower": {...}},
     "training": {...}}

A file whose checksum does not match the manifest is refused (``ModelFileError``) and the
worker keeps the models it has.

A ranking model's dense inputs change width when a feature is added, so each model file
says which it was trained with (its metadata's ``features``; the manifest's, and before them
its training configuration's, for files that do not): a model trained with fewer features
than this release computes serves with its own, in its order (``ranking.score``), and the
worker logs that ``freshrec train`` would add the others; one trained with a feature this
release does not compute, or one that says nothing of its features, is refused with the
reason, and the worker keeps the models it has.
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
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from inference.models.features import DENSE
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
    meta = {"kind": model.kind, "version": version, "dim": dim, "features": list(model.features)}
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
    features = model_features(directory, manifest, entry)
    try:
        model = build(kind, int(manifest["dim"]), state, features)
        model.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError) as exc:
        raise ModelFileError(f"{entry['file']} does not fit a {kind} model: {exc}") from None
    model = model.to(device).eval()
    return store_half(model) if dtype == "float16" else model


def model_features(directory: Path, manifest: dict, entry: dict) -> tuple[str, ...]:
    """The dense features the model file ``entry`` was trained with, by name, in its order:
    its metadata's, else the manifest's, else its training configuration's (models written
    before the files named them); checked against those this release computes."""
    found = None
    try:
        with safe_open(str(directory / entry["file"]), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("freshrec", "{}"))
        found = meta.get("features")
    except (OSError, ValueError, AttributeError, SafetensorError) as exc:
        raise ModelFileError(f"{entry['file']}: metadata not readable: {exc}") from None
    if found is None:
        found = manifest.get("features")
    if found is None:
        config = manifest.get("training", {}).get("config", {})
        text = config.get("features") if isinstance(config, dict) else None
        found = text.split(",") if isinstance(text, str) and text else None
    if not isinstance(found, list) or not all(isinstance(f, str) for f in found):
        raise ModelFileError(
            f"{entry['file']} does not say which ranking features it was trained with: "
            "run `freshrec train`"
        )
    unknown = [f for f in found if f not in DENSE]
    if unknown:
        raise ModelFileError(
            f"{entry['file']} was trained with ranking features this release does not compute "
            f"({', '.join(unknown)}): run `freshrec train` with this release"
        )
    return tuple(found)


def missing_features(models: dict[str, nn.Module]) -> list[str]:
    """The features this release computes that some of ``models`` were trained without."""
    held = [set(getattr(m, "features", DENSE)) for m in models.values()]
    return [f for f in DENSE if any(f not in h for h in held)]


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
        lacking = missing_features({"wide_deep": full, "light": light, **others})
        if lacking:
            log.warning(
                "models %s were trained without the ranking features %s: served without "
                "them; `freshrec train` retrains them",
                new.version,
                ", ".join(lacking),
            )
        self.on_change(new)

    @property
    def version(self) -> str | None:
        return self.current.version if self.current else None
