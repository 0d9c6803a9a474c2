"""What a Hugging Face model family is to domino: a :class:`Family` names its ``model_type`` and
classes, maps its ``config.json`` to our config and back, maps its weight names, says which of
our config's settings its models have, and what of ours it cannot express (its obstacles).
Families that share a layout and a refusal (the Llama family) form a :class:`Group`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from domino.checkpoint.families.common import (
    gemma,
    gpt_oss,
    local_global,
    longrope,
    nope,
    norms_after,
    scalars,
)
from domino.checkpoint.families.weights import Link
from domino.checkpoint.hf_keys import HFKeys
from domino.config import TransformerConfig

Obstacles = Callable[[TransformerConfig], list[str]]


def nothing(config: TransformerConfig) -> list[str]:
    """No obstacle."""
    return []


@dataclass(frozen=True, eq=False)
class Group:
    """Families that a refusal speaks of together (``name``, e.g. "the Llama family"; ``label``
    in "as Llama it has ..."), with what none of them can express (``obstacles``)."""

    name: str
    label: str
    obstacles: Obstacles


@dataclass(frozen=True, eq=False)
class Family:
    """One Hugging Face family. ``read`` builds our config from its ``config.json`` (refusing,
    in the file's keys, what it cannot express); ``write`` gives the ``config.json`` of a model
    it expresses (less the token ids, which ``hf_config`` adds), ``weights`` its weight-name
    map; a model is expressed when neither its group's obstacles nor its ``own`` name anything.
    A family read only to be refused has no ``read`` and says what it ``lacks``."""

    model_type: str
    name: str
    classes: tuple[str, ...] = ()
    group: Group | None = None
    read: Callable[[HFKeys], TransformerConfig] | None = None
    write: Callable[[TransformerConfig], dict[str, Any]] | None = None
    weights: Callable[[TransformerConfig], list[Link]] | None = None
    own: Obstacles = nothing
    # Our config's settings every model of the family has, beyond its group's (set on import).
    features: Mapping[str, Any] = field(default_factory=dict)
    experts: bool = False  # its models have MoE layers
    # Our config's fields as the config.json keys a user edits, for messages.
    keys: Mapping[str, str] = field(default_factory=dict)
    also: tuple[str, ...] = ()  # other model_types it reads alike
    vocab: tuple[str, str] = ("model.embed_tokens.weight", "lm_head.weight")  # table, head
    prefix: str = ""  # a prefix of every name but the head's, which some files leave off
    buffers: tuple[str, ...] = ()  # endings of non-weights some files hold next to weights
    lacks: Callable[[str], tuple[str, ...]] | None = None
    scalars: bool = False  # it has Granite's embedding, residual, attention and logit scalars
    nope: bool = False  # its models may leave RoPE out on some layers (SmolLM3's NoPE layers)
    norms_after: bool = False  # its norms run after each sublayer (OLMo 2's)
    gemma: bool = False  # it has Gemma's settings: (1 + weight) norms, soft-caps, local layers
    longrope: bool = False  # its RoPE may have LongRoPE scaling (Phi-3's)
    # GPT-OSS's settings: sinks, router and expert biases, the clamped SwiGLU, yarn RoPE.
    gpt_oss: bool = False

    def obstacles(self, config: TransformerConfig) -> list[str]:
        """What of ``config`` this family cannot express (empty: it expresses the model)."""
        shared = self.group.obstacles(config) if self.group is not None else []
        return shared + self.own_obstacles(config)

    def own_obstacles(self, config: TransformerConfig) -> list[str]:
        """What of ``config`` this family, but not every one of its group, cannot express:
        :attr:`own`, Granite's scalars where it has none, SmolLM3's NoPE layers, OLMo 2's
        norms after the sublayers, Gemma's settings, Phi-3's LongRoPE, GPT-OSS's settings and
        (Gemma's and GPT-OSS's) full-attention layers among sliding ones."""
        return (self.own(config) + ([] if self.scalars else scalars(config))
                + ([] if self.nope else nope(config))
                + ([] if self.norms_after else norms_after(config))
                + ([] if self.gemma else gemma(config))
                + ([] if self.longrope else longrope(config))
                + ([] if self.gpt_oss else gpt_oss(config))
                + ([] if self.gemma or self.gpt_oss else local_global(config)))

    def key(self, name: str, rope: str = "rope_scaling") -> str:
        """The ``config.json`` key our config's field ``name`` comes from (``name`` itself when
        none does); ``rope``: the key holding the RoPE settings."""
        key = self.keys.get(name, name)
        return f"{rope}.{key.split('.', 1)[1]}" if key.startswith("rope_scaling.") else key

    def names(self, rope: str = "rope_scaling") -> dict[str, str]:
        """Every field of :attr:`keys` -> its key, for :meth:`HFKeys.build`'s messages."""
        return {name: self.key(name, rope) for name in self.keys}
