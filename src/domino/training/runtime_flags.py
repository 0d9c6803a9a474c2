"""`domino train`'s run-time flags, derived from :class:`~domino.runtime.RuntimeConfig`'s fields
(as :mod:`~domino.training.model_flags` derives the model flags from TransformerConfig's).

Each field of the run-time config is one of:

* a flag of the same name (:data:`SAME_NAMED`: ``--sequence-parallel``, ``--compile``, ...):
  type, default and choices from the field; the table gives the flag's group and help (a
  command's wording, where the field's help is the library's);
* set through other flags (:data:`FROM_FLAGS`: the plan from Megatron-style ``--domino-*``
  flags, the compute dtype from ``--bf16`` / ``--fp16``, which also choose the optimiser's
  precision and so sit with the training flags).

:func:`runtime_fields` makes the flags, :func:`runtime_config` the config they describe; a
RuntimeConfig field missing here stops the import.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from domino.plan import Plan
from domino.runtime import SEED_SPELLING, RuntimeConfig
from domino.training.model_flags import Flag

# Same-named flags: field -> (help group, the flag's help).
SAME_NAMED: dict[str, tuple[str, str]] = {
    "recompute_granularity": (
        "model", "Activation recomputation: full (every layer's pieces are rerun in backward "
        "from their inputs) or selective (the core attention only); saves memory for compute."),
    "compile": (
        "model", "torch.compile each piece's work between its GEMMs and collectives (norms, "
        "dropout, residuals, RoPE, attention, activations; never across a collective, so the "
        "Domino overlap stays). Compiling costs tens of seconds at start (reported once); "
        "docs/compile.md says when it pays."),
    "attention_backend": (
        "model", "The core attention's path: auto (the fastest measured on this machine at the "
        "run's shapes, dtype and masks, once per machine, torch version and threads; cached in "
        "$DOMINO_CACHE_DIR and printed at start), or flash, math, explicit, explicit_fp32 for "
        "every mask (docs/performance.md#attention). Dropout, a soft-cap and sinks always run "
        "an explicit one."),
    "compile_backend": (
        "model", "torch.compile backend of --compile: inductor (fused generated code; a C++ "
        "compiler on CPU, Triton on CUDA) or aot_eager (the same graphs, no generated code)."),
    "cp_comm_type": (
        "parallel", "Context-parallel attention: p2p (K/V blocks passed around a ring, each "
        "transfer under the previous block's compute), all_gather (K/V gathered once) or a2a "
        "(Ulysses: all-to-all by heads; heads divisible by TP x CP)."),
    "sequence_parallel": (
        "parallel", "With TP > 1: norms, dropout and residuals on each TP rank's 1/TP of the "
        "sequence (activation memory of those parts / TP); the TP all-reduces become "
        "reduce-scatters and all-gathers, which the Domino schedule overlaps the same way. "
        "Needs --seq-length divisible by TP."),
}


@dataclass(frozen=True)
class FromFlags:
    """A run-time field set through other flags: ``flags`` (declared here; none: declared with
    the other settings) and ``to_field(args)``."""

    flags: tuple[Flag, ...]
    to_field: Callable[[Any], Any]
    label: str  # how a message names the setting


def _seed_flag(name: str) -> Flag:
    default, help_ = SEED_SPELLING[name]
    return Flag(name, type(default), default, help_)


FROM_FLAGS: dict[str, FromFlags] = {
    "plan": FromFlags(
        tuple(_seed_flag(f"domino_{n}") for n in ("micro_batches", "overlap", "column_chunks")),
        lambda a: Plan(a.domino_micro_batches, a.domino_overlap, a.domino_column_chunks),
        "the Domino plan (--domino-micro-batches, --domino-overlap, --domino-column-chunks)"),
    "compute_dtype": FromFlags((), lambda a: a.compute_dtype(), "the precision (--bf16, --fp16)"),
    # Measured at start (Trainer), where the ranks and the shapes are known.
    "attention_measured": FromFlags((), lambda a: None, "the measured attention paths "
                                    "(--attention-backend auto)"),
}

_RUNTIME_FIELDS = {f.name: f for f in dataclasses.fields(RuntimeConfig)}
_RUNTIME_TYPES = typing.get_type_hints(RuntimeConfig)


def runtime_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """The run-time flags as ``dataclasses.make_dataclass`` fields: the plan's flags, then the
    same-named fields in :data:`SAME_NAMED`'s order."""
    out = [(x.name, x.kind, _field(x.default, "model", x.help, None))
           for x in FROM_FLAGS["plan"].flags]
    for name, (group, help_) in SAME_NAMED.items():
        f = _RUNTIME_FIELDS[name]
        out.append((name, _RUNTIME_TYPES[name],
                    _field(f.default, group, help_, f.metadata.get("choices"))))
    return out


def _field(default: Any, group: str, help_: str, choices: tuple[str, ...] | None) -> Any:
    return dataclasses.field(default=default,
                             metadata={"help": help_, "group": group, "choices": choices})


def runtime_config(args: Any) -> RuntimeConfig:
    """The RuntimeConfig the run-time flags of ``args`` describe."""
    values = {name: getattr(args, name) for name in SAME_NAMED}
    values.update({name: f.to_field(args) for name, f in FROM_FLAGS.items()})
    return RuntimeConfig(**values)


def _check_table() -> None:
    covered = set(SAME_NAMED) | set(FROM_FLAGS)
    if covered != set(_RUNTIME_FIELDS):  # a field added to or removed from RuntimeConfig
        raise RuntimeError(f"runtime_flags is out of step with RuntimeConfig: missing "
                           f"{sorted(set(_RUNTIME_FIELDS) - covered)}, stale "
                           f"{sorted(covered - set(_RUNTIME_FIELDS))}")


_check_table()
