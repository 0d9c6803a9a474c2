"""``domino demo``: a tiny GPT trained for a few SGD steps at TP=2 on CPU, checked against the
single-process model with the same seed (a sanity check of an installation)."""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from domino import ParallelState, TransformerConfig
from domino.gpt_model import GPTModel
from domino.utils import free_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-model-parallel-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1234)


def _config() -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                             vocab_size=300, seq_length=32, max_position_embeddings=32,
                             hidden_dropout=0.0, attention_dropout=0.0, domino_micro_batches=2)


def _train(model: GPTModel, steps: int, seed: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 300, (8, 33), generator=gen)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(data[:, :-1], None, None, labels=data[:, 1:]).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _rank(rank: int, world: int, port: int, steps: int, seed: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = ParallelState.build(world)
    torch.manual_seed(seed)
    losses = _train(GPTModel(_config(), parallel_state=state), steps, seed)
    torch.manual_seed(seed)
    ref = _train(GPTModel(_config(), parallel_state=ParallelState.single()), steps, seed)
    if rank == 0:
        print(f"{'step':>4}  {'loss TP=' + str(world):>12}  {'loss TP=1':>12}  {'|diff|':>9}")
        for i, (a, b) in enumerate(zip(losses, ref)):
            print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}  {abs(a - b):>9.2e}")
        worst = max(abs(a - b) for a, b in zip(losses, ref))
        ok = worst < 1e-4 and losses[-1] < losses[0]
        print("OK: TP and single-process training agree" if ok else "MISMATCH")
        if not ok:
            sys.exit(1)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    tp = args.tensor_model_parallel_size
    _config().validate_parallel(tp)
    mp.spawn(_rank, args=(tp, free_port(), args.steps, args.seed), nprocs=tp, join=True)
    return 0
