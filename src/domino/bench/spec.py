"""What a benchmark run measures, checked before any process starts: the ``domino bench`` flags
become the *spec* (a JSON-able dict) every worker rank reads.

:func:`tp_spec` for a comparison of Domino modes, :func:`pipeline_spec` for one of pipeline
schedules; both raise ValueError with a message that names the flag to change.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from domino.bench.modes import DEFAULT_MODES, Mode, parse_modes
from domino.config import TransformerConfig
from domino.context_parallel import check_context_parallel
from domino.flops import check_peak_tflops
from domino.netem import check_can_emulate, parse_rate
from domino.parallel_dims import SIZED
from domino.pipeline.partition import Layout, partition
from domino.pipeline.schedules import check_schedule
from domino.plan import Plan
from domino.runtime import CP_COMM_TYPES, DEFAULT_PLAN, RuntimeConfig, check_compile
from domino.transformer.attention_paths import AttentionShapes, measured_choice

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_SCHEDULES = "gpipe,1f1b,interleaved,zero_bubble"
PIPELINE_MICRO_BATCHES = 8  # --pipeline-micro-batches when not given
PIPELINE_PLAN = "m2:cross"  # --plan when not given

# The parallel sizes the bench has flags for (domino.parallel_dims).
_SIZES = tuple(str(d.size_field) for d in SIZED if d.bench_help is not None)
# Flags only a pipeline comparison reads: given without one they would be silently ignored.
PIPELINE_ONLY = ("pipeline_micro_batches", "schedules", "num_layers_per_virtual_pipeline_stage",
                 "pipeline_stage_layers", "plan")


def build_config(spec: dict[str, Any]) -> TransformerConfig:
    """The model config a spec describes (raises ValueError for a bad combination)."""
    return TransformerConfig(
        num_layers=spec["num_layers"],
        hidden_size=spec["hidden_size"],
        num_attention_heads=spec["num_attention_heads"],
        seq_length=spec["seq_length"],
        max_position_embeddings=spec["seq_length"],
        vocab_size=spec["vocab_size"] if spec["model"] == "gpt" else 0,
        # No dropout by default: its masks would only add noise that differs between modes.
        hidden_dropout=0.0,
        attention_dropout=spec.get("attention_dropout") or 0.0,
        params_dtype=DTYPES[spec["dtype"]],
        activation="swiglu" if spec.get("swiglu") else "gelu",
        **({} if not spec.get("num_experts") else dict(
            num_experts=spec["num_experts"], moe_router_topk=spec["moe_router_topk"],
            moe_ffn_hidden_size=spec.get("moe_ffn_hidden_size"),
            moe_aux_loss_coeff=spec.get("moe_aux_loss_coeff", 0.0),
            moe_router_force_load_balancing=bool(spec.get("moe_router_force_load_balancing")))),
    )


def build_runtime(spec: dict[str, Any], plan: Plan = DEFAULT_PLAN) -> RuntimeConfig:
    """How the spec's model runs (the modes then swap the plan and sequence parallelism)."""
    return RuntimeConfig(plan=plan, recompute_granularity=spec.get("recompute_granularity"),
                         compile=bool(spec.get("compile")),
                         compile_backend=spec.get("compile_backend", "inductor"),
                         cp_comm_type=spec.get("cp_comm_type", "p2p"),
                         attention_backend=spec.get("attention_backend", "auto"),
                         attention_measured=spec.get("attention"))


def with_attention(spec: dict[str, Any], state: Any) -> dict[str, Any]:
    """``spec`` with its attention paths (``"attention"``, what :func:`build_runtime` passes
    on): ``--attention-backend auto`` measured by every rank of ``state`` at once, at the
    unsplit micro-batch; a fixed backend, context parallelism (the ring's own kernels) or
    ``--model moe`` (no attention runs) measures nothing."""
    if (spec.get("attention_backend", "auto") != "auto" or state.cp.size > 1
            or spec.get("model") == "moe"):
        return spec
    config = build_config({**spec, "model": "gpt"})  # (the pipeline bench's spec has no model)
    shapes = AttentionShapes.of_run(config, spec["micro_batch_size"], state.tp.size, 1,
                                    config.params_dtype, state.device)
    return {**spec, "attention": measured_choice(shapes, state.world)}


def compiled_runtime(spec: dict[str, Any]) -> RuntimeConfig:
    """The runtime of the compiled twin that ``:compiled`` modes run."""
    return build_runtime(spec).replace(compile=True)


def layouts(spec: dict[str, Any]) -> dict[str, Layout]:
    """Each pipeline schedule's layout (interleaved: chunks of ``layers_per_virtual_stage``)."""
    out = {}
    counts = spec.get("stage_layers")
    for schedule in spec["schedules"]:
        per = spec["layers_per_virtual_stage"] if schedule == "interleaved" else None
        layout = partition(spec["num_layers"], spec["pipeline_model_parallel_size"], per,
                           None if per or counts is None else tuple(counts))
        check_schedule(schedule, layout.stages, spec["pipeline_micro_batches"], layout.chunks)
        out[schedule] = layout
    return out


def resolve_device(choice: str, world: int) -> str:
    """``--device`` (auto, cpu or cuda) for ``world`` ranks: cuda needs a GPU per rank."""
    have = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if choice == "cuda" and not have:
        raise ValueError(f"--device cuda needs {world} visible CUDA devices (one per rank); "
                         "use --device cpu")
    return "cuda" if choice == "cuda" or (choice == "auto" and have) else "cpu"


def check_link(args: argparse.Namespace, spec: dict[str, Any], hosts: int) -> None:
    """``--emulate-link`` / ``--link-mtu`` into ``spec`` (``hosts`` emulated hosts)."""
    if args.link_mtu is not None and args.emulate_link is None:
        raise ValueError("--link-mtu sets the emulated link's MTU: add --emulate-link RATE")
    if args.emulate_link is not None:
        spec["link"] = parse_rate(args.emulate_link)
        if args.link_mtu is not None:
            if not 1280 <= args.link_mtu <= 65535:
                raise ValueError(f"--link-mtu={args.link_mtu} must be in [1280, 65535] (1500 is "
                                 "Ethernet's, 9000 jumbo frames)")
            spec["link_mtu"] = args.link_mtu
        if hosts < 2:
            raise ValueError("--emulate-link needs two or more hosts: --tensor-model-parallel-"
                             "size, --context-parallel-size or --expert-model-parallel-size >= 2 "
                             "(one host per rank), or a pipeline (one per stage)")
        if spec["device"] != "cpu":
            raise ValueError("--emulate-link shapes gloo's TCP traffic; use it with --device cpu")
        try:
            check_can_emulate()
        except RuntimeError as err:
            raise ValueError(str(err)) from err  # a set-up problem: report it like bad flags


def _check_modes(modes: list[Mode], args: argparse.Namespace) -> None:
    for mode in modes:
        mode.plan.check_fits(args.micro_batch_size, what=f"the micro-batches (m<N>) of {mode.name}",
                             batch_name="--micro-batch-size")
        mode.plan.check_width(args.hidden_size, what=f"the column chunks (c<K>) of {mode.name}",
                              width_name="--hidden-size")
        tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
        if mode.sequence_parallel and (args.seq_length // cp) % tp:
            each = "" if cp == 1 else f" (each CP rank's {args.seq_length // cp} tokens)"
            raise ValueError(f"{mode.name} splits the sequence{each} over the {tp} TP ranks: "
                             f"--seq-length={args.seq_length} is not divisible by {tp * cp}; "
                             f"use a multiple of {tp * cp} or drop the :sp modes.")


def _check_at_least_one(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")


def tp_spec(args: argparse.Namespace) -> tuple[dict[str, Any], list[Mode]]:
    """The worker spec of a comparison of Domino modes (TP ranks only), and its modes."""
    _refuse_pipeline_flags(args)
    modes = _modes(args)
    _check_run_flags(args)
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    cp = _check_context_parallel(args)
    world = tp * cp * ep
    spec: dict[str, Any] = {
        k: getattr(args, k) for k in (
            "model", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
            "micro_batch_size", "vocab_size", "tensor_model_parallel_size", "steps", "warmup",
            "threads_per_rank", "dtype", "seed", "timeout", "recompute_granularity",
            "attention_dropout", "shared_memory_comm", "peak_tflops", "compile",
            "compile_backend", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
            "moe_aux_loss_coeff", "moe_router_force_load_balancing", "swiglu",
            "attention_backend")}
    _check_moe(args)
    spec.update(expert_model_parallel_size=ep, context_parallel_size=cp,
                cp_comm_type=args.cp_comm_type, world_size=world, hosts=world)
    build_config(spec).validate_parallel(tp)
    build_runtime(spec)  # (its checks)
    _check_modes(modes, args)
    spec["modes"] = [m.name for m in modes]
    spec["device"] = resolve_device(args.device, world)
    _check_compile(args, spec["device"], modes)
    spec["trace"] = args.out_dir is not None
    _check_simulated_link(args, spec)
    check_link(args, spec, hosts=world)
    if args.json is not None:
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            raise ValueError(f"--json {args.json}: directory {parent} does not exist")
    return spec, modes


def _refuse_pipeline_flags(args: argparse.Namespace) -> None:
    """The flags only a pipeline comparison reads (they would be silently ignored)."""
    given = [f"--{n.replace('_', '-')}" for n in PIPELINE_ONLY if getattr(args, n) is not None]
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        raise ValueError(f"{', '.join(given)} {verb} only to a pipeline comparison: add "
                         "--pipeline-model-parallel-size 2 (or more), or drop them (the Domino "
                         "modes to compare are chosen with --modes)")


def _modes(args: argparse.Namespace) -> list[Mode]:
    """The modes to compare (MoE at TP > 1: sequence parallel ones, by default)."""
    moe_sp = args.num_experts is not None and args.tensor_model_parallel_size > 1
    if args.modes is None and moe_sp:  # MoE at TP > 1 runs sequence parallel
        args.modes = ",".join(f"{m}:sp" for m in DEFAULT_MODES.split(","))
    modes = parse_modes(args.modes if args.modes is not None else DEFAULT_MODES)
    plain = [m.name for m in modes if not m.sequence_parallel]
    if moe_sp and plain:
        raise ValueError(
            f"--num-experts at --tensor-model-parallel-size {args.tensor_model_parallel_size} "
            f"trains with sequence parallelism (each TP rank routes its own tokens): the modes "
            f"{', '.join(plain)} lack it; end them in ':sp' (e.g. sync:sp,nocomm:sp,"
            "domino:m2:cross:sp)")
    if args.compile and any(m.compiled for m in modes):
        raise ValueError("--compile runs every mode on the compiled model; ':compiled' modes "
                         "run a compiled twin beside the eager one: drop one or the other")
    return modes


def _check_run_flags(args: argparse.Namespace) -> None:
    """Counts, sizes and rates that must be positive."""
    _check_at_least_one(args, ("steps", "threads_per_rank", *_SIZES))
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    if args.timeout <= 0:
        raise ValueError(f"--timeout={args.timeout} must be > 0")
    check_peak_tflops(args.peak_tflops)
    if args.model == "gpt" and args.vocab_size < 1:
        raise ValueError(f"--vocab-size={args.vocab_size} must be >= 1 for --model gpt")


def _check_simulated_link(args: argparse.Namespace, spec: dict[str, Any]) -> None:
    """``--simulate-link`` into ``spec``: TP all-reduces and EP all-to-alls only."""
    if args.simulate_link is None:
        return
    if args.emulate_link is not None:
        raise ValueError("--simulate-link and --emulate-link exclude each other: simulate a "
                         "CPU-free link or emulate a real one, not both")
    spec["simulate_link"] = parse_rate(args.simulate_link)
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    if (tp < 2 and ep < 2) or args.context_parallel_size > 1:
        raise ValueError("--simulate-link times TP all-reduces and expert-parallel "
                         "all-to-alls: it needs --tensor-model-parallel-size >= 2 or "
                         "--expert-model-parallel-size >= 2, and no context parallelism "
                         "(use --emulate-link for the CP ring)")


def _check_context_parallel(args: argparse.Namespace) -> int:
    """The context-parallel flags fit the rest (what ``domino train`` checks too); the CP size."""
    cp = args.context_parallel_size
    if cp == 1:
        return cp
    if args.num_experts is not None or args.model == "moe":
        raise ValueError(f"--context-parallel-size {cp} with MoE layers: the bench measures "
                         "context parallelism and MoE in separate comparisons (domino train "
                         "runs them together): drop --num-experts / --model moe, or use "
                         "--context-parallel-size 1")
    check_context_parallel(seq_length=args.seq_length, context_parallel_size=cp,
                           num_attention_heads=args.num_attention_heads,
                           attention_dropout=args.attention_dropout or 0.0,
                           kind=CP_COMM_TYPES[args.cp_comm_type],
                           tensor_model_parallel_size=args.tensor_model_parallel_size)
    return cp


def _check_moe(args: argparse.Namespace) -> None:
    """The MoE flags fit together (the model config checks the rest)."""
    ep, experts = args.expert_model_parallel_size, args.num_experts
    if experts is None:
        if args.model == "moe" or ep > 1:
            what = "--model moe" if args.model == "moe" else f"--expert-model-parallel-size {ep}"
            raise ValueError(f"{what} needs MoE layers: add --num-experts N")
        return
    if experts % ep:
        raise ValueError(f"--num-experts {experts} is not divisible by "
                         f"--expert-model-parallel-size {ep}: each EP rank holds an equal "
                         "share of the experts; pick a multiple of EP")


def _check_compile(args: argparse.Namespace, device: str,
                   modes: list[Mode] | None = None) -> None:
    wanted = args.compile or any(m.compiled for m in modes or [])
    what = "--compile" if args.compile or not modes else "a :compiled mode"
    check_compile(wanted, args.compile_backend, device, what)


def pipeline_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The worker spec of a comparison of pipeline schedules; fills in the defaults of
    ``--pipeline-micro-batches`` and ``--plan`` on ``args``."""
    if args.modes is not None:
        raise ValueError("--modes picks the Domino modes of a TP comparison; a pipeline "
                         "comparison (--pipeline-model-parallel-size > 1) compares --schedules "
                         "with one --plan inside each stage: drop --modes")
    check_peak_tflops(args.peak_tflops)
    if args.pipeline_micro_batches is None:
        args.pipeline_micro_batches = PIPELINE_MICRO_BATCHES
    if args.plan is None:
        args.plan = PIPELINE_PLAN
    plan = Plan.parse(args.plan)
    p, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    _check_at_least_one(args, ("pipeline_micro_batches", "steps", "threads_per_rank", *_SIZES))
    if args.simulate_link is not None:
        raise ValueError("--simulate-link times TP all-reduces; the pipeline bench runs on "
                         "loopback or --emulate-link")
    ignored = [f"{flag} {value}" for flag, value, given in (
        ("--context-parallel-size", args.context_parallel_size, args.context_parallel_size != 1),
        ("--expert-model-parallel-size", args.expert_model_parallel_size,
         args.expert_model_parallel_size != 1),
        ("--num-experts", args.num_experts, args.num_experts is not None),
        ("--model", args.model, args.model == "moe")) if given]
    if ignored:  # they would be silently ignored: the pipeline bench builds a dense GPT
        raise ValueError(f"the pipeline bench (--pipeline-model-parallel-size {p}) compares "
                         f"schedules of a dense GPT at TP x PP; {', '.join(ignored)} is not "
                         "part of it: drop it (domino train runs PP with CP or MoE), or drop "
                         "--pipeline-model-parallel-size for a comparison of Domino modes")
    schedules = [s.strip() for s in (args.schedules or DEFAULT_SCHEDULES).split(",") if s.strip()]
    per = args.num_layers_per_virtual_pipeline_stage
    if per is None and "interleaved" in schedules:
        if args.num_layers % (2 * p):
            raise ValueError(f"the interleaved schedule needs --num-layers as a multiple of 2 x "
                             f"PP = {2 * p} (two chunks per stage), or "
                             "--num-layers-per-virtual-pipeline-stage; or drop it from "
                             "--schedules")
        per = args.num_layers // (2 * p)
    spec: dict[str, Any] = {
        k: getattr(args, k) for k in (
            "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
            "vocab_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "pipeline_micro_batches", "steps", "warmup", "threads_per_rank", "dtype", "seed",
            "timeout", "plan", "shared_memory_comm", "peak_tflops", "compile",
            "compile_backend", "attention_backend")}
    counts = None
    if args.pipeline_stage_layers:
        try:
            counts = [int(x) for x in args.pipeline_stage_layers.split(",")]
        except ValueError:
            raise ValueError(f"--pipeline-stage-layers={args.pipeline_stage_layers!r} must be "
                             "comma-separated layer counts, e.g. 5,3") from None
    spec.update(kind="pipeline", model="gpt", schedules=schedules, layers_per_virtual_stage=per,
                stage_layers=counts,
                world_size=p * tp, ranks_per_host=tp, hosts=p, trace=args.out_dir is not None)
    build_config(spec).validate_parallel(tp)
    build_runtime(spec)  # (its checks)
    plan.check_fits(args.micro_batch_size, what=f"--plan {args.plan}",
                    batch_name="--micro-batch-size")
    layouts(spec)  # every schedule fits the layers and pipeline micro-batches
    spec["device"] = resolve_device(args.device, p * tp)
    _check_compile(args, spec["device"])
    check_link(args, spec, hosts=p)
    return spec
