"""The seed's :class:`Embedding` (word, position and token-type tables; the word table split
over TP by vocabulary) and its Domino prologue, whose all-reduce a schedule overlaps with the
first block's work."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from domino.config import TransformerConfig
from domino.context_parallel import local_positions
from domino.megatron_compat import resolve
from domino.parallel_state import ParallelState
from domino.precision import compute, compute_dtype_of
from domino.tensor_parallel import CommGroup, VocabParallelEmbedding
from domino.tensor_parallel.layers import init_sharded
from domino.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
)
from domino.transformer.microbatch import MicroBatch


class Embedding(nn.Module):
    """Word (vocab-parallel), learned position and token-type embeddings + dropout -> [s, b, h].

    ``vocab_size`` is the padded size (a multiple of the TP size); ``config.vocab_size`` (when
    set) is the real vocabulary, used to reject out-of-range ids and to keep padded rows zero.
    """

    def __init__(self, hidden_size: int, vocab_size: int, max_sequence_length: int,
                 embedding_dropout_prob: float, config: TransformerConfig, num_tokentypes: int = 0,
                 embedding_weights_in_fp32: bool = False, *,
                 parallel_state: ParallelState | None = None) -> None:
        super().__init__()
        state = resolve(parallel_state)
        self.state, self.config = state, config
        self.hidden_size, self.num_tokentypes = hidden_size, num_tokentypes
        self.real_vocab_size = config.vocab_size or vocab_size
        self.max_sequence_length = max_sequence_length
        self.dropout_p = embedding_dropout_prob
        self.embedding_weights_in_fp32 = embedding_weights_in_fp32
        wdtype = torch.float32 if embedding_weights_in_fp32 else config.params_dtype
        device = state.device
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size, hidden_size, group=state.tp, init_method=config.init_method,
            real_num_embeddings=self.real_vocab_size, params_dtype=wdtype, device=device)
        self.add_position_embedding = config.position_embedding_type == "learned_absolute"
        if self.add_position_embedding:
            self.position_embeddings = _embedding(max_sequence_length, hidden_size, wdtype,
                                                  device)
            _init_replicated(self.position_embeddings.weight, config.init_method)
        self.tokentype_embeddings = None
        if num_tokentypes > 0:
            self.add_tokentype_embeddings(num_tokentypes)

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype of the hidden states it returns (the model's compute dtype)."""
        return compute_dtype_of(self.word_embeddings.weight, self.config.params_dtype)

    def add_tokentype_embeddings(self, num_tokentypes: int) -> None:
        """Add (or replace) token-type embeddings, e.g. when fine-tuning a pretrained model."""
        self.num_tokentypes = num_tokentypes
        self.tokentype_embeddings = _embedding(
            num_tokentypes, self.hidden_size, self.word_embeddings.weight.dtype,
            self.word_embeddings.weight.device)
        _init_replicated(self.tokentype_embeddings.weight, self.config.init_method)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                tokentype_ids: torch.Tensor | None = None,
                use_tokentypes: bool = True) -> torch.Tensor:
        """``use_tokentypes=False`` skips token types (a decoder's input has none)."""
        todo = self.prologue(input_ids, position_ids, tokentype_ids, use_tokentypes)
        whole = MicroBatch(batch_size=input_ids.shape[0])
        reduced = reduce_from_tensor_model_parallel_region(todo.partial(whole), self.state.tp)
        return todo.finish(reduced, whole)

    def prologue(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                 tokentype_ids: torch.Tensor | None = None,
                 use_tokentypes: bool = True) -> EmbeddingPrologue:
        """The embedding of these ids as a Domino prologue (``DominoTransformer(...,
        prologue=...)``): the schedule all-reduces each micro-batch's vocabulary-shard lookups
        while other work runs. Ids are checked and the dropout mask drawn here, for the whole
        batch, so the result equals :meth:`forward`'s whatever the split."""
        _check_ids(input_ids, self.real_vocab_size, "input_ids", "vocab_size")
        if self.add_position_embedding:
            if position_ids is None:
                position_ids = default_position_ids(input_ids, self.state.cp)
            _check_ids(position_ids, self.max_sequence_length, "position_ids",
                       "max_position_embeddings")
        if tokentype_ids is not None:
            if self.tokentype_embeddings is None:
                raise ValueError("tokentype_ids were given but the model has no token-type "
                                 "embeddings: build it with num_tokentypes > 0.")
            _check_ids(tokentype_ids, self.num_tokentypes, "tokentype_ids", "num_tokentypes")
        elif self.tokentype_embeddings is not None and use_tokentypes:
            raise ValueError("this model has token-type embeddings: pass tokentype_ids.")
        b, s = input_ids.shape
        keep = None
        if self.training and self.dropout_p > 0.0:
            # The mask forward's dropout would draw for the whole [s, b, h] output.
            device = self.word_embeddings.weight.device
            keep = torch.empty((s, b, self.hidden_size), dtype=self.activation_dtype,
                               device=device).bernoulli_(
                1.0 - self.dropout_p, generator=self.state.rng.replicated(device))
        return EmbeddingPrologue(self, input_ids, position_ids if self.add_position_embedding
                                 else None, tokentype_ids, keep)


def _scaled(emb: torch.Tensor, config: TransformerConfig) -> torch.Tensor:
    """The embeddings times ``embedding_multiplier``, rounded first to their dtype where the
    config says (Gemma's normaliser)."""
    m = config.embedding_multiplier
    if m == 1.0:
        return emb
    return emb * (torch.tensor(m, dtype=emb.dtype) if config.embedding_multiplier_rounded else m)


class EmbeddingPrologue:
    """One batch's embedding, cut for a Domino schedule (see :meth:`Embedding.prologue`):
    :meth:`partial` is this rank's vocabulary-shard lookup of a micro-batch, :meth:`finish` adds
    the replicated position / token-type embeddings to the all-reduced sum, moves it to
    [s, b_m, h] and applies dropout."""

    def __init__(self, emb: Embedding, ids: torch.Tensor, position_ids: torch.Tensor | None,
                 tokentype_ids: torch.Tensor | None, keep: torch.Tensor | None) -> None:
        self.emb, self.ids, self.position_ids, self.tokentype_ids = emb, ids, position_ids, \
            tokentype_ids
        self.keep = keep
        self.keep_sharded = False  # keep holds only this rank's sequence rows
        self.shape = (ids.shape[1], ids.shape[0])

    def parameters(self) -> list[torch.Tensor]:
        return list(self.emb.parameters())

    @staticmethod
    def _rows(t: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        if t.shape[0] == 1 or (mb.batch_start == 0 and mb.batch_size == t.shape[0]):
            return t  # broadcast over the batch, or the whole batch
        return t[mb.batch_start:mb.batch_start + mb.batch_size]

    def partial(self, mb: MicroBatch, seq_shard: tuple[int, int] | None = None) -> torch.Tensor:
        part = self.emb.word_embeddings.partial(self._rows(self.ids, mb))  # [b_m, s, h]
        # Sequence parallel: the reduce-scatter splits the first dim, so put the sequence there.
        return part if seq_shard is None else part.transpose(0, 1).contiguous()

    def finish(self, reduced: torch.Tensor, mb: MicroBatch,
               seq_shard: tuple[int, int] | None = None) -> torch.Tensor:
        s = self.shape[0]
        cols = slice(0, s)  # the positions this rank holds
        if seq_shard is not None:
            rank, size = seq_shard
            cols = slice(rank * s // size, (rank + 1) * s // size)
            reduced = reduced.transpose(0, 1)  # [b_m, s/size, h], as the tables give
        emb = _scaled(reduced, self.emb.config)
        if self.position_ids is not None:
            table = compute(self.emb.position_embeddings.weight)
            emb = emb + F.embedding(self._rows(self.position_ids, mb)[:, cols], table)
        if self.tokentype_ids is not None:
            table = compute(self.emb.tokentype_embeddings.weight)
            emb = emb + F.embedding(self._rows(self.tokentype_ids, mb)[:, cols], table)
        emb = emb.transpose(0, 1).contiguous().to(self.emb.activation_dtype)  # [s, b_m, h]
        if self.keep is None:
            return emb
        if seq_shard is not None and not self.keep_sharded:
            # Backward keeps the mask (and this prologue): only this rank's rows of it.
            self.keep, self.keep_sharded = self.keep[cols].clone(), True
        rows = slice(None) if self.keep_sharded else cols
        keep = self.keep[rows, mb.batch_start:mb.batch_start + emb.shape[1]]
        return emb * keep * (1.0 / (1.0 - self.emb.dropout_p))


def default_position_ids(ids: torch.Tensor, cp: CommGroup | None = None) -> torch.Tensor:
    """0..s-1 for every sample of ids [b, s]; with a context-parallel group ``cp`` of more
    than one rank (``ids`` this rank's shard), the true positions of the shard's tokens."""
    b, s = ids.shape
    if cp is not None and cp.size > 1:
        return local_positions(s * cp.size, cp.rank, cp.size, ids.device).expand(b, s)
    return torch.arange(s, device=ids.device).unsqueeze(0).expand(b, s)



def _check_ids(ids: torch.Tensor, limit: int, name: str, field: str) -> None:
    if ids.numel() and (bool((ids < 0).any()) or bool((ids >= limit).any())):
        lo, hi = int(ids.min()), int(ids.max())
        raise ValueError(f"{name} range from {lo} to {hi}, outside [0, {limit}) set by {field}; "
                         f"check the data/tokenizer or raise {field}.")


def _embedding(num: int, dim: int, dtype: torch.dtype, device) -> nn.Embedding:
    """``nn.Embedding``; on the meta device (sizing a model) without its own random init, whose
    meta kernel imports ``torch._dynamo`` (2.5 s of a launcher's start-up). Elsewhere it still
    draws, so the default generator's stream - and every weight - is what it always was."""
    if device is not None and torch.device(device).type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim, dtype=dtype, device="meta"))
    return nn.Embedding(num, dim, dtype=dtype, device=device)


def _init_replicated(weight: torch.Tensor, init_method) -> None:
    """Init a replicated weight from the default generator (same on every rank)."""
    with torch.no_grad():
        # A group of one: init_sharded draws and returns the full tensor.
        weight.copy_(init_sharded(tuple(weight.shape), init_method, 0, CommGroup(), weight.dtype,
                                  weight.device))
