"""The seed-era import path of GPT; the code lives in :mod:`domino.models.gpt`."""

from domino.models.gpt import GPTModel

__all__ = ["GPTModel"]
