"""Sharded data parallelism with pipeline parallelism (PP=2 x DP=2): one spawn of 4 ranks.

* ``optim_grads`` and ``optim_grads_params`` (units resharded after each forward, or kept for
  the step) under 1F1B, interleaved 1F1B and zero-bubble give ``no_shard``'s losses, gradient
  norms, validation loss and saved weights and AdamW moments within fp32 rounding (bf16 too,
  an MoE model with EP=2, and a LoRA fine-tune whose frozen base ties its word table across
  the two stages).
* Where the pipeline gathers and reduces, recorded action by action (a CommHook on the
  gradient group, the runner's F/B/W wrapped): resharded, every unit is gathered again for each
  pipeline micro-batch's forward and backward, and few are whole at once; kept, each unit is
  gathered once per step and stays whole until the step's last backward through its chunk,
  then freed. The blocks' gradients are reduce-scattered once per pipeline micro-batch, inside
  the step, under 1F1B; once, after the W passes, under zero-bubble.
* A checkpoint of the PP x DP ``optim_grads_params`` run resumes exactly and continues at
  TP=2 x DP=2 under ``no_shard``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dist import run_distributed
from test_fsdp import FP32, STEPS, _args, _rel, _saved, _slug

OGP = "optim_grads_params"
M = 4  # pipeline micro-batches per step: global 16 / (micro-batch 2 x DP 2)
PP = dict(pipeline_model_parallel_size=2, micro_batch_size=2, global_batch_size=16,
          eval_interval=2, eval_iters=1)
INTERLEAVED = dict(pipeline_schedule="interleaved", num_layers_per_virtual_pipeline_stage=1)
# 8 layers: 4 units per stage, so resharding holds fewer than all of them.
WIDE = dict(num_layers=8, fsdp_prefetch=0)
LORA = dict(load="1f1b no_shard", finetune=True, lora_rank=4, adam_eps=1e-3)
RUNS = {
    "1f1b no_shard": {},
    "1f1b optim_grads": dict(data_parallel_sharding_strategy="optim_grads"),
    "1f1b units": dict(data_parallel_sharding_strategy=OGP),
    "1f1b units kept": dict(data_parallel_sharding_strategy=OGP, fsdp_reshard_after_forward=False),
    "interleaved no_shard": INTERLEAVED,
    "interleaved optim_grads": dict(INTERLEAVED, data_parallel_sharding_strategy="optim_grads"),
    "interleaved units": dict(INTERLEAVED, data_parallel_sharding_strategy=OGP),
    "interleaved units kept": dict(INTERLEAVED, data_parallel_sharding_strategy=OGP,
                                   fsdp_reshard_after_forward=False),
    "zero_bubble no_shard": dict(pipeline_schedule="zero_bubble"),
    "zero_bubble units 2": dict(pipeline_schedule="zero_bubble",
                                data_parallel_sharding_strategy=OGP, fsdp_unit_layers=2),
    "moe no_shard": dict(num_experts=4, expert_model_parallel_size=2),
    "moe units": dict(num_experts=4, expert_model_parallel_size=2,
                      data_parallel_sharding_strategy=OGP),
    # LoRA fine-tunes of the "1f1b no_shard" run (its tied word table frozen, on two stages);
    # AdamW's eps large, as B starts at zero: gradients that are rounding noise in one order
    # and exact zeros in another would otherwise each move by a whole step.
    "lora no_shard": dict(LORA),
    "lora units": dict(LORA, data_parallel_sharding_strategy=OGP),
    "bf16 1f1b no_shard": dict(bf16=True),
    "bf16 1f1b units": dict(bf16=True, data_parallel_sharding_strategy=OGP),
}
RECORDED = {  # (recorded: the order of events)
    "wide no_shard": WIDE,
    "wide resharded": dict(WIDE, data_parallel_sharding_strategy=OGP),
    "wide kept": dict(WIDE, data_parallel_sharding_strategy=OGP,
                      fsdp_reshard_after_forward=False),
    "wide optim_grads": dict(WIDE, data_parallel_sharding_strategy="optim_grads"),
    "wide zero_bubble optim_grads": dict(WIDE, pipeline_schedule="zero_bubble",
                                         data_parallel_sharding_strategy="optim_grads"),
}


# -- in the ranks ---------------------------------------------------------------------------------
class _Recorder:
    """One log per rank: ``("step",)`` / ``("end",)`` around each pipeline step, each action
    (kind, micro-batch, chunk, the (chunk, unit)s whole as it starts), each unit's all-gather
    (``("gather", chunk, unit)``) and each block bucket's reduce-scatter (``("rs", bucket)``)."""

    def __init__(self, trainer) -> None:
        self.t, self.log = trainer, []
        parts = trainer.gathers.parts if trainer.gathers is not None else []
        self.flats = {(c, u): fs for c, part in enumerate(parts) for u, fs in enumerate(part.flats)}
        self.unit_of_flat = {id(f.full): cu for cu, fs in self.flats.items() for f in fs}
        inside = {id(p) for b in trainer.model.blocks() for p in b.parameters()}
        self.block_buckets = {i for i, b in enumerate(trainer.reducer.buckets)
                              if all(id(p) in inside for p in b.params)}

    def present(self) -> tuple:
        return tuple(sorted(cu for cu, fs in self.flats.items() if all(f.present() for f in fs)))

    def launch(self, tensor, group, kind="all_reduce"):
        if kind == "all_gather" and id(tensor) in self.unit_of_flat:
            self.log.append(("gather", *self.unit_of_flat[id(tensor)]))
        elif kind == "reduce_scatter":
            for bi, bucket in enumerate(self.t.reducer.buckets):
                if tensor is bucket.flat and bi in self.block_buckets:
                    self.log.append(("rs", bi))
        return None  # the real collective runs

    def finished(self, *args) -> None:
        pass

    def region(self, *args, **tags):
        import contextlib
        return contextlib.nullcontext()

    def _logged(self, kind: str, method):
        def logged(run, a):
            self.log.append((kind, a.mb, a.chunk, self.present()))
            return method(run, a)
        return logged

    def wrap(self, run_cls, runner) -> None:
        """Log every action of ``run_cls`` (the runner's ``_StepRun``) and ``runner``'s steps."""
        for kind, name in (("F", "forward"), ("B", "backward"), ("W", "weights")):
            setattr(run_cls, name, self._logged(kind, getattr(run_cls, name)))
        step = runner.step

        def stepped(*args, **kw):
            self.log.append(("step",))
            out = step(*args, **kw)
            self.log.append(("end", self.present()))
            return out
        runner.step = stepped


def _train(args, run_dir: str, record: bool = False) -> dict:
    from domino.pipeline import runtime
    from domino.training import logging as train_logging
    from domino.training.fsdp import implied_state
    from domino.training.loop import Trainer
    from domino.training.prepare import build_run
    from domino.training.worker import build_state

    train_logging.plot_loss_curve = lambda path, train, val: None  # (this rank's process only)
    state = build_state(args, args.device)
    methods = {n: getattr(runtime._StepRun, n) for n in ("forward", "backward", "weights")}
    out: dict = {}
    try:
        trainer = Trainer(build_run(args, Path(run_dir)), state)
        if record:
            rec = _Recorder(trainer)
            rec.wrap(runtime._StepRun, trainer.runner)
            for g in trainer.reducer.groups():
                g.hook = rec
        result = trainer.finish(trainer.fit())
        if record:
            for g in trainer.reducer.groups():
                g.hook = None
            units = trainer.gathers.unit_bytes() if trainer.gathers is not None else []
            out.update(log=rec.log, units=units, buckets=sorted(rec.block_buckets),
                       implied=implied_state(trainer.strategy, trainer.model, trainer.params,
                                             trainer.optimizer, trainer.gathers,
                                             args.fsdp_prefetch))
    except BaseException:
        state.close(wait=False)
        raise
    finally:
        for n, f in methods.items():
            setattr(runtime._StepRun, n, f)
    state.close()
    return {"losses": result.losses, "norms": result.grad_norms, "val": result.val_losses, **out}


def _four_ranks(rank: int, world: int, data: str, tmp: str) -> dict:
    out = {}
    for name, kw in RUNS.items():
        if "load" in kw:  # (a run above, by name)
            kw = dict(kw, load=f"{tmp}/{_slug(kw['load'])}")
        out[name] = _train(_args(data, **PP, **kw), f"{tmp}/{_slug(name)}")
    out.update({name: _train(_args(data, **PP, **kw), f"{tmp}/{_slug(name)}", record=True)
                for name, kw in RECORDED.items()})
    units = dict(PP, data_parallel_sharding_strategy=OGP)
    _train(_args(data, **units, exit_interval=2), f"{tmp}/cut")
    out["resumed"] = _train(_args(data, **units, load=f"{tmp}/cut"), f"{tmp}/resumed")
    out["at tp2"] = _train(_args(data, tensor_model_parallel_size=2, micro_batch_size=2,
                                 global_batch_size=16, load=f"{tmp}/cut"), f"{tmp}/at_tp2")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fsdp_pp")


@pytest.fixture(scope="module")
def four(byte_dataset, runs) -> list[dict]:
    return run_distributed(_four_ranks, 4, byte_dataset(200_000), str(runs))


# -- 1. every strategy and schedule equals no_shard -----------------------------------------------
def test_every_strategy_and_schedule_equals_no_shard(four, runs) -> None:
    saved = {name: _saved(runs / _slug(name)) for name in RUNS}
    for name in RUNS:
        # (the same schedule's, or precision's, no_shard run)
        ref = next(n for n in RUNS if n.endswith("no_shard") and n.split()[0] == name.split()[0])
        tol = 1e-3 if name.startswith("bf16") else FP32
        for res in four:
            got, want = res[name], res[ref]
            assert len(got["losses"]) == STEPS, name
            assert got["losses"] == pytest.approx(want["losses"], rel=tol / 10), name
            assert got["norms"] == pytest.approx(want["norms"], rel=tol / 10), name
            assert [v for _, v in got["val"]] == pytest.approx([v for _, v in want["val"]],
                                                              rel=tol / 10), name
            assert len(got["val"]) == 2, name
        assert saved[name].keys() == saved[ref].keys(), name
        worst = max(saved[ref], key=lambda k: _rel(saved[name][k], saved[ref][k]))
        assert _rel(saved[name][worst], saved[ref][worst]) < tol, (name, worst)
    for name in RECORDED:  # (the recorded runs train alike too)
        assert four[0][name]["losses"] == pytest.approx(four[0]["wide no_shard"]["losses"],
                                                        rel=FP32 / 10), name
    assert four[0]["bf16 1f1b no_shard"]["losses"] != four[0]["1f1b no_shard"]["losses"]


# -- 2. where the pipeline gathers and reduces ----------------------------------------------------
def _steps(log: list) -> list[tuple[list, tuple]]:
    """The log cut into pipeline steps: (what happened from ``step`` to ``end``, and after it
    until the next step: the reductions finished after the schedule, the optimizer)."""
    starts = [i for i, e in enumerate(log) if e[0] == "step"] + [len(log)]
    out = []
    for a, b in zip(starts, starts[1:], strict=False):
        end = next(i for i in range(a, b) if log[i][0] == "end")
        out.append((log[a + 1:end], log[end], log[end + 1:b]))
    return out


def test_units_resharded_per_micro_batch_or_kept_for_the_step(four) -> None:
    for res in four:
        for name, kept in (("wide resharded", False), ("wide kept", True)):
            run = res[name]
            count = len(run["units"])
            assert count == 4, name  # (4 layers per stage, a unit each)
            steps = _steps(run["log"])
            assert len(steps) == STEPS, name
            for inside, end, _after in steps:
                gathers = [e[1:] for e in inside if e[0] == "gather"]
                per_unit = {cu: gathers.count(cu) for cu in set(gathers)}
                assert set(per_unit) == {(0, u) for u in range(count)}, (name, per_unit)
                assert end[1] == (), (name, "units left whole after the step", end)
                held = [e[3] for e in inside if e[0] in "FB"]
                if kept:  # once, and whole from its first use to the step's last backward
                    assert set(per_unit.values()) == {1}, (name, per_unit)
                    last_b = max(i for i, e in enumerate(inside) if e[0] == "B")
                    first_b = min(i for i, e in enumerate(inside) if e[0] == "B")
                    for e in inside[first_b:last_b + 1]:
                        if e[0] in "FB":
                            assert len(e[3]) == count, (name, e)
                else:  # each micro-batch's forward and backward gather the inner units again
                    for u in range(count - 1):
                        assert per_unit[(0, u)] == 2 * M, (name, u, per_unit)
                    assert M <= per_unit[(0, count - 1)] <= 2 * M, (name, per_unit)
                    assert max(len(h) for h in held) <= 2, (name, held)
        # The start-up line's formula: kept, the stage's units whole; resharded, a few.
        whole, unit = sum(res["wide kept"]["units"]), max(res["wide kept"]["units"])
        outside = res["wide kept"]["implied"]["weights"] - whole
        assert outside >= 0
        assert res["wide resharded"]["implied"]["weights"] == outside + 2 * unit


def test_gradients_reduce_scattered_per_micro_batch_inside_the_step(four) -> None:
    for res in four:
        for name, per_step in (("wide optim_grads", M), ("wide resharded", M),
                               ("wide zero_bubble optim_grads", 1)):
            run = res[name]
            for inside, _end, after in _steps(run["log"]):
                rs_in = [e[1] for e in inside if e[0] == "rs"]
                rs_after = [e[1] for e in after if e[0] == "rs"]
                if per_step == 1:  # zero-bubble: the W passes finish them after the schedule
                    assert rs_in == [] and sorted(rs_after) == run["buckets"], name
                    continue
                assert rs_after == [], (name, "block gradients left for after the schedule")
                assert {b: rs_in.count(b) for b in run["buckets"]} == {
                    b: per_step for b in run["buckets"]}, (name, rs_in)
                # Each micro-batch's B launches all of its buckets before the next action.
                actions = [i for i, e in enumerate(inside) if e[0] in "FBW"] + [len(inside)]
                for i, j in zip(actions, actions[1:], strict=False):
                    launched = sorted(e[1] for e in inside[i + 1:j] if e[0] == "rs")
                    want = run["buckets"] if inside[i][0] == "B" else []
                    assert launched == want, (name, inside[i], launched)


# -- 3. checkpoints -------------------------------------------------------------------------------
def test_checkpoint_resumes_exactly_and_continues_at_another_layout(four) -> None:
    for res in four:
        full = res["1f1b units"]["losses"]
        assert res["resumed"]["losses"] == full[2:], "resume is not exact"
        assert res["at tp2"]["losses"] == pytest.approx(full[2:], rel=1e-4)
