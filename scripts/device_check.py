"""Device check of the Domino schedules, for a session that is lent an accelerator.

Two sections (``--section all``, the default, runs both, in this order):

* ``tp2`` - correctness at TP=2: two processes on one device (gloo on the device's tensors, or
  NCCL with --nccl on a machine with two or more GPUs) check, for every schedule, that loss and
  gathered gradients equal the sync-TP model's; then a bf16 step (fp32 masters, bf16 compute
  copies, as ``domino train --bf16`` runs) and a sync vs Domino
  step-time table. Prints "DEVICE CHECK OK" (or FAILED, and the script exits 1).
* ``readiness`` - GPU readiness at TP=1 on ONE device, the Domino split forced
  (``set_plan(plan, force=True)``; a TP=1 stack otherwise runs unsplit): forward+backward step
  time of unsplit (m1:none) vs 2 and 4 micro-batches (m2:cross, m4:cross) on a GPT-style causal
  stack (RMSNorm, RoPE, SwiGLU with ffn ~8/3 hidden, no biases) at hidden 1024, 2048 and 4096
  (4, 4 and 2 layers, seq 2048, batch 8, heads = hidden / 128). Params are bf16
  (``TransformerConfig(params_dtype=torch.bfloat16)``; ``--precision masters``: fp32 params
  computed from bf16 copies cast once per step, as ``domino train --bf16`` runs;
  ``--precision autocast``: fp32 params under bf16 autocast, for comparison). Times are
  CUDA-synchronised,
  after warmup, medians of interleaved rounds; per size it prints each plan's step time, the
  split's cost in % vs unsplit, MFU and max_memory_allocated. Then a 1.3B-parameter GPT (24
  layers, hidden 2048, 16 heads, ffn 5632, seq 2048, batch 8, vocab 32000, tied head): unsplit
  vs m2 / m4 and their MFU. The goals ("split costs <= 5% at hidden >= 2048", "1B model >= 45%
  bf16 MFU") are printed with whether they were met, as information: missing them does not
  change the exit status (an error other than OOM does; an OOM at a size prints "OOM at hidden
  N" and the next size runs). Ends with "READINESS DONE". On a CPU it runs tiny sizes (hidden
  64/128, seq 32: a smoke test, what the test suite does). ``--compile both`` times every
  size eager and then with compiled pieces (``RuntimeConfig.compile``; the compile time
  printed once per size), the 1B model too; ``--compile on`` compiled only.

On the GPU machine, from the repo root (PYTHONPATH=src unless the package is installed):

    python scripts/device_check.py                       # both sections (~1-3 min on an H200)
    python scripts/device_check.py --section tp2 [--steps 10] [--nccl]
    python scripts/device_check.py --section readiness   # ~1 min on an H200
    python scripts/device_check.py --section readiness --peak-tflops 989 --rounds 10
    python scripts/device_check.py --section readiness --compile both   # eager vs compiled

On this CPU-only machine (smoke test, seconds):

    python scripts/device_check.py --section readiness --device cpu --tiny

MFU = model FLOPs per step / step time / peak; the peak defaults to 989 TFLOP/s (H200 dense
bf16) on CUDA and to none (MFU "n/a") on a CPU unless --peak-tflops is given.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from domino.runtime import COMPILE_BACKENDS, RuntimeConfig

PLANS = [(1, "none", 1), (2, "intra_layer", 1), (2, "cross_layer", 1), (3, "cross_layer", 2),
         (4, "cross_layer", 2)]
SECTIONS = ("tp2", "readiness")
H200_BF16_DENSE_TFLOPS = 989.0
SPLIT_GOAL_PCT, SPLIT_GOAL_HIDDEN, MFU_GOAL_PCT = 5.0, 2048, 45.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(rank: int, world: int, port: int, device_name: str, nccl: bool, steps: int) -> None:
    from domino import ParallelState, TransformerConfig
    from domino.gpt_model import GPTModel
    from domino.precision import set_compute_dtype
    from domino.tensor_parallel import gather_full
    from domino.transformer import Plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if nccl else "gloo", rank=rank, world_size=world)
    state = ParallelState.build(world, device=device)
    cfg = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=8,
                            num_query_groups=4, vocab_size=1000, seq_length=128,
                            max_position_embeddings=128, hidden_dropout=0.0,
                            attention_dropout=0.0, activation="swiglu",
                            position_embedding_type="rope")
    torch.manual_seed(0)
    model = GPTModel(cfg, parallel_state=state)
    stack = model.language_model.encoder
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (8, 129), generator=gen).to(device)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(ids[:, :-1], None, None, labels=ids[:, 1:]).mean()
        loss.backward()
        return loss.detach()

    results = {}
    for plan in PLANS:
        stack.set_plan(Plan(*plan))
        loss = step()
        grads = [gather_full(p.grad, p, state.tp) for p in model.parameters()]
        results[plan] = (loss, grads)
    ref_loss, ref_grads = results[PLANS[0]]
    worst = 0.0
    for plan, (loss, grads) in results.items():
        err = (loss - ref_loss).abs().item() / ref_loss.abs().item()
        for g, r in zip(grads, ref_grads):
            err = max(err, ((g - r).abs().max() / r.abs().max().clamp_min(1e-6)).item())
        worst = max(worst, err)
        if rank == 0:
            print(f"plan {plan}: max relative error vs sync {err:.2e}", flush=True)
    set_compute_dtype(model, torch.bfloat16)  # fp32 masters, bf16 compute copies
    stack.set_plan(Plan(2, "cross_layer", 1))
    bf16_loss = step()
    set_compute_dtype(model, None)
    times: dict[tuple, list[float]] = {p: [] for p in PLANS}
    for _ in range(steps):
        for plan in PLANS:
            stack.set_plan(Plan(*plan))
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times[plan].append(time.perf_counter() - t0)
    if rank == 0:
        print(f"bf16 loss {bf16_loss.item():.4f} (fp32 {ref_loss.item():.4f})")
        base = statistics.median(times[PLANS[0]])
        for plan in PLANS:
            med = statistics.median(times[plan])
            print(f"{str(plan):28s} median {med * 1e3:8.2f} ms   speedup {base / med:5.2f}x")
        ok = worst < 1e-4 and torch.isfinite(bf16_loss).item()
        print("DEVICE CHECK OK" if ok else "DEVICE CHECK FAILED", flush=True)
        if not ok:
            state.close()
            sys.exit(1)
    state.close()  # the shared-memory transports' threads stop before the groups go
    dist.destroy_process_group()


# ---- section tp2 --------------------------------------------------------------------------


def run_tp2(args: argparse.Namespace) -> bool:
    """The TP=2 correctness check and its step-time table; False when it failed."""
    print("=== section tp2: TP=2 schedules vs sync TP (2 ranks on one device)", flush=True)
    if args.nccl and torch.cuda.device_count() < 2:
        print("--nccl needs two GPUs (NCCL cannot run two ranks on one GPU): tp2 skipped",
              flush=True)
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_rank, args=(2, port, args.device, args.nccl, args.steps), nprocs=2, join=True)
    except Exception:  # a failed rank: report it and let the next section run
        traceback.print_exc()
        print("tp2 section FAILED (see above)", flush=True)
        return False
    return True


# ---- section readiness ----------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One model of the readiness section (vocab 0: the transformer stack alone)."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    seq: int
    batch: int
    vocab: int = 0

    @property
    def tokens(self) -> int:
        return self.seq * self.batch


def ffn_size(hidden: int, multiple: int) -> int:
    """SwiGLU width as Llama picks it: 8/3 of hidden, rounded up to ``multiple``."""
    return multiple * math.ceil(8 * hidden / 3 / multiple)


def model_flops(cfg, shape: Shape, head: bool) -> float:
    """Model FLOPs of one forward+backward step: ``domino.flops`` (the Megatron / PaLM MFU
    convention: GEMMs, the full s x s attention, the LM head with ``head``; no recomputation)."""
    from domino.flops import train_flops_per_step

    return train_flops_per_step(cfg, shape.tokens, head=head)


def _config(shape: Shape, dtype: torch.dtype):
    from domino import TransformerConfig

    return TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        ffn_hidden_size=shape.ffn, vocab_size=shape.vocab, seq_length=shape.seq,
        max_position_embeddings=shape.seq, hidden_dropout=0.0, attention_dropout=0.0,
        activation="swiglu", normalization="RMSNorm", add_bias_linear=False,
        position_embedding_type="rope", params_dtype=dtype)


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _time_plans(model, plans, step, device: torch.device, warmup: int, rounds: int):
    """Per plan: (median step seconds, peak bytes during its warmup or None on CPU). Warmup runs
    each plan in turn; timed rounds interleave the plans, each round starting one plan later."""
    from domino.transformer import set_plan

    peaks: dict = {}
    for plan in plans:
        set_plan(model, plan, force=True)
        for stack in _stacks(model):
            got = stack.effective_plan()
            if got != plan:
                raise RuntimeError(f"forced plan {plan} but the stack runs {got}")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(max(warmup, 1)):
            step()
        _sync(device)
        peaks[plan] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    times: dict = {p: [] for p in plans}
    for r in range(rounds):
        k = r % len(plans)
        for plan in plans[k:] + plans[:k]:
            set_plan(model, plan, force=True)
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times[plan].append(time.perf_counter() - t0)
    return {p: (statistics.median(times[p]), peaks[p], _spread(times[p])) for p in plans}


def _max_mem(results: dict, device: torch.device) -> int:
    """torch.cuda.max_memory_allocated over the whole size (each plan's warmup resets it)."""
    return max([torch.cuda.max_memory_allocated(device)] + [r[1] for r in results.values()])


def _spread(samples: list[float]) -> float:
    """(max - min) / median of the timed samples, in %: how noisy the median is."""
    return (max(samples) - min(samples)) / statistics.median(samples) * 100.0


def _flops_str(flops: float) -> str:
    return f"{flops / 1e12:.2f} TFLOP" if flops >= 1e11 else f"{flops / 1e9:.4f} GFLOP"


def _stacks(model):
    from domino.transformer import stacks_of

    return stacks_of(model)


def _print_rows(tag: str, results: dict, flops: float, peak_tflops: float | None) -> dict:
    """One row per plan; returns {plan: (ms, split cost %, MFU % or None)}."""
    base = results[next(iter(results))][0]
    out = {}
    for plan, (sec, peak, spread) in results.items():
        cost = (sec / base - 1.0) * 100.0
        mfu = None if peak_tflops is None else flops / sec / (peak_tflops * 1e12) * 100.0
        mfu_s = "n/a" if mfu is None else f"{mfu:.1f}%"
        print(f"  {tag:>7s} {str(plan):10s} step {sec * 1e3:10.2f} ms   split cost {cost:+7.2f}%"
              f"   MFU {mfu_s:>6s}   peak mem {_gib(peak)}   spread {spread:.0f}%", flush=True)
        out[plan] = (sec * 1e3, cost, mfu)
    return out


def _runtime(precision: str, compile: bool, backend: str) -> RuntimeConfig:
    return RuntimeConfig(compute_dtype=torch.bfloat16 if precision == "masters" else None,
                         compile=compile, compile_backend=backend)


def _stack_size(shape: Shape, plans, device, precision: str, warmup: int, rounds: int,
                peak_tflops: float | None, compile: bool = False,
                backend: str = "inductor") -> dict:
    """Time one size of the causal stack alone (no embedding, no head); ``compile``: with
    compiled pieces (the first warm-up step compiles)."""
    from domino import AttnMaskType, ParallelState
    from domino.transformer import DominoTransformer
    from domino.transformer.rope import RotaryEmbedding

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    runtime = _runtime(precision, compile, backend)
    cfg = _config(shape, dtype)
    torch.manual_seed(0)
    stack = DominoTransformer(cfg, ParallelState.single(device),
                              self_attn_mask_type=AttnMaskType.causal, device=device,
                              runtime=runtime)
    params = sum(p.numel() for p in stack.parameters())
    flops = model_flops(cfg, shape, head=False)
    print(f"hidden {shape.hidden}: {shape.layers} layers, {shape.heads} heads, ffn {shape.ffn}, "
          f"seq {shape.seq}, batch {shape.batch}, {params / 1e6:.1f}M params, "
          f"{_flops_str(flops)}/step (model FLOPs)", flush=True)
    gen = torch.Generator(device="cpu").manual_seed(1)
    act = torch.bfloat16 if precision in ("bf16", "masters") else torch.float32
    x = torch.randn(shape.seq, shape.batch, shape.hidden, generator=gen).to(device, act)
    x.requires_grad_(True)  # as an embedding's output: the first layer's input grad is computed
    dy = torch.randn(shape.seq, shape.batch, shape.hidden, generator=gen).to(device, act)
    rot = RotaryEmbedding(cfg.kv_channels, device=device)(
        torch.arange(shape.seq, device=device).unsqueeze(0))  # [s, 1, 1, d]: every sample
    amp = precision == "autocast"

    def step():
        stack.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            y = stack(x, None, rotary_pos_emb=rot)
        y.backward(dy)

    t0 = time.perf_counter()
    results = _time_plans(stack, plans, step, device, warmup, rounds)
    tag = f"h{shape.hidden}" + (" compiled" if compile else "")
    if compile:
        log = stack.kernels.log
        print(f"  {tag}: compiled {log.graphs} graphs in {log.seconds:.1f} s (of "
              f"{time.perf_counter() - t0:.1f} s timing)", flush=True)
    rows = _print_rows(tag, results, flops, peak_tflops)
    if device.type == "cuda":
        print(f"  h{shape.hidden} max_memory_allocated {_gib(_max_mem(results, device))}",
              flush=True)
    return rows


def _gpt_model(shape: Shape, plans, device, precision: str, warmup: int, rounds: int,
               peak_tflops: float | None, compile: bool = False,
               backend: str = "inductor") -> dict:
    """Time the GPT model (embedding, stack, tied LM head, cross entropy)."""
    from domino import ParallelState
    from domino.gpt_model import GPTModel

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    runtime = _runtime(precision, compile, backend)
    cfg = _config(shape, dtype)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = GPTModel(cfg, parallel_state=ParallelState.single(device), runtime=runtime)
    params = sum(p.numel() for p in model.parameters())
    flops = model_flops(cfg, shape, head=True)
    print(f"GPT: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, ffn "
          f"{shape.ffn}, vocab {shape.vocab}, seq {shape.seq}, batch {shape.batch}: "
          f"{params / 1e6:.1f}M params, {_flops_str(flops)}/step (model FLOPs) "
          f"(built in {time.perf_counter() - t0:.1f} s)", flush=True)
    gen = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=gen).to(device)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    amp = precision == "autocast"

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(inputs, None, None, labels=labels).float().mean()
        loss.backward()

    results = _time_plans(model, plans, step, device, warmup, rounds)
    rows = _print_rows("gpt compiled" if compile else "gpt", results, flops, peak_tflops)
    if device.type == "cuda":
        print(f"  gpt max_memory_allocated {_gib(_max_mem(results, device))}", flush=True)
    return rows


def _guarded(what: str, fn, device: torch.device, *a):
    """Run ``fn(*a)``; returns (rows or None, error flag). OOM prints "OOM at <what>" and is
    not an error; any other exception is printed and is one."""
    rows, error = None, False
    try:
        rows = fn(*a)
    except Exception as err:  # keep going: one size must not end the run
        if _is_oom(err):
            print(f"OOM at {what}: {str(err).splitlines()[0][:200]}", flush=True)
        else:
            error = True
            traceback.print_exc()
            print(f"ERROR at {what}: {type(err).__name__}: {err}", flush=True)
    _free(device)  # outside the except block: the traceback's frames (tensors) are gone by now
    return rows, error


def run_readiness(args: argparse.Namespace) -> bool:
    """The readiness section; False only when something broke (not for missed goals, not OOM)."""
    from domino.plan import Plan

    print("=== section readiness: TP=1, one device, Domino split forced", flush=True)
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    tiny = args.tiny or device.type != "cuda"
    if tiny and not args.tiny:
        print(f"(device {device.type}: tiny sizes; the full sizes are for a GPU)", flush=True)
    peak = args.peak_tflops
    if peak is None and device.type == "cuda":
        peak = H200_BF16_DENSE_TFLOPS
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    what = {"bf16": "bf16 params", "masters": "fp32 masters, bf16 compute copies",
            "autocast": "fp32 params, bf16 autocast", "fp32": "fp32 params"}[args.precision]
    peak_s = "n/a (give --peak-tflops)" if peak is None else f"{peak:g} TFLOP/s"
    if args.peak_tflops is None and peak is not None:
        peak_s += " (H200 dense bf16 default; --peak-tflops to change)"
    print(f"torch {torch.__version__}, device {device} ({name}), precision {args.precision} "
          f"({what}), peak {peak_s}", flush=True)
    plans = [Plan(1, "none", 1), Plan(2, "cross_layer", 1), Plan(4, "cross_layer", 1)]
    if tiny:
        seq, batch = args.seq or 32, args.batch or 4
        sizes = [Shape(h, 2, h // 32, ffn_size(h, 32), seq, batch) for h in (64, 128)]
        gpt = Shape(128, 2, 4, ffn_size(128, 32), seq, batch, vocab=512)
        warmup, rounds = args.warmup or 1, args.rounds or 2
        gpt_warmup, gpt_rounds = warmup, rounds
    else:
        seq, batch = args.seq or 2048, args.batch or 8
        sizes = [Shape(h, n, h // 128, ffn_size(h, 256), seq, batch)
                 for h, n in ((1024, 4), (2048, 4), (4096, 2))]
        gpt = Shape(2048, 24, 16, ffn_size(2048, 256), seq, batch, vocab=32000)
        warmup, rounds = args.warmup or 3, args.rounds or 10
        gpt_warmup, gpt_rounds = args.warmup or 2, args.rounds or 5
    if batch < max(p.micro_batches for p in plans):
        print(f"--batch {batch} is smaller than 4 micro-batches: readiness not run", flush=True)
        return False
    start = time.perf_counter()
    broken = False
    table: dict[int, dict] = {}
    compiles = {"off": (False,), "on": (True,), "both": (False, True)}[args.compile]
    for shape in sizes:
        for compile in compiles:
            if time.perf_counter() - start > args.budget_s:
                print(f"skipped hidden {shape.hidden}{' compiled' if compile else ''}: past the "
                      f"{args.budget_s:g} s budget", flush=True)
                continue
            rows, error = _guarded(f"hidden {shape.hidden}", _stack_size, device, shape, plans,
                                   device, args.precision, warmup, rounds, peak, compile,
                                   args.compile_backend)
            broken |= error
            if rows is not None and compile == compiles[0]:  # the summary reads eager's rows
                table[shape.hidden] = rows
    gpt_rows = None
    if time.perf_counter() - start > args.budget_s:
        print(f"skipped the 1B model: past the {args.budget_s:g} s budget", flush=True)
    else:
        for compile in compiles:
            rows, error = _guarded(f"hidden {gpt.hidden} (1B model)", _gpt_model, device, gpt,
                                   plans, device, args.precision, gpt_warmup, gpt_rounds, peak,
                                   compile, args.compile_backend)
            broken |= error
            if compile == compiles[0]:  # the goal reads eager's rows (or the only ones)
                gpt_rows = rows

    print("--- readiness summary", flush=True)
    for hidden, rows in table.items():
        costs = ", ".join(f"{p} {c:+.2f}%" for p, (_, c, _) in list(rows.items())[1:])
        print(f"  hidden {hidden}: split cost vs unsplit: {costs}", flush=True)
    big = {h: r for h, r in table.items() if h >= SPLIT_GOAL_HIDDEN}
    goal = f"goal: split costs <= {SPLIT_GOAL_PCT:g}% at hidden >= {SPLIT_GOAL_HIDDEN}"
    if not big:
        print(f"{goal}: NOT MEASURED (no size >= {SPLIT_GOAL_HIDDEN} ran)", flush=True)
    else:
        best = {h: min(c for _, c, _ in list(r.values())[1:]) for h, r in big.items()}
        worst = {h: max(c for _, c, _ in list(r.values())[1:]) for h, r in big.items()}
        met_best = all(c <= SPLIT_GOAL_PCT for c in best.values())
        met_all = all(c <= SPLIT_GOAL_PCT for c in worst.values())
        print(f"{goal}: {'MET' if met_best else 'NOT MET'} by the best split ("
              + ", ".join(f"h{h} {c:+.2f}%" for h, c in best.items()) + "); "
              f"{'met' if met_all else 'not met'} by every split ("
              + ", ".join(f"h{h} {c:+.2f}%" for h, c in worst.items()) + ")", flush=True)
    goal = f"goal: 1B model >= {MFU_GOAL_PCT:g}% bf16 MFU"
    if gpt_rows is None:
        print(f"{goal}: NOT MEASURED", flush=True)
    else:
        items = list(gpt_rows.items())
        unsplit_plan, (unsplit_ms, _, unsplit_mfu) = items[0]
        best_plan, (best_ms, best_cost, best_mfu) = min(items[1:], key=lambda kv: kv[1][0])
        fmt = "n/a" if unsplit_mfu is None else f"{unsplit_mfu:.1f}%"
        fmt_best = "n/a" if best_mfu is None else f"{best_mfu:.1f}%"
        print(f"1B model MFU: unsplit {unsplit_plan} {unsplit_ms:.1f} ms {fmt}; best split "
              f"{best_plan} {best_ms:.1f} ms {fmt_best} (split cost {best_cost:+.2f}%)",
              flush=True)
        if unsplit_mfu is None:
            print(f"{goal}: NOT MEASURED (no peak: give --peak-tflops)", flush=True)
        else:
            print(f"{goal}: unsplit {'MET' if unsplit_mfu >= MFU_GOAL_PCT else 'NOT MET'} "
                  f"({fmt}); best split {'MET' if best_mfu >= MFU_GOAL_PCT else 'NOT MET'} "
                  f"({fmt_best})", flush=True)
    print(f"readiness took {time.perf_counter() - start:.1f} s", flush=True)
    print("READINESS DONE" + (" (with errors, see above)" if broken else ""), flush=True)
    return not broken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--section", choices=("all", *SECTIONS), default="all",
                        help="which checks to run (default: all, tp2 then readiness)")
    parser.add_argument("--nccl", action="store_true", help="tp2: NCCL (needs >= 2 GPUs)")
    parser.add_argument("--steps", type=int, default=10, help="tp2: timed steps per schedule")
    parser.add_argument("--tiny", action="store_true",
                        help="readiness: tiny sizes (a smoke test; always so on a CPU)")
    parser.add_argument("--precision", choices=("bf16", "masters", "autocast", "fp32"),
                        default="bf16",
                        help="readiness: bf16 params (default); fp32 masters with bf16 compute "
                             "copies (domino train --bf16); fp32 params under bf16 autocast; "
                             "or fp32")
    parser.add_argument("--compile", choices=("off", "on", "both"), default="off",
                        help="readiness: compiled pieces (RuntimeConfig.compile): off, on, or "
                             "both (each size and the 1B model eager, then compiled)")
    parser.add_argument("--compile-backend", choices=COMPILE_BACKENDS, default="inductor",
                        help="readiness: torch.compile backend of --compile")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help=f"readiness: peak FLOP/s for MFU (default {H200_BF16_DENSE_TFLOPS:g}"
                             " on CUDA, H200 dense bf16; none on a CPU)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="readiness: timed rounds (default 10 per size, 5 for the 1B model; "
                             "2 tiny)")
    parser.add_argument("--warmup", type=int, default=0,
                        help="readiness: warmup steps per plan (default 3, 2 for the 1B model; "
                             "1 tiny)")
    parser.add_argument("--seq", type=int, default=0, help="readiness: sequence length")
    parser.add_argument("--batch", type=int, default=0, help="readiness: batch size (>= 4)")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="readiness: sizes not started by then are skipped")
    args = parser.parse_args(argv)
    ok = True
    if args.section in ("all", "tp2"):
        ok &= run_tp2(args)
    if args.section in ("all", "readiness"):
        try:
            ok &= run_readiness(args)
        except Exception:
            traceback.print_exc()
            print("readiness section FAILED (see above)", flush=True)
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
