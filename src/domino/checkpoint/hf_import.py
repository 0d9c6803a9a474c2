"""A ``transformers`` model folder (safetensors weights) of a family domino reads
(:mod:`domino.checkpoint.families`) as a domino checkpoint at any TP size, weights only
(``domino import``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

import domino
from domino.checkpoint import hf_tokens, layout
from domino.checkpoint.hf import expected_hf_shapes, family_of, from_hf
from domino.checkpoint.hf_config import config_from_hf
from domino.checkpoint.layout import Meta
from domino.checkpoint.reshard import reshard
from domino.checkpoint.shards import describe
from domino.checkpoint.store import save_tokenizer
from domino.config import TransformerConfig
from domino.data.tokenizer import HFTokenizer

_HF_FIX = ("a model folder holds its files itself; re-download the model or re-save it with "
           "save_pretrained(dir, safe_serialization=True)")


def hf_file(folder: Path, name: object, index: Path | None = None) -> Path:
    """``folder / name`` for a file of HF model folder ``folder`` (``index``: the
    ``model.safetensors.index.json`` that listed ``name``, which must then end in
    ``.safetensors``); ValueError naming the listing file, the name, the rule and the fix.

    ``name`` is one plain component: Hugging Face keeps a model's files in its folder, so no
    ``..``, absolute path, subfolder, backslash or control character. The folder is the user's
    choice, not domino's, so unlike a checkpoint it may hold symbolic links: the hub cache is
    made of them (``snapshots/<rev>/<file> -> ../../blobs/<hash>``) and ``domino import`` of a
    cache snapshot must work. A link must lead to a regular file inside the folder or, for a
    cache snapshot, inside that cache's ``blobs``; anywhere else it is refused, so that a
    downloaded folder cannot pull in a file it does not hold (resolving a link only looks up
    path components; nothing outside is opened).
    """
    rule = layout.name_problem(name)
    if not rule and "/" in str(name):
        rule = "it must be a file of the folder itself (no subfolder)"
    if not rule and index is not None and not str(name).endswith(".safetensors"):
        rule = "weights are .safetensors files"
    path = folder / str(name)
    if not rule and path.is_symlink():
        rule = _link_rule(folder, path.name)
    if rule:
        where = f"{index}: weight_map entry {name!r}" if index is not None else f"{path}"
        raise ValueError(f"{where} is refused: {rule}; {_HF_FIX}")
    return path


def _link_rule(folder: Path, name: str) -> str | None:
    """Why link ``folder / name`` is refused (see ``hf_file``; None: it is not). Each hop is
    followed by its text, so no path outside is looked up before it is known to be inside."""
    base = folder.resolve()
    roots = [base, base.parent.parent / "blobs"] if base.parent.name == "snapshots" else [base]
    here = base / name
    for _hop in range(40):  # (the kernel's own limit on a chain of links)
        if not here.is_symlink():
            break
        here = Path(os.path.normpath(here.parent / os.readlink(here)))
        if not any(here.is_relative_to(r) for r in roots):
            return "it is a symbolic link leading out of the folder"
    else:
        return "it is a chain of too many symbolic links"
    real = Path(os.path.realpath(here))  # (a linked folder on the way: judged by where it is)
    if not any(real.is_relative_to(r) for r in roots):
        return "it is a symbolic link leading out of the folder"
    if not real.is_file():
        return "it is a symbolic link to something other than a regular file"
    return None


def read_hf_weights(folder: Path, expected: dict[str, tuple[int, ...]] | None = None,
                    ) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (one file or an index of shards); every
    name checked by ``hf_file`` before anything is opened. With ``expected`` (HF name ->
    shape, as :func:`~domino.checkpoint.hf.expected_hf_shapes` gives) each tensor's shape is
    checked from the file's header before its data is read."""
    index = hf_file(folder, "model.safetensors.index.json")
    if index.is_file():
        weight_map = layout.read_json(index, "safetensors index", follow=True).get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: 'weight_map' must be a JSON object of tensor -> file")
        files = sorted({hf_file(folder, name, index).name for name in weight_map.values()})
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
        path = hf_file(folder, name)
        bad = (layout.safetensors_header_problem(path, follow=True) if path.is_file()
               else "missing")
        if bad:
            raise ValueError(f"{path}: {bad}")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if expected is not None:
                        _check_shape(path, key, tuple(f.get_slice(key).get_shape()), expected)
                    out[key] = f.get_tensor(key)
        except SafetensorError as err:
            raise ValueError(f"{path}: cannot be read as safetensors ({err}): the file is "
                             "truncated or damaged; download or save it again") from None
    return out


def _check_shape(path: Path, key: str, shape: tuple[int, ...],
                 expected: dict[str, tuple[int, ...]]) -> None:
    """``key``'s shape in the file is the one ``config.json`` implies (tensors the model does
    not use are ignored)."""
    want = expected.get(key)
    if want is not None and shape != want:
        raise ValueError(f"{path}: tensor {key} has shape {shape}, but config.json describes a "
                         f"model whose {key} is {want}; the weights and config.json belong to "
                         "different models: use the config.json saved with these weights")


def read_hf_tokenizer(folder: Path, config: TransformerConfig, eod: int | None,
                      raw: dict | None = None) -> HFTokenizer:
    """The folder's tokenizer (tokenizer.json, or GPT-2's vocab.json + merges.txt), with its BOS
    and EOS ids and token metadata (:mod:`~domino.checkpoint.hf_tokens`; ``raw``: the
    folder's config.json)."""
    paths = {name: hf_file(folder, name) for name in hf_tokens.NAMES}
    return hf_tokens.read_tokenizer(folder, paths, config, eod, raw)


def hf_folder_tokenizer(folder: Path) -> HFTokenizer:
    """The tokenizer ``domino import`` would take from model folder ``folder`` (the same ids,
    end of text and vocabulary, so data tokenized with either matches)."""
    path = hf_file(folder, "config.json")
    raw = layout.read_json(path, "model config", follow=True)
    _, config, eod = config_from_hf(raw, path)
    return read_hf_tokenizer(folder, config, eod, raw)


def _check_tp(path: Path, config: TransformerConfig, arch: str, tp: int) -> None:
    """The model splits over ``tp`` ranks; ValueError naming the ``config.json`` keys that
    do not divide (not our config's field names)."""
    sizes = {family_of(arch).key(field): getattr(config, field)
             for field in ("num_attention_heads", "num_query_groups", "ffn_hidden_size")}
    if arch == "gpt2" and config.ffn_hidden_size == 4 * config.hidden_size:
        sizes["n_inner (4 x n_embd when null)"] = sizes.pop("n_inner")
    bad = [f"{key}={value}" for key, value in sizes.items() if value % tp]
    if bad:
        raise ValueError(f"{path}: {', '.join(bad)}: not divisible by "
                         f"--tensor-model-parallel-size={tp}: each rank holds an equal share; "
                         f"pass a TP size that divides {', '.join(sizes)}")
    config.validate_parallel(tp)  # (and whatever else it asks)


def weights_dtype(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{"dtype": D}``: the floating dtype holding most of the folder's weights (the
    checkpoint keeps them in fp32, exactly; export writes them in ``D`` again by default);
    empty when that is none ``domino export`` writes."""
    count: dict[str, int] = {}
    for t in weights.values():
        if t.is_floating_point():
            name = str(t.dtype).removeprefix("torch.")
            count[name] = count.get(name, 0) + t.numel()
    top = max(count, key=count.__getitem__, default=None)
    return {"dtype": top} if top in ("float32", "bfloat16", "float16") else {}


def import_hf(folder: Path, out: Path, tp: int) -> Path:
    """Write ``folder``'s model into run folder ``out`` at TP=``tp``; returns the step folder."""
    from domino.models.gpt import GPTModel
    from domino.parallel_state import ParallelState

    path = hf_file(folder, "config.json")
    raw = layout.read_json(path, "model config", follow=True)
    arch, config, eod = config_from_hf(raw, path)
    _check_tp(path, config, arch, tp)
    tokenizer = read_hf_tokenizer(folder, config, eod, raw)
    padded = config.padded_vocab_size(1)
    family = family_of(arch)
    expected = expected_hf_shapes(config, arch)
    # (the names as the files that leave the family's prefix off write them, too)
    expected.update({k.removeprefix(family.prefix): s for k, s in list(expected.items())})
    weights = read_hf_weights(folder, expected)
    hf = {k: v for k, v in weights.items() if not (family.buffers and k.endswith(family.buffers))}
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
                    extra={"imported_from": str(folder.resolve()), "architecture": arch,
                           **weights_dtype(weights)})
        layout.write_json_atomic(step_dir / layout.META, meta.to_json())
        return reshard(step_dir, meta, out, tp)
