"""GPT's import path beside the seed's (the DeepSpeed-Domino language-model API that domino
keeps compatible, see docs/glossary.md); the code lives in :mod:`domino.models.gpt`."""

from domino.models.gpt import GPTModel

__all__ = ["GPTModel"]
