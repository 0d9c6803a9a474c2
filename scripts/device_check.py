"""Device check of the Domino schedules, for a session that is lent an accelerator.

Runs TP=2 as two processes on one device (gloo on the device's tensors, or NCCL with --nccl on a
machine with two or more GPUs) and checks, for every schedule, that loss and gathered gradients
equal the sync-TP model's; then runs bf16 autocast and prints a sync vs Domino step-time table.
On a CPU-only machine it runs the same checks on the CPU (what the test suite does).

    python scripts/device_check.py [--device cuda] [--nccl] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PLANS = [(1, "none", 1), (2, "intra_layer", 1), (2, "cross_layer", 1), (3, "cross_layer", 2),
         (4, "cross_layer", 2)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(rank: int, world: int, port: int, device_name: str, nccl: bool, steps: int) -> None:
    from domino import ParallelState, TransformerConfig
    from domino.gpt_model import GPTModel
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
    with torch.autocast(device.type, dtype=torch.bfloat16):
        stack.set_plan(Plan(2, "cross_layer", 1))
        bf16_loss = step()
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
        print(f"bf16 autocast loss {bf16_loss.item():.4f} (fp32 {ref_loss.item():.4f})")
        base = statistics.median(times[PLANS[0]])
        for plan in PLANS:
            med = statistics.median(times[plan])
            print(f"{str(plan):28s} median {med * 1e3:8.2f} ms   speedup {base / med:5.2f}x")
        ok = worst < 1e-4 and torch.isfinite(bf16_loss).item()
        print("DEVICE CHECK OK" if ok else "DEVICE CHECK FAILED", flush=True)
        if not ok:
            sys.exit(1)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--nccl", action="store_true", help="NCCL (needs >= 2 GPUs)")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    if args.nccl and torch.cuda.device_count() < 2:
        raise SystemExit("--nccl needs two GPUs (NCCL cannot run two ranks on one GPU).")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, args.device, args.nccl, args.steps), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
