"""HSDP (``--data-parallel-shard-size K``): at DP=4 sharded in groups of 2 and replicated across
them, each strategy trains as plain data parallelism does (losses, gradient norms and the saved
weights and AdamW moments within fp32 rounding), the groups are what the layout says, and a
shard size that does not apply is refused before any process starts. One spawn of 4 ranks
builds the groups and trains the three runs (tests/train_spawn.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist import run_distributed
from train_spawn import held_launches, train_configs

from domino.checkpoint.layout import open_checkpoint
from domino.checkpoint.shards import ShardReader, TensorSpec
from domino.cli import main

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
         "--train-iters", "3", "--lr", "1e-3", "--lr-warmup-iters", "0", "--adam-eps", "1e-3",
         "--eval-iters", "0", "--sample-tokens", "0", "--no-tensorboard", "--log-interval", "1",
         "--tensor-model-parallel-size", "1", "--nproc", "4", "--seed", "5"]
# The runs compared: plain data parallelism and HSDP under each strategy that shards.
RUNS = {"plain": [],
        **{strategy: ["--data-parallel-sharding-strategy", strategy,
                      "--data-parallel-shard-size", "2"]
           for strategy in ("optim", "optim_grads_params")}}


def _read(save: Path) -> tuple[list[dict], dict[str, torch.Tensor]]:
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    step_dir, meta, _ = open_checkpoint(save)
    reader = ShardReader(step_dir)
    tensors = {k: reader.full(k, TensorSpec.from_json(k, raw))
               for k, raw in meta.tensors.items() if not k.startswith("optimizer.step")}
    return records, tensors


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
    return {"runs": {name: _read(tmp / name) for name in RUNS}, "groups": groups}


def _hsdp_ranks(rank: int, world: int, configs: list[str]) -> dict:
    """In a rank: its shard and replicate groups (returned), then the runs of ``configs``."""
    groups = _groups_rank(rank, world)
    train_configs(rank, world, configs)
    return groups


def test_hsdp_trains_as_plain_data_parallelism(hsdp: dict) -> None:
    want, want_tensors = hsdp["runs"]["plain"]
    for strategy in ("optim", "optim_grads_params"):
        got, tensors = hsdp["runs"][strategy]
        for a, b in zip(got, want, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), strategy
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), strategy
        assert set(tensors) == set(want_tensors)
        for name, t in want_tensors.items():
            assert _rel(tensors[name], t) < 1e-4, (strategy, name)


def test_hsdp_groups_follow_the_layout(hsdp: dict) -> None:
    """DP x CP ranks [0..3] in shard groups of 2: {0,1} {2,3}; replicas {0,2} {1,3}."""
    groups = hsdp["groups"]
    assert [g["shard"] for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["replicate"] for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def _groups_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from domino import ParallelState
    from domino.training.fsdp import hybrid_groups

    state = ParallelState.build(1)
    shard, replicate = hybrid_groups(state, 2)["dp_cp"]
    out = {}
    for name, group in (("shard", shard), ("replicate", replicate)):
        mine = torch.tensor([float(rank)])
        every = [torch.zeros(1) for _ in range(group.size)]
        dist.all_gather(every, mine, group=group.group)
        out[name] = [int(t.item()) for t in every]
    assert hybrid_groups(state, 4) == {}  # all of DP: plain sharding
    state.close()
    return out


def test_hsdp_refusals(tmp_path: Path, capfd) -> None:
    cases = [(["--data-parallel-shard-size", "2"],
              "--data-parallel-shard-size 2 shards within groups of data-parallel ranks: add "
              "--data-parallel-sharding-strategy optim"),
             (["--data-parallel-shard-size", "3", "--use-distributed-optimizer"],
              "--data-parallel-shard-size 3 must divide the data-parallel (x context-parallel) "
              "size 4; e.g. 2")]
    for extra, message in cases:
        assert main(["train", *MODEL, "--save", str(tmp_path / "bad"), *extra]) == 2
        assert message in capfd.readouterr().err
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
