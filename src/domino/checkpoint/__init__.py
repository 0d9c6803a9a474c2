"""Checkpoints that cannot run code: safetensors tensors + JSON, one file set per rank, readable
at any TP / DP size (``layout`` says where everything is, ``shards`` how tensors are cut,
``store`` saves and loads a run's state)."""

from domino.checkpoint.layout import CheckpointError, Meta, open_checkpoint
from domino.checkpoint.store import load_model, load_optimizer, load_rng, save

__all__ = ["CheckpointError", "Meta", "load_model", "load_optimizer", "load_rng",
           "open_checkpoint", "save"]
