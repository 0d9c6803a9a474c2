"""MoE models in a pipeline (`domino train --pipeline-model-parallel-size 2`): the same losses,
gradient norms, validation and logged router metrics as one stage over the same micro-batches
(the auxiliary losses of each micro-batch weighed by its own tokens while 1F1B interleaves the
micro-batches; the metrics summed over the stages), an exact resume, the closing sample through
MoE stages; with expert parallelism and ZeRO-1 too, the checkpoint holding whole experts and
continuing at PP=1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist import fit, run_distributed
from test_moe_training import MOE_ARGS

from domino.checkpoint.layout import open_checkpoint

STEPS, CUT = 4, 2
# Four layers, the first dense: each of two stages holds an MoE layer. Global batch 8 in
# micro-batches of 2: 4 pipeline micro-batches at PP=2, 2 at PP=2 x DP=2.
RUN = dict(MOE_ARGS, num_layers=4, micro_batch_size=2, global_batch_size=8, train_iters=STEPS)


def _train(data: str, run_dir: str, **kw) -> dict:
    from test_checkpoint_resume import _args

    res = fit(_args(data, **dict(RUN, **kw)), run_dir)
    return {"losses": res.losses, "norms": res.grad_norms, "val": res.val_losses,
            "sample": res.sample}


def _metrics(run_dir: Path) -> list[dict]:
    """The router metrics rank 0 logged, per step."""
    return [{k: v for k, v in json.loads(line).items() if k.startswith("moe_")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tensors(run_dir: Path) -> dict[str, list[int]]:
    """The full shapes of the latest checkpoint's model tensors."""
    _, meta, _ = open_checkpoint(run_dir, hashes=False)
    return {k: v["shape"] for k, v in meta.tensors.items() if not k.startswith("optimizer.")}


def _reference(rank: int, world: int, data: str, tmp: str) -> dict:
    return _train(data, f"{tmp}/pp1")


@pytest.fixture(scope="module")
def reference(byte_dataset, tmp_path_factory) -> tuple[str, Path, dict]:
    """(data, run folder, results) of the one-stage run every pipeline run is held to."""
    data = byte_dataset(200_000)
    tmp = tmp_path_factory.mktemp("moe_pp1")
    return data, tmp / "pp1", run_distributed(_reference, 1, data, str(tmp))[0]


def _close(got: dict, want: dict, what: str, steps: slice = slice(None)) -> None:
    """Losses, gradient norms and validation of ``got`` are ``want``'s (at ``steps``)."""
    for key in ("losses", "norms"):
        assert got[key] == pytest.approx(want[key][steps], rel=1e-5), (what, key)
    val = dict(want["val"])
    assert got["val"] and dict(got["val"]) == pytest.approx(
        {step: val[step] for step, _ in got["val"]}, rel=1e-5), what


def _pp2(rank: int, world: int, data: str, tmp: str) -> dict:
    pp = dict(pipeline_model_parallel_size=2)
    out = {"1f1b": _train(data, f"{tmp}/1f1b", sample_tokens=8, **pp)}
    _train(data, f"{tmp}/cut", exit_interval=CUT, **pp)
    out["resumed"] = _train(data, f"{tmp}/resumed", load=f"{tmp}/cut", **pp)
    # Chunks without an MoE layer (layer 0) and with one; zero-bubble's deferred W passes.
    out["interleaved"] = _train(data, f"{tmp}/interleaved",
                                num_layers_per_virtual_pipeline_stage=1, **pp)
    out["zero_bubble"] = _train(data, f"{tmp}/zero_bubble", pipeline_schedule="zero_bubble", **pp)
    return out


def test_moe_pipeline_matches_one_stage_and_resumes_exactly(reference, tmp_path) -> None:
    """PP=2 (1F1B, interleaved, zero-bubble) with capacity drops, a shared expert, the expert
    bias and both auxiliary losses follows PP=1 over the same micro-batches, logs PP=1's router
    metrics, resumes bit for bit (each stage's expert biases in its checkpoint) and samples."""
    data, ref_dir, ref = reference
    ranks = run_distributed(_pp2, 2, data, str(tmp_path))
    want = _metrics(ref_dir)
    assert any(r["moe_dropped"] > 0 for r in want)
    for res in ranks:
        for name in ("1f1b", "interleaved", "zero_bubble"):
            _close(res[name], ref, name)
        resumed, full = res["resumed"], res["1f1b"]
        assert resumed["losses"] == full["losses"][CUT:]
        assert resumed["norms"] == full["norms"][CUT:]
        assert resumed["val"] == [v for v in full["val"] if v[0] > CUT]
        assert full["sample"] and len(full["sample"]) > 3
    for name in ("1f1b", "interleaved", "zero_bubble"):
        got = _metrics(tmp_path / name)
        assert len(got) == len(want) and all(
            g == pytest.approx(w, rel=1e-5) for g, w in zip(got, want)), name
    assert _metrics(tmp_path / "resumed") == _metrics(tmp_path / "1f1b")[CUT:]


def _pp2_ep2(rank: int, world: int, data: str, tmp: str) -> dict:
    """PP=2 x DP=2 with the experts split over EP=2 and ZeRO-1, and its checkpoint continued
    at PP=1 (DP=4, EP=1)."""
    run = dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2,
               use_distributed_optimizer=True)
    out = {"pp2ep2": _train(data, f"{tmp}/pp2ep2", sample_tokens=8, **run)}
    _train(data, f"{tmp}/cut", exit_interval=CUT, **run)
    out["at_pp1"] = _train(data, f"{tmp}/at_pp1", load=f"{tmp}/cut",
                           use_distributed_optimizer=True)
    return out


def test_moe_pipeline_with_expert_parallelism_and_zero(reference, tmp_path) -> None:
    """PP=2 x EP=2 (DP=2, ZeRO-1; each stage's Domino schedule runs its MoE edges) follows
    PP=1 at DP=1; its checkpoint holds whole experts (PP=1's tensors) and continues at PP=1
    (DP=4, EP=1) as the one-stage run does."""
    data, ref_dir, ref = reference
    for res in run_distributed(_pp2_ep2, 4, data, str(tmp_path)):
        _close(res["pp2ep2"], ref, "pp2ep2")
        _close(res["at_pp1"], ref, "at_pp1", slice(CUT, None))
        assert res["pp2ep2"]["sample"] and len(res["pp2ep2"]["sample"]) > 3
    got, want = _metrics(tmp_path / "pp2ep2"), _metrics(ref_dir)
    assert all(g == pytest.approx(w, rel=1e-5) for g, w in zip(got, want, strict=True))
    assert _tensors(tmp_path / "cut") == _tensors(ref_dir)
