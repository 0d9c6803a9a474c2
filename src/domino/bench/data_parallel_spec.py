"""The flags of ``domino bench --data-parallel-size D`` (a comparison of data-parallel sharding
strategies) checked before any process starts, into the spec every worker rank reads.

:func:`data_parallel_spec` builds it; :func:`refuse_data_parallel_flags` refuses this path's
flags on the other paths, where they would be silently ignored. Errors name the flag and the fix.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from domino.bench.spec import (
    PIPELINE_ONLY,
    PIPELINE_PLAN,
    build_config,
    build_runtime,
    check_link,
    resolve_device,
)
from domino.flops import check_peak_tflops
from domino.plan import Plan
from domino.training.fsdp import STRATEGIES

DEFAULT_STRATEGIES = ",".join(STRATEGIES)
FSDP_UNIT_LAYERS = 1  # --fsdp-unit-layers when not given (domino train's default)
FSDP_PREFETCH = 1  # --fsdp-prefetch when not given (domino train's default)
# Flags only the data-parallel bench reads (None / False: not given).
DATA_PARALLEL_ONLY = ("data_parallel_sharding_strategy", "fsdp_unit_layers", "fsdp_prefetch",
                      "bf16")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def refuse_data_parallel_flags(args: argparse.Namespace) -> None:
    """This path's flags given without ``--data-parallel-size``: they would be ignored."""
    given = [_flag(n) for n in DATA_PARALLEL_ONLY if getattr(args, n) not in (None, False)]
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        raise ValueError(f"{', '.join(given)} {verb} only to a comparison of data-parallel "
                         "sharding strategies: add --data-parallel-size D (e.g. 2), or drop "
                         f"{'it' if len(given) == 1 else 'them'}")


def parse_strategies(text: str) -> list[str]:
    """``"no_shard, optim_grads_params"`` -> the strategies, each known and named once."""
    names = [s.strip().lower() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError(f"--data-parallel-sharding-strategy {text!r} names no strategy: give "
                         f"one or more of {DEFAULT_STRATEGIES}, comma-separated")
    for name in names:
        if name not in STRATEGIES:
            raise ValueError(f"--data-parallel-sharding-strategy: {name!r} is not one of "
                             f"{', '.join(STRATEGIES)}; e.g. --data-parallel-sharding-strategy "
                             "no_shard,optim_grads_params")
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"--data-parallel-sharding-strategy names {', '.join(twice)} more than "
                         "once: name each strategy once")
    return names


def _refuse_other_paths(args: argparse.Namespace) -> None:
    """Flags of the Domino-mode and pipeline comparisons, and what this bench does not run."""
    p = args.pipeline_model_parallel_size
    if p != 1:
        raise ValueError(f"--pipeline-model-parallel-size {p} with --data-parallel-size: the "
                         "bench compares pipeline schedules or data-parallel sharding "
                         "strategies, one at a time; drop one of them (domino train runs both)")
    piped = [_flag(n) for n in PIPELINE_ONLY if n != "plan" and getattr(args, n) is not None]
    if piped:
        raise ValueError(f"{', '.join(piped)} applies to a pipeline comparison, not to the "
                         "data-parallel bench (--data-parallel-size): drop it")
    ignored = [text for text, given in (
        (f"--modes {args.modes}", args.modes is not None),
        (f"--context-parallel-size {args.context_parallel_size}",
         args.context_parallel_size != 1),
        (f"--expert-model-parallel-size {args.expert_model_parallel_size}",
         args.expert_model_parallel_size != 1),
        (f"--num-experts {args.num_experts}", args.num_experts is not None),
        ("--model moe", args.model == "moe"),
        (f"--simulate-link {args.simulate_link}", args.simulate_link is not None),
        ("--compile", args.compile),
        (f"--out-dir {args.out_dir}", args.out_dir is not None)) if given]
    if ignored:
        raise ValueError(f"the data-parallel bench (--data-parallel-size) compares sharding "
                         f"strategies of a dense GPT at DP x TP; {', '.join(ignored)} "
                         "is not part of it: drop it (domino train runs DP with CP, MoE and "
                         "--compile; the Domino-mode comparison takes --modes, --out-dir and "
                         "--simulate-link)")
    if args.dtype != "fp32":
        raise ValueError(f"--dtype {args.dtype} with --data-parallel-size: the data-parallel "
                         "bench keeps fp32 master weights as domino train does; use --bf16 "
                         "(bf16 compute from fp32 masters) instead of --dtype bf16")


def _check_counts(args: argparse.Namespace, strategies: list[str]) -> None:
    """Sizes, counts and the units of optim_grads_params."""
    for name in ("data_parallel_size", "tensor_model_parallel_size", "steps",
                 "threads_per_rank", "num_layers", "micro_batch_size", "vocab_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"{_flag(name)}={getattr(args, name)} must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    if args.timeout <= 0:
        raise ValueError(f"--timeout={args.timeout} must be > 0")
    check_peak_tflops(args.peak_tflops)
    d = args.data_parallel_size
    sharded = [s for s in strategies if s != "no_shard"]
    if d < 2 and sharded:
        raise ValueError(f"--data-parallel-sharding-strategy {', '.join(sharded)} shards over "
                         f"data-parallel ranks, but --data-parallel-size is {d}: use "
                         "--data-parallel-size 2 (or more), or compare no_shard only")
    units = "optim_grads_params" in strategies
    for name, low in (("fsdp_unit_layers", 1), ("fsdp_prefetch", 0)):
        value = getattr(args, name)
        if value is not None and not units:
            raise ValueError(f"{_flag(name)} sets the units of optim_grads_params, which "
                             "--data-parallel-sharding-strategy does not name: add it, or "
                             f"drop {_flag(name)}")
        if value is not None and value < low:
            raise ValueError(f"{_flag(name)}={value} must be >= {low}")
    layers = args.fsdp_unit_layers
    if layers is not None and layers > args.num_layers:
        raise ValueError(f"--fsdp-unit-layers {layers}: between 1 and --num-layers "
                         f"({args.num_layers})")


def data_parallel_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The worker spec of a comparison of sharding strategies over ``--data-parallel-size``
    replicas of the GPT (each ``--tensor-model-parallel-size`` ranks, one emulated host per
    replica with ``--emulate-link``)."""
    _refuse_other_paths(args)
    strategies = parse_strategies(args.data_parallel_sharding_strategy or DEFAULT_STRATEGIES)
    _check_counts(args, strategies)
    plan = Plan.parse(args.plan or PIPELINE_PLAN)
    d, tp = args.data_parallel_size, args.tensor_model_parallel_size
    spec: dict[str, Any] = {
        k: getattr(args, k) for k in (
            "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
            "vocab_size", "tensor_model_parallel_size", "data_parallel_size", "steps", "warmup",
            "threads_per_rank", "dtype", "seed", "timeout", "recompute_granularity",
            "attention_dropout", "shared_memory_comm", "peak_tflops", "swiglu",
            "attention_backend", "bf16")}
    spec.update(kind="data_parallel", model="gpt", strategies=strategies, plan=str(plan),
                fsdp_unit_layers=args.fsdp_unit_layers or FSDP_UNIT_LAYERS,
                fsdp_prefetch=FSDP_PREFETCH if args.fsdp_prefetch is None else args.fsdp_prefetch,
                world_size=d * tp, ranks_per_host=tp, hosts=d, trace=False)
    build_config(spec).validate_parallel(tp)
    build_runtime(spec, plan)  # (its checks)
    plan.check_fits(args.micro_batch_size, what=f"--plan {plan}",
                    batch_name="--micro-batch-size")
    spec["device"] = resolve_device(args.device, d * tp)
    if args.emulate_link is not None and d < 2:
        raise ValueError("--emulate-link puts each data-parallel replica on its own emulated "
                         f"host: it needs --data-parallel-size >= 2 (is {d})")
    check_link(args, spec, hosts=d)
    if args.json is not None:
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            raise ValueError(f"--json {args.json}: directory {parent} does not exist")
    return spec
