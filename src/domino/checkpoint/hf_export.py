"""A checkpoint as a ``transformers`` model folder (config.json, model.safetensors, tokenizer
files) of the first family that expresses the model (``domino export --format hf``), in the
model's own dtype (:func:`model_dtype`) or the one asked for."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from domino.checkpoint import layout
from domino.checkpoint.families import family_for
from domino.checkpoint.hf import to_hf
from domino.checkpoint.hf_config import hf_config
from domino.checkpoint.hf_tokens import config_tokens, write_token_files
from domino.checkpoint.shards import ShardReader, TensorSpec
from domino.checkpoint.store import load_tokenizer
from domino.config import TransformerConfig
from domino.data.tokenizer import BPETokenizer, as_rust_tokenizer

DTYPES = ("float32", "bfloat16", "float16")


def model_dtype(meta: layout.Meta) -> str:
    """The dtype a checkpoint's model is in: an imported model's as its folder held it (kept in
    ``extra["dtype"]``, and carried into the runs that fine-tune it), else the dtype its
    weights were saved in (a trained run's fp32 master weights, ``--bf16`` or not)."""
    recorded = meta.extra.get("dtype")
    if recorded in DTYPES:
        return str(recorded)
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


def export_hf(step_dir: Path, meta: layout.Meta, out: Path, dtype: str | None = None) -> str:
    """Write the HF model folder with weights in ``dtype`` (one of :data:`DTYPES`; None: the
    model's own, :func:`model_dtype`); returns the architecture (the family's model_type)."""
    config = TransformerConfig.from_dict(meta.config)
    arch = family_for(config).model_type
    dtype = dtype or model_dtype(meta)
    tokenizer = load_tokenizer(step_dir, meta)
    reader = ShardReader(step_dir)
    ours = {name: reader.full(name, TensorSpec.from_json(name, raw))
            for name, raw in meta.tensors.items() if not name.startswith("optimizer.")}
    weights = _cast(to_hf(ours, config, arch), dtype)
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
