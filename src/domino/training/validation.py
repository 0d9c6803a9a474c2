"""`domino train`'s feature flags checked before any process starts, named as flags.

A flag of a feature the run does not use would be silently ignored, so it is refused: an MoE
flag without ``--num-experts``, an MoE option whose own switch is off (the shared expert's gate
without a shared expert, ...), ``--cp-comm-type`` at context-parallel size 1, fp16's loss
scaling without ``--fp16``. The MoE values are checked here too, before the parallel checks that
would otherwise blame another flag (the model config repeats them in its field names for library
use).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from domino.training.arguments import TrainArgs, flag

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainArgs)}
MOE_FLAGS = tuple(name for name in _DEFAULTS if name.startswith("moe_"))
LOSS_SCALING_FLAGS = ("initial_loss_scale", "loss_scale_window")

# MoE options that act only when another one is on: (option, what it needs, the need met).
_MOE_NEEDS: tuple[tuple[str, str, Callable[[Any], bool]], ...] = (
    ("moe_shared_expert_gate", "--moe-shared-expert-intermediate-size (a shared expert to gate)",
     lambda a: a.moe_shared_expert_intermediate_size is not None),
    ("moe_token_drop_policy", "--moe-expert-capacity-factor (without a capacity no token is "
     "dropped)", lambda a: a.moe_expert_capacity_factor is not None),
    ("moe_pad_expert_input_to_capacity", "--moe-expert-capacity-factor (dropless routing has no "
     "capacity to pad to)", lambda a: a.moe_expert_capacity_factor is not None),
    ("moe_router_bias_update_rate", "--moe-router-enable-expert-bias (the bias it moves)",
     lambda a: a.moe_router_enable_expert_bias),
    ("moe_router_pre_softmax", "--moe-router-score-function softmax (sigmoid scores are never "
     "re-normalised)", lambda a: a.moe_router_score_function == "softmax"),
    ("moe_aux_loss_coeff", "--moe-router-load-balancing-type aux_loss (the loss it weights)",
     lambda a: a.moe_router_load_balancing_type == "aux_loss"),
)


def check_features(args: TrainArgs) -> None:
    """Raise ValueError (one line naming the flag and value, the rule and the fix) for a flag
    whose feature is off, or an MoE value out of range."""
    check_moe(args)
    check_cp_flags(args)
    check_loss_scaling(args)


def changed(args: TrainArgs, names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` whose value is not the default."""
    return [name for name in names if getattr(args, name) != _DEFAULTS[name]]


def shown(args: TrainArgs, name: str, sep: str = " ") -> str:
    """``--flag value`` as given (a switch: ``--flag`` / ``--no-flag``)."""
    value = getattr(args, name)
    if isinstance(value, bool):
        return f"--{flag(name)}" if value else f"--no-{flag(name)}"
    return f"--{flag(name)}{sep}{value:g}" if isinstance(value, float) else \
        f"--{flag(name)}{sep}{value}"


def check_moe(args: TrainArgs) -> None:
    experts = args.num_experts
    if experts is None:
        given = changed(args, MOE_FLAGS)
        if given:
            many = len(given) > 1
            raise ValueError(f"{', '.join(shown(args, n) for n in given)} set"
                             f"{'' if many else 's'} the MoE layers, but --num-experts is not "
                             f"set (dense MLPs only), so {'they' if many else 'it'} would be "
                             "ignored; add --num-experts N for MoE layers, or drop "
                             f"{'them' if many else '--' + flag(given[0])}")
        return
    if experts < 1:
        raise ValueError(f"--num-experts={experts} must be a positive integer (the experts of "
                         "each MoE layer); pass N >= 1, or drop --num-experts for dense MLPs")
    _check_moe_values(args)
    for name, needs, met in _MOE_NEEDS:
        if getattr(args, name) != _DEFAULTS[name] and not met(args):
            raise ValueError(f"{shown(args, name)} would be ignored: it needs {needs}; add that, "
                             f"or drop --{flag(name)}")


def _check_moe_values(args: TrainArgs) -> None:
    for name in ("moe_router_topk", "moe_layer_freq", "moe_ffn_hidden_size",
                 "moe_shared_expert_intermediate_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            absent = "" if _DEFAULTS[name] is not None else " or leave it out"
            raise ValueError(f"--{flag(name)}={value} must be a positive integer; pass one"
                             f"{absent}")
    if args.moe_router_topk > args.num_experts:
        raise ValueError(f"--moe-router-topk={args.moe_router_topk} is more than --num-experts="
                         f"{args.num_experts}; route each token to at most every expert")
    if not 0 <= args.moe_first_k_dense_layers <= args.num_layers:
        raise ValueError(f"--moe-first-k-dense-layers={args.moe_first_k_dense_layers} must be "
                         f"between 0 and --num-layers={args.num_layers}")
    for name in ("moe_router_topk_scaling_factor", "moe_expert_capacity_factor"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"{shown(args, name, '=')} must be > 0; pass a positive factor, "
                             "or leave it out")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise ValueError(f"{shown(args, name, '=')} must be >= 0; pass 0 or more")


def check_cp_flags(args: TrainArgs) -> None:
    if args.context_parallel_size == 1 and changed(args, ("cp_comm_type",)):
        raise ValueError(f"--cp-comm-type {args.cp_comm_type} picks how context-parallel "
                         "attention communicates, but --context-parallel-size is 1 (no context "
                         "parallelism), so it would be ignored; add --context-parallel-size N "
                         "(N > 1), or drop --cp-comm-type")


def check_loss_scaling(args: TrainArgs) -> None:
    bad = [n for n in LOSS_SCALING_FLAGS if (getattr(args, n) <= 0 if n == "initial_loss_scale"
                                             else getattr(args, n) < 1)]
    rule = {"initial_loss_scale": "must be > 0", "loss_scale_window": "must be >= 1"}
    if not args.fp16:
        given = changed(args, LOSS_SCALING_FLAGS)
        if given:
            name = given[0]
            run = "a --bf16 run" if args.bf16 else "an fp32 run"
            also = f" (and it {rule[name]})" if name in bad else ""
            raise ValueError(f"{shown(args, name)} sets fp16's dynamic loss scaling, which "
                             f"applies only to --fp16: {run} scales no loss, so it would be "
                             f"ignored{also}; drop --{flag(name)}, or train with --fp16")
        return
    if bad:
        raise ValueError(f"{shown(args, bad[0], '=')} {rule[bad[0]]} (fp16's "
                         "dynamic loss scaling); pass a positive value")
