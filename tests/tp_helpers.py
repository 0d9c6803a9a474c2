"""Helpers shared by the tensor-parallel tests: configs, weight sharding, error measures.

Sharding here is written from its definition (a parameter tagged ``partition_dim`` d and
``partition_stride`` s is s equal blocks along d, each cut into ``tp`` contiguous chunks), not
with the library's own helpers, so that a sharding bug in the library shows up as a mismatch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from domino import TransformerConfig
from domino.tensor_parallel import CommGroup

TOL = 1e-5  # fp32: relative to the largest magnitude of the expected tensor
FLOOR = 1e-3  # below this scale the error is absolute: TOL * FLOOR = 1e-8


def config(**overrides) -> TransformerConfig:
    """A tiny deterministic (dropout-free, sync-schedule) model config."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                seq_length=8, max_position_embeddings=16, hidden_dropout=0.0,
                attention_dropout=0.0, domino_micro_batches=1, domino_overlap="none")
    base.update(overrides)
    return TransformerConfig(**base)


def rel_err(a: torch.Tensor | None, b: torch.Tensor | None, floor: float = FLOOR) -> float:
    """max |a - b| / max(max |b|, floor); inf on a shape mismatch or a missing tensor."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    if not torch.isfinite(a).all():
        return math.inf
    return (a - b).abs().max().item() / max(b.abs().max().item(), floor)


def is_vocab_param(name: str) -> bool:
    """Parameters whose first dim is the (TP-dependent) padded vocabulary."""
    return name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight") \
        or name == "word_embeddings"


def fit_rows(full: torch.Tensor, rows: int, valid: int) -> torch.Tensor:
    """Keep the first ``valid`` rows of ``full`` and zero-pad to ``rows`` rows."""
    out = full.new_zeros((rows, *full.shape[1:]))
    out[:valid] = full[:valid]
    return out


def shard(full: torch.Tensor, like: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """This rank's shard of ``full`` for a parameter ``like`` (replicated: ``full`` itself)."""
    if group.size == 1 or not getattr(like, "tensor_model_parallel", False):
        return full
    dim, stride = like.partition_dim, like.partition_stride
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(group.size, dim=dim)[group.rank] for b in blocks], dim=dim)


def expected_local(name: str, full: torch.Tensor, like: torch.Tensor, group: CommGroup,
                   vocab: int) -> torch.Tensor:
    """What the TP parameter (or gradient) ``like`` should hold, given the unsharded ``full``."""
    if is_vocab_param(name):
        full = fit_rows(full, like.shape[0] * group.size, vocab)
    return shard(full, like, group)


def perturb(model: nn.Module, seed: int, scale: float = 0.05, vocab: int | None = None) -> None:
    """Add noise to every parameter (biases and norm weights included, which init leaves at
    0 / 1 and would hide bugs); padded vocabulary rows stay zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * scale
            if vocab is not None and is_vocab_param(name):
                noise[vocab:] = 0
            p.add_(noise.to(p.dtype))


def copy_weights(model: nn.Module, ref: nn.Module, group: CommGroup, vocab: int) -> None:
    """Load the unsharded weights of ``ref`` into the TP ``model`` (same structure)."""
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(expected_local(name, ref_params[name], p, group, vocab))


def grad_errors(model: nn.Module, ref: nn.Module, group: CommGroup, vocab: int) -> dict:
    """Per parameter: error of this rank's gradient vs its share of the reference gradient."""
    ref_params = dict(ref.named_parameters())
    out = {}
    for name, p in model.named_parameters():
        r = ref_params[name]
        if p.grad is None or r.grad is None:
            out[name] = math.inf
            continue
        out[name] = rel_err(p.grad, expected_local(name, r.grad, p, group, vocab))
    return out


def weight_errors(model: nn.Module, ref: nn.Module, group: CommGroup, vocab: int) -> dict:
    ref_params = dict(ref.named_parameters())
    return {name: rel_err(p, expected_local(name, ref_params[name], p, group, vocab))
            for name, p in model.named_parameters()}


def snapshot_grads(model: nn.Module) -> dict:
    return {n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters()}


def grads_vs(model: nn.Module, expected: dict) -> dict:
    return {n: rel_err(p.grad, expected[n]) for n, p in model.named_parameters()}


def worst(errors: dict) -> tuple[str, float]:
    """(name, error) of the largest error in a flat dict."""
    if not errors:
        return ("<none>", 0.0)
    name = max(errors, key=lambda k: errors[k])
    return name, errors[name]


def failures(errors: dict, tol: float = TOL) -> dict:
    return {k: v for k, v in errors.items() if not v <= tol}
