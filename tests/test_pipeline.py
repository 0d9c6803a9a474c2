"""Pipeline parallelism against the single-process model (spawned gloo ranks).

PP=2 x TP=1, PP=2 x TP=2 (with a Domino plan inside each stage) and PP=2 x DP=2, under every
schedule, for tied and untied word embeddings, with several pipeline micro-batches per step
(gradient accumulation): the initial weights are the full model's (each part drawn from its own
seeded stream), and the loss, the gradient norm, every gathered gradient after the first step
and every weight after three optimizer steps equal the single-process run's within fp32
tolerance; the first and last stage's copies of a tied word table stay equal. PP runs save,
resume bit-identically, and reshard to PP=1. PP=2 x CP=2 trains as PP=2 x DP=2 on the same
batches under every schedule, and writes the same checkpoint.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from dist import fit, run_distributed
from safetensors.torch import load_file
from tp_helpers import one_thread

from domino.config import TransformerConfig
from domino.plan import Plan
from domino.training.arguments import TrainArgs

V, S, MICRO, GLOBAL, STEPS = 97, 16, 2, 8, 3
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


def _config(tied: bool, sp: bool = False) -> TransformerConfig:
    """The untied model also slides a 6-key window over its 16 tokens (Mistral's attention)."""
    return TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=V,
                             seq_length=S, max_position_embeddings=S, hidden_dropout=0.0,
                             attention_dropout=0.0, untie_embeddings_and_output_weights=not tied,
                             make_vocab_size_divisible_by=16, sequence_parallel=sp,
                             window_size=None if tied else 6)


def _batches() -> list[dict[str, torch.Tensor]]:
    """The step's micro-batches (global order), some loss tokens masked out."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(GLOBAL // MICRO):
        ids = torch.randint(0, V, (MICRO, S + 1), generator=gen)
        out.append({"tokens": ids[:, :-1], "labels": ids[:, 1:],
                    "loss_mask": (torch.rand(MICRO, S, generator=gen) > 0.2).float(),
                    "position_ids": torch.arange(S).expand(MICRO, S)})
    return out


def _args(**kw) -> TrainArgs:
    return TrainArgs(micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-2, min_lr=1e-3,
                     lr_warmup_iters=0, clip_grad=0.5, weight_decay=0.1, **kw)


def _gathered(model, state, grads: bool) -> dict[str, torch.Tensor]:
    """Full tensors (or gradients) under the full model's names, on TP rank 0."""
    from domino.tensor_parallel import gather_full, placement_of

    out = {}
    tensors = model.checkpoint_tensors() if hasattr(model, "checkpoint_tensors") else \
        model.named_parameters()
    for name, p in tensors:
        t = p.grad if grads else p.detach()
        full = gather_full(t.detach(), p, state.tp)
        rows = placement_of(p).rows  # padding rows depend on the TP size
        key = name + (" (last-stage copy)" if placement_of(p).tied_copy else "")
        out[key] = (full[:rows] if rows else full).clone()
    return out


def _train(model, state, args, runner=None) -> dict:
    from domino.training.grad_sync import make_reducer
    from domino.training.optim import build_optimizer, learning_rate, set_lr
    from domino.training.step import train_step

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, args)
    everything = _batches()
    per_rank = len(everything) // state.dp.size
    mine = everything[state.dp.rank * per_rank:(state.dp.rank + 1) * per_rank]
    res = {"losses": [], "norms": [], "early": []}
    # With DP the buckets launch during the schedule's last backwards (not zero-bubble's).
    reducer = make_reducer(model, params, state, runner=runner, bucket_numel=4096)
    for step in range(1, STEPS + 1):
        set_lr(optimizer, learning_rate(step, args))
        out = train_step(model, params, optimizer, None, mine, args, state, runner=runner,
                         reducer=reducer)
        if reducer is not None:
            res["early"].append(reducer.launched_early)
        res["losses"].append(out.loss)
        res["norms"].append(out.grad_norm)
        if step == 1:
            res["grads"] = _gathered(model, state, grads=True)
    res["weights"] = _gathered(model, state, grads=False)
    return res


def _reference(tied: bool) -> dict:
    from domino.models.gpt import GPTModel
    from domino.parallel_state import ParallelState

    state = ParallelState.single()
    torch.manual_seed(0)
    model = GPTModel(_config(tied), parallel_state=state)
    init = _gathered(model, state, grads=False)
    res = _train(model, state, _args())
    res["init"] = init
    return res


def _pipelined(state, tied: bool, schedule: str, plan: Plan, sp: bool = False) -> dict:
    from domino.pipeline.model import PipelineModel
    from domino.pipeline.partition import partition
    from domino.pipeline.runtime import PipelineRunner

    layout = partition(4, 2, layers_per_virtual_stage=1 if schedule == "interleaved" else None)
    torch.manual_seed(0)
    model = PipelineModel(_config(tied, sp), state, layout, plan=plan)
    init = _gathered(model, state, grads=False)
    runner = PipelineRunner(model, schedule, GLOBAL // (MICRO * state.dp.size), S, MICRO)
    res = _train(model, state, _args(), runner)
    res["init"] = init
    return res


def _ranks(rank: int, world: int, layouts: list[tuple[int, int]]) -> dict:
    from domino.parallel_state import ParallelState

    out = {}
    for tp, pp in layouts:
        state = ParallelState.build(tp, pp)
        plan = Plan(2, "cross_layer", 2) if tp > 1 else Plan(2, "cross_layer")
        # Sequence parallelism at TP > 1: stages send their sequence shards.
        for sp in (False, True) if tp > 1 else (False,):
            for tied in (True, False):
                for schedule in SCHEDULES:
                    res = _pipelined(state, tied, schedule, plan, sp)
                    if state.tp.rank == 0 and state.dp.rank == 0:  # full tensors live here
                        out[(tp, pp, state.dp.size, tied, schedule, sp)] = res
    return out


def _merge(ranks: list[dict]) -> dict:
    """Per configuration: losses and norms (from any rank) and the stages' tensors together."""
    merged: dict = {}
    for part in ranks:
        for key, res in part.items():
            m = merged.setdefault(key, {"losses": res["losses"], "norms": res["norms"],
                                        "early": res["early"], "grads": {}, "weights": {},
                                        "init": {}})
            for field in ("grads", "weights", "init"):
                m[field].update(res[field])
    return merged


def _close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 0.0) -> None:
    scale = max(float(want.abs().max()), 1e-3)
    err = float((got - want).abs().max())
    assert err <= 2e-5 * scale + atol, f"{what}: error {err:.2e} (scale {scale:.2e})"


@pytest.fixture(scope="module")
def refs() -> dict:
    with one_thread():  # not OpenMP threads spinning against the other tests' processes
        return {tied: _reference(tied) for tied in (True, False)}


# One test per spawn, so a failure names its layout (the file's tests share one worker):
# (world, TP, PP) -> configurations (sequence parallelism on and off at TP > 1, tied or not).
SPAWNS = {(2, 1, 2): 2, (4, 2, 2): 4, (4, 1, 2): 2}


@pytest.mark.parametrize("spawn", list(SPAWNS), ids=lambda s: f"world{s[0]}_tp{s[1]}_pp{s[2]}")
def test_pipelines_match_the_single_process_model(refs, spawn) -> None:
    world, tp, pp = spawn
    results = _merge(run_distributed(_ranks, world, [(tp, pp)]))
    assert len(results) == SPAWNS[spawn] * len(SCHEDULES)
    for (tp, pp, dp, tied, schedule, sp), res in results.items():
        ref = refs[tied]
        where = f"TP={tp} PP={pp} DP={dp} tied={tied} {schedule} sp={sp}"
        assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5), where
        assert res["norms"] == pytest.approx(ref["norms"], rel=1e-5), where
        if dp > 1 and schedule != "zero_bubble":  # buckets launched during the schedule
            assert res["early"] and min(res["early"]) > 0, (where, res["early"])
        for field in ("init", "grads", "weights"):
            names = {k for k in res[field] if not k.endswith("(last-stage copy)")}
            assert names == set(ref[field]), (where, field)
            # AdamW turns the fp32 noise of a near-zero gradient element into up to a step of
            # lr: weights after steps get an absolute allowance of 1% of lr (a real error,
            # e.g. a gradient summed twice, moves whole tensors by about lr).
            atol = 0.01 * _args().lr if field == "weights" else 0.0
            for name in names:
                _close(res[field][name], ref[field][name], f"{where} {field} {name}", atol)
        copy = "language_model.embedding.word_embeddings.weight (last-stage copy)"
        if tied:  # both ends of the pipeline hold the word table, and it stays one table
            for field in ("init", "weights"):
                assert torch.equal(res[field][copy],
                                   res[field]["language_model.embedding.word_embeddings.weight"])
        else:
            assert copy not in res["weights"]
        assert all(math.isfinite(x) for x in res["losses"])


# ---- checkpoints of pipeline runs -------------------------------------------------------------


@pytest.fixture(scope="module")
def data(byte_dataset) -> str:
    return byte_dataset(200_000)


def _run_args(data: str, **kw) -> TrainArgs:
    base = dict(data_path=data, tokenizer_type="byte", split="80,20,0", num_layers=4,
                hidden_size=32, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                global_batch_size=8, train_iters=6, lr=3e-3, min_lr=3e-4, lr_warmup_iters=2,
                eval_interval=3, eval_iters=1, log_interval=1, sample_tokens=8,
                tensorboard=False, device="cpu", hidden_dropout=0.1, attention_dropout=0.0,
                save_interval=0, save_interval_minutes=0.0, tensor_model_parallel_size=1)
    base.update(kw)
    return TrainArgs(**base)


def _fit(args: TrainArgs, run_dir: str) -> dict:
    res = fit(args, run_dir)
    return {"losses": res.losses, "norms": res.grad_norms, "val": res.val_losses,
            "sample": res.sample}


def _pp_runs(rank: int, world: int, data: str, tmp: str) -> dict:
    pp = dict(pipeline_model_parallel_size=2, pipeline_schedule="zero_bubble")
    out = {"ref": _fit(_run_args(data, **pp), f"{tmp}/ref")}
    _fit(_run_args(data, exit_interval=3, **pp), f"{tmp}/cut")
    out["resumed"] = _fit(_run_args(data, load=f"{tmp}/cut", **pp), f"{tmp}/cut")
    nodrop = dict(pp, hidden_dropout=0.0)
    _fit(_run_args(data, exit_interval=3, **nodrop), f"{tmp}/half")
    out["cont"] = _fit(_run_args(data, load=f"{tmp}/half", **nodrop), f"{tmp}/half_cont")
    # bf16 mixed precision: bf16 activations and gradients cross the stage boundary.
    out["bf16"] = _fit(_run_args(data, bf16=True, **nodrop), f"{tmp}/bf16")
    return out


def _at_pp1(rank: int, world: int, data: str, tmp: str) -> dict:
    return {"cont": _fit(_run_args(data, load=f"{tmp}/half", hidden_dropout=0.0),
                         f"{tmp}/half_at_pp1"),
            "bf16": _fit(_run_args(data, bf16=True, hidden_dropout=0.0), f"{tmp}/bf16_pp1")}


def test_pipeline_checkpoints_resume_and_reshard(data: str, tmp_path) -> None:
    ranks = run_distributed(_pp_runs, 2, data, str(tmp_path))
    at_pp1 = run_distributed(_at_pp1, 1, data, str(tmp_path))[0]
    for res in ranks:
        ref, resumed = res["ref"], res["resumed"]
        # Exact resume of a PP=2 zero-bubble run with dropout: steps 4-6 bit for bit.
        assert resumed["losses"] == ref["losses"][3:] and resumed["norms"] == ref["norms"][3:]
        assert resumed["val"] == [v for v in ref["val"] if v[0] > 3]
        assert ref["sample"] and len(ref["sample"]) > 3  # the final sample went through stages
    # PP=2 -> PP=1: the continued training matches within fp32 tolerance.
    cont = ranks[0]["cont"]
    bf16, bf16_pp1 = ranks[0]["bf16"], at_pp1["bf16"]
    at_pp1 = at_pp1["cont"]
    assert at_pp1["losses"] == pytest.approx(cont["losses"], rel=1e-5)
    assert [v for _, v in at_pp1["val"]] == pytest.approx([v for _, v in cont["val"]], rel=1e-5)
    # bf16 through two stages: the one-stage bf16 run's curve within bf16 rounding.
    assert bf16["losses"] == pytest.approx(bf16_pp1["losses"], rel=2e-2)
    assert all(math.isfinite(x) for x in bf16["norms"])
    names = {p.name for p in (tmp_path / "half" / "checkpoints" / "step_0000003").iterdir()}
    assert {"model-tp00-pp00.safetensors", "model-tp00-pp01.safetensors"} <= names


def _pp_dp_memory_options(rank: int, world: int, data: str, tmp: str) -> dict:
    """PP=2 x DP=2: ZeRO-1 with full recomputation, and selective recomputation, against the
    plain run, under zero-bubble (its deferred W passes are the harder case)."""
    out = {}
    for schedule in ("zero_bubble", "1f1b"):
        base = dict(pipeline_model_parallel_size=2, pipeline_schedule=schedule,
                    hidden_dropout=0.1, train_iters=4, eval_interval=2)
        out[schedule] = {
            "plain": _fit(_run_args(data, **base), f"{tmp}/{schedule}_plain"),
            "zero full": _fit(_run_args(data, **base, use_distributed_optimizer=True,
                                        recompute_granularity="full"), f"{tmp}/{schedule}_zero"),
            "selective": _fit(_run_args(data, **base, recompute_granularity="selective"),
                              f"{tmp}/{schedule}_sel"),
            # 1F1B launches the DP buckets during its last backwards; this reduces after.
            "blocking": _fit(_run_args(data, **base, overlap_grad_reduce=False),
                             f"{tmp}/{schedule}_block"),
        }
    return out


def _pp_cp(data: str, tmp: str) -> dict:
    """PP=2 x CP=2 against PP=2 x DP=2 on the same global batches (each pipeline micro-batch
    of 4 samples split over the CP pair instead of 2 samples per DP rank), under each
    schedule: what crosses a stage boundary is the rank's sequence shard."""
    out = {}
    for schedule in ("1f1b", "interleaved", "zero_bubble"):
        base = dict(pipeline_model_parallel_size=2, pipeline_schedule=schedule, train_iters=4,
                    eval_interval=2, hidden_dropout=0.0,
                    # Not 1e-8: AdamW would blow the key bias's gradient (zero in exact
                    # arithmetic, rounding noise here) up to full steps.
                    adam_eps=1e-4)
        if schedule == "interleaved":
            base["num_layers_per_virtual_pipeline_stage"] = 1
        out[schedule] = {
            "dp": _fit(_run_args(data, **base), f"{tmp}/{schedule}_dp"),
            "cp": _fit(_run_args(data, **base, context_parallel_size=2, micro_batch_size=4,
                                 cp_comm_type="p2p" if schedule != "zero_bubble" else "a2a"),
                       f"{tmp}/{schedule}_cp"),
        }
    # MoE layers with EP = 2 over DP or over CP: pipeline micro-batches of the same 2 samples
    # (so the auxiliary losses are of the same tokens), a capacity that drops.
    moe = dict(pipeline_model_parallel_size=2, pipeline_schedule="1f1b", train_iters=4,
               eval_interval=2, hidden_dropout=0.0, adam_eps=1e-4, num_experts=4,
               moe_ffn_hidden_size=32, moe_router_topk=2, moe_aux_loss_coeff=0.1,
               moe_z_loss_coeff=0.01, moe_expert_capacity_factor=1.0,
               expert_model_parallel_size=2)
    out["moe"] = {"dp": _fit(_run_args(data, **moe), f"{tmp}/moe_dp"),
                  "cp": _fit(_run_args(data, **moe, context_parallel_size=2), f"{tmp}/moe_cp")}
    return out


def _four_ranks(rank: int, world: int, data: str, tmp: str) -> dict:
    return {"memory": _pp_dp_memory_options(rank, world, data, tmp), "cp": _pp_cp(data, tmp)}


_FOUR: dict = {}


def _four(data: str, tmp: Path) -> list[dict]:
    """The four-rank spawn both tests below read (one spawn: start-up is most of its time)."""
    if not _FOUR:
        _FOUR["ranks"], _FOUR["tmp"] = run_distributed(_four_ranks, 4, data, str(tmp)), tmp
    return _FOUR["ranks"]


def test_pipeline_with_context_parallelism(data: str, tmp_path_factory) -> None:
    ranks = _four(data, tmp_path_factory.mktemp("four"))
    for rank, res in enumerate(ranks):
        for schedule, runs in res["cp"].items():
            dp, cp = runs["dp"], runs["cp"]
            where = f"rank {rank} {schedule}"
            assert cp["losses"] == pytest.approx(dp["losses"], rel=1e-5), where
            assert cp["norms"] == pytest.approx(dp["norms"], rel=1e-5), where
            assert [v for _, v in cp["val"]] == pytest.approx([v for _, v in dp["val"]],
                                                              rel=1e-5), where
            assert cp["sample"] == dp["sample"], where
    folder = _FOUR["tmp"]
    for schedule in ranks[0]["cp"]:  # the checkpoints do not depend on CP
        if schedule == "moe":
            continue
        for stage in ("pp00", "pp01"):
            name = f"checkpoints/step_0000004/model-tp00-{stage}.safetensors"
            want = load_file(folder / f"{schedule}_dp" / name)
            got = load_file(folder / f"{schedule}_cp" / name)
            assert got.keys() == want.keys()
            for key, w in want.items():
                err = float((got[key] - w).abs().max() / w.abs().max().clamp(min=1e-3))
                assert err <= 1e-5, (schedule, key, err)


def test_pipeline_with_distributed_optimizer_and_recompute(data: str, tmp_path_factory) -> None:
    for res in (r["memory"] for r in _four(data, tmp_path_factory.mktemp("four"))):
        for schedule, runs in res.items():
            plain = runs["plain"]
            assert runs["selective"]["losses"] == plain["losses"], schedule  # bit for bit
            assert runs["selective"]["norms"] == plain["norms"], schedule
            # ZeRO-1 sums the norm from DP chunks (another order): fp32 tolerance.
            assert runs["zero full"]["losses"] == pytest.approx(plain["losses"], rel=1e-5)
            assert runs["zero full"]["norms"] == pytest.approx(plain["norms"], rel=1e-5)
            assert runs["blocking"] == plain, schedule  # overlapped DP reduction: bit for bit
