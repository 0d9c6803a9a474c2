"""Loading a saved model for inference: the checkpoint's GPT on this rank, in eval mode."""

from __future__ import annotations

from pathlib import Path

import torch

from domino.checkpoint import layout
from domino.checkpoint import lora as checkpoint_lora
from domino.checkpoint.layout import Meta
from domino.checkpoint.store import load_model, load_tokenizer
from domino.config import TransformerConfig
from domino.models.gpt import GPTModel
from domino.models.lora import apply_lora
from domino.plan import Plan
from domino.runtime import RuntimeConfig


def load_saved_model(step_dir: Path, state, plan: Plan | None = None,
                     compute_dtype: torch.dtype | None = None):
    """(model, config, tokenizer, meta): the checkpoint's GPT on this rank, in eval mode;
    ``compute_dtype``: computed from copies in that dtype (``domino.precision``)."""
    meta = Meta.from_json(layout.read_json(step_dir / layout.META, "checkpoint record"),
                          step_dir / layout.META)
    config = TransformerConfig.from_dict(meta.config)
    if plan is None and meta.plan:
        plan = Plan.parse(meta.plan)
    # Sequence parallelism is a training-memory layout of the same weights; inference feeds
    # sequences of any length (and KV-cache steps of one token), so it runs without it.
    runtime = RuntimeConfig(plan=plan) if plan is not None else RuntimeConfig()
    runtime = runtime.replace(compute_dtype=compute_dtype)
    torch.manual_seed(0)  # weights are overwritten; this only fixes the throwaway init
    model = GPTModel(config, parallel_state=state, runtime=runtime)
    lora = checkpoint_lora.spec_of(meta)
    if lora is not None:  # a LoRA run's: its base's weights and its adapters (load_model)
        apply_lora(model, lora, state, seed=0)
    load_model(step_dir, meta, model, state)
    model.eval()
    return model, config, load_tokenizer(step_dir, meta), meta
