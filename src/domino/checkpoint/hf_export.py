"""A checkpoint as a ``transformers`` model folder (config.json, model.safetensors, tokenizer
files) of the first family that expresses the model (``domino export --format hf``), in the
model's own dtype (:func:`model_dtype`) or the one asked for. A LoRA checkpoint
(:mod:`domino.checkpoint.lora`) is written merged: its base's weights with the adapters' update
added (:func:`domino.checkpoint.peft_export.merged`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from domino.checkpoint import layout, lora
from domino.checkpoint.families import family_for
from domino.checkpoint.hf import to_hf
from domino.checkpoint.hf_config import hf_config
from domino.checkpoint.hf_tokens import config_tokens, write_token_files
from domino.checkpoint.peft_export import merged, read_adapters
from domino.checkpoint.shards import ShardReader, TensorSpec
from domino.checkpoint.store import load_tokenizer
from domino.config import TransformerConfig
from domino.data.tokenizer import BPETokenizer, as_rust_tokenizer

DTYPES = ("float32", "bfloat16", "float16")


def model_dtype(meta: layout.Meta, step_dir: Path | None = None) -> str:
    """The dtype a checkpoint's model is in: an imported model's as its folder held it (kept in
    ``extra["dtype"]``, and carried into the runs that fine-tune it), else the dtype its
    weights were saved in (a trained run's fp32 master weights, ``--bf16`` or not). A LoRA
    checkpoint's (in ``step_dir``) is its base's: it holds only the fp32 adapters."""
    recorded = meta.extra.get("dtype")
    if recorded in DTYPES:
        return str(recorded)
    if step_dir is not None and lora.spec_of(meta) is not None:
        base_dir, base_meta = lora.base_of(step_dir, meta)
        return model_dtype(base_meta, base_dir)
    saved = {str(raw.get("dtype")) for name, raw in meta.tensors.items()
             if not name.startswith("optimizer.")}
    return saved.pop() if len(saved) == 1 and saved <= set(DTYPES) else "float32"


def _cast(weights: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """``weights`` in ``dtype``; ValueError naming a weight whose values it cannot hold."""
    want = getattr(torch, dtype)
    out = {name: t.to(want) if t.is_floating_point() else t for name, t in weights.items()}
    for name, t in out.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()) \
                and bool(torch.isfinite(weights[name]).all()):
            top = float(weights[name].abs().max())
            raise ValueError(f"--dtype {dtype}: weight {name} holds values beyond {dtype}'s "
                             f"range (largest magnitude {top:.3g}); pass --dtype bfloat16 or "
                             "float32")
    return out


def _full_tensors(step_dir: Path, meta: layout.Meta) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors, whole, as saved."""
    reader = ShardReader(step_dir)
    return {name: reader.full(name, TensorSpec.from_json(name, raw))
            for name, raw in meta.tensors.items() if not name.startswith("optimizer.")}


def model_tensors(step_dir: Path, meta: layout.Meta) -> dict[str, torch.Tensor]:
    """The model's whole tensors (ours, as a TP=1 state dict): a LoRA checkpoint's are its
    base's with the adapters merged in (in fp32)."""
    spec = lora.spec_of(meta)
    if spec is None:
        return _full_tensors(step_dir, meta)
    base_dir, base_meta = lora.base_of(step_dir, meta)
    return merged(_full_tensors(base_dir, base_meta), read_adapters(step_dir, meta), spec.scale)


def export_hf(step_dir: Path, meta: layout.Meta, out: Path, dtype: str | None = None) -> str:
    """Write the HF model folder with weights in ``dtype`` (one of :data:`DTYPES`; None: the
    model's own, :func:`model_dtype`); returns the architecture (the family's model_type).
    A LoRA checkpoint is written merged (:func:`model_tensors`)."""
    config = TransformerConfig.from_dict(meta.config)
    arch = family_for(config).model_type
    dtype = dtype or model_dtype(meta, step_dir)
    if meta.tokenizer is None and lora.spec_of(meta) is not None:
        tokenizer = load_tokenizer(*lora.base_of(step_dir, meta))
    else:
        tokenizer = load_tokenizer(step_dir, meta)
    weights = _cast(to_hf(model_tensors(step_dir, meta), config, arch), dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    # "dtype" is what transformers >= 4.56 reads, "torch_dtype" what older versions read.
    hf = {**hf_config(config, arch, config_tokens(tokenizer)), "torch_dtype": dtype,
          "dtype": dtype}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    rust = as_rust_tokenizer(tokenizer)
    rust.save(str(out / "tokenizer.json"))
    if isinstance(tokenizer, BPETokenizer):
        tokenizer.save(out)  # vocab.json + merges.txt, for GPT2Tokenizer
    # generation_config.json, tokenizer_config.json...: an imported model's own, unchanged
    write_token_files(out, tokenizer, rust, config.max_position_embeddings)
    return arch
