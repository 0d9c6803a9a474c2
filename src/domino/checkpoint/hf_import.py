"""A ``transformers`` GPT-2 or Llama folder (safetensors weights) as a domino checkpoint at any
TP size, weights only (``domino import``)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import domino
from domino.checkpoint import layout
from domino.checkpoint.hf import config_from_hf, from_hf
from domino.checkpoint.layout import Meta
from domino.checkpoint.reshard import reshard
from domino.checkpoint.shards import describe
from domino.checkpoint.store import save_tokenizer
from domino.config import TransformerConfig
from domino.data.tokenizer import EOD_TOKEN, BPETokenizer, HFTokenizer

# Buffers some GPT-2 files carry next to the weights (causal-mask constants), never weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


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
        meta = Meta(step=0, consumed_samples=0, config=config.to_dict(),
                    layout={"tp": 1, "pp": 1, "dp": 1}, tensors=specs, files=files,
                    tokenizer=record,
                    has_optimizer=False, library_version=domino.__version__,
                    extra={"imported_from": str(folder.resolve()), "architecture": arch})
        layout.write_json_atomic(step_dir / layout.META, meta.to_json())
        return reshard(step_dir, meta, out, tp)
