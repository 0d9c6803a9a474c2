"""The transformer: attention, MLP, norms, RoPE, layers and the Domino schedules."""

from domino.transformer.attention import InferenceParams, MicroBatch
from domino.transformer.autotune import autotune, candidate_plans
from domino.transformer.layer import Block, TransformerLayer
from domino.transformer.schedule import Plan, split_batch
from domino.transformer.stack import DominoTransformer

__all__ = ["DominoTransformer", "TransformerLayer", "Block", "Plan", "split_batch",
           "InferenceParams", "MicroBatch", "autotune", "candidate_plans"]
