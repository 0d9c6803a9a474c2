"""Sharded data parallelism (``--data-parallel-sharding-strategy``, ``training.fsdp``) in real
training runs: two spawns (4 ranks, then 2) of several runs each, checked here.

* Every strategy gives ``no_shard``'s losses, gradient norms and saved weights and AdamW
  moments within fp32 rounding, with two accumulated micro-steps per step: at DP=2 (optim,
  optim_grads, optim_grads_params with units of 1 and 2 layers, prefetch 0, 1 and 2,
  resharding on and off, full recomputation, bf16) and at TP=2 x DP=2 (sequence parallel,
  Domino m2 cross-layer, column chunks).
* The order of events, recorded by a CommHook on the TP group (the schedule's compute spans)
  and on the gradient group (the units' all-gathers and the buckets' reduce-scatters): the
  first unit's gather before the embedding, the next ``prefetch`` units' before a unit's first
  block, a wait only where a unit first computes, freed units holding no storage, re-gathered
  in reverse for the backward (or kept), each unit's gradients reduce-scattered and freed under
  the backward of the units before it.
* Model state per rank at DP=2 and DP=4 (a model whose layers dominate), against the
  start-up line's formula (``implied_state``).
* Checkpoints: exact resume under optim_grads_params; its checkpoint continued under no_shard
  at TP=1; ``domino eval`` and ``domino generate`` from it.
* Bad flag combinations refused before any process starts; a crashed rank stops every rank.
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

import pytest
import torch
from dist import run_distributed
from test_bad_inputs import _refused, _small
from test_train_cli import _workers_of, fail_rank_at
from train_spawn import run_output

from domino.cli import main
from domino.training.arguments import TrainArgs

OGP = "optim_grads_params"
STEPS, CUT = 3, 2  # every run trains STEPS steps; the resumed one is cut after CUT
FP32 = 1e-4  # saved tensors vs no_shard: max |difference| / max |value| (fp32 sums reordered)
BF16 = 1e-3  # bf16 runs: a reordered fp32 update may flip a bf16 rounding
TP2 = dict(tensor_model_parallel_size=2, sequence_parallel=True, domino_micro_batches=2,
           domino_overlap="cross_layer", micro_batch_size=2, global_batch_size=8)
# Layers dominate (0.79 M of 0.84 M parameters: byte vocabulary): the memory runs.
MEMORY = dict(hidden_size=128, micro_batch_size=1, global_batch_size=8, train_iters=2)


def _ogp(**kw) -> dict:
    return {"data_parallel_sharding_strategy": OGP, **kw}


# Recorded (the order of events) where the name says "units".
DP2_RUNS = {
    "no_shard": {},
    "optim": {"data_parallel_sharding_strategy": "optim"},
    "optim_grads": {"data_parallel_sharding_strategy": "optim_grads"},
    "units 1, prefetch 1": _ogp(),
    "units 2, prefetch 0": _ogp(fsdp_unit_layers=2, fsdp_prefetch=0),
    "units 1, prefetch 2, kept": _ogp(fsdp_prefetch=2, fsdp_reshard_after_forward=False),
    "units 2, full recompute": _ogp(fsdp_unit_layers=2, recompute_granularity="full"),
    "bf16 no_shard": {"bf16": True},
    "bf16 units 1": _ogp(bf16=True),
}
TP2_RUNS = {
    "no_shard": {},
    "optim_grads": {"data_parallel_sharding_strategy": "optim_grads"},
    "units 1, prefetch 1": _ogp(),
    "units 2, prefetch 0, kept, chunks 2": _ogp(fsdp_unit_layers=2, fsdp_prefetch=0,
                                                fsdp_reshard_after_forward=False,
                                                domino_column_chunks=2),
}


def _slug(*words: str) -> str:
    """A run folder's name for a run's description."""
    return re.sub(r"\W+", "_", " ".join(words))


def _args(data: str, **kw) -> TrainArgs:
    base = dict(data_path=data, tokenizer_type="byte", split="80,20,0", num_layers=4,
                hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=1,
                global_batch_size=4, train_iters=STEPS, lr=3e-3, min_lr=3e-4,
                lr_warmup_iters=1, clip_grad=0.3,  # clipping acts: the norm over shards counts
                eval_interval=0, eval_iters=0, log_interval=1, sample_tokens=0,
                tensorboard=False, device="cpu", hidden_dropout=0.0, attention_dropout=0.0,
                save_interval=0, save_interval_minutes=0.0, tensor_model_parallel_size=1,
                domino_micro_batches=1, peak_tflops=1.0, attention_backend="flash")
    base.update(kw)
    return TrainArgs(**base)


# -- in the ranks ---------------------------------------------------------------------------------
class _Recorder:
    """A CommHook on the TP group (the schedule's compute spans) and on the units' gradient
    group (their all-gathers, the buckets' reduce-scatters, the gathers' waits): one log, in
    order. Each span notes which units hold their parameters (storage not empty) and which
    hold gradients; with ``memory``, the peak model state by part, and of the reduce-scatters'
    buffers in flight."""

    def __init__(self, trainer, memory: bool) -> None:
        self.t, self.memory, self.log = trainer, memory, []
        gathers = trainer.gathers
        self.unit_of_flat = {id(f.full): u for u, fs in enumerate(gathers.flats) for f in fs}
        self.unit_of_bucket = {f.bucket: u for u, fs in enumerate(gathers.flats) for f in fs}
        blocks = trainer.model.language_model.encoder.blocks()
        self.params: list[list] = [[] for _ in range(gathers.count)]
        for b, u in zip(blocks, gathers.unit_of_block, strict=True):
            self.params[u].extend(p for p in b.parameters() if p.requires_grad)
        self.peak: dict[str, int] = {}
        self.dtypes: set[tuple[str, str]] = set()  # (gather | rs, the dtype on the wire)

    def launch(self, tensor, group, kind="all_reduce"):
        if kind == "all_gather" and id(tensor) in self.unit_of_flat:
            self.log.append(("gather", self.unit_of_flat[id(tensor)]))
            self.dtypes.add(("gather", str(tensor.dtype)))
        elif kind == "reduce_scatter":
            for bi, bucket in enumerate(self.t.reducer.buckets):
                if tensor is bucket.flat:
                    self.log.append(("rs", self.unit_of_bucket.get(bi)))
                    self.dtypes.add(("rs", str(tensor.dtype)))
        return None  # the real collective runs

    def finished(self, name, tags, nbytes, launched_s, wait_s, done_s) -> None:
        if "fsdp" in name:  # a unit's gather waited for
            self.log.append(("done",))

    def region(self, name, category, **tags):
        present, graded = [], []
        for u, ps in enumerate(self.params):
            held = {p.untyped_storage().nbytes() > 0 for p in ps}
            if len(held) > 1:
                self.log.append(("mixed", u))  # part of a unit freed
            if True in held:
                present.append(u)
            if any(p.grad is not None for p in ps):
                graded.append(u)
        self.log.append(("span", name, tags.get("mb"), tuple(present), tuple(graded)))
        if self.memory:
            self._sample()
        return contextlib.nullcontext()

    def _sample(self) -> None:
        from domino.training.optim import model_state_bytes

        t = self.t
        now = model_state_bytes(t.model, t.params, t.optimizer)
        now["in flight"] = sum(b.flat.numel() * b.flat.element_size()
                               for b in t.reducer.buckets if b.flat is not None)
        now["total"] = now["weights"] + now["grads"] + now["optimizer"]
        for part, value in now.items():
            self.peak[part] = max(self.peak.get(part, 0), value)


def _train(args: TrainArgs, run_dir: str, record: bool = False, memory: bool = False) -> dict:
    """``domino.training.loop.train`` of ``args`` on this rank (tests/dist.py ``fit``), the
    trainer's groups watched by a :class:`_Recorder` when ``record``."""
    from domino.training import logging as train_logging
    from domino.training.fsdp import implied_state
    from domino.training.loop import Trainer
    from domino.training.prepare import build_run
    from domino.training.worker import build_state

    train_logging.plot_loss_curve = lambda path, train, val: None  # (this rank's process only)
    run = build_run(args, Path(run_dir))
    state = build_state(args, args.device)
    out: dict = {}
    try:
        trainer = Trainer(run, state)
        rec = _Recorder(trainer, memory) if record else None
        groups = [state.tp, *trainer.reducer.groups()] if record else []
        for g in groups:
            g.hook = rec
        result = trainer.fit()
        for g in groups:
            g.hook = None
        result = trainer.finish(result)
        if rec is not None:
            g = trainer.gathers
            inside = {id(p) for ps in rec.params for p in ps}
            out.update(log=rec.log, peak=rec.peak, units=g.unit_bytes(), dtypes=rec.dtypes,
                       layout=dict(first=g.first, last=g.last, count=g.count,
                                   blocks=len(g.unit_of_block), of=g.unit_of_block,
                                   prefetch=g.prefetch, reshard=g.reshard_after_forward),
                       implied=implied_state(trainer.strategy, trainer.model, trainer.params,
                                             trainer.optimizer, g, args.fsdp_prefetch),
                       outside=sum(p.numel() * p.element_size() for p in trainer.params
                                   if id(p) not in inside),
                       trained=sum(p.numel() for p in trainer.params))
    except BaseException:
        state.close(wait=False)
        raise
    state.close()
    return {"losses": result.losses, "norms": result.grad_norms,
            "state": result.model_state_bytes[state.world.rank], **out}


def _four_ranks(rank: int, world: int, data: str, tmp: str) -> dict:
    out = {name: _train(_args(data, **TP2, **kw), f"{tmp}/{_slug('tp2', name)}",
                        record="units" in name) for name, kw in TP2_RUNS.items()}
    _train(_args(data, **TP2, **_ogp(), exit_interval=CUT), f"{tmp}/cut")
    out["resumed"] = _train(_args(data, **TP2, **_ogp(), load=f"{tmp}/cut"), f"{tmp}/resumed")
    out["memory"] = _train(_args(data, **MEMORY, **_ogp()), f"{tmp}/memory_dp4", record=True,
                           memory=True)
    return out


def _two_ranks(rank: int, world: int, data: str, tmp: str) -> dict:
    out = {name: _train(_args(data, **kw), f"{tmp}/{_slug('dp2', name)}",
                        record="units" in name) for name, kw in DP2_RUNS.items()}
    out["memory"] = _train(_args(data, **MEMORY, **_ogp()), f"{tmp}/memory_dp2", record=True,
                           memory=True)
    # The TP=2 x DP=2 optim_grads_params checkpoint of step CUT, continued at TP=1 unsharded.
    out["at tp1"] = _train(_args(data, micro_batch_size=2, global_batch_size=8,
                                 load=f"{tmp}/cut"), f"{tmp}/at_tp1")
    return out


# -- the spawns -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(byte_dataset) -> str:
    return byte_dataset(200_000)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def four(data, runs) -> list[dict]:
    return run_distributed(_four_ranks, 4, data, str(runs))


@pytest.fixture(scope="module")
def two(data, runs, four) -> list[dict]:  # (continues a run of ``four``)
    return run_distributed(_two_ranks, 2, data, str(runs))


def _saved(run: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's latest checkpoint, whole (weights and AdamW moments)."""
    return run_output(run, hashes=False)[1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    rows = min(a.shape[0], b.shape[0]) if a.dim() else None  # (vocabulary padding: by TP)
    a, b = (a[:rows], b[:rows]) if rows is not None else (a, b)
    return float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-12)


def _assert_equal_runs(got: dict, want: dict, saved: dict, ref: dict, tol: float, name: str):
    assert len(got["losses"]) == STEPS, name
    assert got["losses"] == pytest.approx(want["losses"], rel=tol / 10), name
    assert got["norms"] == pytest.approx(want["norms"], rel=tol / 10), name
    assert saved.keys() == ref.keys(), name
    worst = max(ref, key=lambda k: _rel(saved[k], ref[k]))
    assert _rel(saved[worst], ref[worst]) < tol, (name, worst, _rel(saved[worst], ref[worst]))


# -- 1. every strategy equals no_shard ------------------------------------------------------------
@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_every_strategy_equals_no_shard(layout, two, four, runs) -> None:
    ranks, table = (two, DP2_RUNS) if layout == "dp2" else (four, TP2_RUNS)
    saved = {name: _saved(runs / _slug(layout, name)) for name in table}
    for res in ranks:
        for name in table:
            ref = "bf16 no_shard" if name.startswith("bf16") else "no_shard"
            _assert_equal_runs(res[name], res[ref], saved[name], saved[ref],
                               BF16 if name.startswith("bf16") else FP32, f"{layout} {name}")
    assert two[0]["no_shard"]["losses"][-1] < two[0]["no_shard"]["losses"][0]  # it trains
    assert two[0]["bf16 no_shard"]["losses"] != two[0]["no_shard"]["losses"]  # in bf16


# -- 2. the order of events -----------------------------------------------------------------------
def _passes(log: list) -> list[tuple[list, list]]:
    """The log cut into micro-steps, each (its forward, its backward): a forward begins with
    the gathers launched just before its embedding's first span, and ends with its last span."""
    starts = []
    for i, e in enumerate(log):
        if e[0] == "span" and e[1] == "fwd embed" and e[2] == 0:
            while i and log[i - 1][0] == "gather":
                i -= 1
            starts.append(i)
    out = []
    for a, b in zip(starts, [*starts[1:], len(log)]):
        seg = log[a:b]
        end = max(i for i, e in enumerate(seg) if e[0] == "span" and e[1].startswith("fwd"))
        out.append((seg[:end + 1], seg[end + 1:]))
    return out


def _forward_order(lay: dict) -> list:
    """The gathers, their waits and the units' first blocks, in the forward's order: unit 0's
    gather before the embedding, a unit waited for where its first block begins, having
    launched the next ``prefetch`` units' gathers."""
    count, ahead = lay["count"], lay["prefetch"]
    seq, launched = [("gather", 0), "embed"], {0}
    for u in range(count):
        if u not in launched:  # (prefetch 0: gathered where it is used)
            seq.append(("gather", u))
            launched.add(u)
        seq.append(("done",))
        for v in range(u + 1, min(u + ahead, count - 1) + 1):
            if v not in launched:
                seq.append(("gather", v))
                launched.add(v)
        seq.append(("first block", u))
    return seq


def _backward_order(lay: dict) -> list:
    """The same in the backward: units gathered again in reverse (the last one kept from the
    forward), waited for where their last block's backward begins; nothing gathered when the
    forward kept them."""
    count, ahead = lay["count"], lay["prefetch"]
    if not lay["reshard"]:
        return [("last block", u) for u in reversed(range(count))]
    seq, launched = [], {count - 1}
    for u in reversed(range(count)):
        if u not in launched:
            seq.append(("gather", u))
            launched.add(u)
        if u != count - 1:
            seq.append(("done",))
        for v in range(u - 1, max(u - ahead, 0) - 1, -1):
            if v not in launched:
                seq.append(("gather", v))
                launched.add(v)
        seq.append(("last block", u))
    return seq


def _events(seg: list, lay: dict, forward: bool) -> list:
    """The gathers, waits and the spans where units begin (as the orders above name them)."""
    begins = ({f"fwd local {j}": ("first block", u) for u, j in enumerate(lay["first"])}
              if forward else
              {f"bwd local {j + 1}": ("last block", u) for u, j in enumerate(lay["last"])})
    out = []
    for e in seg:
        if e[0] in ("gather", "done"):
            out.append(e)
        elif e[0] == "span" and e[2] == 0 and e[1] == "fwd embed":
            out.append("embed")
        elif e[0] == "span" and e[2] == 0 and e[1] in begins:
            out.append(begins[e[1]])
    return out


def _uses(name: str, lay: dict) -> set[int]:
    """The units a compute span reads: a par piece its block's; a local piece its block's
    norm and the exit of the block before (residual, bias)."""
    _, piece, *j = name.split()
    if piece not in ("local", "par"):
        return set()  # the embedding, deferred weight gradients (shapes only), late work
    j = int(j[0])
    blocks = [j] if piece == "par" else [i for i in (j - 1, j) if 0 <= i < lay["blocks"]]
    return {lay["of"][i] for i in blocks}


def _check_spans(seg: list, lay: dict, forward: bool, where: str) -> None:
    """Every span: the units it reads are whole; no other unit holds storage beyond the
    schedule's window (freed units are empty); gradients are freed once reduce-scattered."""
    ahead, scattered = lay["prefetch"], set()
    for e in seg:
        if e[0] == "rs":
            scattered.add(e[1])
        if e[0] != "span":
            continue
        _, name, m, present, graded = e
        at, present, uses = (where, name, m, present), set(present), _uses(name, lay)
        assert uses <= present, at
        assert not (set(graded) & (set(range(lay["count"])) if forward else scattered)), (
            at, graded)
        if name == "fwd embed":
            assert present == {0}, at  # the last backward freed every unit
        if not uses:
            continue
        # A par piece may run the next local piece inside it (cross-layer overlap): the
        # block after it in the forward, before it in the backward.
        if not lay["reshard"]:  # kept from the forward to the backward
            assert set(range(max(uses) + 1 if forward else min(uses) + 1)) <= present, at
        if name.split()[1] == "par":
            uses = uses | _uses(f"x local {int(name.split()[2]) + (1 if forward else -1)}", lay)
        lo, hi = min(uses), max(uses)
        if lay["reshard"]:
            window = range(lo - 1, hi + ahead + 1) if forward else range(lo - ahead, hi + 2)
        else:
            window = range(0, hi + ahead + 1) if forward else range(0, hi + 2)
        assert present <= set(window), at


def _check_reduce_scatters(bwd: list, lay: dict, where: str, sp: bool) -> None:
    """Each unit's bucket reduce-scattered last unit first, under the backward of the units
    before it: before the first block of the unit before begins its norms' backward (``bwd
    local`` of that block, first micro-batch). With sequence parallelism a block is final only
    once its norms' partial gradients are summed over TP, an all-reduce whose completion the
    schedule polls between pieces (how many pieces later depends on the timing): there, before
    the backward's last piece. Then the rest (embedding, head)."""
    count, rs = lay["count"], [e[1] for e in bwd if e[0] == "rs"]
    assert rs[:count] == list(reversed(range(count))) and None not in rs[:count], (where, rs)
    assert all(u is None for u in rs[count:]), (where, rs)
    last_piece = max(i for i, e in enumerate(bwd) if e[0] == "span")
    for u in range(1, count):
        begun = next(i for i, e in enumerate(bwd) if e[0] == "span"
                     and e[1] == f"bwd local {lay['first'][u - 1]}" and e[2] == 0)
        assert bwd.index(("rs", u)) < (last_piece if sp else begun), (where, u)


def _check_order(run: dict, where: str) -> None:
    lay, log = run["layout"], run["log"]
    assert not [e for e in log if e[0] == "mixed"], where  # a unit is whole or empty
    passes = _passes(log)
    assert passes and len(passes) % len(run["losses"]) == 0, where
    for k, (fwd, bwd) in enumerate(passes):
        at = f"{where}, micro-step {k}"
        assert _events(fwd, lay, True) == _forward_order(lay), at
        assert _events(bwd, lay, False) == _backward_order(lay), at
        _check_spans(fwd, lay, True, at)
        _check_spans(bwd, lay, False, at)
        _check_reduce_scatters(bwd, lay, at, sp=where.startswith("tp2"))


def test_gathers_and_reduce_scatters_follow_the_schedule(two, four) -> None:
    checked = []
    for layout, ranks in (("dp2", two), ("tp2", four)):
        for rank, res in enumerate(ranks):
            for name, run in res.items():
                if "log" in run:
                    _check_order(run, f"{layout} {name}, rank {rank}")
                    checked.append(name)
                    # Parameters gathered in their own dtype, gradients reduced in fp32.
                    dtype = "torch.bfloat16" if name.startswith("bf16") else "torch.float32"
                    assert run["dtypes"] == {("gather", dtype), ("rs", "torch.float32")}, name
    assert len(checked) == 2 * 6 + 4 * 3, checked


# -- 3. model state per rank ----------------------------------------------------------------------
def test_model_state_scales_as_one_over_dp(two, four) -> None:
    """optim_grads_params at DP=2 and DP=4: what is sharded (the gradients' chunk sums, the
    moments and fp32 masters: 16 bytes per parameter) is 1/DP of it, the parts outside the
    units stay whole, and the units in flight during a step come on top, as many at either DP
    size; the start-up formula's sharded parts are what is measured."""
    sharded, flights = {}, set()
    for dp, ranks in ((2, two), (4, four)):
        for res in ranks:
            run = res["memory"]
            end, n, unit = run["state"], run["trained"], max(run["units"])
            assert end["weights"] == run["outside"], dp  # no unit held after the run
            sharded[dp] = end["grads"] + end["optimizer"]
            assert sharded[dp] == pytest.approx(16 * n / dp, rel=0.01), dp
            assert sum(end.values()) == pytest.approx(run["outside"] + 16 * n / dp, rel=0.01)
            flight = run["peak"]["weights"] - run["outside"]
            assert flight % unit == 0 and 1 <= flight // unit <= 2 + run["layout"]["prefetch"]
            flights.add(flight)
            implied = run["implied"]
            assert implied["optimizer"] == pytest.approx(end["optimizer"], rel=1e-3), dp
            assert implied["grads"] - unit == end["grads"], dp  # chunk sums + a unit's whole
    assert run["outside"] < 0.1 * n * 4  # (the layers dominate: the test's premise)
    assert sharded[2] / sharded[4] == pytest.approx(2, rel=0.1)
    assert len(flights) == 1, flights


def test_start_up_formula_bounds_the_measured_peak(two, four) -> None:
    """The start-up line's model state per rank against the peak measured at every compute
    span of the steps (accumulating micro-steps, at DP=2 and DP=4)."""
    for res in [*two, *four]:
        run = res["memory"]
        assert run["peak"]["weights"] <= run["implied"]["weights"]
        assert run["peak"]["total"] == pytest.approx(sum(run["implied"].values()), rel=0.03)


def test_reduce_scatter_buffers_are_freed_as_their_bucket_is_reduced(two, four) -> None:
    for res in [*two, *four]:
        run = res["memory"]
        assert run["peak"]["in flight"] <= max(run["units"])


# -- 4. checkpoints -------------------------------------------------------------------------------
def test_checkpoints_resume_exactly_and_load_anywhere(two, four, runs, data, capfd) -> None:
    sharded = _slug("tp2", "units 1, prefetch 1")
    for res in four:  # cut after step CUT, resumed: the uninterrupted run's steps, bit for bit
        ref, resumed = res["units 1, prefetch 1"], res["resumed"]
        assert resumed["losses"] == ref["losses"][CUT:]
        assert resumed["norms"] == ref["norms"][CUT:]
    want = _saved(runs / sharded)
    got = _saved(runs / "resumed")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # The same checkpoint continued unsharded at TP=1 (DP=2, the same batches).
    for res in two:
        cont = res["at tp1"]
        assert cont["losses"] == pytest.approx(four[0]["units 1, prefetch 1"]["losses"][CUT:],
                                               rel=1e-5)
        assert cont["norms"] == pytest.approx(four[0]["units 1, prefetch 1"]["norms"][CUT:],
                                              rel=1e-5)
    got = _saved(runs / "at_tp1")
    assert got.keys() == want.keys()
    assert max(_rel(got[k], want[k]) for k in want) < FP32
    # `domino eval` and `domino generate` read it as they read the unsharded run's.
    capfd.readouterr()
    evals, ids = {}, {}
    for name in (sharded, _slug("tp2", "no_shard")):
        assert main(["eval", str(runs / name), "--data-path", data, "--eval-iters", "1"]) == 0
        evals[name] = float(capfd.readouterr().out.split(" loss ")[1].split(",")[0])
        assert main(["generate", str(runs / name), "--prompt", "def ", "--greedy", "--ids",
                     "--max-new-tokens", "6", "--no-stop-at-eod"]) == 0
        ids[name] = capfd.readouterr().out.split()
    assert evals[sharded] == pytest.approx(evals[_slug("tp2", "no_shard")], abs=2e-4), evals
    assert len(ids[sharded]) == 6 and ids[sharded] == ids[_slug("tp2", "no_shard")], ids


# -- 5. refusals before any process starts --------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--data-parallel-sharding-strategy", "no_shard", "--use-distributed-optimizer"],
     "--data-parallel-sharding-strategy no_shard contradicts --use-distributed-optimizer"),
    (["--data-parallel-sharding-strategy", OGP, "--fsdp-unit-layers", "0"],
     "--fsdp-unit-layers 0: between 1 and --num-layers (2)"),
    (["--data-parallel-sharding-strategy", OGP, "--fsdp-unit-layers", "3"],
     "--fsdp-unit-layers 3: between 1 and --num-layers (2)"),
    (["--data-parallel-sharding-strategy", OGP, "--fsdp-prefetch", "-1"],
     "--fsdp-prefetch -1: 0 or more units"),
], ids=["no_shard zero", "units 0", "units 3", "prefetch -1"])
def test_bad_combinations_are_refused_before_spawn(flags, message, data, tmp_path,
                                                   capfd) -> None:
    run = tmp_path / "run"
    line = _refused(capfd, ["train", *_small(data), "--split", "80,20,0", "--num-layers", "2",
                            "--nproc", "2", *flags, "--save", str(run)])
    assert message in line, line
    assert not run.exists(), line  # nothing left behind


# -- 6. a crashed rank ----------------------------------------------------------------------------
def test_a_crashed_rank_stops_every_rank(data, tmp_path, capfd, monkeypatch) -> None:
    # Rank 1 fails at step 2 while rank 0 runs into the step's first collectives (a unit's
    # gather among them).
    fail_rank_at(monkeypatch, 1, 2)
    t0 = time.monotonic()
    rc = main(["train", *_small(data), "--split", "80,20,0", "--num-layers", "2", "--nproc", "2",
               "--data-parallel-sharding-strategy", OGP, "--train-iters", "4",
               "--sample-tokens", "0", "--save", str(tmp_path / "run")])
    err = capfd.readouterr().err
    assert rc != 0 and "injected failure on rank 1 at step 2" in err, err
    assert re.search(r"ranks? (\d, )*1(, \d)* exited with codes? .*; stopping the other ranks",
                     err), err
    assert time.monotonic() - t0 < 120  # far below the process group's timeout (5 min)
    assert not _workers_of(tmp_path / "run" / "config.json")  # no rank left running
