"""The seed's import path (the seed: the DeepSpeed-Domino language-model API that domino keeps
compatible, see docs/glossary.md); the code lives in
:mod:`domino.models.language_model`."""

from domino.models.language_model import (
    Embedding,
    Pooler,
    TransformerLanguageModel,
    default_position_ids,
    get_language_model,
    parallel_lm_logits,
)

__all__ = ["Embedding", "Pooler", "TransformerLanguageModel", "default_position_ids",
           "get_language_model", "parallel_lm_logits"]
