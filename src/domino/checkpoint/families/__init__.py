"""The Hugging Face model families, one module each, registered in :data:`FAMILIES`.

Import asks the family of the ``config.json``'s ``model_type`` to read it (each refuses, in the
file's keys, what it cannot express); export writes a model as the first family in the list
that can express it, and a model none can is refused with each family's obstacles. A family
that needs no new math is one module (its :class:`~.family.Family`, named ``FAMILY``) plus its
name in :data:`MODULES`.
"""

from __future__ import annotations

import importlib

from domino.checkpoint.families.family import Family, Group
from domino.config import TransformerConfig

# The families' modules, one name each. Export writes a model as the first family here that
# expresses it: where two express the same model (a Mistral without a window is a Llama) the
# earlier one is chosen.
MODULES = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "olmoe",
           "olmo2", "flex_olmo", "phi3", "granite", "gpt_oss", "starcoder2", "smollm3", "gemma",
           "gemma2", "gemma3", "vaultgemma")
FAMILIES: list[Family] = [importlib.import_module(f"{__name__}.{name}").FAMILY
                          for name in MODULES]


def readable(families: list[Family] = FAMILIES) -> tuple[str, ...]:
    """The model_types import reads (in the list's order)."""
    return tuple(f.model_type for f in families if f.read is not None)


def family_named(model_type: str, families: list[Family] = FAMILIES) -> Family | None:
    """The family that reads (or refuses) ``model_type`` configs; None: no family knows it."""
    return next((f for f in families if model_type in (f.model_type, *f.also)), None)


def family_for(config: TransformerConfig, families: list[Family] = FAMILIES) -> Family:
    """The first family that expresses the model; ValueError naming each family's obstacles."""
    writers = [f for f in families if f.write is not None]
    for family in writers:
        if not family.obstacles(config):
            return family
    groups = list(dict.fromkeys(f.group for f in writers if f.group is not None))
    names = " nor ".join(_group_name(g, config, writers) for g in groups)
    reasons = [r for g in groups for r in _reasons(g, config, writers)]
    raise ValueError(f"neither {names} can express this model: "
                     + ". ".join(r if i == 0 else r[0].upper() + r[1:]
                                 for i, r in enumerate(reasons)) + ".")


def _members(group: Group, config: TransformerConfig, families: list[Family]) -> list[Family]:
    """The group's families of the model's kind (dense or MoE); all of them if none is."""
    members = [f for f in families if f.group is group]
    alike = [f for f in members if f.experts == (config.num_experts is not None)]
    return alike or members


def _group_name(group: Group, config: TransformerConfig, families: list[Family]) -> str:
    if sum(f.group is group for f in families) == 1:
        return group.name
    return f"{group.name} ({', '.join(f.name for f in _members(group, config, families))})"


def _reasons(group: Group, config: TransformerConfig, families: list[Family]) -> list[str]:
    """"as GPT-2 it has ...": what none of the group's families can express, or, when that is
    nothing, what each one cannot."""
    shared = group.obstacles(config)
    if shared:
        return [f"as {group.label} it has " + "; ".join(shared)]
    return [f"as {f.name} it has " + "; ".join(f.own_obstacles(config))
            for f in _members(group, config, families)]
