"""Where a parameter lives: one :class:`Placement` record per parameter.

The record says which group shards the parameter (and how), and which group reduces its
gradient. Gradient reduction (``training.grad_sync``), the distributed optimizer, the global
gradient norm, clipping and checkpoints read it through :func:`placement_of` instead of assuming
"TP-sharded or replicated"; groups are named as :data:`domino.parallel_state.GROUPS` names them
and looked up with ``state.group(name)``.

:func:`place` also writes Megatron's attributes (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``) for code written against Megatron, and :func:`placement_of` reads a
parameter tagged only with those (by hand, Megatron's way) as TP-sharded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from domino.tensor_parallel.comm import CommGroup

# Groups that may shard a parameter (``ep`` for expert weights, once expert parallelism lands)
# and groups that may reduce a gradient (DP x CP for dense weights, expert-DP for experts).
SHARD_GROUPS = ("tp", "ep")
GRAD_GROUPS = ("dp_cp", "expert_dp")
# The global gradient norm sums over these groups: between them they hold every distinct part
# of the model once gradients are reduced (pp: each stage its own parameters). CP needs no sum:
# its ranks are inside DP x CP, so they hold equal dense gradients; likewise EP is cut out of
# DP x CP (the mesh builder), so dense gradients are equal over EP and count on EP rank 0.
NORM_GROUPS = ("tp", "pp", "ep")
# Norm groups that lie inside a gradient group (see above): a sum over the gradient group (the
# distributed optimizer's chunks) already spans their ranks.
# (Expert-DP spans the TP ranks too: experts are whole on a rank, replicated over TP.)
WITHIN = {"dp_cp": ("ep",), "expert_dp": ("tp",)}


@dataclass(frozen=True)
class Placement:
    """How one parameter is laid out over the parallel groups."""

    shard: str | None = None
    """The group sharding it (``"tp"``; later ``"ep"``), or None: replicated."""
    dim: int = 0
    """The dimension it is cut along (when sharded)."""
    stride: int = 1
    """The dimension is ``stride`` equal blocks, each cut over the group (SwiGLU's [gate; up])."""
    rows: int | None = None
    """Vocabulary tables: the rows along ``dim`` that are real; the rest is padding, whose amount
    depends on the TP size (checkpoints reshard it, comparisons cut it off)."""
    grad_group: str = "dp_cp"
    """The group its gradient is summed over (``"dp_cp"`` dense, ``"expert_dp"`` experts)."""
    tp_partial_grad: bool = False
    """Replicated, but each TP rank computes only its share of the gradient (a LoRA factor
    meeting a TP-split gradient: ``tensor_parallel.lora``): the stack's backward sums it over
    TP (``transformer.sp_grads.ShardGrads``) before it is reduced over ``grad_group``."""
    tied_copy: bool = False
    """A copy of a weight held elsewhere (a pipeline's last-stage word table, tied to the
    first stage's): its gradient is summed with the original's over the embedding group, and the
    norm, the parameter count and checkpoints count the original only."""

    def __post_init__(self) -> None:
        if self.shard is not None and self.shard not in SHARD_GROUPS:
            raise ValueError(f"Placement(shard={self.shard!r}): a parameter is sharded over one "
                             f"of {', '.join(SHARD_GROUPS)} or None (replicated)")
        if self.grad_group not in GRAD_GROUPS:
            raise ValueError(f"Placement(grad_group={self.grad_group!r}): gradients are reduced "
                             f"over one of {', '.join(GRAD_GROUPS)}")
        if self.stride < 1:
            raise ValueError(f"Placement(stride={self.stride}) must be at least 1")


REPLICATED = Placement()


def place(param: Any, placement: Placement) -> None:
    """Give ``param`` its placement record (and Megatron's attributes for it)."""
    param.placement = placement
    param.tensor_model_parallel = placement.shard == "tp"
    param.partition_dim = placement.dim if placement.shard == "tp" else -1
    param.partition_stride = placement.stride


def placement_of(param: Any) -> Placement:
    """``param``'s record; without one, a tensor tagged Megatron's way (``tensor_model_parallel``)
    is TP-sharded, anything else replicated with its gradient reduced over DP x CP."""
    record = getattr(param, "placement", None)
    if isinstance(record, Placement):
        return record
    if getattr(param, "tensor_model_parallel", False):
        return Placement("tp", int(param.partition_dim), int(getattr(param, "partition_stride", 1)))
    return REPLICATED


class NamedGroups(Protocol):
    """What the readers need of a parallel state: its groups by name (``ParallelState``)."""

    def group(self, name: str) -> CommGroup: ...


def counts_in_norm(placement: Placement, state: NamedGroups,
                   skip: tuple[str, ...] = ()) -> bool:
    """Whether this rank adds the parameter's reduced gradient to the global norm, so that each
    element counts once over :data:`NORM_GROUPS`: always when a group shards it, else only on
    rank 0 of every norm group replicating it (TP rank 0 for a TP-replicated norm weight).
    ``skip``: groups to leave out of that test (already spanned by a sum over them)."""
    if placement.tied_copy:
        return False
    return all(state.group(name).rank == 0 for name in NORM_GROUPS
               if name not in (placement.shard, "pp", *skip))


def sum_over_norm_groups(total: Any, state: NamedGroups) -> None:
    """Sum a rank's part of the squared norm over :data:`NORM_GROUPS` (in place)."""
    for name in NORM_GROUPS:
        group = state.group(name)
        if group.size > 1:
            group.all_reduce(total, name="grad norm")
