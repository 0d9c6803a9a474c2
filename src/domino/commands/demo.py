"""``domino demo``: a tiny GPT trained for a few SGD steps at TP=2 on CPU, checked against the
single-process model with the same seed (a sanity check of an installation).

Each rank is ``python -m domino.commands.demo STEPS SEED`` under the shared supervisor."""

from __future__ import annotations

import argparse
import sys

import torch

from domino import ParallelState, TransformerConfig
from domino.distributed import init_distributed, shutdown_distributed
from domino.models.gpt import GPTModel
from domino.supervisor import RankFailed, local_env, run_ranks
from domino.tensor_parallel import CommGroup
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


def _rank(steps: int, seed: int) -> int:
    """One rank (RANK / WORLD_SIZE from the environment); rank 0 prints the comparison."""
    torch.set_num_threads(1)
    init_distributed("cpu")
    state = None
    try:
        state = ParallelState.build(CommGroup.world().size)
        torch.manual_seed(seed)
        losses = _train(GPTModel(_config(), parallel_state=state), steps, seed)
        torch.manual_seed(seed)
        ref = _train(GPTModel(_config(), parallel_state=ParallelState.single()), steps, seed)
        if state.world.rank != 0:
            return 0
        print(f"{'step':>4}  {'loss TP=' + str(state.tp.size):>12}  {'loss TP=1':>12}  "
              f"{'|diff|':>9}")
        for i, (a, b) in enumerate(zip(losses, ref, strict=True)):
            print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}  {abs(a - b):>9.2e}")
        worst = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
        ok = worst < 1e-4 and losses[-1] < losses[0]
        print("OK: TP and single-process training agree" if ok else "MISMATCH", flush=True)
        return 0 if ok else 1
    finally:
        if state is not None:  # its transports' threads stop before the groups go
            state.close()
        shutdown_distributed()


def run(args: argparse.Namespace) -> int:
    tp = args.tensor_model_parallel_size
    _config().validate_parallel(tp)
    command = [sys.executable, "-m", "domino.commands.demo", str(args.steps), str(args.seed)]
    port = free_port()
    try:
        run_ranks([command] * tp, [local_env(r, tp, port) for r in range(tp)],
                  label="domino demo")
    except RankFailed as err:
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(_rank(int(sys.argv[1]), int(sys.argv[2])))
