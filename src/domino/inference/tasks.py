"""What each rank of ``domino generate`` / ``domino eval`` does with a loaded model."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

from domino.data.checks import check_tokenizer, eod_of, open_dataset
from domino.inference.loading import load_saved_model
from domino.inference.sampling import generate, position_limit, position_problem
from domino.precision import PRECISIONS


def _load(spec: dict[str, Any], state):
    dtype = PRECISIONS[spec.get("precision", "fp32")]
    return load_saved_model(Path(spec["step_dir"]), state, compute_dtype=dtype)


def prompt_ids(tokenizer, spec: dict[str, Any], step_dir: Path) -> list[int]:
    """The ids `domino generate` feeds for ``spec``'s prompt: encoded as text (an empty one:
    EOD alone), or with ``chat`` rendered as a conversation by the chat template
    (:func:`~domino.inference.chat.chat_prompt_ids`; the checkpoint's own lies in
    ``step_dir``'s tokenizer folder)."""
    if spec.get("chat"):
        from domino.checkpoint import layout
        from domino.inference.chat import chat_prompt_ids

        return chat_prompt_ids(tokenizer, spec, str(step_dir / layout.TOKENIZER_DIR))
    return tokenizer.encode(spec["prompt"]) or [tokenizer.eod]


def check_positions(step_dir: Path, meta, spec: dict[str, Any]) -> None:
    """Before any rank starts: the prompt can be encoded (a chat template renders it) and with
    ``max_new_tokens`` fits in the model's positions
    (:func:`~domino.inference.sampling.position_limit`), unless ``slide_context``; ValueError
    with the rule and the fix."""
    from domino.checkpoint.store import load_tokenizer
    from domino.config import TransformerConfig

    prompt = prompt_ids(load_tokenizer(step_dir, meta), spec, step_dir)  # a chat's errors too
    if spec.get("slide_context"):
        return
    config = TransformerConfig.from_dict(meta.config)
    limit = position_limit(config)
    what = "max_position_embeddings" if limit == config.max_position_embeddings else "seq_length"
    problem = position_problem(len(prompt), spec["max_new_tokens"], limit, what)
    if problem:
        raise ValueError(problem)


def generate_rank(spec: dict[str, Any], state) -> None:
    model, config, tokenizer, _ = _load(spec, state)
    prompt = prompt_ids(tokenizer, spec, Path(spec["step_dir"]))
    context = position_limit(config)
    ids = generate(model, state, prompt, spec["max_new_tokens"], config.vocab_size, context,
                   top_k=1 if spec["greedy"] else spec["top_k"],
                   temperature=spec["temperature"], seed=spec["seed"], top_p=spec["top_p"],
                   stop=tokenizer.stop_ids if spec["stop_at_eod"] else (),
                   use_cache=spec["use_cache"], slide=bool(spec.get("slide_context")))
    if state.world.rank == 0:
        if spec["ids"]:
            print(" ".join(map(str, ids)))
        elif spec.get("chat"):  # the reply alone (decoding drops the EOS that ended it)
            print(tokenizer.decode(ids))
        else:
            print(spec["prompt"] + tokenizer.decode(ids))
        sys.stdout.flush()


def eval_rank(spec: dict[str, Any], state) -> None:
    from domino.data.blend import build_blended, component_seed, parse_blend
    from domino.data.gpt_dataset import split_documents

    model, config, tokenizer, meta = _load(spec, state)
    saved = meta.args or {}

    def pick(key: str, default: Any) -> Any:
        value = spec.get(key)
        return value if value is not None else saved.get(key, default)

    seq, seed = pick("seq_length", config.seq_length), pick("seed", 1234)
    micro = pick("micro_batch_size", 8)
    blend = parse_blend(spec["data_path"])
    opened = {p: open_dataset(p) for p in blend.prefixes}
    for ds in opened.values():
        check_tokenizer(ds, tokenizer)
    which = ("train", "valid", "test").index(spec["split_name"])
    split = eval_split(spec.get("split"), saved, which)
    need = [False, False, False]
    need[which] = True
    ranges = {}
    for p, ds in opened.items():
        try:
            ranges[p] = split_documents(ds.num_documents, split, required=need)[which]
        except ValueError as err:
            raise ValueError(f"--data-path {p}: {err}") from None
    dp = state.dp
    if spec["eval_iters"] is not None:
        g = pick("global_batch_size", micro * dp.size)
        if g % (micro * dp.size):
            raise ValueError(f"--global-batch-size={g} is not a multiple of --micro-batch-size "
                             f"{micro} x DP {dp.size}")
        size: dict[str, Any] = {"num_samples": spec["eval_iters"] * g}
    else:
        size = {"num_samples": None, "epochs": 1}

    def part(k: int, count: int | None, seed: int):
        ds = opened[blend.prefixes[k]]
        amount = size if count is None else {"num_samples": count}
        return _samples(ds, seq, amount, seed, ranges[blend.prefixes[k]],
                        eod_of(ds, tokenizer), saved)

    if len(blend) == 1:
        samples: Any = part(0, None, seed)
    else:  # as training's validation reads a blend (commands.eval demands --eval-iters)
        samples = build_blended(blend.weights, size["num_samples"],
                                lambda k, count: part(k, count, component_seed(seed, k)))
    if len(samples) == 0:
        raise ValueError(f"the {spec['split_name']} split of {blend.describe()} holds no "
                         f"sample of {seq} tokens; use a shorter --seq-length or more data")
    mine = (list(range(dp.rank, len(samples), dp.size)) if spec["eval_iters"] is None
            else _slice(len(samples), dp.size, dp.rank, g))
    total = torch.zeros(2, dtype=torch.float64, device=state.device)
    with torch.no_grad():
        for start in range(0, len(mine), micro):
            items = [samples[i] for i in mine[start:start + micro]]
            batch = {k: torch.stack([it[k] for it in items]).to(state.device) for k in items[0]}
            loss = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                         labels=batch["labels"])
            # The arithmetic of training's validation (fp32 sums per micro-batch).
            total[0] += (loss.float() * batch["loss_mask"]).sum().double()
            total[1] += batch["loss_mask"].sum().double()
    dp.all_reduce(total, name="eval loss")
    if state.world.rank == 0:
        mean = float(total[0] / total[1].clamp(min=1))
        print(f"domino eval: {spec['split_name']} split of {blend.describe()}: loss "
              f"{mean:.4f}, perplexity {math.exp(min(mean, 50.0)):.3f} over {int(total[1]):,} "
              f"tokens ({len(samples):,} samples of {seq}; checkpoint step {meta.step}, TP="
              f"{state.tp.size} x DP={dp.size}, {spec.get('precision', 'fp32')})", flush=True)


def _samples(ds, seq: int, amount: dict[str, Any], seed: int, split, eod: int,
             saved: dict[str, Any]):
    """The samples of one dataset as the run made them (packed, or cut at its EOD flags)."""
    from domino.data.gpt_dataset import GPTDataset
    from domino.data.packed import PackedDataset

    if saved.get("pack_documents"):
        return PackedDataset(ds, seq, **amount, seed=seed, split=split, pad_token=eod)
    options = {k: bool(saved.get(k, False)) for k in ("reset_position_ids",
                                                      "reset_attention_mask", "eod_mask_loss")}
    return GPTDataset(ds, seq, **amount, seed=seed, eod_token=eod, split=split,
                      create_attention_mask=options["reset_attention_mask"], **options)


def eval_split(given: str | None, saved: dict[str, Any], which: int) -> str:
    """The --split that cuts `domino eval`'s data: the one given, else the run's; but a run that
    named each split's datasets (--train-data-path, --valid-data-path) read them whole, not cut
    by its --split, so then split ``which`` is the whole dataset (its validation reproduced)."""
    if given is not None:
        return given
    if saved.get("train_data_path") is not None:
        return ",".join("1" if i == which else "0" for i in range(3))
    return saved.get("split") or "98,2,0"


def _slice(n: int, dp_size: int, dp_rank: int, global_batch: int) -> list[int]:
    """Training's validation order: each global batch cut into contiguous per-rank slices."""
    per_rank = global_batch // dp_size
    out = []
    for first in range(0, n, global_batch):
        start = first + dp_rank * per_rank
        out.extend(range(start, min(start + per_rank, n)))
    return out
