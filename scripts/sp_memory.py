"""What one TP rank keeps for backward, by kind of piece, with and without sequence parallelism.

One process stands in for one rank of a TP group (collectives disabled: shapes and memory are a
real rank's, the numbers are not), runs a training forward of GPT under a Domino plan and prints
the bytes autograd saved for backward while each kind of piece ran (``domino.memory.
kept_by_piece``): ``local`` (norms, dropout masks, residual adds, the embedding's finish) is what
sequence parallelism shards, ``par`` (the TP regions) and ``other`` (the LM head and the loss)
compute on the whole sequence either way.

    python scripts/sp_memory.py [--tp 2] [--hidden-size 512] [--num-layers 4] [--seq-length 1024]
"""

from __future__ import annotations

import argparse

import torch

from domino import ParallelState, TransformerConfig
from domino.gpt_model import GPTModel
from domino.memory import kept_by_piece
from domino.plan import Plan
from domino.tensor_parallel import CommGroup


def kept(args: argparse.Namespace, sp: bool, recompute: str | None) -> dict[str, int]:
    state = ParallelState(tp=CommGroup(size=args.tp, rank=args.tp - 1, enabled=False))
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
        seq_length=args.seq_length, max_position_embeddings=args.seq_length,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        sequence_parallel=sp, recompute_granularity=recompute)
    torch.manual_seed(0)
    model = GPTModel(cfg, parallel_state=state, plan=Plan.parse(args.plan))
    ids = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1))
    return kept_by_piece(state.tp, model.parameters(),
                         lambda: model(ids[:, :-1], None, None, labels=ids[:, 1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = parser.add_argument
    a("--tp", type=int, default=2)
    a("--hidden-size", type=int, default=512)
    a("--num-attention-heads", type=int, default=8)
    a("--num-layers", type=int, default=4)
    a("--seq-length", type=int, default=1024)
    a("--micro-batch-size", type=int, default=4)
    a("--vocab-size", type=int, default=8192)
    a("--hidden-dropout", type=float, default=0.1)
    a("--attention-dropout", type=float, default=0.1)
    a("--plan", default="m2:cross")
    args = parser.parse_args()
    torch.set_num_threads(1)
    mib = 1 << 20
    print(f"GPT {args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, "
          f"batch {args.micro_batch_size}, one rank of TP={args.tp}, plan {args.plan}, fp32: "
          "MiB kept for backward")
    print(f"{'':28}{'local':>8}{'par':>8}{'other':>8}{'total':>8}")
    for recompute in (None, "selective"):
        for sp in (False, True):
            k = kept(args, sp, recompute)
            name = f"{'SP' if sp else 'no SP'}, recompute {recompute or 'none'}"
            parts = [k.get(p, 0) / mib for p in ("local", "par", "other")]
            print(f"{name:28}" + "".join(f"{v:8.1f}" for v in parts)
                  + f"{sum(k.values()) / mib:8.1f}")


if __name__ == "__main__":
    main()
