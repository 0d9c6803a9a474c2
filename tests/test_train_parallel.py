"""The trainer gives the single-process loss curve and gradient norm at DP=2 x TP=1 and
DP=1 x TP=2 (and with gradient accumulation), and resumes exactly from a checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from dist import fit, run_distributed

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
    base = dict(data_path=data, tokenizer_type="byte", split="80,20,0", num_layers=2,
                hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=4,
                global_batch_size=4, train_iters=STEPS, lr=3e-3, min_lr=3e-4, lr_warmup_iters=2,
                clip_grad=0.3,  # small enough that clipping acts on every step
                eval_interval=3, eval_iters=1, log_interval=1, sample_tokens=0,
                tensorboard=False, device="cpu", hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return TrainArgs(**base)


def _train(args: TrainArgs, run_dir: str) -> dict:
    res = fit(args, run_dir)
    assert res.skipped == sum(not math.isfinite(n) for n in res.grad_norms)
    return {"losses": res.losses, "norms": res.grad_norms, "val": res.val_losses}


def _single(rank: int, world: int, data: str, tmp: str) -> dict:
    from domino.data.checks import open_dataset
    from domino.gpt_model import GPTModel
    from domino.parallel_state import ParallelState
    from domino.training.data import build_datasets, rank_batches
    from domino.training.prepare import model_config

    out = {"gen": _generation(data, 1),
           "ref": _train(_args(data, tensor_model_parallel_size=1), f"{tmp}/ref")}
    out["accum"] = _train(_args(data, tensor_model_parallel_size=1, micro_batch_size=2),
                          f"{tmp}/accum")
    # Resume: 3 steps, checkpoint, then continue to STEPS from the checkpoint.
    _train(_args(data, tensor_model_parallel_size=1, exit_interval=3), f"{tmp}/first")
    out["resumed"] = _train(_args(data, tensor_model_parallel_size=1, load=f"{tmp}/first"),
                            f"{tmp}/second")
    # fp16 with a too-large initial loss scale: overflowing steps are skipped, the scale halves
    # until steps go through (CPU autocast supports fp16; the CLI allows it on GPU only).
    fp16 = _args(data, tensor_model_parallel_size=1, fp16=True, initial_loss_scale=2.0 ** 21,
                 eval_iters=0)
    out["fp16"] = _train(fp16, f"{tmp}/fp16")
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


def _generation(data: str, tp: int) -> dict:
    """Greedy ids with the KV cache, without it (full recompute), with a sliding window, and
    top-k sampled ids, from a freshly initialised model (TP-invariant init)."""
    from domino.gpt_model import GPTModel
    from domino.inference.sampling import generate
    from domino.parallel_state import ParallelState
    from domino.training.prepare import model_config

    args = _args(data, tensor_model_parallel_size=tp)
    state = ParallelState.build(tp, device="cpu")
    torch.manual_seed(args.seed)
    model = GPTModel(model_config(args, 257), parallel_state=state)
    prompt = [100, 101, 32, 102]
    out = {"cached": generate(model, state, prompt, 12, 257, max_context=32)}
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            x = torch.tensor([ids, ids])  # two rows: one per Domino micro-batch
            logits = model.eval()(x, torch.arange(len(ids)).expand(2, -1), None)
            ids.append(int(state.tp.all_gather_last_dim(logits[0, -1])[:257].argmax()))
    out["recomputed"] = ids[len(prompt):]
    out["sliding"] = generate(model, state, prompt, 40, 257, max_context=16)
    out["top_k"] = generate(model, state, prompt, 10, 257, 32, top_k=5, temperature=0.8, seed=3,
                            banned=(256,))
    return out


def _parallel(rank: int, world: int, data: str, tmp: str) -> dict:
    dp2 = dict(tensor_model_parallel_size=1, micro_batch_size=2)
    accum = dict(tensor_model_parallel_size=1, micro_batch_size=1,  # 2 micro-steps per rank
                 domino_micro_batches=1)
    return {
        "gen": _generation(data, 2),
        "dp2": _train(_args(data, **dp2), f"{tmp}/dp2"),
        "dp2 accum": _train(_args(data, **accum), f"{tmp}/dp2a"),
        "tp2": _train(_args(data, tensor_model_parallel_size=2), f"{tmp}/tp2"),
        # The same runs over gloo instead of the shared-memory transport: the same bits (two
        # ranks sum in one order whatever the transport).
        "over gloo": {"tp2": _train(_args(data, tensor_model_parallel_size=2,
                                          shared_memory_comm=False), f"{tmp}/tp2g"),
                      "dp2": _train(_args(data, **dp2, shared_memory_comm=False),
                                    f"{tmp}/dp2g")},
        "tp2 sp": _train(_args(data, tensor_model_parallel_size=2, sequence_parallel=True),
                         f"{tmp}/tp2sp"),
        # ZeRO-1: moments sharded over DP, gradients reduce-scattered, parameters all-gathered.
        "zero": _train(_args(data, **dp2, use_distributed_optimizer=True), f"{tmp}/zero"),
        "zero accum": _train(_args(data, **accum, use_distributed_optimizer=True,
                                   overlap_grad_reduce=False), f"{tmp}/zeroa"),
        # Its parameter all-gathers waited at the step's end instead of under the next forward.
        "zero gather blocking": _train(_args(data, **dp2, use_distributed_optimizer=True,
                                             overlap_param_gather=False), f"{tmp}/zerog"),
        # The blocking DP reduction, to compare the overlapped one with bit for bit.
        "blocking": {"dp2": _train(_args(data, **dp2, overlap_grad_reduce=False),
                                   f"{tmp}/dp2b"),
                     "dp2 accum": _train(_args(data, **accum, overlap_grad_reduce=False),
                                         f"{tmp}/dp2ab")},
    }


def test_dp_tp_and_accumulation_match_single_process(data, tmp_path) -> None:
    (single,) = run_distributed(_single, 1, data, str(tmp_path))
    ranks = run_distributed(_parallel, 2, data, str(tmp_path))
    ref = single["ref"]
    assert len(ref["losses"]) == STEPS
    assert ref["losses"][-1] < ref["losses"][0] - 0.3  # it learns
    assert ref["norms"][0] == pytest.approx(single["torch_norm"], rel=1e-5)
    gen = single["gen"]
    assert gen["cached"] == gen["recomputed"]
    assert len(gen["sliding"]) == 40 and gen["sliding"][:12] == gen["cached"]
    assert len(gen["top_k"]) == 10 and 256 not in gen["top_k"]
    for res in ranks:
        assert res.pop("gen") == gen  # TP=2 generates what TP=1 generates
        for name, blocking in res.pop("blocking").items():
            assert res[name] == blocking, name  # overlapped DP reduction: the same numbers
        for name, gloo in res.pop("over gloo").items():
            assert res[name] == gloo, name  # shared memory or gloo: the same numbers
        assert res["zero"] == res["zero gather blocking"]  # overlapped parameter all-gathers
    runs = {"accum": single["accum"], **{f"{k} rank{r}": v for r, res in enumerate(ranks)
                                         for k, v in res.items()}}
    for name, run in runs.items():
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5), name
        assert run["norms"] == pytest.approx(ref["norms"], rel=1e-5), name
        assert [v for _, v in run["val"]] == pytest.approx([v for _, v in ref["val"]],
                                                           rel=1e-5), name
    norms = single["fp16"]["norms"]
    skipped = sum(not math.isfinite(n) for n in norms)
    assert 0 < skipped < STEPS and not math.isfinite(norms[0])
    assert all(math.isfinite(v) for v in single["fp16"]["losses"])
    # Resumed run: steps 4..6 equal the uninterrupted run's.
    assert single["resumed"]["losses"] == pytest.approx(ref["losses"][3:], rel=1e-5)
    metrics = (tmp_path / "tp2" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == STEPS
    step6 = Path("checkpoints") / "step_0000006"
    assert (tmp_path / "tp2" / step6 / "model-tp01-pp00.safetensors").is_file()
    assert not (tmp_path / "dp2" / step6 / "model-tp01-pp00.safetensors").exists()
    dp_log = [json.loads(line) for line in
              (tmp_path / "dp2" / "metrics.jsonl").read_text().splitlines()]
    assert all(rec["exposed_dp_comm_s"] >= 0 for rec in dp_log)
    assert all(rec["peak_mem_bytes"] > 1 << 20 for rec in dp_log)  # the process's RSS peak
    assert dataclasses.asdict(_args(data))  # settings stay plain data (picklable, JSON-able)


def _tp2_dp2(rank: int, world: int, data: str, tmp: str) -> dict:
    # Domino m2 inside 2 accumulated micro-steps per rank, with dropout.
    common = dict(tensor_model_parallel_size=2, micro_batch_size=2, global_batch_size=8,
                  domino_micro_batches=2, hidden_dropout=0.1)
    return {"overlap": _train(_args(data, **common), f"{tmp}/o"),
            "blocking": _train(_args(data, **common, overlap_grad_reduce=False), f"{tmp}/b"),
            # Sequence parallelism with everything it combines with: DP overlap (its buckets
            # wait for the TP sums of the shard-touched gradients), ZeRO-1, recomputation.
            "sp": _train(_args(data, **common, sequence_parallel=True), f"{tmp}/sp"),
            "sp zero full": _train(_args(data, **common, sequence_parallel=True,
                                         use_distributed_optimizer=True,
                                         recompute_granularity="full"), f"{tmp}/spz"),
            "sp selective blocking": _train(_args(data, **common, sequence_parallel=True,
                                                  recompute_granularity="selective",
                                                  overlap_grad_reduce=False), f"{tmp}/sps"),
            # bf16 mixed precision, its DP sums in bf16: all-reduced, and reduce-scattered
            # under ZeRO-1.
            "bf16": _train(_args(data, **common, bf16=True, grad_reduce_in_bf16=True),
                           f"{tmp}/bf"),
            "bf16 zero": _train(_args(data, **common, bf16=True, grad_reduce_in_bf16=True,
                                      use_distributed_optimizer=True), f"{tmp}/bfz")}


def test_overlapped_dp_reduction_equals_blocking_at_tp2_dp2(data, tmp_path) -> None:
    """TP=2 x DP=2 (4 ranks), Domino m2 with accumulation and dropout: the DP buckets launched
    during the backward give the blocking reduction's losses, norms and validation exactly
    (that path matches the single process: the test above); sequence parallelism, also with
    ZeRO-1 and recomputation, gives them within fp32 rounding; bf16 with its DP sums in bf16
    (with and without ZeRO-1) within bf16 rounding."""
    ranks = run_distributed(_tp2_dp2, 4, data, str(tmp_path))
    for res in ranks:
        assert res["overlap"] == res["blocking"]
        ref = res["overlap"]
        for name in ("sp", "sp zero full", "sp selective blocking"):
            run = res[name]
            assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5), name
            assert run["norms"] == pytest.approx(ref["norms"], rel=1e-5), name
            assert [v for _, v in run["val"]] == pytest.approx([v for _, v in ref["val"]],
                                                               rel=1e-5), name
        for name in ("bf16", "bf16 zero"):
            run = res[name]
            assert run["losses"] == pytest.approx(ref["losses"], rel=2e-2), name
            assert run["losses"] != ref["losses"], name
        assert res["bf16 zero"]["losses"] == pytest.approx(res["bf16"]["losses"], rel=1e-2)
    assert all(res == ranks[0] for res in ranks)


def _zero_resume(rank: int, world: int, data: str, tmp: str) -> dict:
    """ZeRO-1 at DP=2: 3 steps, checkpoint, resumed at DP=2 with ZeRO; the checkpoint also
    loads at DP=1 with the plain optimizer (in the test)."""
    zero = dict(tensor_model_parallel_size=1, micro_batch_size=2, use_distributed_optimizer=True)
    full = _train(_args(data, **zero), f"{tmp}/full")
    _train(_args(data, **zero, exit_interval=3), f"{tmp}/first")
    resumed = _train(_args(data, **zero, load=f"{tmp}/first"), f"{tmp}/second")
    return {"full": full, "resumed": resumed}


def _plain_from_zero(rank: int, world: int, data: str, tmp: str) -> dict:
    return _train(_args(data, tensor_model_parallel_size=1, load=f"{tmp}/first"), f"{tmp}/plain")


def test_distributed_optimizer_checkpoint_resumes_and_reshards(data, tmp_path) -> None:
    ranks = run_distributed(_zero_resume, 2, data, str(tmp_path))
    for res in ranks:
        assert res["resumed"]["losses"] == res["full"]["losses"][3:]  # exact: moments restored
        assert res["resumed"]["norms"] == res["full"]["norms"][3:]
    (plain,) = run_distributed(_plain_from_zero, 1, data, str(tmp_path))
    assert plain["losses"] == pytest.approx(ranks[0]["full"]["losses"][3:], rel=1e-5)
    assert plain["norms"] == pytest.approx(ranks[0]["full"]["norms"][3:], rel=1e-5)
