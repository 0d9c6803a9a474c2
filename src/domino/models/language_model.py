"""The seed: the DeepSpeed-Domino language-model API that domino keeps compatible (Embedding,
Pooler, TransformerLanguageModel, parallel_lm_logits and get_language_model; docs/glossary.md),
over Domino transformers.

Shapes: token ids and position ids are [b, s] at the API edge; hidden states are [s, b, h].
Every constructor also takes an optional ``parallel_state`` (default: the current one from
``domino.parallel_state``, or single-process when none was initialised); the models also take
``runtime`` (a :class:`~domino.runtime.RuntimeConfig`: how their transformers run; default
``config.runtime()``, the seed's keywords) and ``plan`` (a shortcut for its Domino schedule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from domino.config import TransformerConfig
from domino.enums import AttnMaskType, LayerType
from domino.megatron_compat import resolve
from domino.models.embedding import Embedding, default_position_ids
from domino.parallel_state import ParallelState
from domino.plan import Plan
from domino.precision import compute, set_compute_dtype
from domino.runtime import RuntimeConfig, resolve_runtime
from domino.tensor_parallel import (
    ColumnParallelLinear,
    CommGroup,
    gather_from_tensor_model_parallel_region,
)
from domino.tensor_parallel.layers import init_sharded, linear_reduce_input_grad
from domino.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
)
from domino.tensor_parallel.placement import Placement, place
from domino.transformer import BackwardContext, Block, DominoTransformer, InferenceParams
from domino.transformer.late_work import LateWork
from domino.transformer.rope import RotaryEmbedding
from domino.utils import init_scope


def parallel_lm_logits(input_: torch.Tensor, word_embeddings_weight: torch.Tensor,
                       parallel_output: bool, bias: torch.Tensor | None = None, *,
                       parallel_state: ParallelState | None = None,
                       late: LateWork | None = None,
                       sequence_parallel: bool = False) -> torch.Tensor:
    """Logits [..., vocab/tp] (``parallel_output``) or [..., vocab] from hidden states [..., h]
    and this rank's vocabulary shard of the (tied or output) weight. ``late``: the late work
    of the backward context given to the Domino stack that produced ``input_``, which then
    runs what its all-reduce does not need of the weight-gradient GEMM. ``sequence_parallel``:
    ``input_`` is this rank's sequence shard [s/tp, b, h] (a sequence-parallel stack's output);
    the logits are the whole sequence's."""
    group = resolve(parallel_state).tp
    # The input-gradient all-reduce runs under the vocabulary shard's weight-gradient GEMM.
    logits = linear_reduce_input_grad(input_, word_embeddings_weight, bias, group, late,
                                      sequence_parallel)
    return logits if parallel_output else gather_from_tensor_model_parallel_region(logits, group)


class Pooler(nn.Module):
    """tanh(W h[sequence_index] + b): a sequence-level representation [b, h]."""

    def __init__(self, hidden_size: int, init_method, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size, dtype=dtype, device=device)
        with torch.no_grad():
            self.dense.weight.copy_(init_sharded((hidden_size, hidden_size), init_method, 0,
                                                 CommGroup(), dtype, device))
            self.dense.bias.zero_()

    def forward(self, hidden_states: torch.Tensor, sequence_index: int = 0, *,
                sequence_parallel_group: CommGroup | None = None) -> torch.Tensor:
        """``sequence_parallel_group``: ``hidden_states`` is this rank's sequence shard over
        that TP group; the pooled token may live on another rank, so the sequence is gathered
        (every rank pools the same token: its gradient is each rank's own shard)."""
        if sequence_parallel_group is not None:
            hidden_states = gather_from_sequence_parallel_region(hidden_states,
                                                                 sequence_parallel_group)
        dense = self.dense
        return torch.tanh(F.linear(hidden_states[sequence_index], compute(dense.weight),
                                   compute(dense.bias)))


class TransformerLanguageModel(nn.Module):
    """Embedding -> Domino encoder, optionally -> Domino decoder with cross attention and/or
    -> pooler."""

    def __init__(self, config: TransformerConfig, encoder_attn_mask_type: AttnMaskType,
                 num_tokentypes: int = 0, add_encoder: bool = True, add_decoder: bool = False,
                 decoder_attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 add_pooler: bool = False, pre_process: bool = True, post_process: bool = True,
                 *, parallel_state: ParallelState | None = None,
                 runtime: RuntimeConfig | None = None, plan: Plan | None = None,
                 layers: tuple[int, int] | None = None) -> None:
        """``layers`` = (first, end) of the encoder's layers this pipeline stage holds
        (default: all); the decoder of an encoder-decoder model is not pipelined."""
        super().__init__()
        state = resolve(parallel_state)
        runtime = resolve_runtime(config, runtime, plan)
        config.validate_parallel(state.tp.size)
        if not (add_encoder or add_decoder):
            raise ValueError("a language model needs add_encoder or add_decoder (or both).")
        if config.vocab_size <= 0 and pre_process:
            raise ValueError("config.vocab_size must be set (> 0) for a model with embeddings.")
        self.config, self.state = config, state
        self.pre_process, self.post_process = pre_process, post_process
        self.add_encoder, self.add_decoder = add_encoder, add_decoder
        self.add_pooler, self.num_tokentypes = add_pooler, num_tokentypes
        self.encoder_attn_mask_type = encoder_attn_mask_type
        self.decoder_attn_mask_type = decoder_attn_mask_type
        self.padded_vocab_size = config.padded_vocab_size(state.tp.size)
        self.untie_embeddings_and_output_weights = config.untie_embeddings_and_output_weights
        if pre_process:
            with init_scope("embedding"):
                self.embedding = Embedding(config.hidden_size, self.padded_vocab_size,
                                           config.max_position_embeddings,
                                           config.hidden_dropout, config, num_tokentypes,
                                           parallel_state=state)
        self.rotary_pos_emb = (RotaryEmbedding.of(config, state.device)
                               if config.position_embedding_type == "rope" else None)
        first, end = layers if layers is not None else (0, config.num_layers)
        if not 0 <= first < end <= config.num_layers:
            raise ValueError(f"layers={layers} must be a non-empty range inside the model's "
                             f"{config.num_layers} layers")
        if layers is not None and add_decoder:
            raise ValueError("an encoder-decoder model is not split into pipeline stages")
        self.encoder = (DominoTransformer(config, state, LayerType.encoder, encoder_attn_mask_type,
                                          pre_process, post_process, num_layers=end - first,
                                          runtime=runtime, layer_offset=first)
                        if add_encoder else None)
        self.decoder = (DominoTransformer(config, state, LayerType.decoder, decoder_attn_mask_type,
                                          pre_process, post_process, runtime=runtime)
                        if add_decoder else None)
        if post_process and add_pooler:
            with init_scope("pooler"):
                self.pooler = Pooler(config.hidden_size, config.init_method,
                                     dtype=config.params_dtype, device=state.device)
        if post_process and config.untie_embeddings_and_output_weights:
            with init_scope("output_layer"):
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size, self.padded_vocab_size, group=state.tp, bias=False,
                    init_method=config.init_method, params_dtype=config.params_dtype,
                    device=state.device)
            place(self.output_layer.weight, Placement("tp", 0, rows=config.vocab_size))
        set_compute_dtype(self, runtime.compute_dtype)

    def set_input_tensor(self, input_tensor: torch.Tensor | list | None) -> None:
        """Input of a pipeline stage built with ``pre_process=False``."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0] if input_tensor else None
        target = self.encoder if self.add_encoder else self.decoder
        target.set_input_tensor(input_tensor)

    def sequence_parallel_active(self, inference_params: InferenceParams | None = None) -> bool:
        """Whether a forward's hidden states are sequence shards [s/tp, b, h] (see
        ``DominoTransformer.sequence_parallel_active``): then so are ``enc_hidden_states``, a
        stage's input and the returned hidden states."""
        stack = self.encoder if self.encoder is not None else self.decoder
        return stack.sequence_parallel_active(inference_params)

    def _rotary(self, position_ids: torch.Tensor | None, ids: torch.Tensor | None,
                hidden: torch.Tensor | None, inference_params: InferenceParams | None):
        if self.rotary_pos_emb is None:
            return None
        if position_ids is None:
            if ids is not None:
                position_ids = default_position_ids(ids, self.state.cp)
            else:
                s, b = hidden.shape[0], hidden.shape[1]
                if self.sequence_parallel_active(inference_params):
                    s *= self.state.tp.size  # a sequence-parallel stage gets its shard
                position_ids = torch.arange(s, device=hidden.device).unsqueeze(0).expand(b, s)
            if inference_params is not None:
                position_ids = position_ids + inference_params.sequence_len_offset
        # Sequence shards over CP ranks (not while decoding: one rank holds the whole text).
        cp = self.state.cp if inference_params is None else None
        return self.rotary_pos_emb(position_ids, cp)

    def blocks(self) -> list[Block]:
        """Every scheduled block (encoder's, then decoder's) in forward order: a backward
        makes their gradients final in reverse (see ``BackwardContext.on_final``)."""
        return [b for stack in (self.encoder, self.decoder) if stack is not None
                for b in stack.blocks()]

    def forward(self, enc_input_ids, enc_position_ids, enc_attn_mask, dec_input_ids=None,
                dec_position_ids=None, dec_attn_mask=None, enc_dec_attn_mask=None,
                tokentype_ids=None, inference_params=None, pooling_sequence_index=0,
                enc_hidden_states=None, output_enc_hidden=False, *,
                context: BackwardContext | None = None):
        """Encoder output [s, b, h] (plus pooled [b, h] with a pooler); with a decoder,
        ``(decoder_output, encoder_output[, pooled])``. ``context``: the step's backward
        context, shared by the encoder and the decoder (default: each makes its own)."""
        encoder_output = enc_hidden_states
        enc_position_ids = _cache_positions(enc_position_ids, enc_input_ids, inference_params)
        dec_position_ids = _cache_positions(dec_position_ids, dec_input_ids, inference_params)
        if encoder_output is None and self.add_encoder:
            # The embedding runs inside the encoder's schedule (its all-reduce overlaps).
            enc_in = (self.embedding.prologue(enc_input_ids, enc_position_ids, tokentype_ids)
                      if self.pre_process else None)
            rot = self._rotary(enc_position_ids, enc_input_ids if self.pre_process else None,
                               self.encoder.input_tensor, inference_params)
            encoder_output = self.encoder(None, enc_attn_mask, inference_params=inference_params,
                                          rotary_pos_emb=rot, prologue=enc_in, context=context)
        pooled = None
        if self.post_process and self.add_pooler and encoder_output is not None:
            sp = self.sequence_parallel_active(inference_params)
            pooled = self.pooler(encoder_output, pooling_sequence_index,
                                 sequence_parallel_group=self.state.tp if sp else None)
        if not self.add_decoder or output_enc_hidden:
            return (encoder_output, pooled) if pooled is not None else encoder_output
        dec_in = (self.embedding.prologue(dec_input_ids, dec_position_ids, use_tokentypes=False)
                  if self.pre_process else None)
        rot = self._rotary(dec_position_ids, dec_input_ids if self.pre_process else None,
                           self.decoder.input_tensor, inference_params)
        decoder_output = self.decoder(None, dec_attn_mask, encoder_output=encoder_output,
                                      enc_dec_attn_mask=enc_dec_attn_mask,
                                      inference_params=inference_params, rotary_pos_emb=rot,
                                      prologue=dec_in, context=context)
        if pooled is not None:
            return decoder_output, encoder_output, pooled
        return decoder_output, encoder_output

    _PARTS = ("embedding", "encoder", "decoder", "pooler", "output_layer")

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """Megatron's layout: one state dict per part ('embedding', 'encoder', ...)."""
        out = {}
        for name in self._PARTS:
            part = getattr(self, name, None)
            if part is not None:
                out[name] = part.state_dict(prefix=prefix, keep_vars=keep_vars)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load either the per-part layout of :meth:`state_dict_for_save_checkpoint` or a flat
        ``state_dict()``."""
        if state_dict and all(k in self._PARTS and isinstance(v, dict)
                              for k, v in state_dict.items()):
            flat = {f"{part}.{k}": v for part, sd in state_dict.items() for k, v in sd.items()}
            return super().load_state_dict(flat, strict=strict, assign=assign)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def get_language_model(config: TransformerConfig, num_tokentypes: int, add_pooler: bool,
                       encoder_attn_mask_type: AttnMaskType, add_encoder: bool = True,
                       add_decoder: bool = False,
                       decoder_attn_mask_type: AttnMaskType = AttnMaskType.causal,
                       pre_process: bool = True, post_process: bool = True, *,
                       parallel_state: ParallelState | None = None,
                       runtime: RuntimeConfig | None = None, plan: Plan | None = None,
                       layers: tuple[int, int] | None = None):
    """Build a :class:`TransformerLanguageModel`; returns ``(model, "language_model")``."""
    model = TransformerLanguageModel(
        config, encoder_attn_mask_type, num_tokentypes=num_tokentypes, add_encoder=add_encoder,
        add_decoder=add_decoder, decoder_attn_mask_type=decoder_attn_mask_type,
        add_pooler=add_pooler, pre_process=pre_process, post_process=post_process,
        parallel_state=parallel_state, runtime=runtime, plan=plan, layers=layers)
    return model, "language_model"


def _cache_positions(position_ids: torch.Tensor | None, ids: torch.Tensor | None,
                     inference_params: InferenceParams | None) -> torch.Tensor | None:
    """Default positions while decoding with a KV cache continue from the cache offset."""
    if position_ids is not None or ids is None or inference_params is None:
        return position_ids
    return default_position_ids(ids) + inference_params.sequence_len_offset
