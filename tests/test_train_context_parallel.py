"""`domino train` with context parallelism: the trainer at CP=2 gives the CP=1 run's losses,
gradient norms, validation losses, final weights and greedy sample (every token counted once,
dense gradients summed over DP x CP, each parameter once in the norm), with each CP attention
kind, gradient accumulation, ZeRO-1 and recomputation, MoE layers with EP over the CP ranks
(the router's metrics too), and on packed documents
(``--reset-attention-mask``, ``--reset-position-ids``, ``--eod-mask-loss``); a checkpoint saved
at CP=2 resumes at CP=1; the flags' configuration errors are raised before any process starts
and name the flag to change. One spawn of 2 ranks."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from dist import fit, run_distributed
from safetensors.torch import load_file

from domino.data import ByteTokenizer, preprocess
from domino.data.preprocess import stdlib_corpus_files
from domino.training.arguments import TrainArgs
from domino.training.prepare import prepare_run

STEPS = 6
FINAL = "checkpoints/step_0000006/model-tp00-pp00.safetensors"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("data")
    preprocess(stdlib_corpus_files(limit_bytes=200_000), folder / "small", ByteTokenizer(),
               progress=False)
    return str(folder / "small")


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> str:
    """Short documents (at most 24 bytes: every 32-token sample holds an EOD or more)."""
    folder = tmp_path_factory.mktemp("docs")
    gen = random.Random(0)
    words = Path(stdlib_corpus_files(limit_bytes=20_000)[0]).read_text().split()
    with open(folder / "docs.jsonl", "w") as f:
        for _ in range(400):
            text = " ".join(gen.choice(words) for _ in range(6))[:gen.randint(4, 24)]
            f.write(json.dumps({"text": text}) + "\n")
    preprocess([folder / "docs.jsonl"], folder / "docs", ByteTokenizer(), progress=False)
    return str(folder / "docs")


def _args(data: str, **kw) -> TrainArgs:
    base = dict(data_path=data, tokenizer_type="byte", split="80,20,0", num_layers=2,
                hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                global_batch_size=4, train_iters=STEPS, lr=3e-3, min_lr=3e-4,
                lr_warmup_iters=2, clip_grad=0.3,  # small enough that clipping acts
                eval_interval=3, eval_iters=1, log_interval=1, sample_tokens=0,
                tensorboard=False, device="cpu", hidden_dropout=0.0, attention_dropout=0.0,
                tensor_model_parallel_size=1, position_embedding_type="rope",
                domino_micro_batches=1,
                # Not 1e-8: AdamW would blow gradients that are rounding noise (zero in exact
                # arithmetic) up to full steps, and the final weights would differ by that.
                adam_eps=1e-4)
    base.update(kw)
    return TrainArgs(**base)


def _train(args: TrainArgs, run_dir: str) -> dict:
    res = fit(args, run_dir)
    assert res.skipped == sum(not math.isfinite(n) for n in res.grad_norms)
    logged = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text()
              .splitlines()]
    return {"losses": res.losses, "norms": res.grad_norms, "val": res.val_losses,
            "sample": res.sample,
            "moe": [r[k] for r in logged if "moe_aux_loss" in r for k in MOE_METRICS]}


# MoE layers under CP: micro-batches of 2 samples either way (DP = 2, or CP = 2 accumulating
# two), so the auxiliary losses are of the same tokens; EP = 2 over DP or over CP.
MOE = dict(num_experts=4, moe_ffn_hidden_size=64, moe_router_topk=2, moe_aux_loss_coeff=0.1,
           moe_z_loss_coeff=0.01, expert_model_parallel_size=2, micro_batch_size=2)
MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_max_load", "moe_dropped")


def _runs(rank: int, world: int, data: str, docs: str, tmp: str) -> dict:
    cp2 = dict(context_parallel_size=2, micro_batch_size=4)
    sample = dict(sample_tokens=8, top_k=1)
    packed = dict(reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)
    return {
        # Documents: attention within each, positions restarting, no loss on EODs.
        "docs cp1": _train(_args(docs, **packed), f"{tmp}/docs1"),
        "docs cp2": _train(_args(docs, **cp2, **packed), f"{tmp}/docs2"),
        "docs cp2 a2a m2": _train(_args(docs, **cp2, **packed, cp_comm_type="a2a",
                                        domino_micro_batches=2), f"{tmp}/docs2a"),
        "cp1": _train(_args(data, **sample), f"{tmp}/cp1"),  # DP=2
        "cp2": _train(_args(data, **cp2, **sample), f"{tmp}/cp2"),
        # Domino m2, ring attention (each micro-batch's first exchange launched at its Q/K/V
        # GEMM, inside the piece before), ZeRO-1 over DP x CP, full recomputation (the ring's
        # exchanges rerun in the backward; the entry's GEMM graph is kept from forward).
        "cp2 zero": _train(_args(data, **cp2, domino_micro_batches=2,
                                 use_distributed_optimizer=True, recompute_granularity="full"),
                           f"{tmp}/zero"),
        # Two accumulated micro-batches, all-to-all attention, the blocking reduction,
        # selective recomputation (which leaves CP attention as it is).
        "cp2 accum": _train(_args(data, context_parallel_size=2, cp_comm_type="a2a",
                                  overlap_grad_reduce=False, recompute_granularity="selective"),
                            f"{tmp}/accum"),
        "moe cp1": _train(_args(data, **MOE, **sample, moe_expert_capacity_factor=1.0),
                          f"{tmp}/moe1"),
        "moe cp2": _train(_args(data, **MOE, **sample, moe_expert_capacity_factor=1.0,
                                context_parallel_size=2, domino_micro_batches=2),
                          f"{tmp}/moe2"),
        "first": _train(_args(data, **cp2, exit_interval=3), f"{tmp}/first"),
        "resumed at cp1": _train(_args(data, load=f"{tmp}/first"), f"{tmp}/resumed"),
    }


def test_cp2_training_matches_cp1_and_resumes_at_cp1(data, docs, tmp_path) -> None:
    ranks = run_distributed(_runs, 2, data, docs, str(tmp_path))
    for res in ranks:
        ref = res["docs cp1"]
        for name in ("docs cp2", "docs cp2 a2a m2"):
            assert res[name]["losses"] == pytest.approx(ref["losses"], rel=1e-5), name
            assert res[name]["norms"] == pytest.approx(ref["norms"], rel=1e-5), name
    for res in ranks:  # MoE: losses, norms, the router's metrics (aux loss, z-loss, load, drops)
        moe1, moe2 = res["moe cp1"], res["moe cp2"]
        n = len(MOE_METRICS)
        assert len(moe1["moe"]) == n * STEPS and any(moe1["moe"][n - 1::n])  # it drops
        for key in ("losses", "norms", "moe"):
            assert moe2[key] == pytest.approx(moe1[key], rel=1e-5), key
        assert moe2["sample"] == moe1["sample"] and len(moe1["sample"] or "") > 3
    ref = ranks[0]["cp1"]
    assert ref["losses"][-1] < ref["losses"][0] - 0.3  # it learns
    assert ref["sample"] is not None and ranks[0]["cp2"]["sample"] == ref["sample"]
    for rank, res in enumerate(ranks):
        for name in ("cp2", "cp2 zero", "cp2 accum"):
            run = res[name]
            assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5), (rank, name)
            assert run["norms"] == pytest.approx(ref["norms"], rel=1e-5), (rank, name)
            assert [v for _, v in run["val"]] == pytest.approx([v for _, v in ref["val"]],
                                                               rel=1e-5), (rank, name)
        assert res["first"]["losses"] == pytest.approx(ref["losses"][:3], rel=1e-5)
        assert res["resumed at cp1"]["losses"] == pytest.approx(ref["losses"][3:], rel=1e-5)
        assert res["resumed at cp1"]["norms"] == pytest.approx(ref["norms"][3:], rel=1e-5)
    want = load_file(tmp_path / "cp1" / FINAL)  # the checkpoints do not depend on CP
    for folder in ("cp2", "accum", "resumed"):
        got = load_file(tmp_path / folder / FINAL)
        assert got.keys() == want.keys(), folder
        for key, w in want.items():
            err = float((got[key] - w).abs().max() / w.abs().max().clamp(min=1e-3))
            assert err <= 1e-5, (folder, key, err)


@pytest.mark.parametrize(("flags", "world", "needles"), [
    (dict(seq_length=30), 2, ["--seq-length 30", "2 x --context-parallel-size"]),
    (dict(attention_dropout=0.1), 2, ["--attention-dropout 0.1", "--context-parallel-size 1"]),
    (dict(attention_sinks=True), 2, ["--attention-sinks", "--context-parallel-size 1"]),
    (dict(cp_comm_type="a2a", num_attention_heads=2, tensor_model_parallel_size=2), 4,
     ["--cp-comm-type a2a", "--num-attention-heads 2", "divisible by"]),
    (dict(), 3, ["--context-parallel-size 2", "world size 3"]),
    (dict(domino_autotune=True), 2, ["--domino-autotune", "--context-parallel-size 1"]),
    (dict(sequence_parallel=True, tensor_model_parallel_size=4, seq_length=12), 8,
     ["--sequence-parallel", "multiple of 8"]),
])
def test_cp_flag_errors_before_any_spawn(tmp_path, flags, world, needles) -> None:
    args = _args(str(tmp_path / "absent"), context_parallel_size=2, **flags)
    with pytest.raises(ValueError) as err:
        prepare_run(args, world_size=world, progress=False)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    assert not list(tmp_path.iterdir())  # nothing was built


def test_cp_flags_parse() -> None:
    import argparse

    from domino.training.arguments import add_arguments, resolve_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = resolve_args(parser.parse_args(["--context-parallel-size", "2",
                                           "--cp-comm-type", "all_gather"]))
    assert (args.context_parallel_size, args.runtime().cp_kind) == (2, "allgather")
    with pytest.raises(ValueError,
                       match="--cp-comm-type='ring' is not one of p2p, all_gather, a2a"):
        resolve_args(parser.parse_args(["--cp-comm-type", "ring"]))
