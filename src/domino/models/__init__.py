"""Models built on the Domino transformer: the seed's language model (``language_model``; the
seed is the DeepSpeed-Domino language-model API that domino keeps compatible, see
docs/glossary.md) and GPT (``gpt``). ``domino.language_model`` and ``domino.gpt_model`` stay
importable (the seed's paths)."""

from domino.models.gpt import GPTModel
from domino.models.language_model import (
    Embedding,
    Pooler,
    TransformerLanguageModel,
    get_language_model,
    parallel_lm_logits,
)

__all__ = ["Embedding", "GPTModel", "Pooler", "TransformerLanguageModel", "get_language_model",
           "parallel_lm_logits"]
