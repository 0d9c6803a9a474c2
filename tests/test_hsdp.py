"""HSDP (``--data-parallel-shard-size K``): at DP=4 sharded in groups of 2 and replicated across
them, each strategy trains as plain data parallelism does (losses, gradient norms and the saved
weights and AdamW moments within fp32 rounding), for a dense model and for a Mixture-of-Experts
model with EP=2 (the experts sharded within each expert-DP group's K-blocks), the groups are
what the layout says, and a shard size that does not apply is refused before any process
starts. One spawn of 4 ranks builds the groups and trains the six runs
(tests/train_spawn.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist import run_distributed
from train_spawn import held_launches, run_output, train_configs

from domino.cli import main
from domino.parallel_state import ParallelSizes
from domino.training.fsdp import hybrid_rank_lists

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--train-iters", "3", "--lr", "1e-3", "--lr-warmup-iters", "0", "--adam-eps", "1e-3",
         "--eval-iters", "0", "--sample-tokens", "0", "--no-tensorboard", "--log-interval", "1",
         "--tensor-model-parallel-size", "1", "--nproc", "4", "--seed", "5"]
MOE = ["--num-experts", "4", "--expert-model-parallel-size", "2"]
SHARDED = ("optim", "optim_grads_params")
# The runs compared: plain data parallelism and HSDP under each strategy that shards, of the
# dense model and of the MoE model (EP=2 x expert-DP=2; "moe_" runs).
RUNS = {"plain": [],
        **{strategy: ["--data-parallel-sharding-strategy", strategy,
                      "--data-parallel-shard-size", "2"]
           for strategy in SHARDED}}
RUNS |= {f"moe_{name}": [*MOE, *extra] for name, extra in RUNS.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-6)


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory) -> dict:
    """{"runs": each of RUNS's (metrics records, saved tensors), "groups": each rank's shard
    and replicate groups}: set up by `domino train`, then one spawn of 4 ranks."""
    tmp = tmp_path_factory.mktemp("hsdp")
    with held_launches() as held:
        for name, extra in RUNS.items():
            assert main(["train", *MODEL, "--save", str(tmp / name), *extra]) == 0
    groups = run_distributed(_hsdp_ranks, 4, [str(path) for path, _ in held])
    return {"runs": {name: run_output(tmp / name) for name in RUNS}, "groups": groups}


def _hsdp_ranks(rank: int, world: int, configs: list[str]) -> dict:
    """In a rank: its shard and replicate groups (returned), then the runs of ``configs``."""
    groups = _groups_rank(rank, world)
    train_configs(rank, world, configs)
    return groups


@pytest.mark.parametrize("model", ["", "moe_"])
def test_hsdp_trains_as_plain_data_parallelism(hsdp: dict, model: str) -> None:
    want, want_tensors = hsdp["runs"][f"{model}plain"]
    if model:  # the experts' weights and moments are among the compared tensors
        assert any(".experts." in k and "exp_avg_sq" in k for k in want_tensors)
    for strategy in SHARDED:
        got, tensors = hsdp["runs"][model + strategy]
        for a, b in zip(got, want, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), strategy
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), strategy
        assert set(tensors) == set(want_tensors)
        for name, t in want_tensors.items():
            assert _rel(tensors[name], t) < 1e-4, (model + strategy, name)


def test_hsdp_groups_follow_the_layout(hsdp: dict) -> None:
    """DP x CP ranks [0..3] in shard groups of 2: {0,1} {2,3}; replicas {0,2} {1,3}. With
    EP=2 (EP groups {0,1} {2,3}; expert-DP {0,2} {1,3}) each expert-DP group's K-blocks hold
    one rank: the experts' shard groups are single ranks, their replicas the expert-DP
    groups."""
    dense, moe = ([g[i] for g in hsdp["groups"]] for i in range(2))
    for groups in (dense, moe):
        assert [g["shard"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
        assert [g["replicate"] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["expert shard"] for g in moe] == [[0], [1], [2], [3]]
    assert [g["expert replicate"] for g in moe] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all("expert shard" not in g for g in dense)  # EP=1: experts (if any) as dense


def test_hsdp_expert_groups_at_larger_layouts() -> None:
    """The lists of global ranks (no processes): each expert-DP group (x TP) cut by the
    K-blocks of DP x CP its members lie in, sorted (torch numbers a group's ranks in sorted
    order, the chunks' order), the replicas pairing equal places."""
    # DP=8, EP=2, K=4: expert-DP {0,2,4,6} {1,3,5,7}; blocks of DP ranks 0-3 and 4-7.
    lists = hybrid_rank_lists(ParallelSizes.for_world(8, ep=2), 4)
    assert lists["expert_dp"] == ([[0, 2], [4, 6], [1, 3], [5, 7]],
                                  [[0, 4], [2, 6], [1, 5], [3, 7]])
    # TP=2, DP=8, EP=2, K=4: expert-DP x TP {0,4,1,5,8,12,9,13} (ranks 2p, 2p+1 are DP rank
    # p's TP pair); the first block holds DP ranks 0-3 = global ranks 0-7.
    lists = hybrid_rank_lists(ParallelSizes.for_world(16, tp=2, ep=2), 4)
    assert lists["dp_cp"][0][:2] == [[0, 2, 4, 6], [8, 10, 12, 14]]
    assert lists["expert_dp"] == ([[0, 1, 4, 5], [8, 9, 12, 13], [2, 3, 6, 7],
                                   [10, 11, 14, 15]],
                                  [[0, 8], [1, 9], [4, 12], [5, 13], [2, 10], [3, 11],
                                   [6, 14], [7, 15]])
    assert hybrid_rank_lists(ParallelSizes.for_world(16, tp=2, ep=2), 8) == {}  # all of DP
    with pytest.raises(ValueError, match="shard size must be a multiple of EP"):
        hybrid_rank_lists(ParallelSizes.for_world(8, ep=4), 2)


def _groups_rank(rank: int, world: int) -> tuple[dict, dict]:
    """This rank's HSDP groups' members (each read back through its process group), for the
    dense layout and for EP=2."""
    from domino import ParallelState
    from domino.training.fsdp import hybrid_groups

    out = []
    for ep in (1, 2):
        state = ParallelState.build(1, expert_model_parallel_size=ep)
        groups = hybrid_groups(state, 2)
        named = {"shard": groups["dp_cp"][0], "replicate": groups["dp_cp"][1]}
        if "expert_dp" in groups:
            named |= {"expert shard": groups["expert_dp"][0],
                      "expert replicate": groups["expert_dp"][1]}
        out.append({name: _members(rank, group) for name, group in named.items()})
        assert hybrid_groups(state, 4) == {}  # all of DP: plain sharding
        state.close()
    return out[0], out[1]


def _members(rank: int, group) -> list[int]:
    """The global ranks of ``group``, in its ranks' order, by an all-gather over it."""
    import torch.distributed as dist

    if group.size == 1:
        return [rank]
    mine = torch.tensor([float(rank)])
    every = [torch.zeros(1) for _ in range(group.size)]
    dist.all_gather(every, mine, group=group.group)
    assert dist.get_rank(group.group) == group.rank  # the chunks' place is the group's rank
    return [int(t.item()) for t in every]


def test_hsdp_refusals(tmp_path: Path, capfd) -> None:
    cases = [(["--data-parallel-shard-size", "2"],
              "--data-parallel-shard-size 2 shards within groups of data-parallel ranks: add "
              "--data-parallel-sharding-strategy optim"),
             (["--data-parallel-shard-size", "3", "--use-distributed-optimizer"],
              "--data-parallel-shard-size 3 must divide the data-parallel (x context-parallel) "
              "size 4; e.g. 2"),
             ([*MOE, "--data-parallel-shard-size", "1", "--use-distributed-optimizer"],
              "--data-parallel-shard-size 1 with --expert-model-parallel-size 2: the shard size "
              "must be a multiple of EP (each shard group holds whole EP groups); use 2 or 4"),
             ([*MOE, "--data-parallel-shard-size", "3", "--use-distributed-optimizer"],
              "--data-parallel-shard-size 3 with --expert-model-parallel-size 2: the shard size "
              "must be a multiple of EP")]
    for extra, message in cases:
        assert main(["train", *MODEL, "--save", str(tmp_path / "bad"), *extra]) == 2
        assert message in capfd.readouterr().err
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
