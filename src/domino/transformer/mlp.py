"""The feed-forward block: column-parallel fc1, GELU or SwiGLU, row-parallel fc2."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from domino.config import TransformerConfig
from domino.parallel_state import ParallelState
from domino.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from domino.tensor_parallel.layers import WgradStash
from domino.transformer.exits import ColumnParallelEntry, RowParallelExit
from domino.transformer.kernels import Kernels, glu_args
from domino.transformer.microbatch import MicroBatch

if TYPE_CHECKING:
    from domino.transformer.edge import EdgeContext
    from domino.transformer.spec import LayerArgs


class MLP(nn.Module):
    """h -> ffn (column) -> act -> h (row). A gated activation's (SwiGLU's, GeGLU's) fc1 holds
    [gate; up], sharded with stride 2 so every rank gets the gate and up rows of the same ffn
    channels."""

    def __init__(self, config: TransformerConfig, state: ParallelState,
                 device: torch.device | None = None, kernels: Kernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels if kernels is not None else Kernels()
        self.swiglu = config.activation == "swiglu"
        self.geglu = config.activation == "geglu_tanh"
        self.gelu_approximate = ("tanh" if config.activation in ("gelu_tanh", "geglu_tanh")
                                 else "none")
        gated = self.swiglu or self.geglu
        self.glu = glu_args(config)  # (GPT-OSS's gate scale, offset and clamp)
        width = config.ffn_hidden_size * (2 if gated else 1)
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, width, group=state.tp, bias=config.add_bias_linear,
            init_method=config.init_method, stride=2 if gated else 1,
            params_dtype=config.params_dtype, device=device)
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, group=state.tp,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            init_method=config.output_layer_init_method, params_dtype=config.params_dtype,
            device=device)

    @classmethod
    def build(cls, args: LayerArgs) -> MLP:
        """A layer's dense MLP (a part of :mod:`~domino.transformer.spec`)."""
        return cls(args.config, args.state, args.device, args.kernels)

    @property
    def dense(self) -> RowParallelLinear:
        """The row-parallel exit, under the name every block uses."""
        return self.dense_4h_to_h

    def entry(self, edges: EdgeContext) -> ColumnParallelEntry:
        """Entered by the column-parallel fc1 (a :class:`~domino.transformer.layer.BlockOp`)."""
        return ColumnParallelEntry(self.dense_h_to_4h.group, edges.sequence_parallel)

    def exit(self, edges: EdgeContext) -> RowParallelExit:
        """Left by fc2's partial sums (a :class:`~domino.transformer.layer.BlockOp`)."""
        return RowParallelExit(self.dense_4h_to_h, edges.sequence_parallel)

    def core(self, x: torch.Tensor, mb: MicroBatch, stash: WgradStash | None,
             poll=None) -> torch.Tensor:
        """fc1 and the activation (a :class:`~domino.transformer.layer.BlockOp`)."""
        h, _ = self.dense_h_to_4h(x, reduce_input_grad=False, wgrad_stash=stash)
        if poll is not None:  # a schedule's work between the GEMM and the activation
            poll()
        kernels = self.kernels.serving(mb.inference_params is not None)
        return kernels.activation(h, self.swiglu, self.gelu_approximate, self.geglu, *self.glu)
