"""The parallel dimensions, declared once: what each is called, the keyword and flag of its size,
where it sits in the rank mesh, and the groups derived from them.

:class:`~domino.parallel_state.ParallelSizes` (its fields and checks), the mesh and every group of
a :class:`~domino.parallel_state.ParallelState`, the parallel-size flags of ``domino train`` and
``domino bench`` (and their checks) and the messages that name a size all read :data:`DIMS` and
:data:`GROUPS`. A new dimension is an entry in each (and its own package for what it computes).

The mesh's axes, outermost first (:data:`MESH_DIMS`): PP, DP, CP, TP. TP is innermost, so a TP
group holds consecutive ranks (one host when ranks are packed per node). EP is no axis of its
own: it re-cuts the DP x CP ranks of each (PP, TP) position into expert-DP x EP, EP innermost, as
Megatron lays them out with expert tensor parallelism 1: experts are whole on a rank (replicated
over TP), so their gradients are summed over expert-DP x TP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDim:
    """One parallel dimension: a size, and the group of ranks along it.

    ``name`` is the group's (``state.tp``) and the :class:`ParallelSizes` field's; ``size_field``
    the keyword of its size (``ParallelState.build``, Megatron's name) and, dashed, the flag of
    ``domino train`` and ``domino bench``; None for DP, which is what the world leaves. A mesh
    axis has a ``mesh_axis`` (0 outermost); a dimension ``carved_from`` other axes cuts their
    ranks instead (innermost), and ``rest`` names what its cut leaves (the other axis of that
    view)."""

    name: str
    size_field: str | None
    title: str  # how a message names it: "tensor-parallel"
    mesh_axis: int | None = None
    carved_from: tuple[str, ...] = ()
    rest: str | None = None
    cli_default: int = 1  # the commands' default size (the library's is 1)
    help: str = ""  # `domino train`'s flag help
    bench_help: str | None = None  # `domino bench`'s (None: no such flag)

    @property
    def flag(self) -> str:
        """The command-line flag of its size (``--tensor-model-parallel-size``)."""
        assert self.size_field is not None, f"{self.name}'s size is derived: it has no flag"
        return "--" + self.size_field.replace("_", "-")


@dataclass(frozen=True)
class Group:
    """A group every state holds: the ranks that differ only along ``axes`` (outer first; the
    axes of the mesh, or of a carved dimension's view). ``gradients``: gradients are summed over
    it. ``shared_memory``: on CPU its bulk collectives ride the shared-memory transport when its
    ranks share a host. A hand-built state may leave a group with a ``fallback`` unset while
    the ``fallback_while`` group has one rank: it is then that group."""

    name: str
    axes: tuple[str, ...]
    label: str  # how a message names it
    gradients: bool = False
    shared_memory: bool = False
    fallback: str | None = None
    fallback_while: str | None = None


DIMS: tuple[ParallelDim, ...] = (
    ParallelDim(
        "tp", "tensor_model_parallel_size", "tensor-parallel", mesh_axis=3, cli_default=2,
        help="Tensor-parallel size (TP); DP = world size / (TP x PP x CP).",
        bench_help="TP size = number of ranks"),
    ParallelDim(
        "pp", "pipeline_model_parallel_size", "pipeline-parallel", mesh_axis=0,
        help="Pipeline-parallel size (PP): the layers are cut into this many stages.",
        bench_help="> 1: compare pipeline schedules instead of Domino modes (GPT model, one "
                   "stage per emulated host with --emulate-link)"),
    ParallelDim(
        "cp", "context_parallel_size", "context-parallel", mesh_axis=2,
        help="Context-parallel size (CP): every sequence is cut into 2 x CP chunks and CP rank r "
             "holds chunks r and 2CP-1-r (equal causal work); attention runs across the CP "
             "ranks (--cp-comm-type), dense gradients are summed over DP x CP. Needs "
             "--seq-length divisible by 2 x CP and --attention-dropout 0.",
        bench_help="CP: every sequence split over this many ranks (a head and a tail chunk "
                   "each), attention across them (the bench then runs TP x CP ranks, one "
                   "emulated host each); sync waits for each ring transfer before its block's "
                   "compute, Domino modes overlap it"),
    ParallelDim(
        "ep", "expert_model_parallel_size", "expert-parallel", carved_from=("dp", "cp"),
        rest="edp",
        help="Expert-parallel size (EP): each MoE layer's experts split over this many of the "
             "data-parallel ranks, tokens exchanged by all-to-all (needs --num-experts).",
        bench_help="EP: the experts split over this many ranks with different tokens (the bench "
                   "then runs TP x EP ranks, one emulated host each)"),
    ParallelDim("dp", None, "data-parallel", mesh_axis=1),
)

# Every group a state holds, in the order every rank builds them (torch.distributed requires
# one order): the dimensions' own, then the derived ones.
GROUPS: tuple[Group, ...] = (
    Group("tp", ("tp",), "TP", shared_memory=True),
    Group("cp", ("cp",), "CP"),
    Group("dp", ("dp",), "DP", gradients=True, shared_memory=True),
    Group("pp", ("pp",), "PP"),
    # dense gradients are summed over DP x CP
    Group("dp_cp", ("dp", "cp"), "DP x CP", gradients=True, fallback="dp", fallback_while="cp"),
    # the MoE layers' token all-to-alls
    Group("ep", ("ep",), "EP", shared_memory=True),
    # expert gradients: over the TP ranks too (under sequence parallelism each TP rank routes
    # its own tokens to whole experts)
    Group("expert_dp", ("tp", "edp"), "expert-DP", gradients=True, fallback="dp_cp",
          fallback_while="ep"),
)

BY_NAME = {d.name: d for d in DIMS}
SIZED = tuple(d for d in DIMS if d.size_field is not None)  # the sizes a user chooses
MESH_DIMS = tuple(d.name for d in sorted((d for d in DIMS if d.mesh_axis is not None),
                                         key=lambda d: d.mesh_axis))  # outermost first


def by_size_field(name: str) -> ParallelDim:
    """The dimension whose size keyword is ``name`` (KeyError naming the keywords)."""
    for d in SIZED:
        if d.size_field == name:
            return d
    raise KeyError(f"no parallel size {name!r}; the sizes are "
                   f"{', '.join(str(d.size_field) for d in SIZED)}")


def model_dims() -> tuple[ParallelDim, ...]:
    """The chosen sizes that are mesh axes: their product is what one model replica spans."""
    return tuple(d for d in SIZED if d.mesh_axis is not None)


def check_size(d: ParallelDim, value: object) -> None:
    """ValueError unless ``value`` is a positive integer (the message names the size keyword)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{d.size_field}={value!r} must be a positive integer.")


def data_parallel_size(world_size: int, sizes: dict[str, int]) -> int:
    """What ``world_size`` ranks leave for DP at ``sizes`` (by dimension name); ValueError naming
    the sizes to change when they do not divide the world."""
    model = math.prod(sizes[d.name] for d in model_dims())
    terms = [f"{d.size_field}={sizes[d.name]}" for d in model_dims() if sizes[d.name] > 1]
    names = " x ".join(terms) + (f" = {model}" if len(terms) > 1 else "")
    if model > world_size:
        raise ValueError(f"{names} is larger than the world size {world_size}; start more "
                         "processes or lower the sizes.")
    if world_size % model:
        raise ValueError(
            f"world size {world_size} is not divisible by {names}; the data-parallel size would "
            "not be an integer: change the number of processes or the parallel sizes.")
    return world_size // model


def check_carved(sizes: dict[str, int]) -> None:
    """ValueError unless each carved dimension divides the ranks it cuts (by dimension name)."""
    for d in DIMS:
        if not d.carved_from:
            continue
        block = math.prod(sizes[n] for n in d.carved_from)
        if block % sizes[d.name]:
            titles = " x ".join(BY_NAME[n].title for n in d.carved_from)
            values = " x ".join(str(sizes[n]) for n in d.carved_from)
            raise ValueError(f"{d.size_field}={sizes[d.name]} must divide {titles} size "
                             f"{values} = {block}.")
