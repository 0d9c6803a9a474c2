"""One Megatron-core rank of the MoE comparison: times Megatron's own ``MoELayer``.

Run by the Megatron venv's python (see ``setup.sh``), one process per rank, with torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and GLOO_SOCKET_IFNAME in
the environment; ``compare.py`` starts it. It never imports ``domino``. The MoE layer is
megatron-core's ``MoELayer`` exactly as installed, built from Megatron's own local (non-Transformer
Engine) spec, ``get_moe_module_spec(use_te=False, moe_grouped_gemm=False)``: a ``TopKRouter``
(softmax top-k, the switch load-balancing loss), the ``alltoall`` token dispatcher
(``MoEAlltoAllTokenDispatcher``) and ``SequentialMLP`` experts (one local ``MLP`` per expert, run
one after the other; the grouped-GEMM experts need CUDA). Process groups come from Megatron's
``parallel_state.initialize_model_parallel`` over gloo.

What is timed (``--unit``): ``block`` (the default) is the unit ``domino bench --model moe``
times, built from Megatron's own modules: a ``TransformerBlock`` of one ``TransformerLayer``
whose attention half is Megatron's ``IdentityOp`` (so the layer is its pre-MLP ``LayerNorm``,
the ``MoELayer`` and the residual add) and the block's final ``LayerNorm``:
``final_norm(x + moe(norm(x)))``. ``layer`` times the bare ``MoELayer`` (``moe(x)``), which does
less work than our unit (no norms, no residual).

Megatron-core 0.16 assumes CUDA in three places on this path; :func:`patch_megatron_for_cpu`
changes them at run time, in this process only (no installed file is edited), without changing
what is computed or communicated:

1. The all-to-all dispatcher makes a ``torch.cuda.Stream`` when it is built and, at its
   device-to-host point, copies the split sizes to the host on that stream and synchronises an
   event. On CPU the split sizes are host tensors already, so the patched method converts them to
   NumPy arrays (what the CUDA path hands to ``all_to_all_single``) and needs no stream or event.
2. ``torch.cuda.current_device()`` is used as an allocation device (the all-to-all's output
   buffer, the router moving its weight "to the GPU"): it returns the CPU device here.
3. The router's gating GEMM tests ``te_general_gemm is not None``, a name that only exists when
   Transformer Engine imports: it is set to ``None``, which selects the plain ``torch.mm`` path.

With ``--moe-router-force-load-balancing`` (Megatron's ``moe_router_force_load_balancing``:
random router logits, for load-balanced benchmarks) a fourth patch gives ``RandomSTE`` a CPU
generator where Megatron forks its CUDA RNG tracker.

Per step (after the warm-up steps): barrier, then ``perf_counter`` around zero_grad + forward +
backward of ``(out * w).sum()`` on a fixed random [s, b, h] input (a different one per rank: EP
ranks hold different tokens), with the garbage collector off inside a step (what ``domino bench``
does). A step's time is the max over ranks. Rank 0 prints a JSON report on stdout (and writes it
to ``--out`` if given): the step times and how many token copies each rank sent to each other
rank per step in the dispatch all-to-all (the combine sends the same number back; backward
repeats both).

    .venv-megatron/bin/python -m torch.distributed.run --nproc-per-node 2 mcore_worker.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
from datetime import timedelta

import torch
import torch.distributed as tdist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/
from peer_worker import gather_rows, timed_steps, write_report  # noqa: E402

DTYPES = {"fp32": torch.float32}
UNITS = ("block", "layer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--hidden-size", type=int, default=512)
    a("--moe-ffn-hidden-size", type=int, default=1024, help="each expert's MLP width")
    a("--num-experts", type=int, default=8)
    a("--moe-router-topk", type=int, default=2)
    a("--moe-aux-loss-coeff", type=float, default=0.01,
      help="weight of the switch load-balancing loss (0 turns it off)")
    a("--moe-router-force-load-balancing", action="store_true",
      help="Megatron's moe_router_force_load_balancing: random router logits")
    a("--swiglu", action="store_true", help="SwiGLU experts (default: exact GELU)")
    a("--seq-length", type=int, default=256)
    a("--micro-batch-size", type=int, default=4, help="batch per EP rank and step")
    a("--tensor-model-parallel-size", type=int, default=1,
      help="TP size (> 1 turns on sequence parallelism, which Megatron's MoE needs with TP)")
    a("--expert-tensor-parallel-size", type=int, default=1,
      help="TP inside each expert (Megatron's expert_tensor_parallel_size)")
    a("--expert-model-parallel-size", type=int, default=None,
      help="EP size (default: world size / expert-TP size, no expert data parallelism)")
    a("--steps", type=int, default=6, help="measured steps")
    a("--warmup", type=int, default=2, help="unmeasured steps first")
    a("--threads-per-rank", type=int, default=1)
    a("--dtype", choices=tuple(DTYPES), default="fp32")
    a("--seed", type=int, default=1234)
    a("--unit", choices=UNITS, default="block",
      help="block: norm, MoE layer, residual and final norm (the unit domino bench --model moe "
           "times); layer: the bare MoELayer")
    a("--timeout", type=float, default=300.0, help="seconds a collective may wait for a peer")
    a("--out", default=None, help="also write rank 0's JSON report here")
    a("--log", default=None, help="send this rank's stdout and stderr to this file")
    return p.parse_args(argv)


# ---- the CPU patches --------------------------------------------------------------------------


class _NoStream:
    """Stands in for the dispatcher's class-level CUDA stream so its constructor makes none."""

    def __repr__(self) -> str:
        return "<no CUDA stream: CPU>"


def _host_splits(value):
    """What the CUDA path's device-to-host copy yields for a split-size tensor: a NumPy array."""
    return value.numpy() if torch.is_tensor(value) else value


def _dtoh_and_synchronize_on_cpu(self, point, tokens_per_expert=None):
    """CPU version of ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``.

    At the dispatcher's device-to-host point the split sizes become host arrays, as on CUDA;
    there is no side stream to wait for (every CPU op has finished when it returns)."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        self.input_splits = _host_splits(self.input_splits)
        self.output_splits = _host_splits(self.output_splits)
        self.output_splits_tp = _host_splits(self.output_splits_tp)
    return tokens_per_expert


class _CpuRngFork:
    """A CPU stand-in for Megatron's CUDA RNG tracker, for ``RandomSTE`` only: ``fork`` runs the
    body on this rank's own CPU generator state and restores the default one afterwards."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self._state = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name=None):
        outer = torch.get_rng_state()
        torch.set_rng_state(self._state)
        try:
            yield
        finally:
            self._state = torch.get_rng_state()
            torch.set_rng_state(outer)


def patch_megatron_for_cpu(rng_seed: int | None = None) -> list[str]:
    """Apply the CPU patches (see the module docstring); their descriptions."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    applied = []
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _dtoh_and_synchronize_on_cpu
    applied.append("MoEAlltoAllTokenDispatcher: no CUDA stream; split sizes to NumPy on the host")
    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    applied.append("torch.cuda.current_device() -> cpu (allocation device)")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        applied.append("moe_utils.te_general_gemm = None (no Transformer Engine: torch.mm gating)")
    if rng_seed is not None:
        tracker = _CpuRngFork(rng_seed)
        moe_utils.get_cuda_rng_tracker = lambda *a, **k: tracker
        applied.append("RandomSTE: CPU generator instead of the CUDA RNG tracker")
    return applied


def build_unit(kind: str, config, num_experts: int, pg):
    """(the module timed, its ``MoELayer``): the layer alone, or a one-layer
    ``TransformerBlock`` around it from Megatron's local spec pieces (see the module doc)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    moe = get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False)
    if kind == "layer":
        layer = build_module(moe, config=config, layer_number=1, pg_collection=pg)
        return layer, layer
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
    )
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    norm = LocalSpecProvider().layer_norm(rms_norm=False, for_qk=False)  # torch's LayerNorm
    layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=IdentityOp, self_attention=IdentityOp, self_attn_bda=IdentityFuncOp,
        pre_mlp_layernorm=norm, mlp=moe, mlp_bda=get_bias_dropout_add))
    block = TransformerBlock(config, TransformerBlockSubmodules(layer_specs=[layer],
                                                                layer_norm=norm),
                             post_process=True)
    return block, block.layers[0].mlp


# ---- the measurement --------------------------------------------------------------------------


def build_config(args: argparse.Namespace, tp: int, ep: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden_size,
        num_attention_heads=8,  # required by the config; there is no attention here
        ffn_hidden_size=args.moe_ffn_hidden_size,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=tp > 1,
        params_dtype=DTYPES[args.dtype],
        use_cpu_initialization=True,
        add_bias_linear=False,  # domino's experts and router have no biases
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,  # softmax over the top-k logits (re-normalised weights)
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_router_force_load_balancing=args.moe_router_force_load_balancing,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.log is not None:  # Megatron's warnings go to the log, not the table
        fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    torch.set_num_threads(args.threads_per_rank)

    tdist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = tdist.get_rank(), tdist.get_world_size()
    tp = args.tensor_model_parallel_size
    if world % tp:
        raise SystemExit(f"mcore_worker: world size {world} is not a multiple of TP={tp}")
    etp = args.expert_tensor_parallel_size
    ep = args.expert_model_parallel_size or world // etp
    if world % (ep * etp) or args.num_experts % ep:
        raise SystemExit(f"mcore_worker: EP x expert-TP ({ep} x {etp}) must divide the world "
                         f"size {world}, and EP the expert count {args.num_experts}")
    if args.seq_length % tp:
        raise SystemExit(f"mcore_worker: --seq-length must divide by TP={tp} (sequence parallel)")

    patches = patch_megatron_for_cpu(rng_seed=args.seed + 7919 * (rank + 1)
                                     if args.moe_router_force_load_balancing else None)

    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_default_pg_collection,
    )

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, create_gloo_process_groups=False)
    pg = get_default_pg_collection()

    config = build_config(args, tp, ep)
    torch.manual_seed(args.seed + rank)  # each rank's experts drawn independently
    unit, layer = build_unit(args.unit, config, args.num_experts, pg)
    unit.train()

    # Sequence parallel: each TP rank holds s / TP of the sequence. Every rank draws its own
    # tokens (EP ranks hold different tokens; TP ranks different sequence pieces).
    s, b, h = args.seq_length // tp, args.micro_batch_size, args.hidden_size
    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(args.seed + 1 + 1000 * rank)
    x = torch.randn(s, b, h, generator=gen).to(dtype)  # [s, b, h]
    w = torch.randn(s, b, h, generator=gen).to(dtype)
    dispatcher = layer.token_dispatcher

    def step() -> float:
        unit.zero_grad(set_to_none=True)
        out = unit(hidden_states=x, attention_mask=None) if args.unit == "block" else layer(x)[0]
        loss = (out * w).float().sum()
        loss.backward()
        return loss.item()

    sent: list[list[int]] = []  # per measured step: token copies this rank sent to EP rank j

    def after(measured: bool) -> None:
        if measured:
            splits = dispatcher.input_splits  # None without EP or TP: all stays here
            sent.append([int(v) for v in splits] if splits is not None
                        else [s * b * args.moe_router_topk])
        clear_aux_losses_tracker()

    times, loss = timed_steps(step, args.warmup, args.steps, after)
    # A step's time is its slowest rank's: the EP group moves at that pace.
    rows = gather_rows(times, world)
    sent_all = gather_rows(sent, world, torch.int64)  # per rank [steps, ep]
    # Which global rank each of a rank's split indices is (its EP group, in EP order).
    groups = gather_rows(tdist.get_process_group_ranks(pg.ep), world, torch.int64)
    if rank == 0:
        # "rank i -> rank j" (global ranks; j's EP index is the split's index) per step; the
        # combine all-to-all sends the same counts back, and backward repeats both exchanges.
        copies: dict[str, list[int]] = {}
        for src in range(world):
            for j, dst in enumerate(groups[src]):
                if dst != src:
                    copies[f"rank{src}->rank{dst}"] = [row[j] for row in sent_all[src]]
        report = {
            "system": "megatron-core",
            "model": "megatron.core.transformer.moe.moe_layer.MoELayer (TopKRouter softmax "
                     "top-k + aux loss, MoEAlltoAllTokenDispatcher, SequentialMLP)"
                     + (" in a TransformerBlock of one TransformerLayer (attention: IdentityOp; "
                        "pre-MLP LayerNorm, residual, final LayerNorm)"
                        if args.unit == "block" else ""),
            "unit": args.unit,
            "megatron_core_version": megatron.core.__version__,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "backend": tdist.get_backend(),
            "cpu_patches": patches,
            "world_size": world, "tensor_model_parallel_size": tp,
            "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp,
            "sequence_parallel": tp > 1,
            "hidden_size": h, "moe_ffn_hidden_size": args.moe_ffn_hidden_size,
            "num_experts": args.num_experts, "moe_router_topk": args.moe_router_topk,
            "moe_aux_loss_coeff": args.moe_aux_loss_coeff,
            "force_load_balancing": args.moe_router_force_load_balancing,
            "activation": "swiglu" if args.swiglu else "gelu",
            "seq_length": args.seq_length, "micro_batch_size": b,
            "tokens_per_rank": s * b, "dtype": args.dtype,
            "threads_per_rank": args.threads_per_rank,
            "steps": args.steps, "warmup": args.warmup,
            "param_bytes_rank0": sum(p.numel() * p.element_size() for p in unit.parameters()),
            "last_loss_rank0": loss,
            "step_times_s": [max(col) for col in zip(*rows)],
            "step_times_s_per_rank": rows,
            "dispatch_token_copies_per_step": copies,
        }
        text = (write_report(args.out, report) if args.out is not None
                else json.dumps(report, indent=2))
        print(text, flush=True)
    tdist.barrier()
    parallel_state.destroy_model_parallel()
    tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
