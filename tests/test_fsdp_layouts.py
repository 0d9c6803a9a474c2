"""Sharded data parallelism with the other parallel dimensions of a run: context parallelism
(CP=2 x DP=2: dense gradients and units over DP x CP) and a Mixture-of-Experts model with
expert parallelism (EP=2 x DP=2: the experts' units over expert-DP) train under
``optim_grads_params`` as they do under ``no_shard`` (losses, gradient norms, the saved weights
and AdamW moments within fp32 rounding). One spawn of 4 ranks trains the four runs
(tests/train_spawn.py); one of 8 ranks trains an MoE model at TP=2 x DP=4 with EP=2 under
``no_shard``, ``optim`` and ``optim_grads_params``."""

from __future__ import annotations

import pytest
import torch
from train_spawn import held_launches, run_output, train_held

from domino.cli import main

COMMON = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
          "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
          "--train-iters", "3", "--lr", "1e-3", "--lr-warmup-iters", "0", "--adam-eps", "1e-3",
          "--eval-iters", "0", "--sample-tokens", "0", "--no-tensorboard", "--log-interval", "1",
          "--tensor-model-parallel-size", "1", "--nproc", "4", "--seed", "3"]
LAYOUTS = {"cp2": ["--context-parallel-size", "2"],
           "moe_ep2": ["--num-experts", "4", "--expert-model-parallel-size", "2"]}


# Each layout trained plainly and fully sharded.
STRATEGIES = {"plain": [], "sharded": ["--data-parallel-sharding-strategy", "optim_grads_params"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], tuple[list[dict], dict[str, torch.Tensor]]]:
    """(layout, strategy) -> (metrics records, saved tensors): every layout under each
    strategy, set up by `domino train`, then trained in one spawn of 4 ranks."""
    tmp = tmp_path_factory.mktemp("layouts")
    keys = [(layout, strategy) for layout in LAYOUTS for strategy in STRATEGIES]
    with held_launches() as held:
        for layout, strategy in keys:
            assert main(["train", *COMMON, "--save", str(tmp / f"{layout}_{strategy}"),
                         *LAYOUTS[layout], *STRATEGIES[strategy]]) == 0
    train_held(held)
    return {(layout, strategy): run_output(tmp / f"{layout}_{strategy}")
            for layout, strategy in keys}


# 8 ranks: TP=2 (sequence parallel) x DP=4 with EP=2, so the experts' gradient group is
# expert-DP x TP, listed out of torch's (sorted) rank order: a sharded optimizer must take
# the chunks torch's collectives give each rank (it crashed at the first step when it did not).
WIDE = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--nproc", "8",
        *LAYOUTS["moe_ep2"]]


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> dict[str, tuple[list[dict], dict[str, torch.Tensor]]]:
    """Strategy -> (metrics records, saved tensors) of the 8-rank layout, one spawn."""
    tmp = tmp_path_factory.mktemp("wide")
    strategies = {"plain": [], "optim": ["--data-parallel-sharding-strategy", "optim"],
                  **STRATEGIES}
    with held_launches() as held:
        for name, flags in strategies.items():
            assert main(["train", *COMMON, *WIDE, "--save", str(tmp / name), *flags]) == 0
    train_held(held)
    return {name: run_output(tmp / name) for name in strategies}


@pytest.mark.parametrize("layout", [*LAYOUTS, "tp2_ep2_dp4 optim", "tp2_ep2_dp4 sharded"])
def test_fully_sharded_equals_no_shard(layout: str, request) -> None:
    if layout.startswith("tp2_ep2_dp4"):
        runs = request.getfixturevalue("wide")
        want, want_tensors = runs["plain"]
        got, tensors = runs[layout.split()[1]]
    else:
        runs = request.getfixturevalue("runs")
        want, want_tensors = runs[layout, "plain"]
        got, tensors = runs[layout, "sharded"]
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert set(tensors) == set(want_tensors)
    if layout != "cp2":
        assert any(".experts." in k for k in tensors)
    for name, t in want_tensors.items():
        err = float((tensors[name] - t).abs().max()) / max(float(t.abs().max()), 1e-6)
        assert err < 1e-4, (layout, name, err)
