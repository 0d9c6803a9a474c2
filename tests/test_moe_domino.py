"""Domino's schedule on MoE layers (``transformer/moe/edges.py``): the dispatch and combine
all-to-alls overlapped with other micro-batches' work must not change the math.

Every plan (micro-batches, overlap, groups of experts per combine), with recomputation, at
EP = 1, 2 and 4, gives the losses, router statistics and every gradient of the single-process
model (EP = 1, one piece) on the same micro-batches; that one equals the independent plain-PyTorch
reference (``reference.py``) where its routing is dropless. Routing corner cases are variants:
an expert no token reaches, tokens none of whose experts a rank holds, every token to one expert
(a rank then receives nothing), capacity drops with padding. Every EP rank launches the same
collectives in the same order although one rank's launches are slow.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from dist import run_distributed
from reference import reference_loss, reference_weights

from domino.config import TransformerConfig
from domino.models.gpt import GPTModel
from domino.parallel_state import ParallelState
from domino.plan import Plan
from domino.runtime import RuntimeConfig
from domino.transformer.moe.op import moe_ops

PLANS = ("m1:none", "m2:intra", "m2:cross", "m4:cross:c2", "m3:cross:c4", "m2:cross+full")
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8,
            max_position_embeddings=8, num_experts=8, moe_router_topk=2,
            moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, hidden_dropout=0.0,
            attention_dropout=0.0, init_method_std=0.2)
VARIANTS = {
    "dropless": {},
    "shared_gelu": dict(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                        activation="gelu", moe_first_k_dense_layers=1, num_layers=3),
    "capacity_pad": dict(moe_expert_capacity_factor=0.6, moe_pad_expert_input_to_capacity=True,
                         moe_token_drop_policy="position"),
    # The bias picks expert 0 for every token and never expert 7: rank 1 of EP = 2 (experts
    # 4..7) misses every token whose second choice is below 4.
    "hot_expert": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_expert_capacity_factor=None),
    # top-1, all to expert 0: every other rank receives no row at all.
    "all_to_one": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_router_topk=1),
    # GPT-OSS's: a bias on the router's logits and on each expert's fc1 and fc2 (made nonzero:
    # _gpt_oss_biases), the clamped, scaled SwiGLU with the offset linear half, attention sinks.
    "gpt_oss": dict(activation="swiglu", swiglu_alpha=1.702, glu_linear_offset=1.0,
                    activation_func_clamp_value=0.3, moe_router_bias=True,
                    moe_expert_linear_bias=True, attention_sinks=True, normalization="RMSNorm"),
}
BIAS = {"hot_expert": [5.0, 0, 0, 0, 0, 0, 0, -5.0], "all_to_one": [5.0] + [0.0] * 7}
BATCH = 12  # sequences per micro-batch
# bf16 on SDPA's math backend: the attention path its tolerance was set on (this checks the
# experts' parallelism; tests/test_attention_paths.py checks each path's bf16 error).
RUNTIMES = {"bf16": dict(compute_dtype=torch.bfloat16, attention_backend="math"),
            "compiled": dict(compile=True, compile_backend="aot_eager")}


def _model(variant: str, plan: str, state: ParallelState, runtime: dict | None = None,
           **variant_kw) -> GPTModel:
    plan, _, recompute = plan.partition("+")
    cfg = TransformerConfig(**{**BASE, **VARIANTS.get(variant, {}), **variant_kw})
    torch.manual_seed(0)
    model = GPTModel(cfg, parallel_state=state, runtime=RuntimeConfig(
        recompute_granularity=recompute or None, sequence_parallel=state.tp.size > 1,
        **(runtime or {})))
    # (at EP = 1 nothing communicates, so a stack splits only when told to)
    model.language_model.encoder.set_plan(Plan.parse(plan), force=True)
    for op in moe_ops(model):
        if variant in BIAS:
            op.moe.router.expert_bias.copy_(torch.tensor(BIAS[variant]))
    if variant == "gpt_oss":
        _gpt_oss_biases(model, state)
    return model


@torch.no_grad()
def _gpt_oss_biases(model: GPTModel, state: ParallelState) -> None:
    """Random router and expert biases and sinks (they start at 0), drawn whole and sliced as
    the parameter is sharded (over EP or TP), so every parallel layout holds the same model."""
    from domino.tensor_parallel.placement import placement_of

    gen = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if name.endswith(("router.bias", "fc1_bias", "fc2_bias", "sinks")):
            group = {"ep": state.ep, "tp": state.tp}.get(placement_of(p).shard)
            size = group.size if group is not None else 1
            noise = torch.randn(p.shape[0] * size, *p.shape[1:], generator=gen) * 0.5
            p.add_(noise.chunk(size)[group.rank] if group is not None else noise)


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, 9), generator=torch.Generator().manual_seed(50 + rank))


def _step(model: GPTModel, ids: torch.Tensor) -> dict:
    loss = model(ids[:, :-1], None, None, labels=ids[:, 1:])
    loss.sum().backward()
    ops = moe_ops(model)
    for op in ops:
        op.close_run()
    return {"loss": loss.detach(), "stats": [(op.counts, op.sums) for op in ops],
            "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


class _SlowLaunches:
    """A hook on the EP group: records each collective it launches (kind, name) and, on rank 1,
    launches it late; the real collective then runs (``launch`` returns None)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.launched, self.events = rank, [], []

    def launch(self, tensor, group, kind="all_reduce"):
        self.launched.append((kind, tuple(tensor.shape[1:])))  # rows differ by routing
        # (an all-to-all shows the rows it sends other ranks: the counts' 1-d, named so)
        self.events.append(("launch", tensor.shape[-1] if tensor.dim() > 1 else "counts"))
        if self.rank == 1:
            time.sleep(0.002)
        return None

    def finished(self, name, tags, *args) -> None:
        self.events.append(("wait", (name, tags.get("mb"), tags.get("chunk"))))

    def region(self, name: str, category: str, **tags):
        return contextlib.nullcontext()


def _ep_rank(rank: int, world: int) -> dict:
    state = ParallelState.build(expert_model_parallel_size=world)
    out = {}
    for variant in VARIANTS:
        for plan in PLANS:
            model = _model(variant, plan, state)
            state.ep.hook = hook = _SlowLaunches(rank)
            marks = [op.moe.experts.register_forward_pre_hook(
                lambda *a, hook=hook: hook.events.append(("experts", 0))) for op in moe_ops(model)]
            try:
                out[variant, plan] = _step(model, _ids(rank))
            finally:
                state.ep.hook = None
                for mark in marks:
                    mark.remove()
            out[variant, plan]["launched"] = hook.launched
            out[variant, plan]["events"] = hook.events
    if world == 2:  # bf16 compute, and compiled local pieces, under the overlapped plan
        for name, runtime in RUNTIMES.items():
            out[name] = _step(_model("capacity_pad", "m2:cross:c2", state, runtime), _ids(rank))
    return out


def _reference(variant: str, world: int) -> list[dict]:
    """The single-process model (EP = 1, one piece) on each rank's micro-batch."""
    return [_step(_model(variant, "m1:none", ParallelState.single()), _ids(r))
            for r in range(world)]


def _close(got, want, what: str, tol: float = 1e-5) -> None:
    """Equal within fp32 rounding: the largest difference against the largest value."""
    assert got.shape == want.shape, what
    err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-3)
    assert err < tol, f"{what}: relative error {err:.2e}"


def _check_like(got: dict, ref: list[dict], rank: int, world: int, what: str,
                tol: float = 1e-5) -> None:
    """One rank's step against the reference: its loss and statistics are its micro-batch's;
    its experts' gradients are every micro-batch's (its slice); its other gradients its own."""
    want = ref[rank]
    _close(got["loss"], want["loss"], f"{what} loss", tol)
    for (c, s), (wc, ws) in zip(got["stats"], want["stats"], strict=True):
        _close(c, wc, f"{what} counts", tol)
        _close(s, ws, f"{what} balance, z, dropped, runs", tol)
    for name, g in got["grads"].items():
        if ".experts." in name:
            total = sum(r["grads"][name] for r in ref)
            local = total.shape[0] // world
            _close(g, total[rank * local:(rank + 1) * local], f"{what} {name}", tol)
        else:
            _close(g, want["grads"][name], f"{what} {name}", tol)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_plan_equals_one_piece_on_one_rank(variant: str) -> None:
    ref = _reference(variant, 1)
    for plan in PLANS[1:]:
        got = _step(_model(variant, plan, ParallelState.single()), _ids(0))
        _check_like(got, ref, 0, 1, f"{variant} {plan}")
    if variant in ("dropless", "shared_gelu", "gpt_oss"):
        return
    # The corner cases happen: drops, an expert with no token, a rank with none (EP = 2).
    counts, sums = ref[0]["stats"][-1]
    assert variant != "capacity_pad" or float(sums[2]) > 0
    assert variant == "capacity_pad" or float(counts[-1]) == 0


def test_the_received_rows_gradient_is_gathered_once() -> None:
    """The experts read the received rows (and their weight column) group by group; their
    gradients land in one buffer per micro-batch and MoE layer, each row written once, not in
    a zero-filled gradient of all the rows per read (autograd's slice backward), which grew
    with the groups."""
    from torch.utils._python_dispatch import TorchDispatchMode

    width = BASE["hidden_size"] + 4  # the rows sent: h, the weight, padding to 16 bytes

    class Made(TorchDispatchMode):
        """Counts the ops that write a tensor of the rows' width (not views of one)."""

        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (not func.is_view and isinstance(out, torch.Tensor) and out.dim() == 2
                    and out.shape[1] == width):
                Made.ops.append(str(func))
            return out

    model = _model("dropless", "m2:cross:c4", ParallelState.single())
    loss = model(_ids(0)[:, :-1], None, None, labels=_ids(0)[:, 1:])
    with Made():
        loss.sum().backward()
    # One buffer per micro-batch and MoE layer, each row written once (was: a zero-filled
    # slice backward per read and group, and the adds of their sums: 92 ops here).
    assert Made.ops == ["aten.empty_like.default"] * 2 * BASE["num_layers"], Made.ops
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    want = _reference("dropless", 1)[0]["grads"]
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-5, msg=name)


def test_the_one_piece_model_equals_the_plain_reference() -> None:
    for variant in ("dropless", "shared_gelu", "gpt_oss"):
        cfg = TransformerConfig(**{**BASE, **VARIANTS[variant], "moe_aux_loss_coeff": 0.0,
                                   "moe_z_loss_coeff": None})
        torch.manual_seed(0)
        model = GPTModel(cfg, parallel_state=ParallelState.single())
        if variant == "gpt_oss":
            _gpt_oss_biases(model, ParallelState.single())
        ids = _ids(0)
        w = reference_weights(model)
        want = reference_loss(w, cfg, ids[:, :-1], ids[:, 1:])
        loss = model(ids[:, :-1], None, None, labels=ids[:, 1:])
        loss.sum().backward()
        want.sum().backward()
        _close(loss.detach(), want.detach(), f"{variant} loss")
        for name, p in model.named_parameters():
            if p.requires_grad:
                _close(p.grad, w[name].grad, f"{variant} {name}")


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_plans_equal_the_reference(world: int) -> None:
    ranks = run_distributed(_ep_rank, world)
    for variant in VARIANTS:
        ref = _reference(variant, world)
        for plan in PLANS:
            for rank, res in enumerate(ranks):
                _check_like(res[variant, plan], ref, rank, world, f"EP={world} {variant} {plan}")
            launched = [res[variant, plan]["launched"] for res in ranks]
            assert len(launched[0]) >= 4 and all(x == launched[0] for x in launched), plan
        if world == 2 and variant == "capacity_pad":
            for name, runtime in RUNTIMES.items():  # against the one-piece model in kind
                one = [_step(_model(variant, "m1:none", ParallelState.single(), runtime),
                             _ids(r)) for r in range(world)]
                tol = 3e-2 if name == "bf16" else 1e-5  # a few bf16 roundings deep
                for rank, res in enumerate(ranks):
                    _check_like(res[name], one, rank, world, f"EP=2 {name}", tol)
        # Overlap (a launch's last dim; "counts" for the per-expert counts): micro-batch 1's
        # dispatch (counts, then rows with their weight column) goes out before micro-batch
        # 0's experts run; with groups of experts its rows go right after the first group's
        # combine (its counts travel under that group); with one piece, the experts run right
        # after their own dispatch.
        # With groups the dispatch is sent per group too (its token chunks): the first
        # group's experts run before the second group's rows are waited for.
        e, h = "counts", BASE["hidden_size"]
        for plan, before, between in (("m2:cross", [e, 36, e, 36], None),
                                      ("m4:cross:c2", [e, 36, 36, e], [h, 36, 36]),
                                      ("m1:none", [e, 36], None)):
            events = ranks[0][variant, plan]["events"]
            first = events.index(("experts", 0))
            second = events.index(("experts", 0), first + 1)
            launched = [w for k, w in events[:first] if k == "launch"]
            assert launched == before, (plan, events[:first])
            got = [w for k, w in events[first + 1:second] if k == "launch"]
            assert between is None or got == between, (plan, got)
            if plan == "m4:cross:c2":  # (where micro-batch 0's groups' rows are waited for)
                at = {w[1:]: i for i, (k, w) in enumerate(events[:second])
                      if k == "wait" and w[0].startswith("fwd dispatch b")}
                assert at[0, 0] < first < at[0, 1] < second, events[:second]


# TP = 2 x EP = 2 on four ranks (DP = 2): each TP rank routes its sequence shard to whole
# experts; "probs" capacity decides on both shards' routing.
TP_PLANS = ("m1:none", "m2:cross", "m4:cross:c2", "m2:cross+full")
TP_VARIANTS = {**VARIANTS, "capacity_probs": dict(moe_expert_capacity_factor=0.6)}


def _tp_ep_rank(rank: int, world: int) -> dict:
    from domino.tensor_parallel.layers import gather_full
    from domino.tensor_parallel.placement import placement_of

    state = ParallelState.build(2, expert_model_parallel_size=2)
    # Gradient groups never share a process group with the schedule's (same ranks here: the
    # TP pair reduces experts, the DP pair is the EP group): their launch orders differ.
    assert state.expert_dp.group is not state.tp.group
    assert state.dp_cp.group is not state.ep.group
    out = {}
    for variant in TP_VARIANTS:
        for plan in TP_PLANS:
            model = _model(variant, plan, state, **TP_VARIANTS.get(variant, {}))
            res = _step(model, _ids(state.dp.rank))
            # TP shards gathered whole (every rank, in one order: a collective)
            res["grads"] = {n: gather_full(p.grad, p, state.tp)
                            if placement_of(p).shard == "tp" else p.grad
                            for n, p in model.named_parameters() if p.grad is not None}
            out[variant, plan] = res
    out["ranks"] = (state.dp.rank, state.tp.rank, state.ep.rank)
    return out


def test_tensor_and_expert_parallel_plans_equal_the_reference() -> None:
    """TP = 2 (sequence parallel) x EP = 2 x DP = 2: each DP rank's losses, router statistics
    and gradients are its micro-batch's in the single-process model, for every variant and
    plan; the experts' gradients, summed over the TP pair (as expert-DP x TP reduces them), are
    every micro-batch's."""
    ranks = run_distributed(_tp_ep_rank, 4)
    for variant in TP_VARIANTS:
        ref = [_step(_model(variant, "m1:none", ParallelState.single(),
                            **TP_VARIANTS.get(variant, {})), _ids(d)) for d in range(2)]
        for plan in TP_PLANS:
            what = f"TP=2 x EP=2 {variant} {plan}"
            for res in ranks:
                dp, tp, ep = res["ranks"]
                got, want = res[variant, plan], ref[dp]
                _close(got["loss"], want["loss"], f"{what} loss")
                for (c, s), (wc, ws) in zip(got["stats"], want["stats"], strict=True):
                    _close(c, wc, f"{what} counts")
                    _close(s, ws, f"{what} balance, z, dropped, runs")
                for name, g in got["grads"].items():
                    full = want["grads"][name]
                    if ".experts." in name:
                        pair = sum(r[variant, plan]["grads"][name] for r in ranks
                                   if r["ranks"][2] == ep)
                        total = sum(r["grads"][name] for r in ref)
                        local = total.shape[0] // 2
                        _close(pair, total[ep * local:(ep + 1) * local], f"{what} {name}")
                    else:  # a vocabulary table's padding differs with TP: the real rows
                        _close(g[tuple(slice(0, n) for n in full.shape)], full,
                               f"{what} {name}")
