"""bf16 the old way (fp32 weights under autocast) against domino's (bf16 compute copies of fp32
masters, ``RuntimeConfig(compute_dtype=torch.bfloat16)``): casts per training step and step time.

One process, one rank (the TP=1 Domino schedule split as at TP>1, so every piece and micro-batch
runs), forward + backward of one batch per step. Both modes run interleaved in one process; the
printed times are medians. Usage::

    python scripts/mixed_precision.py [--hidden 256] [--layers 2] [--seq 128] [--batch 8]
                                      [--plan m2:cross] [--steps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from domino import ParallelState, TransformerConfig
from domino.gpt_model import GPTModel
from domino.plan import Plan
from domino.runtime import RuntimeConfig
from domino.training.adamw import AdamW

CASTS = ("aten::_to_copy", "aten::copy_")


def build(args, mode: str) -> GPTModel:
    cfg = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden,
                            num_attention_heads=max(1, args.hidden // 64), vocab_size=512,
                            seq_length=args.seq, max_position_embeddings=args.seq,
                            hidden_dropout=0.0, attention_dropout=0.0)
    plan = Plan.parse(args.plan)
    dtype = torch.bfloat16 if mode == "compute copies" else None
    torch.manual_seed(0)
    model = GPTModel(cfg, parallel_state=ParallelState.single(),
                     runtime=RuntimeConfig(plan=plan, compute_dtype=dtype))
    model.language_model.encoder.set_plan(plan, force=True)  # split as at TP > 1
    return model


def step(model, opt, ids, mode: str) -> None:
    amp = (torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast"
           else contextlib.nullcontext())
    opt.zero_grad()
    with amp:
        loss = model(ids[:, :-1], None, None, labels=ids[:, 1:])
    loss.float().mean().backward()
    opt.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--plan", default="m2:cross")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    modes = ("autocast", "compute copies")
    runs = {}
    for mode in modes:
        model = build(args, mode)
        runs[mode] = (model, AdamW(list(model.parameters()), lr=1e-4))
    ids = torch.randint(0, 512, (args.batch, args.seq + 1),
                        generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {m: [] for m in modes}
    counts = {}
    for mode in modes:  # warm-up, then count one step's casts
        step(*runs[mode], ids, mode)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(*runs[mode], ids, mode)
        events = {e.key: e for e in prof.key_averages()}
        counts[mode] = {k: (events[k].count, events[k].cpu_time_total / 1e3) if k in events
                        else (0, 0.0) for k in CASTS}
    for _ in range(args.steps):  # interleaved
        for mode in modes:
            t0 = time.perf_counter()
            step(*runs[mode], ids, mode)
            times[mode].append(time.perf_counter() - t0)
    n_params = sum(p.numel() for p in runs[modes[0]][0].parameters())
    print(f"GPT: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch "
          f"{args.batch}, plan {args.plan}, {n_params} params; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for mode in modes:
        casts = ", ".join(f"{k} {n} calls {ms:.1f} ms" for k, (n, ms) in counts[mode].items())
        print(f"{mode:>15}: step {statistics.median(times[mode]) * 1e3:8.1f} ms (median of "
              f"{args.steps}); per step {casts}")


if __name__ == "__main__":
    main()
