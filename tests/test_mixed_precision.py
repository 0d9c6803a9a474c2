"""Mixed precision (``domino.precision``, ``--bf16``): fp32 master weights and gradients, bf16
compute copies of the weights made once per step.

In-process on one rank: every weight is cast once per step whatever the plan splits it into;
every GEMM of the linears, the embedding lookups and the norms runs in bf16 while parameters and
gradients stay fp32 and the gradients match the fp32 model's within bf16 rounding; DP sums in
bf16 only with ``--grad-reduce-in-bf16``. At TP=2 (the shared spawn) the sharded bf16 model, with
and without sequence parallelism, matches the single-process bf16 model. Training runs (bf16 vs
fp32 loss curves, bit-exact bf16 resume, fp32 masters in the checkpoint, resharding and HF export
of a bf16 run) are in ``test_checkpoint_resume.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tp_helpers import (
    config,
    copy_weights,
    grad_errors,
    one_thread,
    perturb,
    register,
    rel_err,
    tp_results,
)

from domino import ParallelState, precision
from domino.bench.hooks import BenchHook, SimulatedLink
from domino.gpt_model import GPTModel
from domino.runtime import RuntimeConfig
from domino.tensor_parallel import CommGroup
from domino.training.adamw import AdamW
from domino.training.grad_sync import GradReducer
from domino.transformer import Plan

BF16_TOL = 3e-2  # relative to the largest magnitude: a few bf16 roundings (2^-8) deep
PLANS = {"sync": Plan(1, "none", 1), "m2-cross-c2": Plan(2, "cross_layer", 2),
         "m3-intra": Plan(3, "intra_layer", 1)}
VARIANTS = {"ln_gelu": {}, "rms_swiglu_rope_gqa": dict(
    normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
    num_query_groups=2, add_bias_linear=False)}
B, S = 6, 8


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _models(variant: str, plan: Plan, state: ParallelState | None = None, **runtime):
    """(bf16 model, fp32 model) with the same fp32 weights (perturbed: norms and biases too);
    ``runtime``: more RuntimeConfig fields of the bf16 model."""
    cfg = config(hidden_size=32, num_attention_heads=4, **VARIANTS[variant])
    single = ParallelState.single()
    torch.manual_seed(0)
    ref = GPTModel(cfg, parallel_state=single, runtime=RuntimeConfig(plan=Plan(1, "none", 1)))
    perturb(ref, seed=1, vocab=cfg.vocab_size)
    state = state or single
    bf16 = GPTModel(cfg, parallel_state=state,
                    runtime=RuntimeConfig(plan=plan, compute_dtype=torch.bfloat16, **runtime))
    copy_weights(bf16, ref, state.tp, cfg.vocab_size)
    if state.tp.size == 1 and plan.micro_batches > 1:
        bf16.language_model.encoder.set_plan(plan, force=True)  # split as at TP > 1
    return cfg, bf16, ref


def _batch(cfg, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


class _Gemms(TorchDispatchMode):
    """The dtypes of every linear GEMM, lookup and norm the model dispatches (attention's own
    batched matmuls are the attention path's business: docs/performance.md#attention)."""

    OPS = {"mm", "addmm", "embedding", "native_layer_norm", "embedding_dense_backward"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.OPS:
            self.seen.append((name, tuple(a.dtype for a in args if isinstance(a, torch.Tensor)
                                          and a.is_floating_point())))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("plan", list(PLANS))
def test_bf16_compute_fp32_masters_and_gradients(variant: str, plan: str) -> None:
    cfg, model, ref = _models(variant, PLANS[plan])
    ids, labels = _batch(cfg)
    record = _Gemms()
    with record:
        loss = model(ids, None, None, labels=labels)
        loss.sum().backward()
    ref_loss = ref(ids, None, None, labels=labels)
    ref_loss.sum().backward()
    gemms = [(n, d) for n, d in record.seen if n in ("mm", "addmm")]
    assert len(gemms) >= 6 * cfg.num_layers, record.seen  # forward, dgrad and wgrad GEMMs
    wrong = [(n, d) for n, d in record.seen if d and set(d) != {torch.bfloat16}]
    assert not wrong, f"ops outside bf16: {wrong}"
    assert loss.dtype == torch.float32  # the loss itself is reduced in fp32
    assert rel_err(loss, ref_loss) <= BF16_TOL
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
    errors = grad_errors(model, ref, CommGroup(), cfg.vocab_size)
    assert max(errors.values()) <= BF16_TOL, errors


@pytest.mark.parametrize("plan", ["sync", "m2-cross-c2"])
def test_each_weight_is_cast_once_per_step(monkeypatch, plan: str) -> None:
    cfg, model, _ = _models("ln_gelu", PLANS[plan])
    casts: list[int] = []
    real = precision._cast
    monkeypatch.setattr(precision, "_cast", lambda p, d: casts.append(id(p)) or real(p, d))
    params = list(model.parameters())
    opt = AdamW(params, lr=1e-3)
    ids, labels = _batch(cfg)
    for step in range(2):  # two steps of two accumulated micro-steps each
        casts.clear()
        opt.zero_grad()
        for half in (slice(0, B // 2), slice(B // 2, B)):
            model(ids[half], None, None, labels=labels[half]).sum().backward()
        assert sorted(casts) == sorted(id(p) for p in params), f"step {step}"
        opt.step()
    # Evaluation after the update casts the new values once; a second pass reuses them.
    casts.clear()
    with torch.no_grad():
        model(ids, None, None)
        model(ids, None, None)
    assert sorted(casts) == sorted(id(p) for p in params)
    for p in params:  # the copies follow the masters
        assert torch.equal(precision.compute_copy(p), p.detach().to(torch.bfloat16))


def test_masters_keep_updates_below_bf16_resolution() -> None:
    """An update far below bf16's resolution at 1.0 (2^-8) still moves the fp32 master, and the
    compute copy follows it once the sum crosses a bf16 step."""
    norm = GPTModel(config(), parallel_state=ParallelState.single(),
                    runtime=RuntimeConfig(compute_dtype=torch.bfloat16))
    w = norm.language_model.encoder.final_layernorm.weight  # ones
    assert torch.equal(precision.compute_copy(w), torch.ones_like(w, dtype=torch.bfloat16))
    with torch.no_grad():
        for _ in range(100):
            w.add_(1e-4)
    assert w.dtype == torch.float32 and torch.allclose(w, torch.full_like(w, 1.01))
    assert torch.equal(precision.compute_copy(w), w.detach().to(torch.bfloat16))
    assert float(precision.compute_copy(w)[0]) > 1.0


def test_zero_holds_the_fp32_masters_of_bf16_parameters() -> None:
    """Under ZeRO-1 the optimizer's fp32 chunks are the masters: the parameters become bf16
    (their own compute copies), gradients stay fp32, an update below bf16's resolution moves
    the master, and checkpoints read and write the masters, not the bf16 values."""
    from domino.training.dist_optim import DistributedAdamW

    state = ParallelState.single()
    torch.manual_seed(0)
    cfg = config(hidden_size=32, num_attention_heads=4)
    model = GPTModel(cfg, parallel_state=state,
                     runtime=RuntimeConfig(compute_dtype=torch.bfloat16))
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    reducer = GradReducer(model, params, state, shard=True)
    opt = DistributedAdamW(reducer, 1e-5, (0.9, 0.95), 1e-8, 0.0)
    assert len(opt.turned) == len(params)
    assert all(p.dtype == torch.bfloat16 and p.grad_dtype == torch.float32 for p in params)
    assert all(precision.compute_copy(p) is p for p in params)  # no second copy held
    masters = opt.full_masters()
    assert all(torch.equal(masters[p], s) for p, s in zip(params, start, strict=True))
    ids, labels = _batch(cfg)
    with reducer.armed() as context:
        model(ids, None, None, labels=labels, context=context).sum().backward()
    reducer.finish()
    assert all(p.grad.dtype == torch.float32 for p in params)
    opt.step()
    after = opt.full_masters()
    moved = [p for p in params if not torch.equal(after[p], masters[p])]
    assert moved and all(after[p].dtype == torch.float32 for p in params)
    # lr 1e-5: most updates are below bf16's step: the masters keep what the weights lose.
    bf = torch.bfloat16
    assert any(((after[p] != masters[p]) & (after[p].to(bf) == masters[p].to(bf))).any()
               for p in moved)
    assert all(torch.equal(p.detach(), after[p].to(torch.bfloat16)) for p in params)
    # A checkpoint's value goes into the master at full precision, the parameter cast.
    w = model.language_model.encoder.final_layernorm.weight
    value = torch.full(w.shape, 1.0 + 2.0 ** -12)  # between two bf16 values
    opt.load_master(w, value)
    assert torch.equal(opt.full_masters()[w], value)
    assert torch.equal(w.detach(), value.to(torch.bfloat16))
    # A parameter written from outside becomes its master at the next step (lr 0: kept).
    for group in opt.param_groups:
        group["lr"] = 0.0
    with torch.no_grad():
        w.fill_(2.0)
    opt.step()
    assert torch.equal(opt.full_masters()[w], torch.full(w.shape, 2.0))


def test_compute_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match=r"compute_dtype=torch.int8 is not one of"):
        RuntimeConfig(compute_dtype=torch.int8)
    # fp32 compute of fp32 parameters: nothing is marked, nothing is copied.
    model = GPTModel(config(), parallel_state=ParallelState.single(),
                     runtime=RuntimeConfig(compute_dtype=torch.float32))
    assert all(precision.compute_copy(p) is p for p in model.parameters())


class _Wire(BenchHook):
    """Records the dtype of each DP launch (an instant simulated link: tensors stay as they
    are, so the 'sum' of the two ranks is this rank's own gradient)."""

    def __init__(self, log: list) -> None:
        super().__init__(link=SimulatedLink(1e15))
        self.log = log

    def launch(self, tensor, group, kind="all_reduce"):
        self.log.append(tensor.dtype)
        return super().launch(tensor, group, kind)


@pytest.mark.parametrize("shard", [False, True], ids=["all-reduce", "reduce-scatter"])
@pytest.mark.parametrize("reduce_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_dp_reduction_dtype(shard: bool, reduce_dtype) -> None:
    log: list = []
    state = ParallelState(dp=CommGroup(size=2, rank=0, hook=_Wire(log)))
    torch.manual_seed(0)
    cfg = config(hidden_size=32, num_attention_heads=4)
    model = GPTModel(cfg, parallel_state=state,
                     runtime=RuntimeConfig(compute_dtype=torch.bfloat16))
    params = list(model.parameters())
    ids, labels = _batch(cfg)
    reducer = GradReducer(model, params, state, shard=shard, reduce_dtype=reduce_dtype)
    with reducer.armed() as context:
        model(ids, None, None, labels=labels, context=context).sum().backward()
    before = [p.grad.clone() for p in params]
    reducer.finish()
    assert log and set(log) == {reduce_dtype or torch.float32}
    wire = reduce_dtype or torch.float32
    if shard:
        for bucket in reducer.buckets:
            assert bucket.shard.dtype == torch.float32
            flat = torch.cat([p.grad.reshape(-1) for p in bucket.params])
            assert torch.equal(bucket.shard, flat.to(wire).float()[:bucket.shard.numel()])
    else:
        for p, g in zip(params, before, strict=True):
            assert p.grad.dtype == torch.float32
            assert torch.equal(p.grad, g.to(wire).float())


# ---- TP=2: sharded bf16 vs the single-process bf16 model (the shared spawn) ---------------------

def _bf16_tp_checks(state: ParallelState) -> dict:
    out = {}
    for name, plan, sp in (("m2-cross-c2", Plan(2, "cross_layer", 2), False),
                           ("sp", Plan(2, "cross_layer", 1), True)):
        cfg, model, _ = _models("rms_swiglu_rope_gqa", plan, state, sequence_parallel=sp)
        _, one, _ = _models("rms_swiglu_rope_gqa", Plan(1, "none", 1))
        ids, labels = _batch(cfg)
        loss = model(ids, None, None, labels=labels)
        loss.sum().backward()
        ref_loss = one(ids, None, None, labels=labels)
        ref_loss.sum().backward()
        out[name] = {"loss": rel_err(loss, ref_loss),
                     "grads": max(grad_errors(model, one, state.tp, cfg.vocab_size).values()),
                     "dtypes": {str(p.grad.dtype) for p in model.parameters()}}
    return out


register(2, _bf16_tp_checks)


def test_tp2_bf16_matches_the_single_process_bf16_model() -> None:
    for rank, res in enumerate(tp_results(2, _bf16_tp_checks)):
        for name, r in res.items():
            assert r["loss"] <= BF16_TOL and r["grads"] <= BF16_TOL, (rank, name, r)
            assert r["dtypes"] == {"torch.float32"}, (rank, name, r)
