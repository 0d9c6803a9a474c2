"""A GPT under context parallelism vs the single-process model on the whole sequence.

One spawn per world size: CP=2 (2 ranks) and CP=2 x TP=2 (4 ranks). Each rank feeds its
load-balanced shard of the tokens (chunks r and 2*CP-1-r, written here from the definition)
with their true positions; for two models (learned positions + GELU; RoPE + SwiGLU + GQA +
a sliding window), every CP attention kind (``cp_comm_type`` p2p / all_gather / a2a) and a
Domino plan or none (at TP=2 also with sequence parallelism), and with documents and key
padding (a SequenceMask of the whole sequence or of the shard): per-token losses (reassembled
in true order), every parameter gradient (summed over CP, this rank's TP shard of the
reference's) and, after one optimizer step on both, the weights and the next losses, in fp32.
Plus the configuration errors and Megatron's mpu functions for CP.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import run_distributed
from tp_helpers import (
    TinyOptimizer,
    config,
    copy_weights,
    expected_local,
    failures,
    one_thread,
    perturb,
    rel_err,
    weight_errors,
)

from domino import ParallelState
from domino.bench.hooks import BenchHook
from domino.bench.timeline import Timeline
from domino.context_parallel import SequenceMask
from domino.enums import AttnMaskType
from domino.gpt_model import GPTModel
from domino.language_model import TransformerLanguageModel
from domino.parallel_state import ParallelSizes
from domino.runtime import CP_COMM_TYPES, RuntimeConfig
from domino.transformer import Plan
from domino.transformer.moe.op import moe_ops
from domino.transformer.stack import stacks_of

BATCH, SEQ = 2, 16
COMMON = dict(hidden_size=64, num_attention_heads=8, seq_length=SEQ, max_position_embeddings=32)
MODELS = {
    "learned_gelu": dict(),
    "rope_swiglu_gqa_window": dict(normalization="RMSNorm", activation="swiglu",
                                   position_embedding_type="rope", num_query_groups=4,
                                   add_bias_linear=False, window_size=5,
                                   # Granite's scalars: the ring's softmax scale among them
                                   embedding_multiplier=2.0, residual_multiplier=0.5,
                                   softmax_scale=0.3, logits_scaling=2.0,
                                   nope_layers=(1,),  # (SmolLM3's: no RoPE on layer 1)
                                   # Phi-3's LongRoPE, long past 12 positions: a CP rank
                                   # holding only middle chunks must still choose the long
                                   # factors (as the whole sequence does)
                                   rope_scaling_type="longrope",
                                   rope_short_factor=(1.0, 1.5, 2.0, 4.0),
                                   rope_long_factor=(2.0, 3.0, 5.0, 9.0),
                                   rope_original_max_position_embeddings=12),
}
# name -> (plan, sequence parallelism: on at TP=2 only)
PLANS = {"sync": (Plan(1, "none", 1), False), "m2_cross": (Plan(2, "cross_layer", 1), False),
         "m2_cross_sp": (Plan(2, "cross_layer", 1), True)}
WORLDS = {2: dict(cp=2), 4: dict(cp=2, tp=2)}
MASKED, MASKS = "rope_swiglu_gqa_window", ("whole", "shard")  # documents + key padding
CP4_PLANS = ("sync", "m2_cross")  # CP = 4 at TP = 1, in the four-rank spawn
# CP = 2 (two-rank spawn) with bf16 compute and with compiled pieces, under m2_cross.
RUNTIMES = {"bf16": dict(compute_dtype=torch.bfloat16),
            "compiled": dict(compile=True, compile_backend="aot_eager")}
RUNTIME_TOL = {"bf16": 3e-2, "compiled": 1e-5}  # bf16: a few bf16 roundings deep
# MoE layers under CP: each CP rank routes its chunks' tokens; the router statistics, the
# auxiliary losses and a capacity's choice are the whole sequences'.
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.1,
           moe_z_loss_coeff=0.01, init_method_std=0.2, normalization="RMSNorm",
           activation="swiglu", position_embedding_type="rope", add_bias_linear=False)
MOE_VARIANTS = {
    "dropless": {},
    # token order decides the drops: the capacity must see the sequences in true order
    "capacity_position_pad": dict(moe_expert_capacity_factor=0.6, moe_token_drop_policy="position",
                                  moe_pad_expert_input_to_capacity=True),
    "capacity_probs_shared": dict(moe_expert_capacity_factor=0.8,
                                  moe_shared_expert_intermediate_size=32,
                                  moe_shared_expert_gate=True),
}
# world -> [(sizes, plan name)]: CP = 2 with EP = 1 and EP = 2 (EP within DP x CP), TP = 2 x
# CP = 2 (sequence parallel, as MoE at TP > 1 trains), CP = 4
MOE_RUNS = {2: [(dict(cp=2), "sync"), (dict(cp=2), "m2_cross"), (dict(cp=2, ep=2), "m2_cross")],
            4: [(dict(cp=2, tp=2), "m2_cross_sp"), (dict(cp=4), "m2_cross")]}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _shard(x: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """[b, s] -> this rank's [b, s/cp]: chunks rank and 2*cp-1-rank of 2*cp."""
    chunks = x.chunk(2 * cp, dim=1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)


def _unshard(shards: list) -> torch.Tensor:
    cp = len(shards)
    chunks = [None] * (2 * cp)
    for r, x in enumerate(shards):
        chunks[r], chunks[2 * cp - 1 - r] = x.chunk(2, dim=1)
    return torch.cat(chunks, dim=1)


def _whole(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Every CP rank's shard [b, s/cp] of ``x``, in true order."""
    parts = [torch.empty_like(x) for _ in range(state.cp.size)]
    dist.all_gather(parts, x.contiguous(), group=state.cp.group)
    return _unshard(parts)


def _sum_grads_over_cp(model: torch.nn.Module, state: ParallelState) -> None:
    """What a trainer's DP x CP reduction does for dense weights (here DP = 1)."""
    for p in model.parameters():
        dist.all_reduce(p.grad, group=state.cp.group)


def _masks() -> tuple[torch.Tensor, torch.Tensor]:
    """[B, SEQ] document ids (packed documents of uneven lengths) and key padding (True = pad:
    sample 0's first 3 keys, so its first queries see no key at all; scattered in sample 1)."""
    docs = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for b, starts in enumerate(([5, 6, 11], [9])):
        docs[b, starts] = 1
    docs = docs.cumsum(1)
    pad = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    pad[0, :3] = True
    pad[1, [4, 13]] = True
    return docs, pad


def _case(state: ParallelState, model_name: str, comm: str, plan: Plan, sp: bool,
          masks: str | None = None, runtime: str | None = None) -> dict:
    """``masks``: documents and key padding, given to the CP model as a SequenceMask of the
    ``whole`` sequence or of each rank's ``shard``, to the reference as a dense mask.
    ``runtime``: a RUNTIMES entry of the CP model (the reference is the fp32 model)."""
    cfg = config(**{**COMMON, **MODELS[model_name]})
    extra = RUNTIMES[runtime] if runtime else {}
    torch.manual_seed(0)
    ref = GPTModel(cfg, parallel_state=ParallelState.single())
    perturb(ref, seed=1, vocab=cfg.vocab_size)
    model = GPTModel(cfg, parallel_state=state,
                     runtime=RuntimeConfig(plan=plan, cp_comm_type=comm, sequence_parallel=sp,
                                           **extra))
    copy_weights(model, ref, state.tp, cfg.vocab_size)
    model.language_model.encoder.set_plan(plan, force=True)  # split at TP=1 too
    cp, rank = state.cp.size, state.cp.rank
    positions = _shard(torch.arange(SEQ).expand(BATCH, SEQ), rank, cp)
    kind, lr = ("sgd", 0.02) if model_name == "learned_gelu" else ("adam", 2e-4)
    opt_m, opt_r = (TinyOptimizer(m.parameters(), kind, lr=lr) for m in (model, ref))
    mask = mask_ref = None
    if masks is not None:
        docs, pad = _masks()
        mask_ref = ((docs[:, :, None] != docs[:, None, :]) | pad[:, None, :]).unsqueeze(1)
        if masks == "shard":
            docs, pad = _shard(docs, rank, cp), _shard(pad, rank, cp)
        mask = SequenceMask(document_ids=docs, key_padding=pad)
    gen = torch.Generator().manual_seed(2)
    res = {}
    for step in range(2):
        ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
        wts = torch.rand(BATCH, SEQ, generator=gen)
        loss = model(_shard(ids, rank, cp), positions, mask, labels=_shard(labels, rank, cp))
        loss_ref = ref(ids, None, mask_ref, labels=labels)
        res[f"loss{step}"] = rel_err(_whole(loss.detach(), state), loss_ref)
        if step == 1:
            break
        (loss * _shard(wts, rank, cp)).sum().backward()
        (loss_ref * wts).sum().backward()
        _sum_grads_over_cp(model, state)
        refs = dict(ref.named_parameters())
        res["grads"] = {n: rel_err(p.grad, expected_local(n, refs[n].grad, p, state.tp,
                                                          cfg.vocab_size))
                        for n, p in model.named_parameters()}
        opt_m.step()
        opt_r.step()
    res["weights"] = weight_errors(model, ref, state.tp, cfg.vocab_size)
    if comm == "p2p" and plan.micro_batches == 1 and masks is None:
        with torch.no_grad():  # positions left out: the shard's true ones
            again = model(_shard(ids, rank, cp), None, None, labels=_shard(labels, rank, cp))
        res["default_positions"] = rel_err(again, loss.detach())
    return res


def _expert_local(name: str, full: torch.Tensor, like: torch.Tensor, state: ParallelState,
                  vocab: int) -> torch.Tensor:
    """This rank's share of a parameter (or gradient): experts by EP rank, the rest by TP."""
    if ".experts." in name:
        return full.chunk(state.ep.size, dim=0)[state.ep.rank]
    return expected_local(name, full, like, state.tp, vocab)


def _moe_case(state: ParallelState, variant: str, plan: Plan, sp: bool) -> dict:
    """A GPT of MoE layers at this state's CP (x TP x EP) vs the single-process model on the
    whole micro-batch: per-token losses, each layer's router statistics (assignments per
    expert; load-balancing loss, z-loss, dropped assignments), every gradient (dense ones
    summed over DP x CP, experts' over expert-DP, as a trainer does)."""
    cfg = config(**{**COMMON, **MOE, **MOE_VARIANTS[variant]})
    torch.manual_seed(0)
    ref = GPTModel(cfg, parallel_state=ParallelState.single())
    perturb(ref, seed=1, vocab=cfg.vocab_size)
    model = GPTModel(cfg, parallel_state=state,
                     runtime=RuntimeConfig(plan=plan, sequence_parallel=sp))
    refs = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(_expert_local(n, refs[n], p, state, cfg.vocab_size))
    model.language_model.encoder.set_plan(plan, force=True)
    cp, rank = state.cp.size, state.cp.rank
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    wts = torch.rand(BATCH, SEQ, generator=gen)
    positions = _shard(torch.arange(SEQ).expand(BATCH, SEQ), rank, cp)
    loss = model(_shard(ids, rank, cp), positions, None, labels=_shard(labels, rank, cp))
    loss_ref = ref(ids, None, None, labels=labels)
    (loss * _shard(wts, rank, cp)).sum().backward()
    (loss_ref * wts).sum().backward()
    for n, p in model.named_parameters():
        group = state.expert_dp if ".experts." in n else state.dp_cp
        if p.grad is not None and group.size > 1:
            dist.all_reduce(p.grad, group=group.group)
    res = {"loss": rel_err(_whole(loss.detach(), state), loss_ref)}
    ops, ref_ops = moe_ops(model), moe_ops(ref)
    assert len(ops) == cfg.num_layers
    for i, (op, op_ref) in enumerate(zip(ops, ref_ops, strict=True)):
        op.close_run()
        op_ref.close_run()
        res[f"counts{i}"] = rel_err(op.counts, op_ref.counts)
        res[f"balance, z, dropped, runs {i}"] = rel_err(op.sums, op_ref.sums)
        res[f"dropped{i}"] = float(op_ref.sums[2] > 0)  # (checked per variant)
    res["grads"] = {n: rel_err(p.grad, _expert_local(n, refs[n].grad, p, state,
                                                     cfg.vocab_size))
                    for n, p in model.named_parameters() if refs[n].grad is not None}
    return res


def _errors(state: ParallelState) -> dict:
    """What CP refuses, at construction or (a dense mask) before the first collective: the
    message of each."""
    out = {}
    builds = {
        "attention_dropout": lambda: GPTModel(config(**COMMON, attention_dropout=0.1),
                                              parallel_state=state),
        "a2a_heads": lambda: GPTModel(config(**COMMON, num_query_groups=state.tp.size),
                                      parallel_state=state,
                                      runtime=RuntimeConfig(cp_comm_type="a2a")),
        "encoder_decoder": lambda: TransformerLanguageModel(
            config(**COMMON), AttnMaskType.padding, add_decoder=True, parallel_state=state),
        "dense_mask": lambda: GPTModel(config(**COMMON), parallel_state=state)(
            torch.zeros(BATCH, SEQ // 2, dtype=torch.long), None,
            torch.zeros(BATCH, 1, SEQ // 2, SEQ, dtype=torch.bool)),
    }
    for name, build in builds.items():
        try:
            build()
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _ring_order(state: ParallelState) -> dict:
    """Under a Domino plan of two micro-batches, in the forward of the first layer and the
    backward of the last: is micro-batch 1's exchange launched before micro-batch 0's is seen
    finished, at its wait (so micro-batch 0's transfer runs under micro-batch 1's compute)?
    With the ring's transfers waited for at once (the benchmark's sync baseline), not."""
    cfg = config(**{**COMMON, **MODELS[MASKED]})
    out = {}
    for name, overlap in (("m2", True), ("m2 sync", False)):
        plan = PLANS["m2_cross"][0]
        torch.manual_seed(0)
        model = GPTModel(cfg, parallel_state=state, runtime=RuntimeConfig(plan=plan))
        timeline = Timeline(state.cp.rank)
        state.cp.hook = BenchHook(timeline=timeline)  # each transfer: launch to finish
        ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ // state.cp.size))
        try:
            for stack in stacks_of(model):
                stack.set_ring_overlap(overlap)
            model(ids, None, None, labels=ids).sum().backward()
        finally:
            state.cp.hook = None
        for direction in ("fwd kv", "bwd dkv"):
            # the first two launched: micro-batches 0 and 1 of one layer
            first, second = sorted((t for t in timeline.by_category("comm")
                                    if t.name == f"cp {direction}"), key=lambda t: t.start_s)[:2]
            out[(name, direction)] = ((first.args["mb"], second.args["mb"]),
                                      second.start_s < first.end_s)
    return out


def _compat(world: int) -> tuple:
    """Megatron's mpu functions over a state with CP."""
    from domino import megatron_compat as mpu

    mpu.initialize_model_parallel(WORLDS[world].get("tp", 1), shared_memory=False,
                                  context_parallel_size=WORLDS[world]["cp"])
    try:
        return (mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank(),
                mpu.get_data_parallel_world_size(), mpu.get_context_parallel_group() is not None)
    finally:
        mpu.destroy_model_parallel()


def _rank(rank: int, world: int) -> dict:
    state = ParallelState.from_sizes(ParallelSizes.for_world(world, **WORLDS[world]))
    try:
        out = {(m, c, p): _case(state, m, c, *PLANS[p]) for m in MODELS for c in CP_COMM_TYPES
               for p in PLANS if state.tp.size > 1 or not PLANS[p][1]}
        for c in CP_COMM_TYPES:
            for masks in MASKS:
                out[(MASKED, c, masks)] = _case(state, MASKED, c, *PLANS["m2_cross"], masks)
        if world == 2:
            for name in RUNTIMES:
                for c in CP_COMM_TYPES if name == "bf16" else ("p2p",):
                    out[(name, c)] = _case(state, MASKED, c, *PLANS["m2_cross"], "shard", name)
        out["errors"] = _errors(state)
        out["compat"] = _compat(world)
        if world == 2:
            out["ring order"] = _ring_order(state)
    finally:
        state.close()
    for sizes, plan in MOE_RUNS[world]:
        moe_state = ParallelState.from_sizes(ParallelSizes.for_world(world, **sizes))
        try:
            for variant in MOE_VARIANTS:
                key = ("moe", variant, tuple(sorted(sizes.items())), plan)
                out[key] = _moe_case(moe_state, variant, *PLANS[plan])
        finally:
            moe_state.close()
    if world == 4:  # CP = 4 (TP = 1) on the same four ranks: chunks of 2 tokens
        cp4 = ParallelState.from_sizes(ParallelSizes.for_world(4, cp=4))
        try:
            for c in CP_COMM_TYPES:
                for m in MODELS:
                    for p in CP4_PLANS:
                        out[("cp4", m, c, p)] = _case(cp4, m, c, *PLANS[p])
                out[("cp4", MASKED, c, "shard")] = _case(cp4, MASKED, c, *PLANS["m2_cross"],
                                                         "shard")
        finally:
            cp4.close()
    return out


_RESULTS: dict = {}


def _results(world: int) -> list:
    if world not in _RESULTS:
        _RESULTS[world] = run_distributed(_rank, world)
    return _RESULTS[world]


def test_ring_transfers_run_under_the_other_micro_batch() -> None:
    """Forward: micro-batch 1's first K/V exchange is launched (at its Q/K/V GEMM, from inside
    micro-batch 0's attention) before micro-batch 0's is waited for. Backward: micro-batch 1's
    dK/dV exchange is launched (in its attention's backward) before micro-batch 0's is waited
    for (in micro-batch 0's local^T, at one TP rank). The sync baseline waits each before the
    next goes out. (The numbers: test_cp_gpt_matches_single_process.)"""
    for rank, per_rank in enumerate(_results(2)):
        order = per_rank["ring order"]
        for direction in ("fwd kv", "bwd dkv"):
            assert order[("m2", direction)] == ((0, 1), True), f"rank {rank}: {order}"
            assert order[("m2 sync", direction)] == ((0, 1), False), f"rank {rank}: {order}"


@pytest.mark.parametrize("comm", list(CP_COMM_TYPES))
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(("world", "plan"), [(w, p) for w in WORLDS for p in PLANS
                                             if w == 4 or not PLANS[p][1]])
def test_cp_gpt_matches_single_process(world, plan, model, comm) -> None:
    for rank, per_rank in enumerate(_results(world)):
        res = per_rank[(model, comm, plan)]
        where = f"world {world} ({WORLDS[world]}) rank {rank}: {model} {comm} {plan}"
        scalars = {k: v for k, v in res.items() if k not in ("grads", "weights")}
        assert not failures(scalars), f"{where}: {failures(scalars)}"
        assert not failures(res["grads"]), f"{where} gradients: {failures(res['grads'])}"
        assert not failures(res["weights"]), f"{where} weights after a step: " \
            f"{failures(res['weights'])}"


@pytest.mark.parametrize("masks", MASKS)
@pytest.mark.parametrize("comm", list(CP_COMM_TYPES))
@pytest.mark.parametrize("world", list(WORLDS))
def test_cp_gpt_with_documents_and_padding(world, comm, masks) -> None:
    for rank, per_rank in enumerate(_results(world)):
        res = per_rank[(MASKED, comm, masks)]
        where = f"world {world} rank {rank}: {comm}, masks of the {masks} sequence"
        bad = {**failures({k: v for k, v in res.items() if k not in ("grads", "weights")}),
               **failures(res["grads"]), **failures(res["weights"])}
        assert not bad, f"{where}: {bad}"


@pytest.mark.parametrize("comm", list(CP_COMM_TYPES))
def test_cp4_gpt_matches_single_process(comm) -> None:
    """CP = 4 (TP = 1): both models under both plans, and documents with padding given as
    shards, equal the single-process model (losses, every gradient, weights after a step)."""
    for rank, per_rank in enumerate(_results(4)):
        for key, res in per_rank.items():
            if not (isinstance(key, tuple) and key[0] == "cp4" and key[2] == comm):
                continue
            bad = {**failures({k: v for k, v in res.items() if k not in ("grads", "weights")}),
                   **failures(res["grads"]), **failures(res["weights"])}
            assert not bad, f"CP=4 rank {rank} {key}: {bad}"
    assert sum(1 for k in _results(4)[0] if isinstance(k, tuple) and k[0] == "cp4") == \
        len(CP_COMM_TYPES) * (len(MODELS) * len(CP4_PLANS) + 1)


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
@pytest.mark.parametrize("world", list(WORLDS))
def test_cp_moe_gpt_matches_single_process(world, variant) -> None:
    """MoE layers under CP = 2 (EP = 1 and 2, sync and Domino), TP = 2 x CP = 2 (sequence
    parallel) and CP = 4: losses, router statistics and every gradient of the single-process
    model on the whole micro-batch."""
    ranks = _results(world)
    keys = [k for k in ranks[0] if isinstance(k, tuple) and k[:2] == ("moe", variant)]
    assert len(keys) == len(MOE_RUNS[world])
    for rank, per_rank in enumerate(ranks):
        for key in keys:
            res = per_rank[key]
            scalars = {k: v for k, v in res.items() if k != "grads" and not k.startswith("dropped")}
            bad = {**failures(scalars), **failures(res["grads"])}
            assert not bad, f"rank {rank} {key}: {bad}"
            # the capacity variants do drop (else they would test nothing more than dropless)
            assert any(res[f"dropped{i}"] for i in range(2)) == (variant != "dropless"), key


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_cp_gpt_in_bf16_and_compiled(runtime) -> None:
    """CP = 2 with bf16 compute (every kind; against the single-process model computing in
    bf16) and with compiled pieces (the ring stays eager between them)."""
    keys = [k for k in _results(2)[0] if isinstance(k, tuple) and k[0] == runtime]
    assert len(keys) == (len(CP_COMM_TYPES) if runtime == "bf16" else 1)
    for rank, per_rank in enumerate(_results(2)):
        for key in keys:
            res = per_rank[key]
            tol = RUNTIME_TOL[runtime]
            bad = {**failures({k: v for k, v in res.items() if k not in ("grads", "weights")},
                              tol), **failures(res["grads"], tol), **failures(res["weights"], tol)}
            assert not bad, f"CP=2 rank {rank} {key}: {bad}"


@pytest.mark.parametrize("world", list(WORLDS))
def test_cp_model_configuration_errors(world) -> None:
    for errors in (r["errors"] for r in _results(world)):
        assert all("context" in e for e in errors.values()), errors
        assert "attention_dropout=0.1" in errors["attention_dropout"]
        assert "context_parallel_size=1" in errors["attention_dropout"]
        assert "num_query_groups" in errors["a2a_heads"] and "p2p" in errors["a2a_heads"]
        assert "SequenceMask" in errors["dense_mask"]
    tp = WORLDS[world].get("tp", 1)
    assert [r["compat"] for r in _results(world)] == [(2, rank // tp, 1, True)
                                                      for rank in range(world)]
