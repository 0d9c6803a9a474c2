"""How one of our tensors becomes a Hugging Face family's tensors and back: the kinds of link a
family's weight-name map is made of. Each link converts both ways, so a map written once serves
export (:meth:`to_hf`) and import (:meth:`from_hf`).

Our layouts: the fused QKV rows are grouped per query group, ``[q heads of group g | k_g |
v_g]``; a SwiGLU ``fc1`` is ``[gate; up]``; an MoE layer's experts are stacked, ``fc1`` ``[E, h,
2f]`` (``[gate | up]``, each ``[in, out]``) and ``fc2`` ``[E, f, h]``. The vocabulary tables are
mapped apart (:mod:`domino.checkpoint.hf`): they are padded here and exact there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from domino.config import TransformerConfig

Tensors = dict[str, torch.Tensor]

EMBEDDING = "language_model.embedding.word_embeddings.weight"
OUTPUT = "language_model.output_layer.weight"
POSITIONS = "language_model.embedding.position_embeddings.weight"
FINAL_NORM = "language_model.encoder.final_layernorm."


def layer(i: int) -> str:
    """The prefix of our layer ``i``'s tensor names."""
    return f"language_model.encoder.layers.{i}."


def suffixes(bias: bool) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


class Link(Protocol):
    """One piece of a weight-name map."""

    def to_hf(self, ours: Tensors) -> Tensors: ...

    def from_hf(self, hf: Tensors) -> Tensors: ...


@dataclass(frozen=True)
class Same:
    """One tensor under another name (``transposed``: stored [in, out] there, as a Conv1D)."""

    ours: str
    theirs: str
    transposed: bool = False

    def to_hf(self, ours: Tensors) -> Tensors:
        t = ours[self.ours]
        return {self.theirs: t.t() if self.transposed else t}

    def from_hf(self, hf: Tensors) -> Tensors:
        t = hf[self.theirs]
        return {self.ours: t.t() if self.transposed else t}


@dataclass(frozen=True)
class Heads:
    """The attention's shape, which the QKV layouts depend on."""

    heads: int
    groups: int
    head_dim: int

    @classmethod
    def of(cls, config: TransformerConfig) -> Heads:
        return cls(config.num_attention_heads, config.num_query_groups, config.kv_channels)

    @property
    def per_group(self) -> int:
        return self.heads // self.groups

    def sizes(self) -> list[int]:
        """Rows of q, k and v."""
        return [self.heads * self.head_dim, self.groups * self.head_dim,
                self.groups * self.head_dim]

    def to_ours(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[q (heads*d) ; k (groups*d) ; v] rows (any trailing dims) -> our per-group layout."""
        tail = q.shape[1:]
        qg = q.reshape(self.groups, self.per_group * self.head_dim, *tail)
        kg = k.reshape(self.groups, self.head_dim, *tail)
        vg = v.reshape(self.groups, self.head_dim, *tail)
        return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)

    def from_ours(self, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tail = w.shape[1:]
        g = w.reshape(self.groups, (self.per_group + 2) * self.head_dim, *tail)
        q, k, v = g.split([self.per_group * self.head_dim, self.head_dim, self.head_dim], dim=1)
        return (q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail))


@dataclass(frozen=True)
class ApartQKV:
    """Our fused QKV tensor as separate q, k and v projections (``q_proj``, ...)."""

    ours: str
    theirs: tuple[str, str, str]
    heads: Heads

    def to_hf(self, ours: Tensors) -> Tensors:
        return dict(zip(self.theirs, self.heads.from_ours(ours[self.ours])))

    def from_hf(self, hf: Tensors) -> Tensors:
        return {self.ours: self.heads.to_ours(*(hf[name] for name in self.theirs))}


@dataclass(frozen=True)
class FusedQKV:
    """Our fused QKV tensor as one ``[all q | all k | all v]`` tensor (GPT-2's ``c_attn``;
    ``transposed``: stored [in, out])."""

    ours: str
    theirs: str
    heads: Heads
    transposed: bool = False

    def to_hf(self, ours: Tensors) -> Tensors:
        both = torch.cat(self.heads.from_ours(ours[self.ours]))
        return {self.theirs: both.t() if self.transposed else both}

    def from_hf(self, hf: Tensors) -> Tensors:
        w = hf[self.theirs].t() if self.transposed else hf[self.theirs]
        return {self.ours: self.heads.to_ours(*w.split(self.heads.sizes(), dim=0))}


@dataclass(frozen=True)
class GateUp:
    """Our SwiGLU ``fc1`` rows ``[gate; up]`` as two projections."""

    ours: str
    gate: str
    up: str

    def to_hf(self, ours: Tensors) -> Tensors:
        gate, up = ours[self.ours].chunk(2, dim=0)
        return {self.gate: gate, self.up: up}

    def from_hf(self, hf: Tensors) -> Tensors:
        return {self.ours: torch.cat([hf[self.gate], hf[self.up]])}


@dataclass(frozen=True)
class Experts:
    """An MoE layer's router and stacked experts as the Hub's per-expert tensors:
    ``{block}.gate.weight`` and ``{block}.experts.{e}.{gate|up|down}.weight`` (transformers reads
    this layout, fusing the experts itself)."""

    ours: str  # our MoE module's prefix
    block: str  # theirs
    names: tuple[str, str, str]  # gate, up, down
    count: int
    width: int

    def _expert(self, e: int, which: int) -> str:
        return f"{self.block}experts.{e}.{self.names[which]}.weight"

    def to_hf(self, ours: Tensors) -> Tensors:
        f = self.width
        out = {self.block + "gate.weight": ours[self.ours + "router.weight"]}
        fc1, fc2 = ours[self.ours + "experts.fc1"], ours[self.ours + "experts.fc2"]
        for e in range(self.count):
            out[self._expert(e, 0)] = fc1[e][:, :f].t()
            out[self._expert(e, 1)] = fc1[e][:, f:].t()
            out[self._expert(e, 2)] = fc2[e].t()
        return out

    def from_hf(self, hf: Tensors) -> Tensors:
        experts = range(self.count)
        fc1 = [torch.cat([hf[self._expert(e, 0)].t(), hf[self._expert(e, 1)].t()], dim=1)
               for e in experts]
        return {self.ours + "router.weight": hf[self.block + "gate.weight"],
                self.ours + "experts.fc1": torch.stack(fc1),
                self.ours + "experts.fc2": torch.stack([hf[self._expert(e, 2)].t()
                                                        for e in experts])}
