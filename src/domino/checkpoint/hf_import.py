"""``domino import HF_DIR OUT``: a ``transformers`` GPT-2 or Llama folder (safetensors weights)
as a domino checkpoint at any TP size, weights only: ``domino generate`` / ``eval`` / ``export``
use it as it is, and ``domino train --config OUT/config.toml --load OUT`` fine-tunes it (a new
run from its weights)."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import domino
from domino.checkpoint import layout
from domino.checkpoint.convert import reshard, write_run_config
from domino.checkpoint.hf import config_from_hf, from_hf
from domino.checkpoint.layout import CheckpointError, Meta
from domino.checkpoint.shards import describe
from domino.checkpoint.store import save_tokenizer
from domino.config import TransformerConfig
from domino.data.tokenizer import EOD_TOKEN, BPETokenizer, HFTokenizer

# Buffers some GPT-2 files carry next to the weights (causal-mask constants), never weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="HF_DIR",
                        help="a transformers model folder: config.json, *.safetensors, tokenizer")
    parser.add_argument("output", metavar="OUT", help="run folder to write the checkpoint into")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1,
                        help="TP size of the checkpoint (it loads at any TP size either way)")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT/checkpoints")


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (one file or an index of shards)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        raw = layout.read_json(index, "safetensors index")
        files = sorted(set(raw.get("weight_map", {}).values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pt"))
        hint = (f" (only {', '.join(pickles)}: pickles, which this library never loads; "
                "convert them with transformers: model.save_pretrained(dir, "
                "safe_serialization=True))" if pickles else "")
        raise ValueError(f"{folder} has no safetensors weights{hint}")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        path = folder / name
        bad = layout.safetensors_header_problem(path) if path.is_file() else "missing"
        if bad:
            raise ValueError(f"{path}: {bad}")
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


def read_hf_tokenizer(folder: Path, config: TransformerConfig, eod: int | None) -> HFTokenizer:
    """The folder's tokenizer (tokenizer.json, or GPT-2's vocab.json + merges.txt)."""
    from tokenizers import Tokenizer as RustTokenizer

    if (folder / "tokenizer.json").is_file():
        try:
            rust = RustTokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as err:
            raise ValueError(f"{folder / 'tokenizer.json'}: not a tokenizers file ({err})"
                             ) from None
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        rust = BPETokenizer.from_files(folder / "vocab.json", folder / "merges.txt")._tok
    else:
        raise ValueError(f"{folder} has no tokenizer (tokenizer.json, or vocab.json + "
                         "merges.txt); generate, eval and training need one")
    if eod is None:
        eod = rust.token_to_id(EOD_TOKEN)
    if eod is None:
        raise ValueError(f"{folder}/config.json sets no eos_token_id and the tokenizer has no "
                         f"{EOD_TOKEN}; add eos_token_id to config.json")
    size = rust.get_vocab_size(with_added_tokens=True)
    if size > config.vocab_size:
        raise ValueError(f"{folder}: the tokenizer has {size} tokens but the model's vocabulary "
                         f"is {config.vocab_size}")
    return HFTokenizer(rust, eod, config.vocab_size)


def train_settings(config: TransformerConfig, tokenizer_dir: Path, tp: int) -> dict[str, Any]:
    """`domino train` settings that build this model with this tokenizer."""
    from domino.training.arguments import TrainArgs

    values = dict(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, ffn_hidden_size=config.ffn_hidden_size,
        num_query_groups=config.num_query_groups, kv_channels=config.kv_channels,
        seq_length=config.seq_length, max_position_embeddings=config.max_position_embeddings,
        position_embedding_type=config.position_embedding_type,
        normalization=config.normalization, swiglu=config.activation == "swiglu",
        openai_gelu=config.activation == "gelu_tanh",
        disable_bias_linear=not config.add_bias_linear, norm_epsilon=config.layernorm_epsilon,
        rotary_base=config.rotary_base, rotary_percent=config.rotary_percent,
        rotary_seq_len_interpolation_factor=config.rotary_seq_len_interpolation_factor,
        rope_scaling_type=config.rope_scaling_type,
        rope_scaling_factor=config.rope_scaling_factor,
        rope_low_freq_factor=config.rope_low_freq_factor,
        rope_high_freq_factor=config.rope_high_freq_factor,
        rope_original_max_position_embeddings=config.rope_original_max_position_embeddings,
        untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
        hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
        init_method_std=config.init_method_std, tokenizer_type="hf",
        tokenizer_dir=str(tokenizer_dir.resolve()), tensor_model_parallel_size=tp)
    return TrainArgs(**values).to_dict()


def import_hf(folder: Path, out: Path, tp: int) -> Path:
    """Write ``folder``'s model into run folder ``out`` at TP=``tp``; returns the step folder."""
    from domino.models.gpt import GPTModel
    from domino.parallel_state import ParallelState

    raw = layout.read_json(folder / "config.json", "model config")
    arch, config, eod = config_from_hf(raw)
    config.validate_parallel(tp)
    tokenizer = read_hf_tokenizer(folder, config, eod)
    padded = config.padded_vocab_size(1)
    hf = {k: v for k, v in read_hf_weights(folder).items() if not k.endswith(_IGNORED_SUFFIXES)}
    try:
        ours = from_hf(hf, config, arch, padded)
    except KeyError as err:
        raise ValueError(f"{folder}: weight {err.args[0]} is missing for a {arch} model with "
                         f"{config.num_layers} layers") from None
    model = GPTModel(config, parallel_state=ParallelState.single("meta"))
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(ours))
    if missing:
        raise ValueError(f"{folder}: no weights for {missing[:4]}")
    specs, tensors = {}, {}
    for name, p in params.items():
        t = ours[name].to(torch.float32)
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{folder}: {name} has shape {tuple(t.shape)}, the model needs "
                             f"{tuple(p.shape)} (check config.json against the weights)")
        tensors[name] = t
        specs[name] = describe(t, p, 1, [layout.model_file(0)]).to_json()
    with tempfile.TemporaryDirectory(prefix="domino-import-") as tmp:
        step_dir = Path(tmp) / layout.step_dir_name(0)
        (step_dir / layout.TOKENIZER_DIR).mkdir(parents=True)
        save_file(tensors, str(step_dir / layout.model_file(0)))
        files = {layout.model_file(0): layout.file_record(step_dir / layout.model_file(0))}
        record = save_tokenizer(tokenizer, step_dir / layout.TOKENIZER_DIR)
        for f in sorted((step_dir / layout.TOKENIZER_DIR).iterdir()):
            files[f"{layout.TOKENIZER_DIR}/{f.name}"] = layout.file_record(f)
        final_tok = out / layout.CHECKPOINTS / step_dir.name / layout.TOKENIZER_DIR
        meta = Meta(step=0, consumed_samples=0, config=config.to_dict(),
                    layout={"tp": 1, "pp": 1, "dp": 1}, tensors=specs, files=files,
                    args=train_settings(config, final_tok, tp), tokenizer=record,
                    has_optimizer=False, library_version=domino.__version__,
                    extra={"imported_from": str(folder.resolve()), "architecture": arch})
        layout.write_json_atomic(step_dir / layout.META, meta.to_json())
        new = reshard(step_dir, meta, out, tp)
    write_run_config(out, meta, tp, new)
    return new


def run(ns: argparse.Namespace) -> int:
    folder, out, tp = Path(ns.source), Path(ns.output), ns.tensor_model_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size={tp} must be >= 1")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a transformers model folder (no config.json)")
    if (out / layout.CHECKPOINTS).exists():
        if not ns.force:
            raise ValueError(f"{out} already holds checkpoints; pass --force to replace them, "
                             "or another OUT")
        shutil.rmtree(out / layout.CHECKPOINTS)
    try:
        new = import_hf(folder, out, tp)
    except CheckpointError as err:
        raise ValueError(str(err)) from None
    arch = json.loads((new / layout.META).read_text())["extra"]["architecture"]
    print(f"domino import: {folder} ({arch}) -> {new} (TP={tp}, weights only); fine-tune with "
          f"`domino train --config {out}/config.toml --load {out} --data-path ...`")
    return 0
