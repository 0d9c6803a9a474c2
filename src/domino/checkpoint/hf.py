"""Hugging Face ``transformers`` weights: our full (TP=1) state dict to theirs and back, by the
family's weight-name map (:mod:`domino.checkpoint.families`; the kinds of link it is made of,
and our layouts, are :mod:`~domino.checkpoint.families.weights`'). The vocabulary tables are
mapped here: padded (to a multiple of 128 x TP) here, exact there.

Written from the formats' documented weight names and shapes, so neither direction needs
``transformers`` installed.
"""

from __future__ import annotations

import torch

from domino.checkpoint.families import family_named
from domino.checkpoint.families.family import Family
from domino.checkpoint.families.weights import EMBEDDING, OUTPUT
from domino.config import TransformerConfig


def family_of(arch: str) -> Family:
    """The family that writes ``arch`` models; ValueError if none does."""
    family = family_named(arch)
    if family is None or family.weights is None:
        raise ValueError(f"no family writes {arch!r} weights")
    return family


def to_hf(ours: dict[str, torch.Tensor], config: TransformerConfig, arch: str
          ) -> dict[str, torch.Tensor]:
    """Our full (TP=1) weights -> the HF model's state dict (vocabulary padding dropped)."""
    family, v = family_of(arch), config.vocab_size
    out: dict[str, torch.Tensor] = {}
    for link in family.weights(config):
        out.update(link.to_hf(ours))
    table, head = family.vocab
    out[table] = ours[EMBEDDING][:v]
    if config.untie_embeddings_and_output_weights:
        out[head] = ours[OUTPUT][:v]
    return {k: t.contiguous() for k, t in out.items()}


def expected_hf_shapes(config: TransformerConfig, arch: str) -> dict[str, tuple[int, ...]]:
    """Every weight an HF folder of this config must hold, with its shape (from our model
    built on the meta device: nothing is allocated)."""
    from domino.models.gpt import GPTModel
    from domino.parallel_state import ParallelState

    model = GPTModel(config, parallel_state=ParallelState.single("meta"))
    return {name: tuple(t.shape)
            for name, t in to_hf(dict(model.named_parameters()), config, arch).items()}


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def from_hf(hf: dict[str, torch.Tensor], config: TransformerConfig, arch: str,
            padded_vocab: int) -> dict[str, torch.Tensor]:
    """An HF state dict -> our full (TP=1) weights; KeyError names a missing weight."""
    family = family_of(arch)
    table, head = family.vocab
    if family.prefix:  # (names some files of the family write without it)
        hf = {k if k.startswith(family.prefix) or k == head else family.prefix + k: t
              for k, t in hf.items()}
    ours: dict[str, torch.Tensor] = {}
    for link in family.weights(config):
        ours.update(link.from_hf(hf))
    ours[EMBEDDING] = _pad_rows(hf[table], padded_vocab)
    if config.untie_embeddings_and_output_weights:
        ours[OUTPUT] = _pad_rows(hf[head], padded_vocab)
    return {k: t.contiguous() for k, t in ours.items()}
