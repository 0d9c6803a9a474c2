"""One pipeline rank's share of a GPT: its model chunks (one, or several for interleaved 1F1B),
each built through the seed API (``get_language_model``: the DeepSpeed-Domino language-model
API that domino keeps compatible, see docs/glossary.md) with ``pre_process`` on the first
virtual stage and
``post_process`` on the last, holding exactly the full model's weights for its layers."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from domino.config import TransformerConfig
from domino.models.gpt import GPTModel
from domino.parallel_state import ParallelState
from domino.pipeline.partition import Layout
from domino.plan import Plan
from domino.runtime import RuntimeConfig, resolve_runtime
from domino.transformer import Block


class PipelineModel(nn.Module):
    """This rank's chunks (``chunks[c]`` is virtual stage ``c x stages + rank``).

    Training steps go through :class:`~domino.pipeline.runtime.PipelineRunner`, which runs the
    chunks under a pipeline schedule. ``forward`` is the forward-only path (evaluation and
    generation): the micro-batch visits the virtual stages in turn, and the last one's output
    (per-token loss with ``labels``, else logits) is returned on every rank of the pipeline.
    """

    def __init__(self, config: TransformerConfig, state: ParallelState, layout: Layout, *,
                 runtime: RuntimeConfig | None = None, plan: Plan | None = None,
                 label_smoothing: float = 0.0) -> None:
        """``runtime``: how every chunk runs (default ``config.runtime()``); ``plan``: a
        shortcut for its Domino schedule."""
        super().__init__()
        runtime = resolve_runtime(config, runtime, plan)
        if layout.stages != state.pp.size:
            raise ValueError(f"the layout has {layout.stages} stages but the pipeline group "
                             f"{state.pp.size} ranks")
        self.config, self.state, self.layout = config, state, layout
        rank = state.pp.rank
        self.chunks = nn.ModuleList(
            GPTModel(config, pre_process=layout.is_first(rank, c),
                     post_process=layout.is_last(rank, c), parallel_state=state, runtime=runtime,
                     layers=layout.layers(rank, c), label_smoothing=label_smoothing)
            for c in range(layout.chunks))

    def checkpoint_tensors(self) -> Iterator[tuple[str, nn.Parameter]]:
        for chunk in self.chunks:
            yield from chunk.checkpoint_tensors()

    def blocks(self) -> list[Block]:
        """This rank's scheduled blocks, chunk by chunk, each in forward order."""
        return [b for chunk in self.chunks for b in chunk.blocks()]

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of what crosses a stage boundary (the chunks' compute dtype)."""
        return self.chunks[0].activation_dtype

    def sequence_parallel_active(self, inference_params=None) -> bool:
        """Do the chunks run sequence parallel (what crosses a stage boundary is then this
        rank's sequence shard [s/tp, b, h])?"""
        return self.chunks[0].language_model.sequence_parallel_active(inference_params)

    def tied_word_tables(self) -> list[nn.Parameter]:
        """The word tables this rank shares with the other end of the pipeline (tied weights
        on a multi-stage pipeline): their gradients are summed over ``state.embedding``."""
        if self.config.untie_embeddings_and_output_weights or self.layout.virtual_stages == 1:
            return []
        out = []
        for chunk in self.chunks:
            if chunk.pre_process:
                out.append(chunk.language_model.embedding.word_embeddings.weight)
            elif chunk.post_process:
                out.append(chunk.word_embeddings)
        return out

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                attention_mask: torch.Tensor | None, labels: torch.Tensor | None = None,
                inference_params=None) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise RuntimeError("PipelineModel.forward is forward-only (evaluation, generation); "
                               "train through domino.pipeline.runtime.PipelineRunner")
        pp, layout = self.state.pp, self.layout
        s, b = input_ids.shape[1], input_ids.shape[0]
        h = self.config.hidden_size
        sp = self.sequence_parallel_active(inference_params)
        s_stage = s // self.state.tp.size if sp else s  # what crosses a stage boundary
        x = None
        out = None
        for k in range(layout.virtual_stages):
            rank, chunk = k % layout.stages, k // layout.stages
            if rank != pp.rank:
                continue
            model = self.chunks[chunk]
            if k > 0:
                x = torch.empty(s_stage, b, h, dtype=self.activation_dtype,
                                device=self.state.device)
                pp.irecv(x, (k - 1) % layout.stages, tag=k).wait()
                model.set_input_tensor(x)
            out = model(input_ids, position_ids, attention_mask,
                        labels=labels if layout.is_last(rank, chunk) else None,
                        inference_params=inference_params)
            model.set_input_tensor(None)
            if k < layout.virtual_stages - 1:
                pp.isend(out.contiguous(), (k + 1) % layout.stages, tag=k + 1).wait()
        # The last virtual stage's output, on every pipeline rank.
        last = (layout.virtual_stages - 1) % layout.stages
        if labels is not None:
            shape = (b, s)
        else:
            shape = (b, s, self.config.padded_vocab_size(self.state.tp.size) // self.state.tp.size)
        result = out.float().contiguous() if pp.rank == last else torch.empty(
            shape, dtype=torch.float32, device=self.state.device)
        pp.broadcast(result, last)
        return result
