"""The transformer: attention, MLP, norms, RoPE, layers and the Domino schedules."""

from domino.plan import Plan
from domino.transformer.autotune import autotune, candidate_plans
from domino.transformer.context import BackwardContext
from domino.transformer.edge import EdgeContext
from domino.transformer.late_work import LateWork
from domino.transformer.layer import Block, BlockOp, TransformerLayer
from domino.transformer.microbatch import InferenceParams, MicroBatch, Prologue, split_batch
from domino.transformer.spec import BlockSpec, LayerArgs, LayerSpec, layer_spec
from domino.transformer.stack import DominoTransformer, set_plan, stacks_of, using_plan

__all__ = ["BackwardContext", "DominoTransformer", "TransformerLayer", "Block", "BlockOp",
           "BlockSpec", "EdgeContext", "LayerArgs", "LayerSpec", "layer_spec", "Plan",
           "split_batch", "InferenceParams", "LateWork", "MicroBatch", "Prologue", "autotune",
           "candidate_plans", "set_plan", "stacks_of", "using_plan"]
