"""MoE layers in the model and the trainer: the auxiliary losses' share of the gradient, router
statistics counted once per training forward (also under full recomputation, never from
evaluation or autotuning), the step's router metrics, and `domino train` with MoE: DP- and
EP-invariant, resuming exactly (also with ZeRO-1 at EP=2)."""

from __future__ import annotations

import math

import pytest
import torch
from dist import run_distributed

from domino.transformer.moe import aux_losses


@pytest.mark.parametrize("plan", ["m1:none", "m3:cross:c2"])
def test_the_auxiliary_losses_get_their_share_of_the_gradient(plan: str) -> None:
    """In a GPT with an MoE layer, the router's gradient is the token loss's plus
    ``aux_loss_scale`` x the gradient of its auxiliary losses on the tokens of the whole
    micro-batch, however the Domino plan splits it (three pieces here: the load-balancing loss
    of the whole is not the sum of the pieces'). (One layer: with more, a later layer's
    auxiliary losses also reach an earlier router through its output.)"""
    from domino.config import TransformerConfig
    from domino.models.gpt import GPTModel
    from domino.parallel_state import ParallelState
    from domino.plan import Plan
    from domino.runtime import RuntimeConfig
    from domino.transformer import BackwardContext
    from domino.transformer.moe.op import moe_ops

    def model(aux: float, z: float | None) -> GPTModel:
        torch.manual_seed(0)
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                vocab_size=64, num_experts=4, moe_aux_loss_coeff=aux,
                                moe_z_loss_coeff=z, hidden_dropout=0.0, attention_dropout=0.0)
        return GPTModel(cfg, parallel_state=ParallelState.single(),
                        runtime=RuntimeConfig(plan=Plan.parse(plan)))

    ids = torch.randint(0, 64, (6, 9), generator=torch.Generator().manual_seed(4))
    grads, inputs = {}, []
    for coeffs in ((0.0, None), (0.3, 0.05)):
        m = model(*coeffs)
        ops = moe_ops(m)
        hooks = [op.moe.router.register_forward_hook(
            lambda mod, a, out: inputs.append(a[0].detach())) for op in ops]
        context = BackwardContext(aux_loss_scale=0.7)
        m(ids[:, :-1], None, None, labels=ids[:, 1:], context=context).sum().backward()
        grads[coeffs] = [op.moe.router.weight.grad.clone() for op in ops]
        for h in hooks:
            h.remove()
    pieces = Plan.parse(plan).micro_batches
    (op,) = moe_ops(model(0.3, 0.05))
    x = torch.cat(inputs[:pieces])  # the first model's router inputs: the same routing
    _, stats = op.moe.router(x)
    balance, z = aux_losses(stats, op.topk)
    (want,) = torch.autograd.grad(0.7 * (0.3 * balance + 0.05 * z), op.moe.router.weight)
    torch.testing.assert_close(grads[(0.3, 0.05)][0] - grads[(0.0, None)][0], want,
                               rtol=1e-4, atol=1e-6)
    assert want.abs().max() > 1e-4


def test_router_statistics_count_each_training_forward_once() -> None:
    """Full recomputation runs an MoE op twice (without a graph in forward, with one in
    backward): its statistics and auxiliary-loss gradient count once, as without it; a forward
    without a graph (evaluation, generation, ``torch.no_grad``) records nothing."""
    from domino.config import TransformerConfig
    from domino.models.gpt import GPTModel
    from domino.parallel_state import ParallelState
    from domino.transformer import BackwardContext
    from domino.transformer.moe.op import moe_ops

    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    seen = {}
    for granularity in (None, "full"):
        torch.manual_seed(0)
        cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                vocab_size=64, num_experts=4, moe_aux_loss_coeff=0.3,
                                moe_z_loss_coeff=0.05, hidden_dropout=0.0,
                                attention_dropout=0.0, recompute_granularity=granularity)
        m = GPTModel(cfg, parallel_state=ParallelState.single())
        ops = moe_ops(m)
        with torch.no_grad():
            m(ids[:, :-1], None, None)
        assert all(float(op.sums[3]) == 0 and float(op.counts.sum()) == 0 for op in ops)
        context = BackwardContext(aux_loss_scale=0.7)
        m(ids[:, :-1], None, None, labels=ids[:, 1:], context=context).sum().backward()
        for op in ops:
            op.close_run()  # the micro-batch's losses join the sums
        seen[granularity] = [(op.counts.clone(), op.sums.clone(),
                              op.moe.router.weight.grad.clone()) for op in ops]
    for plain, recomputed in zip(seen[None], seen["full"]):
        assert float(plain[1][3]) == 1.0  # one forward
        for a, b in zip(plain, recomputed):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_step_metrics_follow_their_definitions() -> None:
    """step_end's metrics from a step's statistics: ``moe_dropped`` is the share of the router's
    T x k assignments the capacity dropped, ``moe_max_load`` the busiest expert's assignments
    over the mean; the expert bias moves towards the mean load; the statistics are reset."""
    from domino.config import TransformerConfig
    from domino.models.gpt import GPTModel
    from domino.parallel_state import ParallelState
    from domino.tensor_parallel import CommGroup
    from domino.transformer.moe.op import moe_ops, step_end

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                            num_experts=4, moe_expert_capacity_factor=0.5, init_method_std=0.3,
                            moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.1,
                            hidden_dropout=0.0, attention_dropout=0.0)
    m = GPTModel(cfg, parallel_state=ParallelState.single())
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    m(ids[:, :-1], None, None, labels=ids[:, 1:]).sum().backward()
    ops = moe_ops(m)
    for op in ops:
        op.close_run()
    stats = [(op.counts.clone(), float(op.sums[2])) for op in ops]
    assert all(float(c.sum()) == 2 * 8 * 2 for c, _ in stats)  # T x k, the dropped included
    assert all(d > 0 for _, d in stats)
    got = step_end(ops, CommGroup())
    assert got["moe_dropped"] == pytest.approx(sum(d / 32 for _, d in stats) / len(ops))
    assert got["moe_max_load"] == pytest.approx(max(float(c.max() / c.mean()) for c, _ in stats))
    for op, (c, _) in zip(ops, stats, strict=True):
        assert op.moe.router.expert_bias.tolist() == pytest.approx(
            (0.1 * torch.sign(c.mean() - c)).tolist())
        assert float(op.counts.sum()) == 0 and float(op.sums.abs().sum()) == 0


MOE_ARGS = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                moe_z_loss_coeff=0.001, moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.01, moe_expert_capacity_factor=1.25,
                moe_shared_expert_intermediate_size=16, moe_first_k_dense_layers=1,
                tensor_model_parallel_size=1)


def _moe_train(rank: int, world: int, data: str, tmp: str) -> dict:
    import json

    from test_checkpoint_resume import _args, _train

    out = {}
    run = dict(MOE_ARGS, micro_batch_size=2, num_layers=3)  # the same micro-batches at DP=1, 2
    out["full"] = _train(_args(data, **run), f"{tmp}/full{world}")
    _train(_args(data, exit_interval=3, **run), f"{tmp}/cut{world}")
    out["resumed"] = _train(_args(data, load=f"{tmp}/cut{world}", **run),
                            f"{tmp}/resumed{world}")
    if world == 2:  # expert parallelism: EP=2 (with ZeRO-1), its checkpoint continued at EP=1
        ep = dict(run, expert_model_parallel_size=2)
        out["ep2"] = _train(_args(data, **ep), f"{tmp}/ep2")
        out["ep2_tuned"] = _train(_args(data, domino_autotune=True, **ep), f"{tmp}/ep2_tuned")
        out["ep2_tuned"]["tried"] = sorted(json.loads(
            open(f"{tmp}/ep2_tuned/autotune.json").read())["median_s"])
        zero = dict(ep, use_distributed_optimizer=True)  # ZeRO-1's full_state, cut over EP
        out["ep2_zero"] = _train(_args(data, **zero), f"{tmp}/ep2_zero")
        _train(_args(data, exit_interval=3, **zero), f"{tmp}/ep2_zero_cut")
        out["ep2_zero_resumed"] = _train(_args(data, load=f"{tmp}/ep2_zero_cut", **zero),
                                         f"{tmp}/ep2_zero_resumed")
        _train(_args(data, exit_interval=3, **ep), f"{tmp}/ep2_cut")
        out["ep2_resumed"] = _train(_args(data, load=f"{tmp}/ep2_cut", **ep),
                                    f"{tmp}/ep2_resumed")
        out["ep2_at_ep1"] = _train(_args(data, load=f"{tmp}/ep2_cut", **run),
                                   f"{tmp}/ep2_at_ep1")
    return out



def _moe_tp_ep(rank: int, world: int, data: str, tmp: str) -> dict:
    """Four ranks: TP=2 (sequence parallel) x EP=2 x DP=2 with ZeRO-1, and its checkpoint
    continued at TP=4 x EP=1."""
    from test_checkpoint_resume import _args, _train

    run = dict(MOE_ARGS, micro_batch_size=2, num_layers=3, sequence_parallel=True,
               tensor_model_parallel_size=2, expert_model_parallel_size=2,
               use_distributed_optimizer=True)
    out = {"tp2ep2": _train(_args(data, **run), f"{tmp}/tp2ep2")}
    _train(_args(data, exit_interval=3, **run), f"{tmp}/tp2ep2_cut")
    tp4 = dict(run, tensor_model_parallel_size=4, expert_model_parallel_size=1)
    out["at_tp4"] = _train(_args(data, load=f"{tmp}/tp2ep2_cut", **tp4), f"{tmp}/at_tp4")
    return out


def _moe_recompute(rank: int, world: int, data: str, tmp: str) -> dict:
    import json

    from test_checkpoint_resume import _args, _train

    out = {}
    for name, kw in (("plain", {}), ("full", dict(recompute_granularity="full")),
                     ("tuned", dict(domino_autotune=True))):
        run_dir = f"{tmp}/{name}"
        out[name] = _train(_args(data, micro_batch_size=2, num_layers=3, **kw, **MOE_ARGS),
                           run_dir)
        out[name]["metrics"] = [
            {k: v for k, v in json.loads(line).items() if k.startswith("moe_")}
            for line in open(f"{run_dir}/metrics.jsonl").read().splitlines()]
    return out


def test_recomputation_and_autotuning_train_moe_as_without_them(byte_dataset,
                                                                tmp_path) -> None:
    """`domino train --recompute-granularity full` re-runs the MoE layers in backward, and
    `--domino-autotune` runs forwards and backwards before the first step: the same losses,
    gradient norms and router metrics (expert biases, drops) as without either."""
    res = run_distributed(_moe_recompute, 1, byte_dataset(200_000), str(tmp_path))[0]
    plain = res["plain"]
    assert plain["metrics"] and any(r["moe_dropped"] > 0 for r in plain["metrics"])
    for name in ("full", "tuned"):
        for key in ("losses", "norms"):
            assert res[name][key] == pytest.approx(plain[key], rel=1e-6), (name, key)
        for a, b in zip(plain["metrics"], res[name]["metrics"], strict=True):
            assert b == pytest.approx(a, rel=1e-6), name

def test_moe_trains_resumes_exactly_and_is_dp_invariant(byte_dataset, tmp_path) -> None:
    """`domino train` with MoE layers (first layer dense, capacity drops, shared expert,
    expert bias, auxiliary losses): DP=2 follows DP=1's accumulation of the same micro-batches
(routing, capacity and auxiliary losses are per micro-batch), a resume continues bit for
    bit (the expert biases are in the checkpoint), the router metrics are logged; TP=2 x EP=2
    follows too, and TP=2 without sequence parallelism is refused before any process starts."""
    import json

    from domino.cli import main

    data = byte_dataset(200_000)
    one = run_distributed(_moe_train, 1, data, str(tmp_path))[0]
    two = run_distributed(_moe_train, 2, data, str(tmp_path))
    full = one["full"]
    assert all(math.isfinite(x) for x in full["losses"])
    for res in (one, *two):
        assert res["resumed"]["losses"] == res["full"]["losses"][3:]
        assert res["resumed"]["norms"] == res["full"]["norms"][3:]
    assert two[0]["full"]["losses"] == pytest.approx(full["losses"], rel=1e-5)
    # Expert parallelism changes where experts run, not the math; its checkpoint holds whole
    # experts, so it resumes exactly at EP=2 and continues at EP=1.
    # --domino-autotune at EP=2 also tries the experts' groups alone (one micro-batch).
    assert two[0]["ep2_tuned"]["tried"] == ["m1:cross:c2", "m1:none", "m2:cross", "m2:cross:c2"]
    for rank in two:
        for key in ("ep2", "ep2_zero", "ep2_tuned"):
            assert rank[key]["losses"] == pytest.approx(full["losses"], rel=1e-5), key
            assert rank[key]["norms"] == pytest.approx(full["norms"], rel=1e-5), key
        assert rank["ep2_resumed"]["losses"] == rank["ep2"]["losses"][3:]
        assert rank["ep2_zero_resumed"]["losses"] == rank["ep2_zero"]["losses"][3:]
        assert rank["ep2_zero_resumed"]["norms"] == rank["ep2_zero"]["norms"][3:]
        assert rank["ep2_at_ep1"]["losses"] == pytest.approx(rank["ep2_resumed"]["losses"],
                                                             rel=1e-5)
    logged = [json.loads(line) for line in (tmp_path / "full1" / "metrics.jsonl").read_text()
              .splitlines()]
    assert all(0.9 < r["moe_aux_loss"] < 4.0 and r["moe_max_load"] >= 1.0
               and 0.0 <= r["moe_dropped"] < 1.0 for r in logged)
    # TP = 2 x EP = 2 (sequence parallel, ZeRO-1): the same math; its checkpoint goes on at
    # TP = 4. Without sequence parallelism TP = 2 is refused before any process starts.
    for rank in run_distributed(_moe_tp_ep, 4, data, str(tmp_path)):
        for key in ("losses", "norms"):
            assert rank["tp2ep2"][key] == pytest.approx(full[key], rel=1e-5), key
            assert rank["at_tp4"][key] == pytest.approx(full[key][3:], rel=1e-5), key
    assert main(["train", "--num-experts", "4", "--data-path", data, "--tokenizer-type", "byte",
                 "--tensor-model-parallel-size", "2", "--save", str(tmp_path / "no")]) == 2
    assert not (tmp_path / "no").exists()


def test_domino_train_splits_the_experts_over_ep_and_samples(byte_dataset, tmp_path,
                                                             capfd) -> None:
    """`domino train --expert-model-parallel-size 2` (the launched ranks, not only fit()):
    each rank holds the optimizer state of half the experts, and the closing sample, whose
    expert exchange needs both EP ranks, is written."""
    import re

    from safetensors.torch import load_file

    from domino.cli import main

    run = tmp_path / "ep2"
    assert main(["train", "--data-path", byte_dataset(200_000), "--tokenizer-type", "byte",
                 "--num-experts", "4", "--tensor-model-parallel-size", "1", "--nproc", "2",
                 "--expert-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "64",
                 "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
                 "--global-batch-size", "4", "--train-iters", "2", "--eval-iters", "1",
                 "--split", "80,20,0", "--sample-tokens", "8", "--save", str(run)]) == 0
    out = capfd.readouterr().out
    found = re.search(r"optimizer state per rank: ([\d., ]+) MiB", out)
    assert found, out
    per_rank = [float(x) for x in found.group(1).split(", ")]
    step = sorted((run / "checkpoints").iterdir())[-1]
    tensors = load_file(step / "model-tp00-pp00.safetensors")  # whole experts
    numel = sum(t.numel() // (2 if ".experts." in k else 1) for k, t in tensors.items())
    assert per_rank == pytest.approx([8 * numel / 2**20] * 2, abs=0.1)  # two fp32 moments
    assert (run / "sample.txt").read_text()
