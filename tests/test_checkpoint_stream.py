"""Sharded runs' checkpoints, streamed (``checkpoint.stream``, ``checkpoint.rank_files``).

* The streamed safetensors writer against the real library: for the same tensors (every dtype
  it names, bf16, 0-d and empty tensors, non-ASCII and escaped names, written in any order) its
  file is byte for byte ``safetensors.torch.save_file``'s, and ``safe_open`` / ``load_file``
  read it back bit for bit; misuse is refused.
* Real runs (DP=2 under optim_grads_params and under optim, TP=2 x DP=2 under
  optim_grads_params): every tensor of the closing checkpoint equals, bit for bit, the one
  reassembled here from every rank's own chunks of the fp32 masters and AdamW moments (the
  test's code, not the optimizer's gather), and each file is the bytes ``save_file`` writes for
  its tensors (the format unchanged).
* Memory, where the whole gathered state is many buckets: while a rank gathers and writes its
  tensors (``write_rank_files``), the torch allocations alive on it beyond those at the start
  (torch's profiler: every allocation and free, in order) stay under about two buckets of fp32;
  while a checkpoint is loaded, the tensors read from it alive at once (each one followed until
  freed) stay under four of the largest parameter.
* Loading that checkpoint back into the trained optimizer, its masters and moments wiped
  first, restores every chunk bit for bit.
"""

from __future__ import annotations

import math
import struct
import weakref
from pathlib import Path

import pytest
import torch
from dist import run_distributed
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file

from domino.checkpoint.stream import StreamWriter, save_streamed

STEPS = 2
SLACK = 64 * 1024  # bytes: step counts, RNG states, the finiteness check's flags


# -- the writer against the library --------------------------------------------------------------
def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ints = torch.arange(-3, 4)
    return {
        "w.f32": torch.randn(5, 3, generator=g),
        "w.bf16": torch.randn(4, 7, generator=g).bfloat16(),
        "w.f16": torch.randn(3, generator=g).half(),
        "w.f64": torch.randn(2, 2, generator=g).double(),
        "step": torch.tensor(7.0), "zero_d_bf16": torch.tensor(-1.5, dtype=torch.bfloat16),
        "i64": ints, "i32": ints.int(), "i16": ints.short(), "i8": ints.to(torch.int8),
        "u8": torch.arange(200, 206, dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "u16": ints.abs().to(torch.uint16), "u32": ints.abs().to(torch.uint32),
        "u64": ints.abs().to(torch.uint64),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "f8b": torch.randn(4, generator=g).to(torch.float8_e5m2),
        "empty": torch.zeros(0, 4), "größe ü": torch.ones(2), 'odd "name"\n\t\\': torch.ones(1),
        "a.b": torch.randn(1, generator=g),  # same dtype as w.f32: ordered by name
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_streamed_file_is_save_files_bytes(tmp_path: Path) -> None:
    tensors = _every_dtype()
    save_file(tensors, tmp_path / "lib.safetensors")
    save_streamed(tensors, tmp_path / "ours.safetensors")
    lib = (tmp_path / "lib.safetensors").read_bytes()
    assert (tmp_path / "ours.safetensors").read_bytes() == lib
    # Any order of arrival: each tensor goes to its place.
    with StreamWriter(tmp_path / "rev.safetensors",
                      {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}) as w:
        for name in reversed(list(tensors)):
            w.write(name, tensors[name])
    assert (tmp_path / "rev.safetensors").read_bytes() == lib
    back = load_file(tmp_path / "rev.safetensors")
    with safe_open(str(tmp_path / "rev.safetensors"), framework="pt") as f:
        opened = {k: f.get_tensor(k) for k in f.keys()}
    for name, value in tensors.items():
        for got in (back[name], opened[name]):
            assert got.dtype == value.dtype and got.shape == value.shape, name
            assert torch.equal(_bits(got), _bits(value)), name
    # A metadata entry: the library's bytes too (one key: its hash map has one order).
    save_file({"x": torch.ones(3)}, tmp_path / "m1", metadata={"format": "pt"})
    save_streamed({"x": torch.ones(3)}, tmp_path / "m2", metadata={"format": "pt"})
    assert (tmp_path / "m1").read_bytes() == (tmp_path / "m2").read_bytes()
    header = (tmp_path / "m2").read_bytes()
    assert (8 + struct.unpack("<Q", header[:8])[0]) % 8 == 0  # data aligned


def test_streamed_writer_refuses_misuse(tmp_path: Path) -> None:
    layout = {"a": ((2, 3), torch.float32), "b": ((), torch.bfloat16)}
    w = StreamWriter(tmp_path / "x.safetensors", layout)
    with pytest.raises(KeyError, match="'c' was not declared"):
        w.write("c", torch.zeros(1))
    with pytest.raises(ValueError, match=r"'a' is \(3, 2\) torch.float32, declared \(2, 3\)"):
        w.write("a", torch.zeros(3, 2))
    with pytest.raises(ValueError, match="'b' is .* torch.float32, declared"):
        w.write("b", torch.tensor(1.0))
    w.write("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match="'a' written twice"):
        w.write("a", torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\['b'\] declared but never written"):
        w.close()
    with pytest.raises(ValueError, match="complex128 has no safetensors name"):
        StreamWriter(tmp_path / "y", {"z": ((1,), torch.complex128)})


# -- in the ranks ---------------------------------------------------------------------------------
def _args(data: str, strategy: str, tp: int):
    from domino.training.arguments import TrainArgs

    # Layers dominate (8 x 50 K of 0.43 M parameters): the whole state is many buckets.
    return TrainArgs(data_path=data, tokenizer_type="byte", split="80,20,0", num_layers=8,
                     hidden_size=64, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                     global_batch_size=8, train_iters=STEPS, lr=3e-3, min_lr=3e-4,
                     lr_warmup_iters=1, clip_grad=0.3, eval_interval=0, eval_iters=0,
                     log_interval=1, sample_tokens=0, tensorboard=False, device="cpu",
                     hidden_dropout=0.0, attention_dropout=0.0, save_interval=0,
                     save_interval_minutes=0.0, tensor_model_parallel_size=tp,
                     domino_micro_batches=2, peak_tflops=1.0, attention_backend="flash",
                     data_parallel_sharding_strategy=strategy)


def _allocated_peak(fn) -> int:
    """Peak bytes of torch allocations alive during ``fn()`` beyond those at its start (every
    allocation and free, from torch's profiler, in the order they ran)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    now = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        now += event.self_cpu_memory_usage
        peak = max(peak, now)
    return peak


class _Reads:
    """Bytes of the tensors ``store.read_part`` returned that are still alive (each one
    followed until freed), and their peak."""

    def __init__(self, read) -> None:
        self.read, self.alive, self.peak = read, 0, 0

    def __call__(self, *args, **kw) -> torch.Tensor:
        value = self.read(*args, **kw)
        n = value.numel() * value.element_size()
        self.alive += n
        self.peak = max(self.peak, self.alive)
        weakref.finalize(value, self._freed, n)
        return value

    def _freed(self, n: int) -> None:
        self.alive -= n


def _segments(opt, names: dict, state, tmp: str) -> None:
    """This rank's own chunks, per parameter segment, to a file the writers read."""
    out = {}
    for seg in opt.segments:
        key = f"{names[id(seg.param)]}|{seg.lo}|{seg.hi}"
        out[f"{key}|master"] = seg.view.clone()
        for slot, value in opt.inner.state.get(seg.view, {}).items():
            out[f"{key}|{slot}"] = value.clone().reshape(-1) if slot != "step" else value
    save_file(out, f"{tmp}/seg-tp{state.tp.rank}-dp{state.dp.rank}.safetensors")


def _reassembled(params: dict, state, tmp: str) -> dict[str, torch.Tensor]:
    """Every parameter's master and moments (checkpoint names) from its TP rank's DP chunks."""
    flat: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    for d in range(state.dp.size):
        for key, value in load_file(f"{tmp}/seg-tp{state.tp.rank}-dp{d}.safetensors").items():
            name, lo, hi, slot = key.split("|")
            target = name if slot == "master" else f"optimizer.{slot}/{name}"
            if slot == "step":
                flat[target] = value
                continue
            p = params[name]
            full = flat.setdefault(target, torch.full((p.numel(),), math.nan))
            full[int(lo):int(hi)] = value
            covered[target] = covered.get(target, 0) + int(hi) - int(lo)
    assert all(covered[k] == params[k.rsplit("/", 1)[-1]].numel() for k in covered)
    return {k: v if v.dim() == 0 else v.view(params[k.rsplit("/", 1)[-1]].shape)
            for k, v in flat.items()}


def _compare_files(trainer, state, step_dir: Path, tmp: str) -> int:
    """Bit for bit: this TP rank's files against the reassembled state; returns the count."""
    from domino.checkpoint import layout
    from domino.checkpoint.store import named_model_tensors
    from domino.tensor_parallel.placement import placement_of

    params = dict(named_model_tensors(trainer.model))
    want = _reassembled(params, state, tmp)
    mine = {n for n, p in params.items()
            if placement_of(p).shard == "tp" or state.tp.rank == 0}
    compared = 0
    for rel in (layout.model_file(state.tp.rank, 0), layout.optim_file(state.tp.rank, 0)):
        path = step_dir / rel
        got = load_file(path)
        assert path.read_bytes() == save(got), rel  # what save_file writes for them
        assert {k.rsplit("/", 1)[-1] for k in got} == mine, rel
        for name, value in got.items():
            assert value.dtype == torch.float32 and torch.equal(value, want[name]), name
            compared += 1
    # master, exp_avg, exp_avg_sq and (replicated: TP rank 0's file only) the step count
    assert compared == (4 if state.tp.rank == 0 else 3) * len(mine)
    return compared


def _snapshot(opt) -> list[torch.Tensor]:
    out = [c.clone() for c in opt.chunks]
    for seg in opt.segments:
        out += [v.clone() for _, v in sorted(opt.inner.state[seg.view].items())]
    return out


def _wipe(opt) -> None:
    for c in opt.chunks:
        c.fill_(math.nan)
    for st in opt.inner.state.values():
        for value in st.values():
            value.fill_(math.nan)


def _memory(trainer, state) -> dict:
    """The save's and the load's peaks, the bounds' units, and the load's round trip."""
    import domino.checkpoint.store as store
    from domino.checkpoint.layout import open_checkpoint

    opt = trainer.optimizer
    write, peaks = store.write_rank_files, []

    def watched(*args):  # the save's tensor part (the rest moves records and JSON)
        out: list = []
        peaks.append(_allocated_peak(lambda: out.append(write(*args))))
        return out[0]

    trainer.last_saved = None  # save the same step again, watched
    store.write_rank_files = watched
    try:
        trainer.save(STEPS)
    finally:
        store.write_rank_files = write
    step_dir, meta, _ = open_checkpoint(trainer.run_dir, hashes=False)
    before = _snapshot(opt)
    _wipe(opt)
    reads = _Reads(store.read_part)
    store.read_part = reads
    try:
        store.load_model(step_dir, meta, trainer.model, state, opt)
        store.load_optimizer(step_dir, meta, opt, trainer.model, state)
    finally:
        store.read_part = reads.read
    after = _snapshot(opt)
    return {"save_peak": peaks[0], "load_peak": reads.peak,
            "bucket": max(b.padded(opt.group_of(i).size) for i, b in
                          enumerate(opt.reducer.buckets)) * 4,
            "largest": max(p.numel() for p in opt.params) * 4,
            "whole": sum(p.numel() for p in opt.params) * 4, "dp": state.dp.size,
            "restored": len(before) == len(after) and all(
                torch.equal(a, b) for a, b in zip(before, after))}


def _one_run(data: str, strategy: str, tp: int, tmp: str) -> dict:
    from domino.checkpoint.layout import open_checkpoint
    from domino.checkpoint.store import named_model_tensors
    from domino.training.loop import Trainer
    from domino.training.prepare import build_run
    from domino.training.worker import build_state

    args = _args(data, strategy, tp)
    run_dir = Path(tmp) / f"{strategy}-tp{tp}"
    state = build_state(args, args.device)
    try:
        trainer = Trainer(build_run(args, run_dir), state)
        trainer.finish(trainer.fit())  # its closing checkpoint: step STEPS
        names = {id(p): n for n, p in named_model_tensors(trainer.model)}
        _segments(trainer.optimizer, names, state, str(run_dir))
        state.world.barrier()
        step_dir, _, _ = open_checkpoint(run_dir, hashes=True)
        compared = (_compare_files(trainer, state, step_dir, str(run_dir))
                    if state.dp.rank == 0 else None)
        out = {"compared": compared, **_memory(trainer, state)}
    except BaseException:
        state.close(wait=False)
        raise
    state.close()
    return out


def _dp2(rank: int, world: int, data: str, tmp: str) -> dict:
    return {s: _one_run(data, s, 1, tmp) for s in ("optim_grads_params", "optim")}


def _tp2_dp2(rank: int, world: int, data: str, tmp: str) -> dict:
    return {"optim_grads_params": _one_run(data, "optim_grads_params", 2, tmp)}


@pytest.fixture(scope="module")
def data(byte_dataset) -> str:
    return byte_dataset(100_000)


@pytest.mark.parametrize("layout", ["dp2", "tp2_dp2"])
def test_sharded_checkpoints_stream_with_bounded_memory(layout, data, tmp_path) -> None:
    fn, world = (_dp2, 2) if layout == "dp2" else (_tp2_dp2, 4)
    ranks = run_distributed(fn, world, data, str(tmp_path))
    for rank, res in enumerate(ranks):
        for strategy, r in res.items():
            where = (layout, strategy, rank, r)
            assert r["compared"] is None or r["compared"] > 100, where
            assert r["restored"], where
            # Saving: one bucket gathered, the collective's own copy of it, this rank's chunk
            # of a moment (and small change). Loading: one parameter's two moments.
            save_bound = (2 + 1 / r["dp"]) * r["bucket"] + SLACK
            load_bound = 4 * r["largest"]
            # Gathering the whole state at once (masters and moments: 3 x whole) would break
            # them several times over.
            assert 3 * r["whole"] > 4 * save_bound and 2 * r["whole"] > 4 * load_bound, where
            assert r["save_peak"] <= save_bound, where
            assert r["load_peak"] <= load_bound, where
    writers = [r for res in ranks for r in res.values() if r["compared"] is not None]
    assert len(writers) == 2  # DP rank 0 of each TP rank, of each run: 2 x 1 or 1 x 2
