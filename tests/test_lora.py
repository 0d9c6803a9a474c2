"""LoRA under tensor parallelism and Domino (``domino.tensor_parallel.lora``,
``domino.models.lora``).

* TP=2 and TP=4 (the shared spawns) under Domino plans (micro-batches, overlaps, column chunks,
  sequence parallelism, full recomputation, adapter dropout) equal the unsharded TP=1 model with
  the same full weights and adapters: logits, losses, every adapter gradient (this rank's shard of
  the full one; the replicated factors whole, their partial gradients summed over TP) over two
  accumulated backwards; the base gets no gradient.
* TP=1 equals the real ``peft`` LoRA on transformers' Llama with the same weights (logits and
  adapter gradients); so does TP=2 under a Domino plan (its gathered gradients).
* TP=1 equals the base model with the update merged into its weights (GeLU + biases too).
* Frozen base weights run no weight-gradient GEMM, and stay in bf16 under a bf16 run while the
  adapters and their gradients are fp32.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tp_helpers import (
    TOL,
    config,
    copy_weights,
    expected_local,
    failures,
    grad_errors,
    one_thread,
    perturb,
    register,
    rel_err,
    tp_results,
)

from domino import ParallelState
from domino.checkpoint.hf import expected_hf_shapes, from_hf
from domino.checkpoint.hf_config import config_from_hf
from domino.gpt_model import GPTModel
from domino.models.lora import LoraSpec, adapters_of, apply_lora, is_adapter_name
from domino.runtime import RuntimeConfig
from domino.transformer import Plan

RANK, ALPHA = 4, 8.0
COMMON = dict(hidden_size=64, num_attention_heads=8)
SWIGLU = dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
              num_query_groups=4, add_bias_linear=False)  # fc1 [gate; up]: stride 2
GELU: dict = {}  # LayerNorm, GeLU, learned positions, every bias
# name -> (config overrides, plan, more runtime fields, adapter dropout)
VARIANTS = {
    "swiglu_m1_none": (SWIGLU, Plan(1, "none", 1), {}, 0.0),
    "gelu_m2_cross_c2": (GELU, Plan(2, "cross_layer", 2), {}, 0.0),
    "swiglu_m2_intra_sp": (SWIGLU, Plan(2, "intra_layer", 1), dict(sequence_parallel=True), 0.0),
    "gelu_m1_intra_c2_sp_recompute": (
        GELU, Plan(1, "intra_layer", 2),
        dict(sequence_parallel=True, recompute_granularity="full"), 0.0),
    "swiglu_m2_cross_c2_recompute": (
        SWIGLU, Plan(2, "cross_layer", 2), dict(recompute_granularity="full"), 0.0),
    # Dropout masks come from the replicated stream, drawn for each micro-batch's whole input
    # (once for all column chunks): TP=1 with the same micro-batches and no column chunks draws
    # the same ones (and full recomputation replays them).
    "swiglu_dropout_m2_cross_c2_recompute": (
        SWIGLU, Plan(2, "cross_layer", 2), dict(recompute_granularity="full"), 0.3),
    "gelu_dropout_m1_intra_c2_sp": (
        GELU, Plan(1, "intra_layer", 2), dict(sequence_parallel=True), 0.3),
}
BATCH, SEQ, STEPS = 2, 8, 2
DROPOUT_SEED = 11


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _randomize(model: torch.nn.Module, seed: int, scale: float = 0.1) -> None:
    """Non-zero A and B everywhere (B starts at zero, which would hide every B-side bug)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in adapters_of(model):
            for p in (adapter.a, adapter.b):
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def _adapter_names(model: torch.nn.Module) -> set[str]:
    return {n for n, _ in model.named_parameters() if is_adapter_name(n)}


def _frozen_ok(model: torch.nn.Module) -> bool:
    """Only the adapters train: the base has no gradient and asks for none."""
    return all((p.requires_grad and p.grad is not None) if is_adapter_name(n)
               else (not p.requires_grad and p.grad is None)
               for n, p in model.named_parameters())


def _build(name: str, state: ParallelState):
    """(config, TP model on ``state``, unsharded TP=1 reference, errors of the TP model's
    initial adapters vs the reference's shares): same full weights and random adapters."""
    over, plan, runtime, dropout = VARIANTS[name]
    cfg = config(**{**COMMON, **over})
    spec = LoraSpec(RANK, ALPHA, dropout)
    single = ParallelState.single()
    torch.manual_seed(0)
    ref = GPTModel(cfg, parallel_state=single)
    if dropout:  # the same micro-batches (forced at TP=1): a mask is drawn per input
        ref.language_model.encoder.set_plan(Plan(plan.micro_batches, plan.overlap, 1),
                                            force=True)
    perturb(ref, seed=1, vocab=cfg.vocab_size)
    model = GPTModel(cfg, parallel_state=state, runtime=RuntimeConfig(plan=plan, **runtime))
    apply_lora(ref, spec, single, seed=5)
    apply_lora(model, spec, state, seed=5)
    # The start is drawn per adapter from the seed: a TP rank holds its share of TP=1's.
    copy_weights(model, ref, state.tp, cfg.vocab_size)  # (base weights; adapters below)
    init = _adapter_errors(model, ref, state, cfg)
    _randomize(ref, seed=3)
    copy_weights(model, ref, state.tp, cfg.vocab_size)
    single.rng.seed(DROPOUT_SEED)
    state.rng.seed(DROPOUT_SEED)
    return cfg, model, ref, init


def _adapter_errors(model, ref, state, cfg) -> dict:
    """Errors of ``model``'s adapters before ``copy_weights`` overwrote them."""
    refs = dict(ref.named_parameters())
    return {n: rel_err(p, expected_local(n, refs[n], p, state.tp, cfg.vocab_size))
            for n, p in model.named_parameters() if is_adapter_name(n)}


def _check_variant(state: ParallelState, name: str) -> dict:
    cfg, model, ref, init = _build(name, state)
    res: dict = {"init": init}
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    with torch.no_grad():
        model.parallel_output = ref.parallel_output = False
        res["logits"] = rel_err(model(ids, None, None), ref(ids, None, None))
    names = _adapter_names(model)
    for step in range(STEPS):  # accumulated: each pass's TP sum is added once
        ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
        wts = torch.rand(BATCH, SEQ, generator=gen)
        loss, loss_ref = (m(ids, None, None, labels=labels) for m in (model, ref))
        res[f"loss{step}"] = rel_err(loss, loss_ref)
        (loss * wts).sum().backward()
        (loss_ref * wts).sum().backward()
        errors = grad_errors(model, ref, state.tp, cfg.vocab_size)
        res[f"grads{step}"] = {n: e for n, e in errors.items() if n in names}
    res["adapters"] = len(names)
    res["frozen"] = _frozen_ok(model) and _frozen_ok(ref)
    return res


def _lora_checks(state: ParallelState) -> dict:
    return {name: _check_variant(state, name) for name in VARIANTS}


register(2, _lora_checks)
register(4, _lora_checks)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("tp", [2, 4])
def test_lora_tp_matches_unsharded(tp: int, variant: str) -> None:
    for rank, per_rank in enumerate(tp_results(tp, _lora_checks)):
        res, where = per_rank[variant], f"TP={tp} rank {rank} {variant}"
        assert res["adapters"] == 2 * 4 * 2, where  # 2 layers x qkv, proj, fc1, fc2 x (A, B)
        bad = failures(res["init"])
        assert not bad, f"{where}: initial adapters {bad}"
        scalars = {k: v for k, v in res.items() if k.startswith(("loss", "logits"))}
        assert not failures(scalars), f"{where}: {failures(scalars)}"
        for step in range(STEPS):
            bad = failures(res[f"grads{step}"])
            assert not bad, f"{where} adapter gradients after {step + 1} backward(s): {bad}"
        assert res["frozen"], f"{where}: a base parameter got a gradient (or an adapter none)"


# ---- TP=1: the update merged into the weights ----------------------------------------------------


@pytest.mark.parametrize("over", [GELU, SWIGLU], ids=["gelu_bias", "swiglu"])
def test_lora_equals_merged_weights(over: dict) -> None:
    """``W x + s B A x`` is ``(W + s B A) x``: logits; and with G = dL/dW of the merged model,
    dL/dA = s B^T G and dL/dB = s G A^T (TP=1 under a forced Domino split)."""
    cfg = config(**{**COMMON, **over})
    single = ParallelState.single()
    plan = Plan(2, "cross_layer", 2)
    torch.manual_seed(0)
    lora = GPTModel(cfg, parallel_state=single)
    perturb(lora, seed=1, vocab=cfg.vocab_size)
    merged = GPTModel(cfg, parallel_state=single)
    merged.load_state_dict(lora.state_dict())
    apply_lora(lora, LoraSpec(RANK, ALPHA), single, seed=5)
    _randomize(lora, seed=3)
    weights = dict(merged.named_parameters())
    linears = {n.rsplit(".", 1)[0]: m for n, m in lora.named_modules()
               if n.endswith(".lora")}
    with torch.no_grad():
        for linear, adapter in linears.items():
            weights[linear + ".weight"].add_(ALPHA / RANK * adapter.b @ adapter.a)
    for m in (lora, merged):
        m.language_model.encoder.set_plan(plan, force=True)
    gen = torch.Generator().manual_seed(2)
    ids, labels = (torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen) for _ in "il")
    loss, loss_m = (m(ids, None, None, labels=labels) for m in (lora, merged))
    assert rel_err(loss, loss_m) <= TOL
    loss.sum().backward()
    loss_m.sum().backward()
    errors = {}
    for linear, adapter in linears.items():
        g = weights[linear + ".weight"].grad
        errors[linear + ".a"] = rel_err(adapter.a.grad, ALPHA / RANK * adapter.b.t() @ g)
        errors[linear + ".b"] = rel_err(adapter.b.grad, ALPHA / RANK * g @ adapter.a.t())
    assert len(errors) == 16 and not failures(errors), failures(errors)
    assert _frozen_ok(lora)


# ---- against peft on transformers' Llama ---------------------------------------------------------

# A tiny Llama as its config.json reads (what transformers' LlamaConfig writes, trimmed).
LLAMA = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "hidden_act": "silu", "max_position_embeddings": 32,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
         "mlp_bias": False, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Our fused linear -> the HF modules it covers (its A is each one's lora_A).
COVERS = {"self_attention.query_key_value": ("self_attn.q_proj", "self_attn.k_proj",
                                            "self_attn.v_proj"),
          "self_attention.dense": ("self_attn.o_proj",),
          "mlp.dense_h_to_4h": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.dense_4h_to_h": ("mlp.down_proj",)}
PEFT_PLAN = Plan(2, "cross_layer", 2)


def _llama_config():
    return config_from_hf(LLAMA)[1]


def _hf_weights(cfg) -> dict[str, torch.Tensor]:
    """Random weights under transformers' names (norms around 1)."""
    gen = torch.Generator().manual_seed(9)
    out = {}
    for name, shape in sorted(expected_hf_shapes(cfg, "llama").items()):
        t = torch.randn(shape, generator=gen) * 0.2
        out[name] = t + 1.0 if name.endswith("norm.weight") else t
    return out


def _imported(state: ParallelState, plan: Plan):
    """(TP model on ``state`` under ``plan``, its TP=1 twin): the Llama weights imported
    (``from_hf``), LoRA on both with the same random adapters."""
    cfg = _llama_config()
    single = ParallelState.single()
    full = GPTModel(cfg, parallel_state=single)
    params = dict(full.named_parameters())
    with torch.no_grad():
        for name, t in from_hf(_hf_weights(cfg), cfg, "llama", cfg.padded_vocab_size(1)).items():
            params[name].copy_(t)
    model = GPTModel(cfg, parallel_state=state, runtime=RuntimeConfig(plan=plan))
    copy_weights(model, full, state.tp, cfg.vocab_size)
    apply_lora(full, LoraSpec(RANK, ALPHA), single, seed=5)
    apply_lora(model, LoraSpec(RANK, ALPHA), state, seed=5)
    _randomize(full, seed=4, scale=0.3)
    copy_weights(model, full, state.tp, cfg.vocab_size)
    if state.tp.size == 1:
        model.language_model.encoder.set_plan(plan, force=True)
    return cfg, model, full


def _llama_batch(cfg):
    gen = torch.Generator().manual_seed(6)
    ids, labels = (torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen) for _ in "il")
    return ids, labels, torch.rand(BATCH, SEQ, generator=gen)


def _run_ours(model, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Full logits, and this rank's adapter gradients after the weighted loss's backward."""
    ids, labels, wts = _llama_batch(cfg)
    model.parallel_output = False
    with torch.no_grad():
        logits = model(ids, None, None)[..., :cfg.vocab_size]
    (model(ids, None, None, labels=labels) * wts).sum().backward()
    assert _frozen_ok(model)
    return logits, {n: p.grad for n, p in model.named_parameters() if is_adapter_name(n)}


def _peft_tp2(state: ParallelState) -> dict:
    cfg, model, _ = _imported(state, PEFT_PLAN)
    logits, grads = _run_ours(model, cfg)
    parts = {n: (g, p.partition_dim, p.partition_stride) if p.tensor_model_parallel else (g,)
             for (n, g), p in zip(grads.items(), (dict(model.named_parameters())[n]
                                                  for n in grads), strict=True)}
    return {"logits": logits, "grads": parts}


register(2, _peft_tp2)


def _unshard(parts: list[tuple]) -> torch.Tensor:
    """The full tensor from every rank's shard (replicated: rank 0's), by the definition of
    a ``partition_dim`` d, ``partition_stride`` s shard: s blocks along d, each cut in tp."""
    if len(parts[0]) == 1:
        return parts[0][0]
    _, dim, stride = parts[0]
    pieces = [p[0].chunk(stride, dim=dim) for p in parts]
    return torch.cat([torch.cat([pc[b] for pc in pieces], dim=dim) for b in range(stride)],
                     dim=dim)


@pytest.fixture(scope="module")
def peft_llama():
    """peft's LoRA on transformers' Llama with the imported weights and our adapters: its
    logits and lora_A / lora_B gradients (by HF module name) on the same batch and loss."""
    import peft
    import transformers

    cfg = _llama_config()
    keep = {k: v for k, v in LLAMA.items() if k != "model_type"}
    hf_cfg = transformers.LlamaConfig(**keep, attn_implementation="eager")
    assert config_from_hf(hf_cfg.to_dict())[1].to_dict() == cfg.to_dict()
    hf_model = transformers.LlamaForCausalLM(hf_cfg)
    hf_model.load_state_dict(_hf_weights(cfg), strict=True)
    _, _, ours = _imported(ParallelState.single(), PEFT_PLAN)
    model = peft.get_peft_model(hf_model, peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=PEFT_TARGETS, lora_dropout=0.0))
    modules = dict(model.base_model.model.named_modules())
    with torch.no_grad():
        for hf_name, (a, b) in _as_peft(ours, cfg, lambda ad: (ad.a, ad.b)).items():
            modules[hf_name].lora_A["default"].weight.copy_(a)
            modules[hf_name].lora_B["default"].weight.copy_(b)
    ids, labels, wts = _llama_batch(cfg)
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             reduction="none")
    (loss.view(BATCH, SEQ) * wts).sum().backward()
    grads = {name: (m.lora_A["default"].weight.grad, m.lora_B["default"].weight.grad)
             for name, m in modules.items() if hasattr(m, "lora_A")}
    assert len(grads) == 2 * len(PEFT_TARGETS)
    return logits.detach(), grads, ours


def _as_peft(ours, cfg, pick) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each HF module's (lora_A, lora_B) from our adapters' ``pick(adapter)`` = (A, B): A as
    it is, B's rows split as the family's link splits the linear's weight rows (``to_hf``)."""
    from domino.checkpoint.hf import to_hf

    params = {n: p.detach() for n, p in ours.named_parameters()}
    adapters = {n.rsplit(".", 1)[0]: m for n, m in ours.named_modules() if n.endswith(".lora")}
    a_of = {}
    for linear, adapter in adapters.items():
        a, params[linear + ".weight"] = pick(adapter)
        a_of[linear] = a
    rows = to_hf(params, cfg, "llama")  # weights of the adapted linears replaced by B
    out = {}
    for linear, a in a_of.items():
        i = int(linear.split(".layers.")[1].split(".")[0])
        ours_name = linear.split(f".layers.{i}.")[1]
        for module in COVERS[ours_name]:
            out[f"model.layers.{i}.{module}"] = (a, rows[f"model.layers.{i}.{module}.weight"])
    return out


def _peft_errors(logits, grads_ours: dict[str, torch.Tensor], cfg, peft_llama) -> dict:
    """Errors of our logits and adapter gradients (full, by our names) vs peft's: B's rows
    map as the weight's; a fused linear's A gradient is the sum of its modules' lora_A's."""
    expected_logits, peft_grads, ours = peft_llama

    def pick(adapter):
        name = names[id(adapter)]
        return grads_ours[name + ".a"], grads_ours[name + ".b"]

    names = {id(m): n for n, m in ours.named_modules() if n.endswith(".lora")}
    errors = {"logits": rel_err(logits, expected_logits)}
    mapped = _as_peft(ours, cfg, pick)
    summed_a: dict[int, torch.Tensor] = {}
    for hf_name, (a, b) in mapped.items():
        peft_a, peft_b = peft_grads[hf_name]
        errors[hf_name + ".lora_B"] = rel_err(b, peft_b)
        summed_a[id(a)] = summed_a.get(id(a), 0) + peft_a
    for hf_name, (a, _) in mapped.items():
        errors[hf_name + ".lora_A (summed)"] = rel_err(a, summed_a[id(a)])
    return errors


PEFT_TOL = 3e-5  # fp32; transformers and ours order some sums differently (seen: 5e-6)


def test_lora_tp1_matches_peft(peft_llama) -> None:
    cfg, model, _ = _imported(ParallelState.single(), PEFT_PLAN)
    logits, grads = _run_ours(model, cfg)
    errors = _peft_errors(logits, grads, cfg, peft_llama)
    assert peft_llama[0].abs().max() > 1.0  # informative logits
    assert len(errors) == 1 + 2 * 2 * len(PEFT_TARGETS)
    assert not failures(errors, PEFT_TOL), failures(errors, PEFT_TOL)


def test_lora_tp2_matches_peft(peft_llama) -> None:
    cfg = _llama_config()
    per_rank = tp_results(2, _peft_tp2)
    for rank, res in enumerate(per_rank):
        assert rel_err(res["logits"], peft_llama[0]) <= PEFT_TOL, f"rank {rank} logits"
    grads = {n: _unshard([r["grads"][n] for r in per_rank]) for n in per_rank[0]["grads"]}
    for n in grads:  # the replicated factors: every rank holds the whole (summed) gradient
        if len(per_rank[0]["grads"][n]) == 1:
            assert all(rel_err(r["grads"][n][0], grads[n]) == 0.0 for r in per_rank), n
    errors = _peft_errors(per_rank[0]["logits"], grads, cfg, peft_llama)
    assert not failures(errors, PEFT_TOL), failures(errors, PEFT_TOL)


# ---- frozen base: no weight-gradient GEMM; bf16 --------------------------------------------------


class _MatMuls(TorchDispatchMode):
    """How many matrix products run."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "addmm", "bmm"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _backward_matmuls(model, ids, labels) -> int:
    loss = model(ids, None, None, labels=labels).sum()
    with _MatMuls() as mode:
        loss.backward()
    return mode.count


@pytest.mark.parametrize("plan", [Plan(1, "none", 1), Plan(2, "cross_layer", 2)], ids=str)
def test_frozen_base_runs_no_weight_gradient_gemm(plan: Plan) -> None:
    """The frozen model's backward runs fewer products than the same model with its base
    trainable, by at least one per base linear (its dL/dW), and leaves the base no gradient."""
    cfg = config(**COMMON)
    single = ParallelState.single()
    torch.manual_seed(0)
    model = GPTModel(cfg, parallel_state=single)
    apply_lora(model, LoraSpec(RANK, ALPHA), single, seed=5)
    _randomize(model, seed=3)
    model.language_model.encoder.set_plan(plan, force=True)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    frozen = _backward_matmuls(model, ids, ids)
    assert _frozen_ok(model)
    for p in model.parameters():
        p.requires_grad_(True)
    trainable = _backward_matmuls(model, ids, ids)
    base_linears = 4 * cfg.num_layers
    assert trainable - frozen >= base_linears * plan.micro_batches, (frozen, trainable)


def test_bf16_run_keeps_the_frozen_base_in_bf16_and_adapters_in_fp32() -> None:
    cfg = config(**{**COMMON, **SWIGLU})
    single = ParallelState.single()
    plan = Plan(2, "cross_layer", 2)
    models = []
    for dtype in (torch.bfloat16, None):
        torch.manual_seed(0)
        m = GPTModel(cfg, parallel_state=single,
                     runtime=RuntimeConfig(plan=plan, compute_dtype=dtype))
        perturb(m, seed=1, vocab=cfg.vocab_size)
        apply_lora(m, LoraSpec(RANK, ALPHA), single, seed=5)
        _randomize(m, seed=3)
        m.language_model.encoder.set_plan(plan, force=True)
        models.append(m)
    bf16, fp32 = models
    for name, p in bf16.named_parameters():
        want = torch.float32 if is_adapter_name(name) else torch.bfloat16
        assert p.dtype == want, (name, p.dtype)
    gen = torch.Generator().manual_seed(2)
    ids, labels = (torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen) for _ in "il")
    losses = [m(ids, None, None, labels=labels) for m in models]
    assert losses[0].dtype == torch.float32
    assert rel_err(losses[0], losses[1]) <= 3e-2
    for loss in losses:
        loss.sum().backward()
    assert _frozen_ok(bf16)
    ref = dict(fp32.named_parameters())
    for name, p in bf16.named_parameters():
        if is_adapter_name(name):
            assert p.grad.dtype == torch.float32, name
            assert rel_err(p.grad, ref[name].grad) <= 1e-1, name  # bf16 rounding
