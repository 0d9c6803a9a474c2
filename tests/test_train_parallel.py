"""The trainer gives the single-process loss curve and gradient norm at DP=2 x TP=1 and
DP=1 x TP=2 (and with gradient accumulation), and resumes exactly from a checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from dist import run_distributed

from domino.data import ByteTokenizer, preprocess
from domino.data.preprocess import stdlib_corpus_files
from domino.training.arguments import TrainArgs

STEPS = 6


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("data")
    preprocess(stdlib_corpus_files(limit_bytes=300_000), folder / "small", ByteTokenizer(),
               progress=False)
    return str(folder / "small")


def _args(data: str, **kw) -> TrainArgs:
    base = dict(data_path=data, split="80,20,0", num_layers=2, hidden_size=64,
                num_attention_heads=4, seq_length=32, micro_batch_size=4, global_batch_size=4,
                train_iters=STEPS, lr=3e-3, min_lr=3e-4, lr_warmup_iters=2,
                clip_grad=0.3,  # small enough that clipping acts on every step
                eval_interval=3, eval_iters=1, log_interval=1, sample_tokens=0,
                tensorboard=False, device="cpu", hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return TrainArgs(**base)


def _train(args: TrainArgs, run_dir: str) -> dict:
    from domino.training.loop import train

    res = train(args, Path(run_dir))
    return {"losses": res.losses, "norms": res.grad_norms, "val": res.val_losses}


def _single(rank: int, world: int, data: str, tmp: str) -> dict:
    from domino.gpt_model import GPTModel
    from domino.parallel_state import ParallelState
    from domino.training.checks import model_config
    from domino.training.data import build_datasets, open_dataset, rank_batches

    out = {"ref": _train(_args(data, tensor_model_parallel_size=1), f"{tmp}/ref")}
    out["accum"] = _train(_args(data, tensor_model_parallel_size=1, micro_batch_size=2),
                          f"{tmp}/accum")
    # Resume: 3 steps, checkpoint, then continue to STEPS from the checkpoint.
    _train(_args(data, tensor_model_parallel_size=1, exit_interval=3), f"{tmp}/first")
    out["resumed"] = _train(_args(data, tensor_model_parallel_size=1, load=f"{tmp}/first"),
                            f"{tmp}/second")
    # Independent norm of step 1: torch's own total norm over the unsharded model's gradients.
    args = _args(data, tensor_model_parallel_size=1)
    torch.manual_seed(args.seed)
    model = GPTModel(model_config(args, 257), parallel_state=ParallelState.single())
    train_ds, _ = build_datasets(args, open_dataset(data), 256)
    (batch,) = rank_batches(train_ds, 0, 4, 1, 0, 4, torch.device("cpu"))
    loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    (loss * batch["loss_mask"]).sum().div(batch["loss_mask"].sum()).backward()
    grads = [p.grad for p in model.parameters()]
    out["torch_norm"] = float(torch.nn.utils.get_total_norm(grads))
    return out


def _parallel(rank: int, world: int, data: str, tmp: str) -> dict:
    return {
        "dp2": _train(_args(data, tensor_model_parallel_size=1, micro_batch_size=2), f"{tmp}/dp2"),
        "tp2": _train(_args(data, tensor_model_parallel_size=2), f"{tmp}/tp2"),
    }


def test_dp_tp_and_accumulation_match_single_process(data, tmp_path) -> None:
    (single,) = run_distributed(_single, 1, data, str(tmp_path))
    ranks = run_distributed(_parallel, 2, data, str(tmp_path))
    ref = single["ref"]
    assert len(ref["losses"]) == STEPS
    assert ref["losses"][-1] < ref["losses"][0] - 0.3  # it learns
    assert ref["norms"][0] == pytest.approx(single["torch_norm"], rel=1e-5)
    runs = {"accum": single["accum"], **{f"{k} rank{r}": v for r, res in enumerate(ranks)
                                         for k, v in res.items()}}
    for name, run in runs.items():
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5), name
        assert run["norms"] == pytest.approx(ref["norms"], rel=1e-5), name
        assert [v for _, v in run["val"]] == pytest.approx([v for _, v in ref["val"]],
                                                           rel=1e-5), name
    # Resumed run: steps 4..6 equal the uninterrupted run's.
    assert single["resumed"]["losses"] == pytest.approx(ref["losses"][3:], rel=1e-5)
    metrics = (tmp_path / "tp2" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == STEPS
    assert (tmp_path / "tp2" / "checkpoint" / "iter_0000006" / "mp_rank_01").is_dir()
    assert not (tmp_path / "dp2" / "checkpoint" / "iter_0000006" / "mp_rank_01").exists()
    assert dataclasses.asdict(_args(data))  # settings stay plain data (picklable, JSON-able)
