"""A LoRA run's checkpoint: its adapters only, and the base checkpoint they adapt.

``checkpoint.json``'s ``extra["lora"]`` records the adapters' settings (rank, alpha, dropout,
targets) and the base: its step folder, relative to this one and absolute, and the SHA-256 of
its ``checkpoint.json`` (which lists every base file's own SHA-256, so it names the base's
content). Its tensors are the adapters' (``<linear>.lora.a`` / ``.lora.b``, full shapes, split
like the linear's weight), with their optimizer state. Loading it (training's resume, generate,
eval, export) reads the base's weights from the base checkpoint, checked against the recorded
hash, and the adapters from this one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from domino.checkpoint import layout
from domino.checkpoint.layout import CheckpointError, Meta, open_checkpoint
from domino.models.lora import LoraSpec

KEY = "lora"


def record(spec: LoraSpec, base_step_dir: Path, save_root: Path | None = None) -> dict[str, Any]:
    """``extra["lora"]`` for a run adapting the checkpoint in ``base_step_dir``; ``save_root``
    (the run's folder) makes the relative path (from a step folder under it)."""
    base = Path(base_step_dir).resolve()
    out: dict[str, Any] = {**spec.to_json(), "base": {
        "path": str(base), "sha256": layout.sha256_of(base / layout.META)}}
    if save_root is not None:
        step_parent = Path(save_root).resolve() / layout.CHECKPOINTS / "step_0000000"
        out["base"]["relative"] = os.path.relpath(base, step_parent)
    return out


def spec_of(meta: Meta) -> LoraSpec | None:
    """The LoRA a checkpoint's adapters were trained with (None: not a LoRA checkpoint)."""
    raw = meta.extra.get(KEY)
    if raw is None:
        return None
    try:
        return LoraSpec.from_json(raw)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"malformed LoRA record in checkpoint.json ({err})") from None


def base_of(step_dir: Path, meta: Meta) -> tuple[Path, Meta]:
    """The base checkpoint a LoRA checkpoint adapts (its step folder and meta), found by the
    recorded relative path, then the absolute one, and checked: intact, and the very one the
    adapters were trained on (the SHA-256 of its checkpoint.json)."""
    raw = meta.extra.get(KEY) or {}
    base = raw.get("base") if isinstance(raw, dict) else None
    if not isinstance(base, dict) or not isinstance(base.get("sha256"), str):
        raise CheckpointError(f"{step_dir / layout.META}: the LoRA record names no base "
                              "checkpoint; the checkpoint was edited or is not from domino")
    tried = []
    for where in (base.get("relative"), base.get("path")):
        if not isinstance(where, str) or not where:
            continue
        candidate = (step_dir / where) if not os.path.isabs(where) else Path(where)
        tried.append(str(candidate))
        if (candidate / layout.META).is_file():
            found, base_meta, _ = open_checkpoint(candidate, hashes=True)
            digest = layout.sha256_of(found / layout.META)
            if digest != base["sha256"]:
                raise CheckpointError(
                    f"{step_dir}: its LoRA adapters were trained on the base checkpoint with "
                    f"checkpoint.json SHA-256 {base['sha256'][:16]}..., but {found} has "
                    f"{digest[:16]}... (a different or re-saved base); use the base they were "
                    "trained on")
            if spec_of(base_meta) is not None:
                raise CheckpointError(f"{found}: a LoRA checkpoint as a base is not supported")
            return found, base_meta
    raise CheckpointError(f"{step_dir}: the base checkpoint its LoRA adapters adapt is not "
                          f"found (tried {', '.join(tried) or 'nothing'}); put it back there")
