"""``domino bench``: sync TP vs Domino schedules vs the no-comm ideal on one model and batch (or,
with ``--pipeline-model-parallel-size P``, pipeline schedules side by side; with
``--data-parallel-size D``, data-parallel sharding strategies side by side).

Checks the flags (:mod:`domino.bench.spec`), runs one worker process per rank, each in its own
network namespace with ``--emulate-link`` (:mod:`domino.bench.execute`), then turns rank 0's
raw measurements into figures, a JSON report, timeline pictures and a table
(:mod:`domino.bench.report`, :mod:`domino.bench.pipeline_report`,
:mod:`domino.bench.data_parallel_report`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from domino.bench import data_parallel_report, pipeline_report, report
from domino.bench.data_parallel_spec import (
    DEFAULT_STRATEGIES,
    data_parallel_spec,
    refuse_data_parallel_flags,
)
from domino.bench.execute import execute
from domino.bench.modes import DEFAULT_MODES, GRAMMAR
from domino.bench.spec import (
    DEFAULT_SCHEDULES,
    DTYPES,
    PIPELINE_MICRO_BATCHES,
    PIPELINE_PLAN,
    pipeline_spec,
    tp_spec,
)
from domino.parallel_dims import SIZED
from domino.runtime import ATTENTION_BACKENDS, COMPILE_BACKENDS, CP_COMM_TYPES
from domino.training.flag_text import command_flags, flags_in_errors

# The MoE flags and their defaults (add_arguments'): any other value needs --num-experts.
MOE_DEFAULTS: dict[str, Any] = {"moe_router_topk": 2, "moe_ffn_hidden_size": None,
                                "moe_aux_loss_coeff": 0.01,
                                "moe_router_force_load_balancing": False}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``domino bench`` flags to ``parser``."""
    a = parser.add_argument
    _model_flags(a)
    _parallel_flags(a)
    _moe_flags(a)
    _measurement_flags(a)
    _link_flags(a)
    _pipeline_flags(a)
    _data_parallel_flags(a)
    a("--json", metavar="PATH", default=None, help="write the report here")
    a("--out-dir", metavar="DIR", default=None,
      help="write a PNG timeline and a Chrome trace per traced mode here")


def _model_flags(a: Callable[..., Any]) -> None:
    """The model the modes run."""
    a("--model", choices=("stack", "gpt", "moe"), default="stack",
      help="stack: the transformer stack on random [s, b, h] input; gpt: the full GPT model; "
           "moe: the stack's MoE MLP blocks only (norm, MoE layer, residual; no attention), "
           "the unit Megatron's MoELayer is (needs --num-experts)")
    a("--num-layers", type=int, default=2)
    a("--hidden-size", type=int, default=512)
    a("--num-attention-heads", type=int, default=8)
    a("--seq-length", type=int, default=256)
    a("--micro-batch-size", type=int, default=8, help="batch per TP group and step")
    a("--vocab-size", type=int, default=32000, help="vocabulary (--model gpt only)")
    a("--swiglu", action="store_true", help="SwiGLU MLPs and experts instead of GELU")
    a("--recompute-granularity", choices=("full", "selective"), default=None,
      help="activation recomputation of every mode's model (memory for compute)")
    a("--attention-dropout", type=float, default=0.0,
      help="attention dropout of every mode's model (with it the core attention keeps its "
           "s x s probabilities for backward, what selective recomputation drops)")


def _parallel_flags(a: Callable[..., Any]) -> None:
    """One flag per parallel size (domino.parallel_dims), and CP's attention."""
    for d in SIZED:
        if d.bench_help is not None:
            a(d.flag, type=int, default=d.cli_default, help=d.bench_help)
    a("--cp-comm-type", choices=tuple(CP_COMM_TYPES), default="p2p",
      help="CP attention: p2p (K/V ring), all_gather or a2a (Ulysses)")


def _moe_flags(a: Callable[..., Any]) -> None:
    a("--num-experts", type=int, default=None,
      help="MoE MLPs with this many experts in every layer (stack, gpt, moe)")
    a("--moe-router-topk", type=int, default=2, help="experts per token")
    a("--moe-ffn-hidden-size", type=int, default=None,
      help="each expert's hidden size [default: 4 x hidden]")
    a("--moe-aux-loss-coeff", type=float, default=0.01, help="load-balancing loss weight")
    a("--moe-router-force-load-balancing", action="store_true",
      help="route by random scores (even loads on average) instead of the router's")


def _measurement_flags(a: Callable[..., Any]) -> None:
    """What is measured, how often, on what."""
    a("--modes", default=None,
      help=f"comma-separated modes: {GRAMMAR} [default: {DEFAULT_MODES}]")
    a("--steps", type=int, default=10, help="measured rounds (steps per mode)")
    a("--warmup", type=int, default=2, help="unmeasured rounds first")
    a("--threads-per-rank", type=int, default=1, help="torch / OpenMP threads per rank")
    a("--dtype", choices=tuple(DTYPES), default="fp32")
    a("--peak-tflops", type=float, default=None,
      help="MFU's denominator, TFLOP/s per rank [default: CUDA: the device's dense peak for "
           "--dtype; CPU: the rate this machine measures on the model's GEMM shapes, cached]")
    a("--compile", action="store_true",
      help="torch.compile each piece's work between its GEMMs and collectives in every mode "
           "(compiled in the warm-up steps; the compile time is reported)")
    a("--compile-backend", choices=COMPILE_BACKENDS, default="inductor",
      help="torch.compile backend of --compile (aot_eager: the same graphs, no generated code)")
    a("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
      help="the core attention's path: auto (the fastest measured on this machine at the "
           "model's shapes and dtype, cached; the report names it), or flash, math, explicit, "
           "explicit_fp32 for every mask (docs/performance.md#attention)")
    a("--seed", type=int, default=1234)
    a("--device", choices=("auto", "cpu", "cuda"), default="auto",
      help="auto: cuda when it has a GPU per rank, else cpu")


def _link_flags(a: Callable[..., Any]) -> None:
    """How the ranks talk: the emulated or simulated link, the transport, the timeout."""
    a("--emulate-link", metavar="RATE", default=None,
      help="run each rank in its own network namespace over a veth shaped to RATE "
           "(e.g. 1gbit, 100mbit); root only")
    a("--simulate-link", metavar="RATE", default=None,
      help="instead of sending data, make each all-reduce take RATE's time with no CPU cost "
           "(timing only, like nocomm): how well a schedule hides a link when moving bytes is "
           "free for the host; no root needed")
    a("--link-mtu", type=int, default=None, metavar="BYTES",
      help="MTU of the emulated link's veths (default: the veth default, 1500); e.g. 9000 for "
           "jumbo frames, which cut the host CPU each transfer costs")
    a("--no-shared-memory-comm", dest="shared_memory_comm", action="store_false",
      help="keep every collective on gloo (default on CPU: ranks on one host move their TP "
           "and EP collectives through shared memory; emulated hosts always use gloo)")
    a("--timeout", type=float, default=300.0,
      help="seconds a collective may wait for a peer before the ranks give up")


def _pipeline_flags(a: Callable[..., Any]) -> None:
    """A comparison of pipeline schedules (--pipeline-model-parallel-size > 1)."""
    a("--pipeline-micro-batches", type=int, default=None,
      help=f"pipeline micro-batches per step [default: {PIPELINE_MICRO_BATCHES}]")
    a("--schedules", default=None,
      help=f"pipeline schedules to compare [default: {DEFAULT_SCHEDULES}]")
    a("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
      help="chunk size of the interleaved schedule [default: num_layers / (2 x PP)]")
    a("--pipeline-stage-layers", default=None,
      help="uneven stages, layers per stage (e.g. 5,3; not for the interleaved schedule)")
    a("--plan", default=None, help=f"Domino plan inside each pipeline stage (or data-parallel "
      f"replica) [default: {PIPELINE_PLAN}]")


def _data_parallel_flags(a: Callable[..., Any]) -> None:
    """A comparison of data-parallel sharding strategies (--data-parallel-size D)."""
    a("--data-parallel-size", type=int, default=None, metavar="D",
      help="compare data-parallel sharding strategies instead of Domino modes: D replicas of "
           "the GPT (D x TP ranks), each strategy built as domino train builds it")
    a("--data-parallel-sharding-strategy", default=None, metavar="S[,S...]",
      help=f"the strategies to compare (Megatron-FSDP's names; docs/data-parallel.md) "
           f"[default: {DEFAULT_STRATEGIES}]")
    a("--fsdp-unit-layers", type=int, default=None,
      help="optim_grads_params: layers per unit (gathered and freed together) [default: 1]")
    a("--fsdp-prefetch", type=int, default=None,
      help="optim_grads_params: units gathered ahead of the one in use [default: 1]")
    a("--bf16", action="store_true",
      help="the data-parallel bench: bf16 compute from fp32 master weights (domino train's "
           "--bf16)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``args``; print the table and return the report. A bad
    flag raises ValueError naming the flags (a library error's config fields spelled as the
    bench's flags)."""
    with flags_in_errors(command_flags(vars(args))):
        _check_feature_flags(args)
        if args.data_parallel_size is not None:
            spec = data_parallel_spec(args)
        else:
            refuse_data_parallel_flags(args)
            if args.pipeline_model_parallel_size != 1:
                spec = pipeline_spec(args)
            else:
                spec, modes = tp_spec(args)
    _make_out_dir(args)
    if args.data_parallel_size is not None:
        result = data_parallel_report.build_report(args, spec, execute(spec))
        table = data_parallel_report.format_table(result)
    elif args.pipeline_model_parallel_size != 1:
        result = pipeline_report.build_report(args, spec, execute(spec))
        table = pipeline_report.format_table(result)
    else:
        result = report.build_report(args, spec, modes, execute(spec))
        table = report.format_table(result)
    if args.json is not None:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(table, flush=True)
    return result


def _check_feature_flags(args: argparse.Namespace) -> None:
    """Refuse the MoE flags without --num-experts and --cp-comm-type at CP 1: ignored there."""
    if args.num_experts is None:
        given = [name for name, default in MOE_DEFAULTS.items()
                 if getattr(args, name) != default]
        if given:
            names, many = ", ".join(f"--{n.replace('_', '-')}" for n in given), len(given) > 1
            it, them = ("they", "them") if many else ("it", "it")
            raise ValueError(f"{names} set{'' if many else 's'} the MoE layers, but --num-experts "
                             f"is not set (the bench's model is dense), so {it} would be "
                             f"ignored; add --num-experts N, or drop {them}")
    if args.context_parallel_size == 1 and args.cp_comm_type != "p2p":
        raise ValueError(f"--cp-comm-type {args.cp_comm_type} picks how context-parallel "
                         "attention communicates, but --context-parallel-size is 1, so it would "
                         "be ignored; add --context-parallel-size N (N > 1), or drop "
                         "--cp-comm-type")


def _make_out_dir(args: argparse.Namespace) -> None:
    if args.out_dir is not None:
        os.makedirs(args.out_dir, exist_ok=True)
