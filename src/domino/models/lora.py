"""LoRA on a built model: which linears get adapters (``--lora-target-modules``), attaching
them (:func:`apply_lora`), freezing the base, and the names both sides use.

The adapters themselves, and how they follow the TP layout, are
:mod:`domino.tensor_parallel.lora`'s. A LoRA run trains only the adapters: every base weight
is frozen (no gradient, no optimizer state) and, when the run computes in bf16 or fp16, kept in
that dtype (the fp32 copy would only feed the casts); the adapters and their optimizer stay
fp32.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from domino.parallel_state import ParallelState
from domino.precision import compute_dtype_of
from domino.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from domino.tensor_parallel.lora import ATTRIBUTE, LoraAdapter, adapter_of
from domino.transformer.moe.experts import GroupedExperts
from domino.transformer.moe.lora import ExpertLora

# --lora-target-modules names -> the linears' attribute names (Megatron's) they cover.
TARGETS: dict[str, tuple[str, ...]] = {
    "qkv": ("query_key_value", "query", "key_value"),
    "proj": ("dense",),
    "fc1": ("dense_h_to_4h",),
    "fc2": ("dense_4h_to_h",),
}
DEFAULT_TARGETS = ("qkv", "proj", "fc1", "fc2")
_LAYER_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attention|inter_attention|mlp)\.(\w+)$")


@dataclass(frozen=True)
class LoraSpec:
    """A run's LoRA: rank r, alpha (the update is scaled by alpha / r), dropout on the
    adapters' input, and the linears it adapts (names of :data:`TARGETS`)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"--lora-rank {self.rank!r}: the adapters' rank must be a "
                             "positive integer (e.g. 8 or 16)")
        if not self.alpha > 0:
            raise ValueError(f"--lora-alpha {self.alpha!r}: must be positive (the update is "
                             "scaled by alpha / rank; PEFT's default is 8, common is 2 x rank)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--lora-dropout {self.dropout!r}: a probability in [0, 1)")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"--lora-target-modules {','.join(self.targets)!r}: "
                             f"{'unknown ' + ', '.join(unknown) if unknown else 'empty'}; "
                             f"choose from {','.join(TARGETS)}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"--lora-target-modules {','.join(self.targets)!r} names a module "
                             "twice")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_json(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "targets": list(self.targets)}

    @classmethod
    def from_json(cls, raw: dict) -> LoraSpec:
        return cls(rank=int(raw["rank"]), alpha=float(raw["alpha"]),
                   dropout=float(raw["dropout"]), targets=tuple(raw["targets"]))

    @classmethod
    def parse_targets(cls, text: str) -> tuple[str, ...]:
        """``"qkv,proj"`` -> ("qkv", "proj")."""
        return tuple(t.strip() for t in text.split(",") if t.strip())


def targeted(model: nn.Module, spec: LoraSpec) -> Iterator[tuple[str, nn.Module]]:
    """The transformer layers' linears ``spec`` adapts, by module name."""
    wanted = {attr for t in spec.targets for attr in TARGETS[t]}
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        m = _LAYER_LINEAR.search(name)
        if m is not None and m.group(3) in wanted:
            yield name, module


def targeted_experts(model: nn.Module, spec: LoraSpec) -> list[tuple[nn.Module, tuple]]:
    """The routed experts ``spec`` adapts (fc1 / fc2 of an MoE layer), with which of theirs."""
    which = tuple(t for t in ("fc1", "fc2") if t in spec.targets)
    if not which:
        return []
    return [(m, which) for m in model.modules() if isinstance(m, GroupedExperts)]


def apply_lora(model: nn.Module, spec: LoraSpec, state: ParallelState, seed: int) -> list[
        nn.Parameter]:
    """Attach an adapter to every linear ``spec`` targets (and to the routed experts' fc1 /
    fc2 in MoE layers), freeze every other parameter (in its compute dtype where the model
    computes in another), and draw the adapters' start from ``seed`` and each adapter's
    checkpoint name (so it does not depend on the TP, EP or PP layout). Returns the adapters'
    parameters (what the optimizer trains). ValueError if nothing matches."""
    found = list(targeted(model, spec))
    experts = targeted_experts(model, spec)
    if not found and not experts:
        raise ValueError(f"--lora-target-modules {','.join(spec.targets)}: no linear of this "
                         "model matches")
    if experts and spec.dropout:
        raise ValueError(f"--lora-dropout {spec.dropout:g} with expert adapters (fc1/fc2 of an "
                         "MoE model): not supported; pass --lora-dropout 0 or target qkv,proj")
    for p in model.parameters():
        p.requires_grad_(False)
    for _, linear in found:
        setattr(linear, ATTRIBUTE, _adapter(linear, spec, state))
    for module, which in experts:
        ep = state.ep if state.ep.size > 1 else None
        setattr(module, ATTRIBUTE, ExpertLora(module, which, spec.rank, spec.alpha,
                                              ep.rank if ep else 0, ep.size if ep else 1))
    _freeze_in_compute_dtype(model)
    adapters = lora_parameters(model)
    _reset(model, seed)
    return adapters


def _adapter(linear: nn.Module, spec: LoraSpec, state: ParallelState) -> LoraAdapter:
    column = isinstance(linear, ColumnParallelLinear)
    adapter = LoraAdapter("column" if column else "row", linear.input_size, linear.output_size,
                          spec.rank, spec.alpha, spec.dropout, linear.group.rank,
                          linear.group.size, state.rng,
                          stride=linear.stride if column else 1, device=linear.weight.device)
    adapter.train(linear.training)
    return adapter


@torch.no_grad()
def _freeze_in_compute_dtype(model: nn.Module) -> None:
    """Frozen parameters marked to compute in another dtype become that dtype: nothing
    updates them, so a master copy would only take memory."""
    for p in model.parameters():
        if p.requires_grad:
            continue
        dtype = compute_dtype_of(p)
        if dtype != p.dtype and p.is_floating_point():
            p.data = p.data.to(dtype)


def _reset(model: nn.Module, seed: int) -> None:
    """Each adapter's start, drawn from ``seed`` and its A factor's checkpoint name."""
    owners = {id(next(a.parameters())): a for a in adapters_of(model)}
    # A pipeline stage renames its parameters to the full model's (checkpoint_tensors).
    named = (model.checkpoint_tensors() if hasattr(model, "checkpoint_tensors")
             else model.named_parameters())
    for name, p in named:
        adapter = owners.get(id(p))
        if adapter is not None:
            gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()))
                                                % (2**63))
            adapter.reset(gen)


def adapters_of(model: nn.Module) -> list[LoraAdapter | ExpertLora]:
    """Every adapter in ``model``."""
    return [m for m in model.modules() if isinstance(m, (LoraAdapter, ExpertLora))]


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' parameters, in the model's order."""
    return [p for a in adapters_of(model) for p in a.parameters()]


def spec_of(model: nn.Module) -> LoraSpec | None:
    """The LoRA a model carries (None without adapters)."""
    adapters = adapters_of(model)
    if not adapters:
        return None
    a = adapters[0]
    targets = tuple(t for t in DEFAULT_TARGETS
                    if any(adapter_of(m) is not None for _, m in targeted(
                        model, dataclasses.replace(LoraSpec(1), targets=(t,))))
                    or any(t in e.which for e in adapters if isinstance(e, ExpertLora)))
    return LoraSpec(a.rank, a.alpha, a.dropout, targets)


def is_adapter_name(name: str) -> bool:
    """Is ``name`` (a parameter's, or a checkpoint tensor's) an adapter factor's?"""
    return ATTRIBUTE in name.split(".")[:-1]
