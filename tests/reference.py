"""An independent, plain-PyTorch GPT written from the math (no domino modules).

It runs on the full weights of a TP=1 domino ``GPTModel``, looked up by domino's parameter
names, in the [batch, seq, hidden] layout with explicit per-head attention, so that a math bug
in domino (one that TP=1 and TP=N would share) shows up as a mismatch.

Weight layouts it assumes (the documented contract):

* fused QKV rows, per query group g: ``[q heads of group g | k_g | v_g]``, each ``kv_channels``
  rows; query head i belongs to group ``i // (heads / groups)``;
* SwiGLU's fc1 rows are ``[gate; up]``; GELU is the exact (erf) one;
* RoPE rotates the first ``int(kv_channels * rotary_percent)`` channels of each head in two
  halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), angle = pos / factor * base^(-2i/rot),
  on every layer but ``nope_layers`` (0-based);
* pre-norm layers, or with ``norm_after_sublayer`` each branch's output normalised before its
  residual add (``post_attention_layernorm`` / ``post_feedforward_layernorm``: OLMo 2);
  ``apply_residual_connection_post_layernorm`` takes the residual from the norm output; MoE
  layers route dropless (see ``_moe``); the loss is
  ``(1 - eps) * nll + eps * mean_j(-log p_j)`` over the real vocabulary;
* Granite's scalars: the word embeddings times ``embedding_multiplier``, each branch's output
  times ``residual_multiplier`` before its residual add, the scores times ``softmax_scale``
  (when set) instead of 1/sqrt(d), the logits divided by ``logits_scaling``;
* Gemma's: norms scaling by (1 + weight) with ``layernorm_zero_centered_gamma``; with
  ``sandwich_norms`` each branch normalised before (``input_layernorm`` /
  ``pre_feedforward_layernorm``) and after (``post_attention_layernorm`` /
  ``post_feedforward_layernorm``); GeGLU = gelu_tanh(gate) * up; scores capped at
  cap * tanh(scores / cap) (``attention_softcap``) and logits likewise (``output_softcap``);
  the sliding window on every layer but ``full_attention_layers``, whose RoPE base is
  ``local_rotary_base`` (without interpolation) where set;
* GPT-OSS's: a learned sink logit per head in each softmax's denominator (``sinks``); gated
  activations with the gate and linear half clamped (``activation_func_clamp_value``), the
  SwiGLU gate g * sigmoid(alpha g), the linear half offset; a bias on the router's logits and
  on each expert's fc1 and fc2; YaRN's RoPE frequencies and cos/sin factor (``_yarn``);
* Phi-3's LongRoPE: per-pair factors, long ones for a batch reaching past the original context,
  and cos/sin factor (``_longrope``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from domino import TransformerConfig

PREFIX = "language_model."


def reference_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached leaf copies (requiring grad) of a TP=1 model's parameters, by domino name."""
    return {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}


def _linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    out = x @ w[name + ".weight"].t()
    bias = w.get(name + ".bias")
    return out if bias is None else out + bias


def _norm(x: torch.Tensor, w: dict, name: str, cfg: TransformerConfig) -> torch.Tensor:
    gamma = w[name + ".weight"]
    if cfg.layernorm_zero_centered_gamma:
        gamma = 1 + gamma
    if cfg.normalization == "RMSNorm":
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * gamma
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + cfg.layernorm_epsilon) * gamma + w[name + ".bias"]


def _rope(x: torch.Tensor, pos: torch.Tensor, cfg: TransformerConfig,
          local: bool = False) -> torch.Tensor:
    """x [b, s, n, d] rotated by absolute positions pos [b, s]; ``local``: a sliding layer's
    own base (``local_rotary_base``), positions not interpolated."""
    rot = int(cfg.kv_channels * cfg.rotary_percent)
    half = rot // 2
    p = pos.double()
    base = cfg.rotary_base
    if local and cfg.local_rotary_base is not None:
        base = cfg.local_rotary_base
    elif cfg.rotary_seq_len_interpolation_factor is not None:
        p = p / cfg.rotary_seq_len_interpolation_factor
    i = torch.arange(half, dtype=torch.float64)
    inv, scale = torch.pow(float(base), -2.0 * i / rot), 1.0
    if cfg.rope_scaling_type == "yarn" and not (local and cfg.local_rotary_base is not None):
        inv, scale = _yarn(inv, cfg, rot)
    if cfg.rope_scaling_type == "longrope":
        inv, scale = _longrope(inv, pos, cfg)
    ang = p[..., None] * inv  # [b, s, half]
    cos = (ang.cos() * scale)[:, :, None].to(x.dtype)
    sin = (ang.sin() * scale)[:, :, None].to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:rot], x[..., rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def _longrope(inv: torch.Tensor, pos: torch.Tensor,
              cfg: TransformerConfig) -> tuple[torch.Tensor, float]:
    """LongRoPE: pair j's frequency divided by long_factor[j] when a position of the batch
    reaches the original context (its largest + 1 exceeds it), else by short_factor[j]; cos
    and sin times the attention factor (default sqrt(1 + ln(factor) / ln(original)), 1 for a
    factor <= 1)."""
    old, factor = cfg.rope_original_max_position_embeddings, cfg.rope_scaling_factor
    longest = int(pos.max()) + 1
    chosen = cfg.rope_long_factor if longest > old else cfg.rope_short_factor
    scale = cfg.rope_attention_factor
    if scale is None:
        scale = math.sqrt(1 + math.log(factor) / math.log(old)) if factor > 1 else 1.0
    return inv / torch.tensor(chosen, dtype=torch.float64), scale


def _yarn(inv: torch.Tensor, cfg: TransformerConfig, rot: int) -> tuple[torch.Tensor, float]:
    """YaRN: a pair whose wave turns more than beta_fast times in the original context keeps
    its frequency, one turning fewer than beta_slow times has it divided by the factor, a
    linear ramp over the pair index between (its ends rounded outwards with ``truncate``);
    cos and sin times the attention factor (default 0.1 ln(factor) + 1)."""
    old, factor = cfg.rope_original_max_position_embeddings, cfg.rope_scaling_factor

    def pair(turns: float) -> float:  # base^(2j/rot) = old / (2 pi turns), solved for j
        return rot * math.log(old / (2 * math.pi * turns)) / (2 * math.log(cfg.rotary_base))

    lo, hi = pair(cfg.rope_yarn_beta_fast), pair(cfg.rope_yarn_beta_slow)
    if cfg.rope_yarn_truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rot - 1)
    hi = hi + 0.001 if hi == lo else hi
    slow = ((torch.arange(rot // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    inv = inv * (1 - slow) + inv / factor * slow
    scale = cfg.rope_attention_factor
    if scale is None:
        scale = 0.1 * math.log(factor) + 1 if factor > 1 else 1.0
    return inv, scale


def _attention(x: torch.Tensor, w: dict, name: str, cfg: TransformerConfig,
               pos: torch.Tensor, mask: torch.Tensor | None, rope: bool = True,
               window: int | None = None) -> torch.Tensor:
    """``rope``: False on a NoPE layer (one of ``cfg.nope_layers``); ``window``: the layer's
    sliding window (None: full attention)."""
    b, s, _ = x.shape
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    per = heads // groups
    qkv = _linear(x, w, name + ".query_key_value").view(b, s, groups, per + 2, d)
    q = qkv[:, :, :, :per].reshape(b, s, heads, d)
    k, v = qkv[:, :, :, per], qkv[:, :, :, per + 1]  # [b, s, groups, d]
    if cfg.qk_layernorm_full_width:  # all heads' queries together, all keys together (OLMoE)
        q = _norm(q.reshape(b, s, heads * d), w, name + ".q_layernorm", cfg).view(b, s, heads, d)
        k = _norm(k.reshape(b, s, groups * d), w, name + ".k_layernorm", cfg).view(b, s, groups, d)
    elif cfg.qk_layernorm:  # each head's queries and keys, over the head size
        q, k = _norm(q, w, name + ".q_layernorm", cfg), _norm(k, w, name + ".k_layernorm", cfg)
    if cfg.position_embedding_type == "rope" and rope:
        local = window is not None
        q, k = _rope(q, pos, cfg, local), _rope(k, pos, cfg, local)
    ctx = []
    for h in range(heads):  # head by head, straight from the definition
        g = h // per
        scale = 1 / math.sqrt(d) if cfg.softmax_scale is None else cfg.softmax_scale
        scores = q[:, :, h] @ k[:, :, g].transpose(1, 2) * scale  # [b, s, s]
        if cfg.attention_softcap is not None:
            scores = cfg.attention_softcap * torch.tanh(scores / cfg.attention_softcap)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        if window is not None:  # key j is seen by query i iff i - window < j <= i
            causal = causal | torch.ones(s, s, dtype=torch.bool).tril(-window)
        blocked = causal if mask is None else (causal | mask[:, 0])
        scores = scores.masked_fill(blocked, float("-inf"))
        sinks = w.get(name + ".sinks")
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # exp(score) / (sum exp(scores) + exp(the head's sink))
            denom = torch.logsumexp(torch.cat([scores, sinks[h].expand(b, s, 1)], -1), -1)
            probs = torch.exp(scores - denom[..., None])
        ctx.append(probs @ v[:, :, g])  # [b, s, d]
    return _linear(torch.cat(ctx, dim=-1), w, name + ".dense")


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _mlp(x: torch.Tensor, w: dict, name: str, cfg: TransformerConfig) -> torch.Tensor:
    h = _linear(x, w, name + ".dense_h_to_4h")
    gate, up = h[..., :cfg.ffn_hidden_size], h[..., cfg.ffn_hidden_size:]
    if cfg.activation in ("swiglu", "geglu_tanh"):
        h = _glu(gate, up, cfg)
    elif cfg.activation == "gelu_tanh":
        h = _gelu_tanh(h)
    else:
        h = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
    return _linear(h, w, name + ".dense_4h_to_h")


def _glu(gate: torch.Tensor, up: torch.Tensor, cfg: TransformerConfig) -> torch.Tensor:
    """A gated activation: SwiGLU's gate g * sigmoid(alpha g) or GeGLU's; GPT-OSS's clamp (the
    gate from above, the linear half both ways) first, and the linear half's offset."""
    clamp = cfg.activation_func_clamp_value
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    if cfg.activation == "geglu_tanh":
        act = _gelu_tanh(gate)
    else:
        act = gate / (1 + torch.exp(-cfg.swiglu_alpha * gate))
    return act * (up + cfg.glu_linear_offset)


def _act(h: torch.Tensor, cfg: TransformerConfig) -> torch.Tensor:
    if cfg.activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return _glu(gate, up, cfg)
    return 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))


def _moe(x: torch.Tensor, w: dict, name: str, cfg: TransformerConfig) -> torch.Tensor:
    """Dropless top-k routing written densely: every expert on every token, each token's output
    the sum of its chosen experts' outputs times their weights (softmax scores, re-normalised
    unless pre-softmax; sigmoid scores re-normalised for k > 1; an expert bias only chooses),
    plus the shared expert (times its sigmoid gate)."""
    logits = x.float() @ w[name + ".router.weight"].float().t()  # [b, s, E]
    if name + ".router.bias" in w:  # GPT-OSS's: shifts the choice and the weights
        logits = logits + w[name + ".router.bias"].float()
    sigmoid = cfg.moe_router_score_function == "sigmoid"
    scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1)
    bias = w.get(name + ".router.expert_bias")
    chosen = (scores if bias is None else scores + bias).topk(cfg.moe_router_topk, -1).indices
    picked = scores.gather(-1, chosen)
    if (cfg.moe_router_topk > 1) if sigmoid else not cfg.moe_router_pre_softmax:
        picked = picked / picked.sum(-1, keepdim=True)
    picked = picked * (cfg.moe_router_topk_scaling_factor or 1.0)
    weights = torch.zeros_like(scores).scatter(-1, chosen, picked)  # [b, s, E]
    out = 0.0
    b1, b2 = w.get(name + ".experts.fc1_bias"), w.get(name + ".experts.fc2_bias")
    for e in range(cfg.num_experts):
        h = x @ w[name + ".experts.fc1"][e] + (0.0 if b1 is None else b1[e])
        y = _act(h, cfg) @ w[name + ".experts.fc2"][e] + (0.0 if b2 is None else b2[e])
        out = out + y * weights[..., e:e + 1].to(x.dtype)
    if name + ".shared.fc1" in w:
        shared = _act(x @ w[name + ".shared.fc1"].t(), cfg) @ w[name + ".shared.fc2"].t()
        if name + ".shared.gate" in w:
            shared = shared * torch.sigmoid(x @ w[name + ".shared.gate"].t())
        out = out + shared
    return out


def _branch_norms(cfg: TransformerConfig) -> list[tuple[str | None, str | None, str]]:
    """Each branch's (norm before, norm after, branch): pre-norm, OLMo 2's norms after only,
    or Gemma 2's on both sides."""
    if cfg.norm_after_sublayer:
        return [(None, "post_attention_layernorm", "attn"),
                (None, "post_feedforward_layernorm", "mlp")]
    if cfg.sandwich_norms:
        return [("input_layernorm", "post_attention_layernorm", "attn"),
                ("pre_feedforward_layernorm", "post_feedforward_layernorm", "mlp")]
    return [("input_layernorm", None, "attn"), ("post_attention_layernorm", None, "mlp")]


def reference_hidden(w: dict, cfg: TransformerConfig, ids: torch.Tensor,
                     position_ids: torch.Tensor | None = None,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Final hidden states [b, s, h]; ``mask`` [b, 1, s, s] bool (True = masked) adds to causal."""
    b, s = ids.shape
    pos = position_ids if position_ids is not None else torch.arange(s).expand(b, s)
    x = w[PREFIX + "embedding.word_embeddings.weight"][ids] * cfg.embedding_multiplier
    if cfg.position_embedding_type == "learned_absolute":
        x = x + w[PREFIX + "embedding.position_embeddings.weight"][pos]
    for i in range(cfg.num_layers):
        layer = f"{PREFIX}encoder.layers.{i}"
        window = None if i in cfg.full_attention_layers else cfg.window_size
        for before, after, branch in _branch_norms(cfg):
            ln = x if before is None else _norm(x, w, f"{layer}.{before}", cfg)
            res = ln if cfg.apply_residual_connection_post_layernorm else x
            if branch == "attn":
                out = _attention(ln, w, f"{layer}.self_attention", cfg, pos, mask,
                                 rope=i not in cfg.nope_layers, window=window)
            elif cfg.num_experts and cfg.is_moe_layer(i):
                out = _moe(ln, w, f"{layer}.mlp.moe", cfg)
            else:
                out = _mlp(ln, w, f"{layer}.mlp", cfg)
            if after is not None:
                out = _norm(out, w, f"{layer}.{after}", cfg)
            x = res + out * cfg.residual_multiplier
    if cfg.final_layernorm:
        x = _norm(x, w, PREFIX + "encoder.final_layernorm", cfg)
    return x


def reference_logits(w: dict, cfg: TransformerConfig, ids: torch.Tensor,
                     position_ids: torch.Tensor | None = None,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [b, s, vocab] over the real vocabulary."""
    out_w = (w[PREFIX + "output_layer.weight"] if cfg.untie_embeddings_and_output_weights
             else w[PREFIX + "embedding.word_embeddings.weight"])
    logits = reference_hidden(w, cfg, ids, position_ids, mask) @ out_w[:cfg.vocab_size].t()
    logits = logits / cfg.logits_scaling
    if cfg.output_softcap is not None:
        logits = cfg.output_softcap * torch.tanh(logits / cfg.output_softcap)
    return logits


def reference_loss(w: dict, cfg: TransformerConfig, ids: torch.Tensor, labels: torch.Tensor,
                   label_smoothing: float = 0.0, position_ids: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token loss [b, s]."""
    logits = reference_logits(w, cfg, ids, position_ids, mask)
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    nll = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return (1.0 - label_smoothing) * nll - label_smoothing * logp.mean(dim=-1)
