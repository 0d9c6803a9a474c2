"""One rank of the FSDP2 side of the comparison: a plain GPT trained under PyTorch's own
``torch.distributed.fsdp.fully_shard`` (FSDP2).

Run by ``compare.py`` (one process per rank, torchrun's variables RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment; on an emulated link also GLOO_SOCKET_IFNAME). It never imports
``domino``: the model is written here from ``torch.nn`` modules with the shapes and FLOPs of
domino's default GPT (learned absolute positions, pre-LayerNorm, biases in every linear,
exact GELU, ffn = 4h, causal SDPA attention, final LayerNorm, the LM head tied to the word
embedding, no dropout), so the parameter count is domino's to the parameter (compare.py checks).

Sharding, as torchtitan does it: ``fully_shard`` on each transformer block, then on the root
(the embeddings, final norm and tied head). Data parallelism over every rank (gloo on CPU, NCCL on
CUDA). bf16: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fp32 sharded
parameters (the masters), bf16 gathers and compute, fp32 reduce-scatters - what domino's
``--bf16`` does under ``optim_grads_params``.

Prefetch (``--prefetch N``): each block explicitly prefetches the next N blocks' all-gathers in
the forward and the N before it in the backward, with ``async_op`` unshards. On CPU this is what
makes FSDP2 overlap at all: its default (implicit) prefetching overlaps through CUDA streams,
which on CPU are no-ops, so a synchronous all-gather blocks the compute. ``--prefetch 0`` keeps
FSDP2's defaults. Its reduce-scatters are synchronous calls on the reduce-scatter "stream"
whatever the setting, so on CPU they block the backward.

Per step: zero_grad, forward, cross entropy (mean over tokens), backward, gradient clipping to
norm 1.0, AdamW (betas 0.9/0.95, weight decay 0.1 off biases and norms: domino train's
defaults), the loss averaged over DP. No barrier between steps (as ``domino train``); each step's
time is ``perf_counter`` around all of it. Peak memory: the process's VmHWM after the last step,
read as ``domino train`` reads it. Rank 0 writes a JSON report to ``--out``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/
from peer_worker import gather_rows, write_report  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--num-layers", type=int, default=4)
    a("--hidden-size", type=int, default=512)
    a("--num-attention-heads", type=int, default=8)
    a("--seq-length", type=int, default=256)
    a("--micro-batch-size", type=int, default=4, help="samples per rank and step")
    a("--vocab-size", type=int, default=2048)
    a("--steps", type=int, default=6, help="measured steps")
    a("--warmup", type=int, default=3, help="unmeasured steps first")
    a("--dtype", choices=tuple(DTYPES), default="fp32")
    a("--prefetch", type=int, default=1,
      help="blocks prefetched ahead (explicit, async unshards); 0: FSDP2's defaults")
    a("--threads", type=int, default=1, help="torch threads per rank")
    a("--device", choices=("cpu", "cuda"), default="cpu")
    a("--seed", type=int, default=1234)
    a("--timeout", type=float, default=300.0, help="seconds a collective may wait for a peer")
    a("--out", required=True, help="JSON report (written by rank 0)")
    a("--log", default=None, help="send this rank's stdout and stderr to this file")
    return p.parse_args(argv)


# ---- the model -----------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LN transformer layer: x + proj(attn(ln1(x))), then x + fc2(gelu(fc1(ln2(x))))."""

    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h, eps=1e-5), nn.LayerNorm(h, eps=1e-5)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)  # [b, a, s, d]
        x = x + self.proj(ctx.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int, h: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h, eps=1e-5)
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() > 1:  # output projections scaled as Megatron's (std / sqrt(2L))
                out = name.endswith(("proj.weight", "fc2.weight"))
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * layers) if out else std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [b, s] -> logits [b, s, V]
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # the tied head


def shard(model: GPT, dtype: torch.dtype, prefetch: int, device: str) -> None:
    """``fully_shard`` each block, then the root; explicit async prefetch when asked."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device, (tdist.get_world_size(),))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if dtype == torch.bfloat16 else MixedPrecisionPolicy())
    blocks = list(model.blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if prefetch > 0:
        model._set_unshard_async_op(True)  # the gathers run in gloo's threads under compute
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch):i][::-1])


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's shards of the parameters, gradients and AdamW state, in bytes."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    params = [p for p in model.parameters()]
    weights = sum(local(p).numel() * local(p).element_size() for p in params)
    grads = sum(local(p.grad).numel() * local(p.grad).element_size()
                for p in params if p.grad is not None)
    optim = sum(local(v).numel() * local(v).element_size() for s in opt.state.values()
                for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return {"weights": weights, "grads": grads, "optimizer": optim}


def vm_hwm_bytes() -> int:
    """The process's resident-set high-water mark (``VmHWM``), as domino.memory reads it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("fsdp2_worker: no VmHWM in /proc/self/status (Linux only)")


def train(args: argparse.Namespace, device: torch.device) -> dict:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    torch.manual_seed(args.seed)  # the same full weights on every rank before sharding
    model = GPT(args.num_layers, args.hidden_size, args.num_attention_heads, args.vocab_size,
                args.seq_length).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    shard(model, DTYPES[args.dtype], args.prefetch, device.type)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=2e-3, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own samples
    shape = (args.micro_batch_size, args.seq_length + 1)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        data = torch.randint(0, args.vocab_size, shape, generator=gen).to(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab_size),
                               data[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        mean = loss.detach().clone()
        tdist.all_reduce(mean)
        losses.append(mean.item() / world)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else vm_hwm_bytes())
    rows = gather_rows(times, world)
    peaks = gather_rows([float(peak)], world)
    states = state_bytes(model, opt)
    return {"params": n_params, "step_times_s": rows[0], "step_times_s_per_rank": rows,
            "peak_mem_bytes_per_rank": [int(r[0]) for r in peaks],
            "peak_mem_method": ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                                else "process RSS high-water mark (VmHWM)"),
            "model_state_bytes_rank0": states, "losses": losses}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.log is not None:  # warnings and errors to the log, not the table
        fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    tdist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                             timeout=timedelta(seconds=args.timeout))
    result = train(args, device)
    if tdist.get_rank() == 0:
        cfg = {k: v for k, v in vars(args).items() if k not in ("out", "log")}
        write_report(args.out, {
            "system": "fsdp2", "torch_version": torch.__version__,
            "python_version": platform.python_version(), "backend": tdist.get_backend(),
            "data_parallel_size": tdist.get_world_size(), **cfg, **result})
    tdist.barrier()
    tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
