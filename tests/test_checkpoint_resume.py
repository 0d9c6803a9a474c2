"""Resuming and resharding real training runs (spawned gloo ranks).

* Exact resume: TP=2 with Domino and dropout, stopped at step 3 and resumed, gives bit-identical
  losses, gradient norms and validation for the 5 steps after the restart (and so does TP=1
  in bf16 mixed precision).
* bf16 mixed precision: its loss curve follows the fp32 run's (same seed, data and dropout)
  within BF16_CURVE; its checkpoint holds fp32 master weights (not bf16-rounded values), which
  load at TP=2 with the same logits and continue training there in bf16, and export to Hugging
  Face as fp32; `domino eval` computes in the run's precision, reproducing its logged validation.
* A new DP size: a DP=1 run accumulating 2 micro-batches, resumed at DP=2 with the same
  micro-batches, is bit-identical (each gradient is the sum of the same two partial sums).
* Resharding: a TP=2 checkpoint loaded at TP=1 and a TP=1 checkpoint loaded at TP=4 give the
  logits of the model that was saved, and training continued from them matches training
  continued unresharded within fp32 tolerance (optimizer state resharded too).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from dist import fit, run_distributed
from safetensors.torch import load_file

from domino.checkpoint.layout import open_checkpoint
from domino.checkpoint.shards import ShardReader, TensorSpec
from domino.cli import main
from domino.training.arguments import TrainArgs

STEPS, CUT = 8, 3  # exact-resume runs stop at CUT and resume to STEPS (5 steps after)
HALF = 4  # reshard runs checkpoint at HALF and continue to STEPS
BF16_CURVE = 2e-2  # bf16 vs fp32 losses, relative, per step (bf16 rounds to 2^-8)
BF16_FLIP = 1e-3  # two bf16 runs whose fp32 updates differ in the last bits
IDS = torch.randint(0, 257, (3, 32), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def data(byte_dataset) -> str:
    return byte_dataset(300_000)


def _args(data: str, **kw) -> TrainArgs:
    base = dict(data_path=data, tokenizer_type="byte", split="80,20,0", num_layers=2,
                hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=4,
                global_batch_size=4, train_iters=STEPS, lr=3e-3, min_lr=3e-4, lr_warmup_iters=2,
                clip_grad=0.3, eval_interval=2, eval_iters=1, log_interval=1, sample_tokens=0,
                tensorboard=False, device="cpu", hidden_dropout=0.0, attention_dropout=0.0,
                save_interval=0, save_interval_minutes=0.0)
    base.update(kw)
    return TrainArgs(**base)


def _train(args: TrainArgs, run_dir: str) -> dict:
    res = fit(args, run_dir)
    return {"losses": res.losses, "norms": res.grad_norms, "val": res.val_losses,
            "optimizer_bytes": res.optimizer_state_bytes}


def _logits(run_dir: str, tp: int) -> torch.Tensor:
    """Full-vocabulary logits of the run's latest checkpoint on IDS, loaded at TP=tp."""
    from domino.checkpoint.layout import open_checkpoint
    from domino.inference.loading import load_saved_model
    from domino.parallel_state import ParallelState

    state = ParallelState.build(tp)
    step_dir, _, _ = open_checkpoint(run_dir, hashes=False)
    model, config, _, _ = load_saved_model(step_dir, state)
    with torch.no_grad():
        part = model(IDS, None, None)
    return state.tp.all_gather_last_dim(part)[..., :config.vocab_size]


def _one_rank(rank: int, world: int, data: str, tmp: str) -> dict:
    out = {}
    # Reshard sources at TP=1 (accumulating two micro-batches per step).
    tp1 = dict(tensor_model_parallel_size=1, micro_batch_size=2)
    _train(_args(data, exit_interval=HALF, **tp1), f"{tmp}/r1")
    out["r1_logits"] = _logits(f"{tmp}/r1", 1)
    out["r1_cont"] = _train(_args(data, load=f"{tmp}/r1", **tp1), f"{tmp}/r1_cont")
    # Exact resume in bf16 mixed precision, and the same run in fp32.
    bf = dict(tensor_model_parallel_size=1, bf16=True, hidden_dropout=0.1)
    out["bf16_ref"] = _train(_args(data, **bf), f"{tmp}/bf_ref")
    out["fp32_twin"] = _train(_args(data, **{**bf, "bf16": False}), f"{tmp}/fp32_twin")
    _train(_args(data, exit_interval=CUT, **bf), f"{tmp}/bf_cut")
    out["bf16_resumed"] = _train(_args(data, load=f"{tmp}/bf_cut", **bf), f"{tmp}/bf_resumed")
    out["bf16_logits"] = _logits(f"{tmp}/bf_cut", 1)
    return out


def _two_ranks(rank: int, world: int, data: str, tmp: str) -> dict:
    out = {}
    domino = dict(tensor_model_parallel_size=2, hidden_dropout=0.1, attention_dropout=0.1,
                  domino_micro_batches=2, domino_overlap="cross_layer")
    out["ref"] = _train(_args(data, **domino), f"{tmp}/ref")
    _train(_args(data, exit_interval=CUT, **domino), f"{tmp}/cut")
    out["resumed"] = _train(_args(data, load=f"{tmp}/cut", **domino), f"{tmp}/cut")
    # Reshard source at TP=2 (no dropout: masks differ between TP sizes).
    _train(_args(data, exit_interval=HALF, tensor_model_parallel_size=2), f"{tmp}/r2")
    out["r2_logits"] = _logits(f"{tmp}/r2", 2)
    out["r2_cont"] = _train(_args(data, load=f"{tmp}/r2", tensor_model_parallel_size=2),
                            f"{tmp}/r2_cont")
    # The bf16 run's checkpoint at TP=2: its logits, and training continued there in bf16.
    out["bf16_logits"] = _logits(f"{tmp}/bf_cut", 2)
    out["bf16_at_tp2"] = _train(_args(data, load=f"{tmp}/bf_cut", tensor_model_parallel_size=2,
                                      bf16=True), f"{tmp}/bf_at_tp2")
    # bf16 under ZeRO-1 at DP=2 (the fp32 masters sharded with the optimizer): exact resume,
    # and the curve of the unsharded optimizer (fp32 masters on every rank).
    zero = dict(tensor_model_parallel_size=1, micro_batch_size=2, bf16=True, hidden_dropout=0.1,
                use_distributed_optimizer=True)
    out["zero_ref"] = _train(_args(data, **zero), f"{tmp}/zero_ref")
    _train(_args(data, exit_interval=CUT, **zero), f"{tmp}/zero_cut")
    out["zero_resumed"] = _train(_args(data, load=f"{tmp}/zero_cut", **zero),
                                 f"{tmp}/zero_resumed")
    out["zero_at_tp2"] = _train(_args(data, load=f"{tmp}/zero_cut", tensor_model_parallel_size=2,
                                      micro_batch_size=4, bf16=True), f"{tmp}/zero_at_tp2")
    out["zero_plain"] = _train(_args(data, **{**zero, "use_distributed_optimizer": False}),
                               f"{tmp}/zero_plain")
    # The TP=1 checkpoint resumed at DP=2 (same micro-batches, no accumulation).
    out["dp2_cont"] = _train(_args(data, load=f"{tmp}/r1", tensor_model_parallel_size=1,
                                   micro_batch_size=2), f"{tmp}/dp2_cont")
    return out


def _resharded(rank: int, world: int, data: str, tmp: str, source: str, tp: int) -> dict:
    return {"logits": _logits(f"{tmp}/{source}", tp),
            "cont": _train(_args(data, load=f"{tmp}/{source}", tensor_model_parallel_size=tp,
                                 micro_batch_size=4 if tp == 1 else 2,
                                 global_batch_size=4), f"{tmp}/{source}_at_tp{tp}")}


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"] and a["norms"] == b["norms"] and a["val"] == b["val"]


def _close(a: dict, b: dict) -> None:
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)
    assert a["norms"] == pytest.approx(b["norms"], rel=1e-4)
    assert [v for _, v in a["val"]] == pytest.approx([v for _, v in b["val"]], rel=1e-5)


def test_resume_and_reshard(data: str, tmp_path, capfd) -> None:
    (single,) = run_distributed(_one_rank, 1, data, str(tmp_path))
    pair = run_distributed(_two_ranks, 2, data, str(tmp_path))
    to1 = run_distributed(_resharded, 1, data, str(tmp_path), "r2", 1)[0]
    to4 = run_distributed(_resharded, 4, data, str(tmp_path), "r1", 4)

    # Exact resume, TP=2 with Domino and dropout: 5 steps after the restart, bit for bit.
    for rank in pair:
        ref, resumed = rank["ref"], rank["resumed"]
        assert len(resumed["losses"]) == STEPS - CUT
        _same(resumed, {"losses": ref["losses"][CUT:], "norms": ref["norms"][CUT:],
                        "val": [v for v in ref["val"] if v[0] > CUT]})
        assert all(math.isfinite(x) for x in ref["losses"])
    bf_ref, bf_res = single["bf16_ref"], single["bf16_resumed"]
    _same(bf_res, {"losses": bf_ref["losses"][CUT:], "norms": bf_ref["norms"][CUT:],
                   "val": [v for v in bf_ref["val"] if v[0] > CUT]})

    # bf16 vs fp32: the same curve within bf16 rounding.
    fp = single["fp32_twin"]
    assert bf_ref["losses"] == pytest.approx(fp["losses"], rel=BF16_CURVE)
    assert [v for _, v in bf_ref["val"]] == pytest.approx([v for _, v in fp["val"]],
                                                          rel=BF16_CURVE)
    assert bf_ref["losses"] != fp["losses"]  # it did run in bf16
    # Its checkpoint: fp32 masters (some not representable in bf16), resharded to TP=2.
    step_dir, meta, _ = open_checkpoint(tmp_path / "bf_cut", hashes=False)
    reader = ShardReader(step_dir)
    weights = {n: reader.full(n, TensorSpec.from_json(n, raw)) for n, raw in meta.tensors.items()
               if not n.startswith("optimizer.")}
    assert weights and all(w.dtype == torch.float32 for w in weights.values())
    assert any(not torch.equal(w, w.bfloat16().float()) for w in weights.values())
    for rank in pair:
        torch.testing.assert_close(rank["bf16_logits"], single["bf16_logits"], rtol=1e-5,
                                   atol=1e-5)
        cont = rank["bf16_at_tp2"]["losses"]
        assert len(cont) == STEPS - CUT and all(math.isfinite(x) for x in cont)
        # Same weights and optimizer state as the TP=1 continuation (dropout masks differ).
        assert cont[0] == pytest.approx(bf_res["losses"][0], rel=0.05)
    # `domino eval` computes in the run's precision by default, so it reproduces the bf16
    # validation the run logged; --precision fp32 computes the same weights in fp32.
    logged = [json.loads(line) for line in
              (tmp_path / "bf_ref" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["val_loss"] for r in logged if "val_loss" in r][-1]
    capfd.readouterr()
    evals = {}
    for precision in (None, "fp32"):
        extra = [] if precision is None else ["--precision", precision]
        assert main(["eval", str(tmp_path / "bf_ref"), "--data-path", data, "--eval-iters", "1",
                     *extra]) == 0
        out = capfd.readouterr().out
        evals[precision] = float(out.split(" loss ")[1].split(",")[0])
        assert f"DP=1, {precision or 'bf16'})" in out
    assert evals[None] == pytest.approx(logged, rel=1e-4)
    assert evals["fp32"] == pytest.approx(logged, rel=BF16_CURVE)  # (printed to 4 decimals)
    assert main(["eval", str(tmp_path / "bf_ref"), "--data-path", data, "--precision",
                 "fp16"]) == 2
    assert "--precision fp16 needs a CUDA device" in capfd.readouterr().err
    # Generation in the run's bf16, through the KV cache (its cache is kept in bf16).
    assert main(["generate", str(tmp_path / "bf_ref"), "--prompt", "def ", "--greedy", "--ids",
                 "--max-new-tokens", "6", "--no-stop-at-eod"]) == 0
    assert len(capfd.readouterr().out.split()) == 6
    # ... and exported to Hugging Face: the same fp32 values.
    assert main(["export", "--format", "hf", str(tmp_path / "bf_cut"), str(tmp_path / "hf")]) == 0
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in hf.values())
    table = weights["language_model.embedding.word_embeddings.weight"]
    assert any(torch.equal(t[:257], table[:257]) for t in hf.values() if t.shape[0] >= 257)

    # ZeRO-1 in bf16: exact resume; the unsharded optimizer's curve; fp32 masters (some not
    # representable in bf16: the bf16 parameters cannot have held them) in its checkpoint,
    # which continues at TP=2; a rank holds half the masters and moments (fp32: 12 bytes per
    # parameter unsharded).
    for rank in pair:
        zref = rank["zero_ref"]
        _same(rank["zero_resumed"], {"losses": zref["losses"][CUT:],
                                     "norms": zref["norms"][CUT:],
                                     "val": [v for v in zref["val"] if v[0] > CUT]})
        # Not bit for bit: the norm sums its squares chunk by chunk, so the clipped update
        # differs in the last fp32 bits, which can flip a bf16 rounding of a weight.
        plain = rank["zero_plain"]
        assert zref["losses"] == pytest.approx(plain["losses"], rel=BF16_FLIP)
        assert zref["norms"] == pytest.approx(plain["norms"], rel=BF16_FLIP)
        assert zref["losses"] != fp["losses"]
        # Resharded to TP=2 without ZeRO: the same weights and moments (dropout masks differ).
        cont = rank["zero_at_tp2"]["losses"]
        assert cont[0] == pytest.approx(rank["zero_resumed"]["losses"][0], rel=0.05)
        n = sum(w.numel() for w in weights.values())
        for got in zref["optimizer_bytes"]:
            assert 12 * n / 2 <= got <= 12 * n / 2 + 4096, (got, n)
    step_dir, meta, _ = open_checkpoint(tmp_path / "zero_cut", hashes=False)
    reader = ShardReader(step_dir)
    zw = {n: reader.full(n, TensorSpec.from_json(n, raw)) for n, raw in meta.tensors.items()
          if not n.startswith("optimizer.")}
    assert zw.keys() == weights.keys() and all(w.dtype == torch.float32 for w in zw.values())
    assert any(not torch.equal(w, w.bfloat16().float()) for w in zw.values())

    # A new DP size with the same micro-batches: bit-identical.
    for rank in pair:
        _same(rank["dp2_cont"], single["r1_cont"])

    # TP=2 -> 1 and TP=1 -> 4: the saved model's logits, and the same continued training.
    torch.testing.assert_close(to1["logits"], pair[0]["r2_logits"], rtol=1e-5, atol=1e-5)
    _close(to1["cont"], pair[0]["r2_cont"])
    for rank in to4:
        torch.testing.assert_close(rank["logits"], single["r1_logits"], rtol=1e-5, atol=1e-5)
        _close(rank["cont"], single["r1_cont"])
    assert len(single["r1_cont"]["losses"]) == STEPS - HALF
