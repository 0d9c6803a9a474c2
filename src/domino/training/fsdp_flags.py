"""`domino train`'s sharded data-parallel flags (``--data-parallel-sharding-strategy`` and the
units of ``optim_grads_params``) and the strategy a run resolves to (``training.fsdp``)."""

from __future__ import annotations

from dataclasses import field
from typing import Any

from domino.training.fsdp import STRATEGIES


def _f(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "group": "parallel",
                                            "choices": choices})


def fsdp_fields() -> list[tuple[str, type, Any]]:
    """The flags, as ``dataclasses.make_dataclass`` fields."""
    return [
        ("data_parallel_sharding_strategy", str | None, _f(
            None, "What is sharded over data parallelism (Megatron-FSDP's names): no_shard; "
            "optim (optimizer state and fp32 masters: ZeRO-1, what "
            "--use-distributed-optimizer means); optim_grads (and the gradients, "
            "reduce-scattered as each bucket is final: ZeRO-2); optim_grads_params (and the "
            "layers' parameters, gathered just ahead of use: ZeRO-3). docs/data-parallel.md. "
            "[default: optim with --use-distributed-optimizer, else no_shard]",
            STRATEGIES)),
        ("data_parallel_shard_size", int | None, _f(
            None, "HSDP: shard over groups of this many data-parallel ranks (x CP) and "
            "replicate across the groups, the gradients' chunks summed over the replicas; for "
            "many nodes: the shard group within a node; with experts a multiple of "
            "--expert-model-parallel-size. [default: all of DP x CP]")),
        ("fsdp_unit_layers", int, _f(
            1, "optim_grads_params: layers per unit (gathered and freed together).")),
        ("fsdp_prefetch", int, _f(
            1, "optim_grads_params: units gathered ahead of the one in use (0: gathered "
            "where first used).")),
        ("fsdp_reshard_after_forward", bool, _f(
            True, "optim_grads_params: free each unit after its forward and gather it again "
            "for the backward (off: kept from the forward to its backward; under a pipeline, "
            "from the step's first forward to its last backward: one gather per step).")),
    ]


def strategy(args: Any) -> str:
    """The run's sharding strategy; ValueError naming the flags where they contradict each
    other or the run."""
    chosen = args.data_parallel_sharding_strategy
    if chosen is None:
        chosen = "optim" if args.use_distributed_optimizer else "no_shard"
    if chosen == "no_shard" and args.use_distributed_optimizer:
        raise ValueError("--data-parallel-sharding-strategy no_shard contradicts "
                         "--use-distributed-optimizer (which shards the optimizer: optim); "
                         "drop one of them")
    if args.data_parallel_shard_size is not None:
        if chosen == "no_shard":
            raise ValueError(f"--data-parallel-shard-size {args.data_parallel_shard_size} "
                             "shards within groups of data-parallel ranks: add "
                             "--data-parallel-sharding-strategy optim, optim_grads or "
                             "optim_grads_params")
    if chosen == "optim_grads_params":
        if args.fsdp_unit_layers < 1 or args.fsdp_unit_layers > args.num_layers:
            raise ValueError(f"--fsdp-unit-layers {args.fsdp_unit_layers}: between 1 and "
                             f"--num-layers ({args.num_layers})")
        if args.fsdp_prefetch < 0:
            raise ValueError(f"--fsdp-prefetch {args.fsdp_prefetch}: 0 or more units")
    return chosen


def check(args: Any, dp: int) -> str:
    """Before any process starts: :func:`strategy`, and an HSDP shard size that divides the
    DP x CP ranks (``dp``: the run's data-parallel size) and, with experts, is a multiple of
    EP (every shard group holds whole EP groups: ``fsdp.hybrid_rank_lists``)."""
    chosen = strategy(args)
    size, shard = dp * args.context_parallel_size, args.data_parallel_shard_size
    ep = args.expert_model_parallel_size
    if shard is not None and ep > 1 and shard % ep:
        fits = [k for k in range(ep, size + 1, ep) if size % k == 0]
        raise ValueError(f"--data-parallel-shard-size {shard} with --expert-model-parallel-size "
                         f"{ep}: the shard size must be a multiple of EP (each shard group "
                         f"holds whole EP groups); use {' or '.join(map(str, fits))}")
    if shard is not None and (shard < 1 or size % shard):
        raise ValueError(f"--data-parallel-shard-size {shard} must divide the data-parallel "
                         f"(x context-parallel) size {size}; e.g. "
                         f"{max(d for d in range(1, size + 1) if size % d == 0 and d < size)}"
                         if size > 1 else f"--data-parallel-shard-size {shard}: this run has "
                         "one data-parallel rank; drop it")
    return chosen
