"""Resharding a checkpoint offline: ``domino convert`` writes a copy for another TP size
(TP=1: one consolidated file set), optimizer state included, in one process."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from domino.checkpoint import layout
from domino.checkpoint.layout import CheckpointError, Meta, open_checkpoint
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
    reader = ShardReader(step_dir)
    specs = {name: TensorSpec.from_json(name, raw) for name, raw in meta.tensors.items()}
    files: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    for rank in range(tp):
        for kind, name_of in (("model", layout.model_file), ("optim", layout.optim_file)):
            names = [n for n in specs if n.startswith("optimizer.") == (kind == "optim")]
            out = {}
            for name in names:
                spec = specs[name]
                if spec.dim is None and rank > 0:
                    continue  # replicated: stored once
                full_len = _target_len(spec, config, tp)
                out[name] = (reader.full(name, spec) if spec.dim is None
                             else reader.part(name, spec, rank, tp, full_len))
                shape = list(spec.shape)
                if spec.dim is not None:
                    shape[spec.dim] = full_len
                target_files = ([name_of(r) for r in range(tp)] if spec.dim is not None
                                else [name_of(0)])
                tensors[name] = TensorSpec(tuple(shape), spec.dtype, tuple(target_files),
                                           spec.dim, spec.stride, spec.vocab).to_json()
            if out:
                rel = name_of(rank)
                save_file({k: v.contiguous() for k, v in out.items()}, str(tmp / rel))
                files[rel] = layout.file_record(tmp / rel)
    _copy_rng(step_dir, meta, tmp, tp, files)
    src_tok = step_dir / layout.TOKENIZER_DIR
    if src_tok.is_dir():
        shutil.copytree(src_tok, tmp / layout.TOKENIZER_DIR)
        for f in sorted((tmp / layout.TOKENIZER_DIR).iterdir()):
            files[f"{layout.TOKENIZER_DIR}/{f.name}"] = layout.file_record(f)
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


# ---- `domino convert` -----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="RUN_DIR",
                        help="run, checkpoints or step folder (default: its latest checkpoint)")
    parser.add_argument("output", metavar="OUT", help="run folder to write the copy into")
    parser.add_argument("--tensor-model-parallel-size", type=int, required=True,
                        help="TP size of the copy (1: one consolidated file set)")
    parser.add_argument("--force", action="store_true",
                        help="replace a checkpoint of the same step already in OUT")


def run(ns: argparse.Namespace) -> int:
    tp = ns.tensor_model_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size={tp} must be >= 1")
    step_dir, meta, _ = open_checkpoint(ns.source, hashes=True)
    out = Path(ns.output)
    if out.resolve() == step_dir.parent.parent.resolve():
        raise ValueError(f"OUT {out} is the source run; write the copy elsewhere")
    target = out / layout.CHECKPOINTS / step_dir.name
    if target.exists() and not ns.force:
        raise ValueError(f"{target} exists; pass --force to replace it, or another OUT")
    new = reshard(step_dir, meta, out, tp)
    write_run_config(out, meta, tp, new)
    size = sum(f.stat().st_size for f in new.rglob("*") if f.is_file())
    print(f"domino convert: {step_dir} (TP={meta.layout['tp']}) -> {new} (TP={tp}), "
          f"{len(meta.tensors)} tensors, {size / 2**20:.1f} MiB")
    return 0


def write_run_config(out: Path, meta: Meta, tp: int, step_dir: Path) -> None:
    """``OUT/config.toml`` with the checkpoint's settings (its tokenizer: the copy in
    ``step_dir``), so ``domino train --config OUT/config.toml --load OUT`` builds the same
    model."""
    if meta.args is None:
        return
    from domino.training.arguments import TrainArgs, to_toml

    values = {k: v for k, v in meta.args.items() if k in TrainArgs.__dataclass_fields__}
    values.update(tensor_model_parallel_size=tp, load=None, save=None, overwrite=False)
    if (meta.tokenizer or {}).get("kind") == "bpe":
        values.update(tokenizer_dir=str((step_dir / layout.TOKENIZER_DIR).resolve()),
                      vocab_file=None, merge_file=None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(to_toml(TrainArgs(**values)), encoding="utf-8")
