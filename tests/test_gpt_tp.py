"""GPT at TP = 1, 2, 4 vs the unsharded single-process model, and TP=1 vs an independent reference.

Each TP size is one spawn running every variant on the same rank processes: per-token loss,
every parameter gradient (this rank's shard vs its share of the reference gradient), logits in
both output modes, and three optimizer steps on both models (losses at each step, final weights).
"""

from __future__ import annotations

import pytest
import torch
from reference import reference_logits, reference_loss, reference_weights
from tp_helpers import (
    TOL,
    TinyOptimizer,
    config,
    copy_weights,
    failures,
    grad_errors,
    one_thread,
    perturb,
    register,
    rel_err,
    tp_results,
    weight_errors,
)

from domino import ParallelState
from domino.gpt_model import GPTModel
from domino.tensor_parallel import gather_from_tensor_model_parallel_region
from domino.transformer import Plan

COMMON = dict(hidden_size=64, num_attention_heads=8)
# name -> (config overrides, label smoothing, TP model's plan, optimizer)
VARIANTS = {
    "ln_gelu_learned": (dict(), 0.0, (1, "none", 1), "sgd"),
    "rms_swiglu_rope_gqa_nobias": (
        dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
             num_query_groups=4, add_bias_linear=False, vocab_size=1000),
        0.0, (2, "cross_layer", 1), "adam"),
    "post_ln_untied_smooth": (
        dict(apply_residual_connection_post_layernorm=True,
             untie_embeddings_and_output_weights=True),
        0.1, (1, "none", 1), "adam"),
    "rope_half_interp_swiglu_smooth": (
        dict(position_embedding_type="rope", rotary_percent=0.5,
             rotary_seq_len_interpolation_factor=2.0, activation="swiglu", vocab_size=1000,
             num_query_groups=4),
        0.05, (3, "intra_layer", 2), "sgd"),
    # Qwen2's bias on Q/K/V alone, Qwen3's per-head query/key norms (their gradients summed
    # over TP) and Mistral's sliding window (3 keys of the 8-token sequence).
    "qkv_bias_qk_norm_window3": (
        dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
             num_query_groups=4, add_bias_linear=False, add_qkv_bias=True, qk_layernorm=True,
             window_size=3, vocab_size=1000),
        0.0, (2, "cross_layer", 2), "adam"),
    # OLMoE's query/key norms over all heads: their squared sums are summed over TP.
    "qk_norm_full_width": (
        dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
             num_query_groups=4, add_bias_linear=False, qk_layernorm=True,
             qk_layernorm_full_width=True, vocab_size=1000),
        0.0, (2, "cross_layer", 2), "adam"),
    # Granite's four scalars: embeddings, each branch's output, attention scores, logits.
    "granite_multipliers": (
        dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
             num_query_groups=4, add_bias_linear=False, embedding_multiplier=3.0,
             residual_multiplier=0.5, softmax_scale=0.2, logits_scaling=4.0, vocab_size=1000),
        0.0, (2, "cross_layer", 2), "adam"),
    # SmolLM3's NoPE layers: no RoPE on layer 1 of 3 (layers 0 and 2 rotate).
    "nope_layer1_of3": (
        dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
             num_query_groups=4, add_bias_linear=False, nope_layers=(1,), num_layers=3,
             vocab_size=1000),
        0.0, (2, "cross_layer", 2), "adam"),
    # OLMo 2's norms after each sublayer (before its residual add), none before; with its
    # query/key norms over all heads.
    "olmo2_norms_after": (
        dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
             num_query_groups=4, add_bias_linear=False, qk_layernorm=True,
             qk_layernorm_full_width=True, norm_after_sublayer=True, vocab_size=1000),
        0.0, (2, "cross_layer", 2), "adam"),
    # The same placement with LayerNorm and biases (added before the norm), the norms
    # running on sequence shards (sequence parallelism).
    "norms_after_ln_bias_gelu": (
        dict(norm_after_sublayer=True, sequence_parallel=True), 0.0, (2, "intra_layer", 1),
        "sgd"),
    # Gemma 2's: (1 + weight) norms on both sides of each sublayer, GeGLU, soft-capped scores
    # and logits, its query scale and scaled embeddings; layer 1 of 3 global, 0 and 2 sliding.
    "gemma2_sandwich_softcaps": (
        dict(normalization="RMSNorm", activation="geglu_tanh", position_embedding_type="rope",
             num_query_groups=4, add_bias_linear=False, layernorm_zero_centered_gamma=True,
             sandwich_norms=True, attention_softcap=0.5, output_softcap=2.0, softmax_scale=0.3,
             embedding_multiplier=8.0, window_size=3, full_attention_layers=(1,),
             num_layers=3, vocab_size=1000),
        0.0, (2, "cross_layer", 2), "adam"),
    # Gemma 3's: per-head (1 + weight) query/key norms, the sliding layers' own RoPE base (the
    # global layer's interpolated), on sequence shards.
    "gemma3_local_rope_sp": (
        dict(normalization="RMSNorm", activation="geglu_tanh", position_embedding_type="rope",
             num_query_groups=4, add_bias_linear=False, layernorm_zero_centered_gamma=True,
             sandwich_norms=True, qk_layernorm=True, window_size=4, full_attention_layers=(2,),
             local_rotary_base=100.0, rotary_base=1e6, rotary_seq_len_interpolation_factor=2.0,
             num_layers=3, vocab_size=1000, sequence_parallel=True),
        0.0, (2, "intra_layer", 2), "sgd"),
    # GPT-OSS's dense features: attention sinks (sharded with the heads), YaRN RoPE (its ramp
    # and cos/sin factor), the clamped, scaled, offset SwiGLU; layer 1 of 3 global, 0 and 2
    # sliding; biases; fp32-scaled RMSNorms; on sequence shards.
    "gpt_oss_sinks_yarn_clamped_swiglu": (
        dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
             num_query_groups=4, attention_sinks=True, window_size=3,
             full_attention_layers=(1,), rotary_base=100.0, rope_scaling_type="yarn",
             rope_scaling_factor=4.0, rope_original_max_position_embeddings=16,
             rope_yarn_beta_fast=4.0, rope_yarn_beta_slow=0.5, rope_yarn_truncate=False,
             swiglu_alpha=1.702, glu_linear_offset=1.0, activation_func_clamp_value=0.05,
             norm_scale_in_fp32=True, num_layers=3, vocab_size=1000, sequence_parallel=True),
        0.0, (2, "intra_layer", 2), "adam"),
    # Phi-3's LongRoPE on half of each head: the 8-token batch reaches past an original
    # context of 7 (long factors), on sequence shards; within one of 8 (short factors, and a
    # given cos/sin factor). Against the reference, the two pin the rule at its boundary.
    "longrope_long_sp": (
        dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
             num_query_groups=4, add_bias_linear=False, rotary_percent=0.5,
             rope_scaling_type="longrope", rope_short_factor=(1.0, 1.5),
             rope_long_factor=(3.0, 7.0), rope_original_max_position_embeddings=7,
             rope_scaling_factor=4.0, vocab_size=1000, sequence_parallel=True),
        0.0, (2, "intra_layer", 2), "adam"),
    "longrope_short_given_factor": (
        dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
             num_query_groups=4, add_bias_linear=False, rope_scaling_type="longrope",
             rope_short_factor=(1.0, 1.2, 2.0, 5.0), rope_long_factor=(4.0, 4.0, 8.0, 9.0),
             rope_original_max_position_embeddings=8, rope_attention_factor=1.3,
             vocab_size=1000),
        0.0, (2, "cross_layer", 1), "sgd"),
    # The same norms as LayerNorms (1 + weight, with biases).
    "zero_centered_layernorm_sandwich": (
        dict(layernorm_zero_centered_gamma=True, sandwich_norms=True), 0.0, (2, "none", 1),
        "sgd"),
    "vocab_1000_pad_1_untied": (
        dict(vocab_size=1001, make_vocab_size_divisible_by=1,
             untie_embeddings_and_output_weights=True, num_layers=1),
        0.0, (2, "none", 2), "sgd"),
}
BATCH, SEQ, STEPS = 3, 8, 3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _optimizer(kind: str, model: torch.nn.Module) -> TinyOptimizer:
    return TinyOptimizer(model.parameters(), kind, lr=2e-4 if kind == "adam" else 0.02)


def _build(name: str, state: ParallelState):
    over, ls, plan, opt = VARIANTS[name]
    cfg = config(**{**COMMON, **over})
    torch.manual_seed(0)
    ref = GPTModel(cfg, parallel_state=ParallelState.single(), label_smoothing=ls)
    perturb(ref, seed=1, vocab=cfg.vocab_size)
    ref.language_model.encoder.set_plan(Plan(1, "none", 1))
    model = GPTModel(cfg, parallel_state=state, label_smoothing=ls)
    copy_weights(model, ref, state.tp, cfg.vocab_size)
    model.language_model.encoder.set_plan(Plan(*plan))
    return cfg, model, ref


def _check_logits(cfg, model, ref, state, ids) -> dict:
    tp, vocab = state.tp, cfg.vocab_size
    res = {}
    with torch.no_grad():
        ref.parallel_output = False
        full_ref = ref(ids, None, None)
        model.parallel_output = False
        full = model(ids, None, None)
        res["full_shape_ok"] = tuple(full.shape) == (BATCH, SEQ, vocab)
        res["logits_full"] = rel_err(full, full_ref)
        model.parallel_output = True
        local = model(ids, None, None)
        padded = cfg.padded_vocab_size(tp.size)
        res["parallel_shape_ok"] = tuple(local.shape) == (BATCH, SEQ, padded // tp.size)
        cols = torch.arange(tp.rank * local.shape[-1], (tp.rank + 1) * local.shape[-1])
        real = cols < vocab
        res["logits_parallel"] = rel_err(local[..., real], full_ref[..., cols[real]])
        res["pad_is_min"] = bool((local[..., ~real] == torch.finfo(local.dtype).min).all())
        gathered = gather_from_tensor_model_parallel_region(local, tp) if tp.size > 1 else local
        res["argmax_real"] = bool((gathered.argmax(-1) < vocab).all())
        res["pad_mass"] = float(torch.softmax(gathered, dim=-1)[..., vocab:].sum())
    return res


def _check_variant(state: ParallelState, name: str) -> dict:
    cfg, model, ref = _build(name, state)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    ids[0, :2] = torch.tensor([0, cfg.vocab_size - 1])
    res = _check_logits(cfg, model, ref, state, ids)
    kind = VARIANTS[name][3]
    opt_m, opt_r = _optimizer(kind, model), _optimizer(kind, ref)
    for step in range(STEPS):
        ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
        wts = torch.rand(BATCH, SEQ, generator=gen)
        opt_m.zero_grad()
        opt_r.zero_grad()
        loss = model(ids, None, None, labels=labels)
        loss_ref = ref(ids, None, None, labels=labels)
        res[f"loss_step{step}"] = rel_err(loss, loss_ref)
        (loss * wts).sum().backward()
        (loss_ref * wts).sum().backward()
        res[f"grads_step{step}"] = grad_errors(model, ref, state.tp, cfg.vocab_size)
        opt_m.step()
        opt_r.step()
    res["weights_after"] = weight_errors(model, ref, state.tp, cfg.vocab_size)
    return res


def _gpt_checks(state: ParallelState) -> dict:
    return {name: _check_variant(state, name) for name in VARIANTS}


register(2, _gpt_checks)
register(4, _gpt_checks)


_TP1: dict = {}


def _results(tp: int) -> list:
    if tp == 1:  # TP=1 needs no process group: run it here
        if not _TP1:
            _TP1["res"] = [_gpt_checks(ParallelState.single())]
        return _TP1["res"]
    return tp_results(tp, _gpt_checks)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt_tp_matches_single_process(tp, variant) -> None:
    for rank, per_rank in enumerate(_results(tp)):
        res = per_rank[variant]
        where = f"TP={tp} rank {rank} {variant}"
        assert res["full_shape_ok"] and res["parallel_shape_ok"], where
        assert res["pad_is_min"] and res["argmax_real"] and res["pad_mass"] == 0.0, where
        scalars = {k: v for k, v in res.items() if k.startswith(("loss", "logits"))}
        assert not failures(scalars), f"{where}: {failures(scalars)}"
        for step in range(STEPS):
            bad = failures(res[f"grads_step{step}"])
            assert not bad, f"{where} step {step} gradients: {bad}"
        bad = failures(res["weights_after"])
        assert not bad, f"{where} weights after {STEPS} optimizer steps: {bad}"


# ---- TP=1 vs the independent reference ---------------------------------------------------------

REF_VARIANTS = ["ln_gelu_learned", "rms_swiglu_rope_gqa_nobias", "post_ln_untied_smooth",
                "rope_half_interp_swiglu_smooth", "qkv_bias_qk_norm_window3", "qk_norm_full_width",
                "nope_layer1_of3", "granite_multipliers", "olmo2_norms_after",
                "norms_after_ln_bias_gelu", "gemma2_sandwich_softcaps", "gemma3_local_rope_sp",
                "zero_centered_layernorm_sandwich", "gpt_oss_sinks_yarn_clamped_swiglu",
                "longrope_long_sp", "longrope_short_given_factor"]


@pytest.mark.parametrize("variant", REF_VARIANTS)
@pytest.mark.parametrize("masked", [False, True])
def test_gpt_tp1_matches_independent_reference(variant, masked) -> None:
    over, ls, plan, _ = VARIANTS[variant]
    cfg = config(**{**COMMON, **over})
    torch.manual_seed(0)
    model = GPTModel(cfg, parallel_state=ParallelState.single(), label_smoothing=ls)
    perturb(model, seed=1, vocab=cfg.vocab_size)
    model.language_model.encoder.set_plan(Plan(*plan))
    w = reference_weights(model)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    wts = torch.rand(BATCH, SEQ, generator=gen)
    mask = None
    if masked:  # key padding (never key 0, nor a whole window: no query row is fully masked)
        mask = torch.zeros(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
        mask[0, ..., 6:] = True
        mask[2, ..., 2] = True
    with torch.no_grad():
        model.parallel_output = False
        assert rel_err(model(ids, None, mask), reference_logits(w, cfg, ids, mask=mask)) <= TOL
    loss = model(ids, None, mask, labels=labels)
    ref = reference_loss(w, cfg, ids, labels, ls, mask=mask)
    assert rel_err(loss, ref) <= TOL
    (loss * wts).sum().backward()
    (ref * wts).sum().backward()
    errors = {n: rel_err(p.grad, w[n].grad) for n, p in model.named_parameters()}
    assert not failures(errors), failures(errors)


def test_reference_detects_a_wrong_layout() -> None:
    """Sanity check of the reference itself: swapping q and k rows changes its loss."""
    over, ls, _, _ = VARIANTS["ln_gelu_learned"]
    cfg = config(**{**COMMON, **over})
    torch.manual_seed(0)
    model = GPTModel(cfg, parallel_state=ParallelState.single())
    perturb(model, seed=1, vocab=cfg.vocab_size)
    w = reference_weights(model)
    ids = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    good = reference_loss(w, cfg, ids, ids)
    name = "language_model.encoder.layers.0.self_attention.query_key_value.weight"
    d = cfg.kv_channels
    with torch.no_grad():
        q0, k0 = w[name][:d].clone(), w[name][d:2 * d].clone()
        w[name][:d], w[name][d:2 * d] = k0, q0
    assert rel_err(reference_loss(w, cfg, ids, ids), good) > 1e-4
    with torch.no_grad():
        model.parallel_output = False
        assert rel_err(model(ids, None, None), reference_logits(w, cfg, ids)) > 1e-4
