"""A checkpoint as a ``transformers`` model folder (config.json, model.safetensors, tokenizer
files) of the first family that expresses the model (``domino export --format hf``)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from domino.checkpoint import layout
from domino.checkpoint.families import family_for
from domino.checkpoint.hf import to_hf
from domino.checkpoint.hf_config import hf_config
from domino.checkpoint.shards import ShardReader, TensorSpec
from domino.checkpoint.store import load_tokenizer
from domino.config import TransformerConfig
from domino.data.tokenizer import BPETokenizer, as_rust_tokenizer


def export_hf(step_dir: Path, meta: layout.Meta, out: Path) -> str:
    """Write the HF model folder; returns the architecture (the family's model_type)."""
    config = TransformerConfig.from_dict(meta.config)
    arch = family_for(config).model_type
    tokenizer = load_tokenizer(step_dir, meta)
    reader = ShardReader(step_dir)
    ours = {name: reader.full(name, TensorSpec.from_json(name, raw))
            for name, raw in meta.tensors.items() if not name.startswith("optimizer.")}
    out.mkdir(parents=True, exist_ok=True)
    save_file(to_hf(ours, config, arch), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    eod = tokenizer.eod
    (out / "config.json").write_text(json.dumps(hf_config(config, arch, eod), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eod, "eos_token_id": eod}, indent=2) + "\n")
    rust = as_rust_tokenizer(tokenizer)
    rust.save(str(out / "tokenizer.json"))
    if isinstance(tokenizer, BPETokenizer):
        tokenizer.save(out)  # vocab.json + merges.txt, for GPT2Tokenizer
    eod_text = rust.id_to_token(eod)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eod_text,
        "eos_token": eod_text, "unk_token": None, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": eod_text, "eos_token": eod_text}, indent=2) + "\n")
    return arch
