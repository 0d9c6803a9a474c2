"""One DeepSpeed rank of the comparison: times DeepSpeed's own ``DominoTransformer``.

Run by the DeepSpeed venv's python (see ``setup.sh``), one process per rank, with torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and GLOO_SOCKET_IFNAME in
the environment; ``compare.py`` starts it. It never imports ``domino``: the model is DeepSpeed's
``deepspeed.runtime.domino.transformer.DominoTransformer`` exactly as installed, in the mode
DeepSpeed ships by default (cross-layer overlap, ``inter_layer_overlap_forward``: the batch cut
in two halves whose all-reduces overlap the other half's compute across layer boundaries).

DeepSpeed's Domino is written against Megatron's objects: a ``config`` (a Megatron
``TransformerConfig``) and an ``mpu`` (Megatron's ``parallel_state``). Neither is needed in
full, so this file builds the minimal stand-ins below from the attributes the DeepSpeed code
reads (see the constructor chain ``DominoTransformer`` -> ``DominoTransformerLayer`` ->
``ShardedAttention`` / ``DominoAsyncColumnParallelLinear`` / ``RowParallelLinearNoComm``).
No DeepSpeed or Megatron code is copied here.

Per step (after the warm-up steps): barrier, then ``perf_counter`` around zero_grad + forward +
backward of ``(out * w).sum()`` on a fixed random [s, b, h] input, with the garbage collector
off inside a step (what ``domino bench`` does). A step's time is the max over ranks. Rank 0
writes a JSON report to ``--out``.

    DS_ACCELERATOR=cpu .venv-deepspeed/bin/python ds_worker.py --out ds.json [sizes...]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

# Pick DeepSpeed's CPU accelerator before deepspeed is imported (it is chosen at import time).
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/
from peer_worker import gather_rows, timed_steps, write_report  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--num-layers", type=int, default=2)
    a("--hidden-size", type=int, default=512)
    a("--num-attention-heads", type=int, default=8)
    a("--seq-length", type=int, default=256)
    a("--micro-batch-size", type=int, default=8, help="batch per TP group and step")
    a("--steps", type=int, default=6, help="measured steps")
    a("--warmup", type=int, default=2, help="unmeasured steps first")
    a("--threads-per-rank", type=int, default=1)
    a("--dtype", choices=tuple(DTYPES), default="fp32")
    a("--seed", type=int, default=1234)
    a("--timeout", type=float, default=300.0, help="seconds a collective may wait for a peer")
    a("--out", required=True, help="JSON report (written by rank 0)")
    a("--log", default=None, help="send this rank's stdout and stderr to this file")
    return p.parse_args(argv)


# ---- minimal stand-ins for Megatron's config and mpu ------------------------------------------


def _normal_init(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def init(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(t, mean=0.0, std=std)

    return init


@dataclass
class DominoConfig:
    """The attributes of a Megatron ``TransformerConfig`` that DeepSpeed's Domino reads.

    Same architecture as domino's ``TransformerConfig`` defaults: ffn = 4h, biases in every
    linear, exact GELU (DeepSpeed hard-codes ``F.gelu``), pre-LayerNorm, no dropout.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    params_dtype: torch.dtype
    init_method_std: float = 0.02
    kv_channels: int = 0  # 0: hidden_size // num_attention_heads
    ffn_hidden_size: int = 0  # 0: 4 * hidden_size
    add_bias_linear: bool = True
    hidden_dropout: float = 0.0  # no dropout, as in domino bench (masks would only add noise)
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    apply_residual_connection_post_layernorm: bool = False
    gated_linear_unit: bool = False
    perform_initialization: bool = True
    # False = cross-layer overlap (inter_layer_overlap_forward), DeepSpeed's default path.
    domino_intra_layer_overlap: bool = False

    def __post_init__(self) -> None:
        self.kv_channels = self.kv_channels or self.hidden_size // self.num_attention_heads
        self.ffn_hidden_size = self.ffn_hidden_size or 4 * self.hidden_size
        self.init_method = _normal_init(self.init_method_std)
        # Megatron's scaled init for the output projections: std / sqrt(2 * num_layers).
        self.output_layer_init_method = _normal_init(
            self.init_method_std / math.sqrt(2.0 * self.num_layers))


class TensorParallelMPU:
    """The two ``mpu`` calls DeepSpeed's Domino makes: the TP group and its size."""

    def __init__(self, group: tdist.ProcessGroup) -> None:
        self._group = group

    def get_tensor_model_parallel_group(self) -> tdist.ProcessGroup:
        return self._group

    def get_tensor_model_parallel_world_size(self) -> int:
        return tdist.get_world_size(self._group)

    def get_tensor_model_parallel_rank(self) -> int:
        return tdist.get_rank(self._group)


# ---- the measurement --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.log is not None:  # DeepSpeed's import and build messages go to the log, not the table
        fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    torch.set_num_threads(args.threads_per_rank)

    import deepspeed
    import deepspeed.comm as ds_dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.domino.transformer import AttnMaskType, DominoTransformer, ModelType

    # deepspeed.comm wraps torch.distributed; gloo is the CPU backend both systems use here.
    ds_dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                             timeout=timedelta(seconds=args.timeout))
    rank, world = tdist.get_rank(), tdist.get_world_size()
    tp_group = tdist.new_group(list(range(world)))  # TP spans every rank (TP = world size)

    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    dtype = DTYPES[args.dtype]
    config = DominoConfig(num_layers=args.num_layers, hidden_size=h,
                          num_attention_heads=args.num_attention_heads, params_dtype=dtype)
    if config.num_attention_heads % world or config.ffn_hidden_size % world:
        raise SystemExit(f"ds_worker: heads and ffn size must divide by TP={world}")
    if b % 2:
        raise SystemExit("ds_worker: DeepSpeed's Domino halves the batch: --micro-batch-size "
                         "must be even")

    torch.manual_seed(args.seed + rank)  # each rank's weight shards drawn independently
    model = DominoTransformer(config, TensorParallelMPU(tp_group), apply_rotary_pos_emb=None,
                              model_type=ModelType.encoder_or_decoder,
                              self_attn_mask_type=AttnMaskType.causal)
    # Inputs from their own generator: identical (replicated) on every rank, as TP expects.
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(s, b, h, generator=gen).to(dtype)  # [s, b, h]
    w = torch.randn(s, b, h, generator=gen).to(dtype)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        # attention_mask=None: DeepSpeed's CoreAttention uses SDPA with is_causal=True.
        loss = (model(x, None) * w).float().sum()
        loss.backward()
        return loss.item()

    times, loss = timed_steps(step, args.warmup, args.steps)
    # A step's time is its slowest rank's: the TP group moves at that pace.
    rows = gather_rows(times, world)
    if rank == 0:
        report = {
            "system": "deepspeed",
            "model": "deepspeed.runtime.domino.transformer.DominoTransformer "
                     "(inter_layer_overlap_forward: cross-layer, 2 halves of the batch)",
            "deepspeed_version": deepspeed.__version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "accelerator": get_accelerator()._name,
            "backend": tdist.get_backend(),
            "tensor_model_parallel_size": world,
            "num_layers": args.num_layers, "hidden_size": h,
            "num_attention_heads": args.num_attention_heads, "seq_length": s,
            "micro_batch_size": b, "dtype": args.dtype, "threads_per_rank": args.threads_per_rank,
            "steps": args.steps, "warmup": args.warmup,
            "param_bytes_rank0": sum(p.numel() * p.element_size() for p in model.parameters()),
            "last_loss_rank0": loss,
            "step_times_s": [max(col) for col in zip(*rows)],
            "step_times_s_per_rank": rows,
        }
        write_report(args.out, report)
    tdist.barrier()
    tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
