"""The transformer: attention, MLP, norms, RoPE, layers and the Domino schedules."""

from domino.plan import Plan
from domino.transformer.attention import InferenceParams
from domino.transformer.autotune import autotune, candidate_plans
from domino.transformer.layer import Block, BlockOp, TransformerLayer
from domino.transformer.schedule import MicroBatch, split_batch
from domino.transformer.stack import DominoTransformer, set_plan, stacks_of, using_plan

__all__ = ["DominoTransformer", "TransformerLayer", "Block", "BlockOp", "Plan", "split_batch",
           "InferenceParams", "MicroBatch", "autotune", "candidate_plans", "set_plan",
           "stacks_of", "using_plan"]
