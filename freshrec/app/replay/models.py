"""The starting models of ``freshrec replay``: trained on the log's training part as
``freshrec train --log`` trains them, and reused from ``OUT/models`` when they were trained on
the same part with the same settings."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

from freshrec.progress import ProgressLine


def starting_models(prefix, items, out: Path, args, progress: ProgressLine) -> tuple[Path, dict]:
    """Models trained on the log's training part: reused when ``out/models`` holds the ones
    for this part and these settings, else trained."""
    from freshrec.app.training import served_rankers
    from inference.models.modelfile import ModelFileError, read_manifest
    from inference.training.logtrain import LOG_CONFIG, fingerprint, train_from_log

    cfg = replace(
        LOG_CONFIG,
        tower_epochs=args.tower_epochs or LOG_CONFIG.tower_epochs,
        tower_share=args.tower_share or LOG_CONFIG.tower_share,
        rankers=served_rankers(),
        seed=LOG_CONFIG.seed if args.train_seed is None else args.train_seed,
    )
    key = {
        "log": fingerprint(prefix),
        "items": hashlib.sha256("\0".join(items.ids).encode()).hexdigest()[:16],
        "negatives": args.negatives,
        "config": asdict(cfg),
    }
    directory = out / "models"
    key_file = directory / "replay-key.json"
    try:
        manifest = read_manifest(directory)
        if key_file.exists() and json.loads(key_file.read_text()) == key:
            progress.done(
                f"models {manifest['version']} of this training part found in {directory}"
            )
            return directory, manifest
    except (ModelFileError, ValueError):
        pass
    started = time.monotonic()
    manifest = train_from_log(prefix, items, directory, progress.update, cfg, args.negatives)
    key_file.write_text(json.dumps(key) + "\n")
    from freshrec.app.training import held_out_line

    progress.done(
        f"trained {manifest['version']} on the training part in "
        f"{time.monotonic() - started:.0f}s; held out: " + held_out_line(manifest["training"])
    )
    return directory, manifest
