"""GPT: a causal decoder-only language model on the Domino transformer."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from domino.config import TransformerConfig
from domino.enums import AttnMaskType
from domino.megatron_compat import resolve
from domino.models.language_model import get_language_model, parallel_lm_logits
from domino.parallel_state import ParallelState
from domino.plan import Plan
from domino.precision import set_compute_dtype
from domino.runtime import RuntimeConfig
from domino.tensor_parallel import (
    gather_from_tensor_model_parallel_region,
    mask_padded_logits,
    vocab_parallel_cross_entropy,
)
from domino.tensor_parallel.layers import init_sharded
from domino.tensor_parallel.placement import Placement, place
from domino.transformer import BackwardContext, Block
from domino.utils import init_scope

TIED_NAME = "language_model.embedding.word_embeddings.weight"
_LAYERS = "language_model.encoder.layers."


class GPTModel(nn.Module):
    """Causal LM. ``forward`` returns the per-token loss [b, s] when ``labels`` are given, else
    logits [b, s, padded_vocab/tp] (``parallel_output``) or [b, s, vocab]."""

    def __init__(self, config: TransformerConfig, num_tokentypes: int = 0,
                 parallel_output: bool = True, pre_process: bool = True,
                 post_process: bool = True, *, parallel_state: ParallelState | None = None,
                 label_smoothing: float = 0.0, runtime: RuntimeConfig | None = None,
                 plan: Plan | None = None, layers: tuple[int, int] | None = None) -> None:
        """``pre_process`` / ``post_process`` / ``layers`` cut the model into a pipeline stage:
        the embedding, the layers ``layers[0]`` .. ``layers[1] - 1``, the final norm and head.
        ``runtime``: how it runs (default ``config.runtime()``); ``plan``: a shortcut for its
        Domino schedule."""
        super().__init__()
        state = resolve(parallel_state)
        self.config, self.state = config, state
        self.parallel_output = parallel_output
        self.pre_process, self.post_process = pre_process, post_process
        self.label_smoothing = label_smoothing
        self.language_model, _ = get_language_model(
            config, num_tokentypes, add_pooler=False, encoder_attn_mask_type=AttnMaskType.causal,
            pre_process=pre_process, post_process=post_process, parallel_state=state,
            runtime=runtime, plan=plan, layers=layers)
        if post_process and not pre_process and not config.untie_embeddings_and_output_weights:
            # Last pipeline stage with tied weights: its own copy, drawn as the embedding's word
            # table is (the same seeded stream, first draw); a pipeline trainer keeps the two
            # equal by summing their gradients (Megatron's word-embedding group).
            padded = config.padded_vocab_size(state.tp.size)
            with init_scope("embedding"):
                self.word_embeddings = nn.Parameter(init_sharded(
                    (padded, config.hidden_size), config.init_method, 0, state.tp,
                    config.params_dtype, state.device, valid_rows=config.vocab_size))
            place(self.word_embeddings, Placement("tp", 0, rows=config.vocab_size,
                                                  tied_copy=True))
        set_compute_dtype(self, self.language_model.encoder.runtime.compute_dtype)

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of its hidden states: the runtime's compute dtype, else the parameters'."""
        return self.language_model.encoder.runtime.compute_dtype or self.config.params_dtype

    def checkpoint_tensors(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters under the full model's names (a stage's layers by their global numbers;
        the last stage's tied copy as the embedding's word table, which it equals)."""
        offset = self.language_model.encoder.layer_offset
        for name, p in self.named_parameters():
            if name == "word_embeddings":
                yield TIED_NAME, p
                continue
            if offset and name.startswith(_LAYERS):
                index, rest = name[len(_LAYERS):].split(".", 1)
                name = f"{_LAYERS}{int(index) + offset}.{rest}"
            yield name, p

    def blocks(self) -> list[Block]:
        """The scheduled blocks in forward order (see :meth:`TransformerLanguageModel.blocks`):
        how a DP reducer orders its buckets and a distributed optimizer finds hook points."""
        return self.language_model.blocks()

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def output_weight(self) -> torch.Tensor:
        """This rank's vocabulary shard of the output projection (tied or not)."""
        lm = self.language_model
        if self.config.untie_embeddings_and_output_weights:
            return lm.output_layer.weight
        if self.pre_process:
            return lm.embedding.word_embeddings.weight
        return self.word_embeddings

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                attention_mask: torch.Tensor | None, labels: torch.Tensor | None = None,
                tokentype_ids: torch.Tensor | None = None, inference_params=None, *,
                context: BackwardContext | None = None) -> torch.Tensor:
        """``context``: this step's :class:`~domino.transformer.BackwardContext` (what a
        training step or pipeline runtime hands the backward: a W-pass sink, a DP reducer's
        callback); default: a fresh one."""
        context = context if context is not None else BackwardContext()
        hidden = self.language_model(input_ids, position_ids, attention_mask,
                                     tokentype_ids=tokentype_ids,
                                     inference_params=inference_params,
                                     context=context)  # [s, b, h]
        if not self.post_process:
            return hidden
        tp = self.state.tp
        # The stack's last all-reduces hide what the head's own all-reduce does not need of its
        # weight-gradient GEMM; the stack's backward also adds it to .grad together with the
        # embedding's (one add per backward pass for a tied table, see LateWork).
        logits = parallel_lm_logits(
            hidden, self.output_weight(), True, parallel_state=self.state, late=context.late,
            sequence_parallel=self.language_model.sequence_parallel_active(inference_params)
        )  # [s, b, v/tp]
        if self.config.logits_scaling != 1.0:  # (Granite's)
            logits = logits / self.config.logits_scaling
        if (cap := self.config.output_softcap) is not None:  # (Gemma 2's)
            logits = torch.tanh(logits / cap) * cap
        logits = mask_padded_logits(logits, self.config.vocab_size, tp)
        if labels is None:
            logits = logits.transpose(0, 1).contiguous()  # [b, s, v/tp]
            if self.parallel_output:
                return logits
            full = gather_from_tensor_model_parallel_region(logits, tp)
            return full[..., :self.config.vocab_size]
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels have shape {tuple(labels.shape)} but input_ids have "
                             f"{tuple(input_ids.shape)}; they must match [b, s].")
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), self.label_smoothing,
                                            group=tp, vocab_size=self.config.vocab_size)
        return loss.transpose(0, 1).contiguous()  # [b, s]
