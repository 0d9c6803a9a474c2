"""Text generation with the KV cache, run by every rank of one TP group in lockstep (the final
sample of `domino train`, and `domino generate`)."""

from __future__ import annotations

import torch

from domino.config import TransformerConfig
from domino.parallel_state import ParallelState
from domino.transformer import InferenceParams
from domino.transformer.rope_longrope import switch_length


@torch.no_grad()
def generate(model: torch.nn.Module, state: ParallelState, prompt_ids: list[int],
             max_new_tokens: int, vocab_size: int, max_context: int, top_k: int = 1,
             temperature: float = 1.0, seed: int = 0, banned: tuple[int, ...] = (),
             top_p: float = 1.0, stop: tuple[int, ...] = (),
             use_cache: bool = True, slide: bool = True) -> list[int]:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens; returns only the new ones.

    Greedy when ``top_k == 1``, else sampling at ``temperature`` from the ``top_k`` most likely
    tokens (0: all) within nucleus ``top_p``, with a generator seeded by ``seed``. Tokens are
    chosen on TP rank 0 and broadcast, so every TP rank feeds the same ids. When the context
    fills the ``max_context`` positions, with ``slide`` the cache is rebuilt from the last half
    of the text (a sliding window: samples can be longer than the training sequence, but no
    longer equal ``transformers``' output); without it that is a ValueError (`domino generate`
    refuses such a request before it starts: :func:`position_problem`). ``banned`` ids (e.g.
    EOD) are never chosen; generation ends after a ``stop`` id (kept in the output). Without
    ``use_cache`` every step recomputes the whole window (a check of the cache). With LongRoPE
    the cache is recomputed once, when the text first grows past the model's original context
    (its keys were rotated with the short factors), as transformers' Phi-3 does.
    """
    was_training = model.training
    model.eval()
    device = state.device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    tokens = list(prompt_ids)
    if not tokens:
        raise ValueError("generate() needs at least one prompt token")
    new: list[int] = []
    params: InferenceParams | None = None
    window_start = fed = 0  # tokens[window_start:] sit at positions 0.. ; the cache holds `fed`
    switch = switch_length(model)
    try:
        while len(new) < max_new_tokens:
            if params is None or len(tokens) - window_start > max_context:
                if len(tokens) - window_start > max_context:
                    if not slide:
                        raise ValueError(position_problem(len(prompt_ids), max_new_tokens,
                                                          max_context))
                    window_start = len(tokens) - max(max_context // 2, 1)
                params = InferenceParams(max_batch_size=1, max_sequence_length=max_context)
                fed = 0
            if not use_cache:  # the whole window, every step, no cache
                fed = 0
            elif switch is not None and 0 < fed <= switch < len(tokens) - window_start:
                params = InferenceParams(max_batch_size=1, max_sequence_length=max_context)
                fed = 0  # past LongRoPE's original context: every key with the long factors
            chunk = tokens[window_start + fed:]
            ids = torch.tensor([chunk], dtype=torch.long, device=device)
            pos = torch.arange(fed, fed + len(chunk), device=device).unsqueeze(0)
            logits = model(ids, pos, None, inference_params=params if use_cache else None)
            params.sequence_len_offset += len(chunk)
            fed += len(chunk)
            last = state.tp.all_gather_last_dim(logits[:, -1].float())[0, :vocab_size]
            if banned:
                last[list(banned)] = float("-inf")
            nxt = _choose(last, top_k, top_p, temperature, gen)
            state.tp.broadcast(nxt)
            token = int(nxt.item())
            tokens.append(token)
            new.append(token)
            if token in stop:
                break
    finally:
        model.train(was_training)
    return new


def position_limit(config: TransformerConfig) -> int:
    """How many positions (prompt and generated tokens) a model's text may take: its learned
    position table, or with RoPE its max_position_embeddings or training sequence if longer."""
    if config.position_embedding_type == "learned_absolute":
        return config.max_position_embeddings
    return max(config.max_position_embeddings, config.seq_length)


def position_problem(prompt: int, max_new_tokens: int, limit: int,
                     what: str = "max_position_embeddings") -> str | None:
    """Why a ``prompt``-token prompt continued by up to ``max_new_tokens`` does not fit in
    ``limit`` positions (the model's ``what``), with the fix (one line); None when it fits."""
    if prompt + max_new_tokens <= limit:
        return None
    shorter = (f"lower --max-new-tokens to {limit - prompt}" if prompt < limit
               else f"shorten the prompt to under {limit} tokens")
    return (f"the prompt's {prompt} tokens + --max-new-tokens {max_new_tokens} = "
            f"{prompt + max_new_tokens} positions, past the model's {limit} (its {what}); "
            "past them the output no longer matches transformers: "
            f"{shorter}, or pass --slide-context to go on from the last half of the text")


def _choose(logits: torch.Tensor, top_k: int, top_p: float, temperature: float,
            gen: torch.Generator) -> torch.Tensor:
    if top_k == 1:
        return logits.argmax().reshape(1)
    k = logits.numel() if top_k <= 0 else min(top_k, logits.numel())
    values, index = torch.topk(logits / temperature, k)  # sorted, most likely first
    probs = torch.softmax(values, dim=-1)
    if top_p < 1.0:
        # The smallest head of the ranking whose mass reaches top_p (at least one token).
        keep = (probs.cumsum(-1) - probs) < top_p
        probs = probs * keep
        probs = probs / probs.sum()
    return index[torch.multinomial(probs, 1, generator=gen)].reshape(1)
