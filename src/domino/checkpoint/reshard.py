"""Resharding a checkpoint offline (what ``domino convert`` and ``domino import`` write): a copy
for another TP size (TP=1: one consolidated file set), optimizer state included, in one
process."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from domino.checkpoint import layout
from domino.checkpoint.layout import CheckpointError, Meta
from domino.checkpoint.shards import ShardReader, TensorSpec
from domino.config import TransformerConfig


def _target_len(spec: TensorSpec, config: TransformerConfig, tp: int) -> int | None:
    """Length along the split dimension at TP=``tp`` (vocabulary padding depends on it)."""
    if spec.dim is None:
        return None
    return config.padded_vocab_size(tp) if spec.vocab is not None else spec.shape[spec.dim]


def reshard(step_dir: Path, meta: Meta, out_dir: Path, tp: int) -> Path:
    """Write ``step_dir``'s checkpoint for TP=``tp`` as run folder ``out_dir``; returns the new
    step folder. Each output rank's file holds exactly what that rank loads."""
    config = TransformerConfig.from_dict(meta.config)
    config.validate_parallel(tp)
    if meta.layout.get("pp", 1) != 1:
        raise CheckpointError(f"{step_dir}: pipeline-parallel checkpoints (PP="
                              f"{meta.layout['pp']}) are not supported by convert yet")
    root = out_dir / layout.CHECKPOINTS
    final = root / step_dir.name
    tmp = root / (final.name + layout.TMP_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    files: dict[str, Any] = {}
    tensors = _write_tensors(step_dir, meta, config, tp, tmp, files)
    _copy_rng(step_dir, meta, tmp, tp, files)
    _copy_tokenizer(step_dir, tmp, files)
    new = Meta(**{**meta.__dict__, "tensors": tensors, "files": files,
                  "layout": {"tp": tp, "pp": 1, "dp": 1}})
    if new.args is not None:
        new.args = {**new.args, "tensor_model_parallel_size": tp}
    layout.write_json_atomic(tmp / layout.META, new.to_json())
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    layout.write_json_atomic(root / layout.LATEST, {"step": meta.step, "dir": final.name})
    return final


def _write_tensors(step_dir: Path, meta: Meta, config: TransformerConfig, tp: int, tmp: Path,
                   files: dict[str, Any]) -> dict[str, Any]:
    """Each output rank's model and optimizer files under ``tmp`` (recorded in ``files``);
    returns the new tensor records."""
    reader = ShardReader(step_dir)
    specs = {name: TensorSpec.from_json(name, raw) for name, raw in meta.tensors.items()}
    tensors: dict[str, Any] = {}
    for rank in range(tp):
        for kind, name_of in (("model", layout.model_file), ("optim", layout.optim_file)):
            names = [n for n in specs if n.startswith("optimizer.") == (kind == "optim")]
            out = {}
            for name in names:
                spec = specs[name]
                if spec.dim is None and rank > 0:
                    continue  # replicated: stored once
                out[name], tensors[name] = _resharded(reader, name, spec, config, tp, rank,
                                                      name_of)
            if out:
                rel = name_of(rank)
                save_file({k: v.contiguous() for k, v in out.items()}, str(tmp / rel))
                files[rel] = layout.file_record(tmp / rel)
    return tensors


def _resharded(reader: ShardReader, name: str, spec: TensorSpec, config: TransformerConfig,
               tp: int, rank: int, name_of: Callable[[int], str]) -> tuple[Any, dict[str, Any]]:
    """Rank ``rank``'s part of tensor ``name`` at TP=``tp`` (the whole of a replicated one),
    and the tensor's record at that TP size."""
    full_len = _target_len(spec, config, tp)
    part = (reader.full(name, spec) if spec.dim is None
            else reader.part(name, spec, rank, tp, full_len))
    shape = list(spec.shape)
    if spec.dim is not None:
        shape[spec.dim] = full_len
    target_files = [name_of(r) for r in range(tp)] if spec.dim is not None else [name_of(0)]
    record = TensorSpec(tuple(shape), spec.dtype, tuple(target_files), spec.dim, spec.stride,
                        spec.vocab).to_json()
    return part, record


def _copy_tokenizer(step_dir: Path, tmp: Path, files: dict[str, Any]) -> None:
    src_tok = step_dir / layout.TOKENIZER_DIR
    if src_tok.is_dir():
        shutil.copytree(src_tok, tmp / layout.TOKENIZER_DIR)
        for f in sorted((tmp / layout.TOKENIZER_DIR).iterdir()):
            files[f"{layout.TOKENIZER_DIR}/{f.name}"] = layout.file_record(f)


def _copy_rng(step_dir: Path, meta: Meta, tmp: Path, tp: int, files: dict[str, Any]) -> None:
    """Same TP size: each rank's dropout streams as they were. Another one: only the streams
    replicated over TP carry over (the TP-distinct ones restart from the seed and the step)."""
    if tp == meta.layout["tp"]:
        for rank in range(tp):
            rel = layout.rng_file(rank)
            if rel in meta.files:
                shutil.copy2(step_dir / rel, tmp / rel)
                files[rel] = layout.file_record(tmp / rel)
        return
    rel0 = layout.rng_file(0)
    if rel0 not in meta.files:
        return
    states = {k: v for k, v in ShardReader(step_dir).all_tensors(rel0).items()
              if k.startswith("replicated|")}
    meta.extra = {**meta.extra, "rng_model_parallel_restart": True}
    if not states:
        return
    for rank in range(tp):
        rel = layout.rng_file(rank)
        save_file({k: v.contiguous() for k, v in states.items()}, str(tmp / rel))
        files[rel] = layout.file_record(tmp / rel)
