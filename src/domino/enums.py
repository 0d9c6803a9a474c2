"""Enumerations shared by the model code (Megatron-compatible names)."""

import enum


class LayerType(enum.Enum):
    encoder = 1
    decoder = 2


class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
