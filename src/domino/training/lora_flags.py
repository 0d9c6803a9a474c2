"""`domino train`'s LoRA flags (``--lora-rank`` and its settings) and the spec they make.

A run with ``--lora-rank R`` trains LoRA adapters (:mod:`domino.models.lora`) on a frozen base:
it starts from ``--load BASE --finetune`` (or resumes a LoRA run with ``--load``), and its
checkpoints hold the adapters and name the base (:mod:`domino.checkpoint.lora`).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from domino.checkpoint.layout import CheckpointError
from domino.checkpoint.lora import base_of, spec_of
from domino.models.lora import DEFAULT_TARGETS, TARGETS, LoraSpec


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help, "group": "lora", "choices": None})


def lora_fields() -> list[tuple[str, type, Any]]:
    """The LoRA flags, as ``dataclasses.make_dataclass`` fields."""
    return [
        ("lora_rank", int, _f(0, "Train LoRA adapters of this rank on the frozen --load model "
                                 "instead of all its weights (0 = off; docs/finetune.md).")),
        ("lora_alpha", float, _f(16.0, "LoRA's alpha: the adapters' update is scaled by "
                                       "alpha / rank.")),
        ("lora_dropout", float, _f(0.0, "Dropout on the adapters' input.")),
        ("lora_target_modules", str, _f(",".join(DEFAULT_TARGETS),
                                        "The linears that get adapters, comma-separated: "
                                        f"{', '.join(TARGETS)} (attention's fused QKV and "
                                        "output, the MLP's two).")),
    ]


def lora_spec(args: Any) -> LoraSpec | None:
    """The run's LoRA (None without ``--lora-rank``); ValueError naming the flag."""
    if args.lora_rank == 0:
        return None
    return LoraSpec(args.lora_rank, args.lora_alpha, args.lora_dropout,
                    LoraSpec.parse_targets(args.lora_target_modules))


def check_lora(args: Any, resume: Any) -> None:
    """Before any process starts: the LoRA flags' values, and that the ``--load`` checkpoint
    (``resume``, a ``training.resume.Resume``) is what they can start from or continue."""
    spec = lora_spec(args)
    saved = spec_of(resume.meta) if resume is not None else None
    where = f"--load {resume.step_dir}" if resume is not None else ""
    if spec is None:
        if saved is not None:
            raise ValueError(
                f"{where} holds LoRA adapters (rank {saved.rank} on "
                f"{','.join(saved.targets)}): continue it with its settings (--config "
                "RUN/config.toml, or --lora-rank and the other --lora-* flags), or export the "
                "merged model (domino export --format hf) and import that")
        return
    if resume is None:
        raise ValueError("--lora-rank trains adapters on a model's frozen weights: pass "
                         "--load BASE --finetune (a run, or a `domino import` folder)")
    if saved is None and not resume.weights_only:
        raise ValueError(f"{where} is a run with optimizer state: add --finetune to train "
                         "LoRA adapters on its weights")
    if saved is not None and resume.finetune:
        raise ValueError(f"{where} is a LoRA run: drop --finetune to continue it; to adapt "
                         "the adapted model again, export it merged (domino export --format "
                         "hf) and import that")
    if saved is not None and saved != spec:
        diffs = [f"{k} {saved.to_json()[k]!r} there, {spec.to_json()[k]!r} here"
                 for k in saved.to_json() if saved.to_json()[k] != spec.to_json()[k]]
        raise ValueError(f"{where} was trained with other LoRA settings ({'; '.join(diffs)}); "
                         "pass its own (its config.toml has them)")
    if saved is not None:  # its base: there and unchanged, before the ranks start to load it
        try:
            base_of(resume.step_dir, resume.meta)
        except CheckpointError as err:
            raise ValueError(f"--load: {err}") from None
    if args.num_experts is not None and {"fc1", "fc2"} & set(spec.targets) and spec.dropout:
        raise ValueError(f"--lora-dropout {spec.dropout:g} with adapters on the experts (fc1/"
                         "fc2 of an MoE model) is not supported: pass --lora-dropout 0, or "
                         "--lora-target-modules qkv,proj")
