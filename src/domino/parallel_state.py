"""Parallel state: one object holding this rank's groups by name (TP, CP, DP, PP, EP and the
derived DP x CP and expert-DP groups), built from named sizes by one mesh builder; the sizes,
the mesh's axes and the groups are those :mod:`domino.parallel_dims` declares.

Model code receives a :class:`ParallelState` explicitly. The Megatron-style module functions
(``initialize_model_parallel``, ``get_tensor_model_parallel_world_size``, ...) for code written
against Megatron's ``mpu`` live in :mod:`domino.megatron_compat`; joining the ranks
(``init_distributed``) in :mod:`domino.distributed`.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from domino import parallel_dims
from domino.distributed import default_device
from domino.parallel_dims import BY_NAME, DIMS, SIZED, Group
from domino.parallel_dims import GROUPS as GROUP_TABLE
from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.random import RNGTracker

# The names of the groups every state holds (parallel_dims.GROUPS), in the order every rank
# builds them; the mesh's axes, outermost first.
GROUPS = tuple(g.name for g in GROUP_TABLE)
MESH_DIMS = parallel_dims.MESH_DIMS


# One int field per dimension (the table's order), default 1: ParallelSizes' fields.
_SizeFields = dataclasses.make_dataclass(
    "_SizeFields", [(d.name, int, dataclasses.field(default=1)) for d in DIMS], frozen=True)


@dataclass(frozen=True)
class ParallelSizes(_SizeFields):
    """The size of every parallel dimension of :data:`~domino.parallel_dims.DIMS` (``tp``,
    ``pp``, ``cp``, ``ep``, ``dp``); ``dp`` is what the world leaves."""

    @classmethod
    def for_world(cls, world_size: int, **sizes: int) -> ParallelSizes:
        """The sizes of a world of ``world_size`` ranks, the chosen ones by dimension name
        (``tp=2, cp=2``; ValueError naming the size keyword to change)."""
        unknown = set(sizes) - {d.name for d in SIZED}
        if unknown:
            raise TypeError(f"for_world() got unknown sizes {', '.join(sorted(unknown))}; the "
                            f"sizes are {', '.join(d.name for d in SIZED)}")
        chosen = {d.name: sizes.get(d.name, 1) for d in SIZED}
        for d in SIZED:
            parallel_dims.check_size(d, chosen[d.name])
        derived = next(d for d in DIMS if d.size_field is None)
        chosen[derived.name] = parallel_dims.data_parallel_size(world_size, chosen)
        parallel_dims.check_carved(chosen)
        return cls(**chosen)

    @classmethod
    def from_fields(cls, world_size: int, **fields: int) -> ParallelSizes:
        """:meth:`for_world` with the sizes by keyword (``tensor_model_parallel_size=2``)."""
        return cls.for_world(world_size, **{
            parallel_dims.by_size_field(k).name: v for k, v in fields.items()})

    @property
    def world(self) -> int:
        return math.prod(getattr(self, name) for name in MESH_DIMS)

    def rank_groups(self) -> dict[str, list[list[int]]]:
        """For each name of :data:`GROUPS`, the global ranks of each of its groups: the ranks
        that differ only along the group's axes, in the first view that has them (the mesh,
        then each carved dimension's)."""
        views = self._views()
        out = {}
        for g in GROUP_TABLE:
            mesh, names = next(v for v in views if set(g.axes) <= set(v[1]))
            out[g.name] = _along(mesh, names, g.axes)
        return out

    def _views(self) -> list[tuple[torch.Tensor, tuple[str, ...]]]:
        """The rank mesh (axes :data:`MESH_DIMS`), and for each carved dimension the mesh with
        the axes it cuts flattened into (``rest``, the dimension), the dimension innermost."""
        mesh = torch.arange(self.world).reshape(*(getattr(self, n) for n in MESH_DIMS))
        views = [(mesh, MESH_DIMS)]
        for d in DIMS:
            if d.carved_from:
                cut = sorted(MESH_DIMS.index(n) for n in d.carved_from)
                keep = [i for i in range(mesh.dim()) if i not in cut]
                view = mesh.permute(*keep, *cut).reshape(
                    *(mesh.shape[i] for i in keep), -1, getattr(self, d.name))
                views.append((view, (*(MESH_DIMS[i] for i in keep), str(d.rest), d.name)))
        return views


def _along(t: torch.Tensor, names: tuple[str, ...], axes: tuple[str, ...]) -> list[list[int]]:
    """The ranks of ``t`` that differ only along ``axes`` (outer first), one list per group."""
    picked = [names.index(a) for a in axes]
    rest = [a for a in range(t.dim()) if a not in picked]
    flat = t.permute(*rest, *picked).reshape(-1, math.prod(t.shape[a] for a in picked))
    return flat.tolist()


def _group_field(g: Group) -> tuple[str, Any, Any]:
    if g.fallback is not None:  # may be left unset: see ParallelState.__post_init__
        return g.name, CommGroup | None, dataclasses.field(default=None)
    return g.name, CommGroup, dataclasses.field(default_factory=CommGroup)


# One CommGroup field per group of the table, in its order: ParallelState's groups.
_GroupFields = dataclasses.make_dataclass(
    "_GroupFields", [_group_field(g) for g in GROUP_TABLE], eq=False)


@dataclass(eq=False)
class ParallelState(_GroupFields):
    """The groups of one rank, by name (:data:`GROUPS`): ``tp`` (tensor), ``cp`` (context),
    ``dp`` (data), ``pp`` (pipeline), ``dp_cp`` (DP x CP: what dense gradients are reduced
    over), ``ep`` (expert) and ``expert_dp`` (what expert gradients are reduced over); plus
    ``world`` (every rank: run-level agreement such as barriers and the autotuner's choice),
    ``embedding`` (the first and last pipeline stage of this rank's position: their tied word
    tables' gradients are summed over it), the device and the dropout RNG streams.

    A derived group left unset is its base group where they coincide (``dp_cp`` = ``dp`` while
    CP is 1, ``expert_dp`` = ``dp_cp`` while EP is 1: a hand-built state for a dense model;
    :meth:`from_sizes` gives MoE models their expert-DP x TP group at any TP size).
    """

    world: CommGroup = field(default_factory=CommGroup)
    embedding: CommGroup = field(default_factory=CommGroup)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rng: RNGTracker = field(default_factory=RNGTracker)

    def __post_init__(self) -> None:
        for g in GROUP_TABLE:  # in order: a fallback is set before the groups falling back to it
            if g.fallback is None or getattr(self, g.name) is not None:
                continue
            if getattr(self, str(g.fallback_while)).size != 1:
                kind = BY_NAME[str(g.fallback_while)].title.removesuffix("-parallel")
                raise ValueError(f"with {kind} parallelism the {g.label} group must be given")
            setattr(self, g.name, getattr(self, g.fallback))

    def group(self, name: str) -> CommGroup:
        """The group called ``name`` (one of :data:`GROUPS`, ``world`` or ``embedding``)."""
        if name not in (*GROUPS, "world", "embedding"):
            raise KeyError(f"no parallel group {name!r}; the groups are "
                           f"{', '.join((*GROUPS, 'world', 'embedding'))}")
        return getattr(self, name)

    @property
    def sizes(self) -> ParallelSizes:
        return ParallelSizes(**{d.name: self.group(d.name).size for d in DIMS})

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelState:
        """The single-process state: every group has size 1."""
        device = torch.device(device)
        names = (*(d.name for d in DIMS), "world", "embedding")
        return cls(**{name: CommGroup(device=device) for name in names}, device=device)

    @classmethod
    def build(cls, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
              device: torch.device | str | None = None, shared_memory: bool = True,
              **sizes: int) -> ParallelState:
        """The groups of the named sizes over the initialised default process group: the
        keywords of :data:`~domino.parallel_dims.DIMS` (``context_parallel_size``,
        ``expert_model_parallel_size``, ...); the data-parallel size is what the world leaves.
        See :meth:`from_sizes`."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call domino.parallel_state."
                "init_distributed() (or run under torchrun) before initialize_model_parallel().")
        sizes = ParallelSizes.from_fields(
            dist.get_world_size(), tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size, **sizes)
        return cls.from_sizes(sizes, device, shared_memory)

    @classmethod
    def from_sizes(cls, sizes: ParallelSizes, device: torch.device | str | None = None,
                   shared_memory: bool = True) -> ParallelState:
        """The one mesh builder: every group of :data:`GROUPS` (ranks laid out as
        :data:`MESH_DIMS` say, TP innermost), a derived group that has the same ranks as an
        earlier one being that group. On CPU, ``shared_memory`` gives the TP, DP, EP and
        embedding groups whose ranks share a host the shared-memory transport
        (``tensor_parallel.shm``) for their bulk collectives (all-reduces, reduce-scatters,
        all-gathers, EP's all-to-alls); ``False`` keeps every collective on gloo.
        :meth:`transports` says what each got."""
        if sizes.world != dist.get_world_size():
            raise ValueError(f"the sizes {sizes} make {sizes.world} ranks, the world has "
                             f"{dist.get_world_size()}")
        device = torch.device(device) if device is not None else default_device()
        me, built, seen = dist.get_rank(), {}, {}
        groups = sizes.rank_groups()
        for name, lists in groups.items():
            # A group is shared only within its use: the schedule's groups launch at fixed
            # places, the gradient groups where a backward's sums happen to be final (under
            # sequence parallelism, when the TP sums finish); one process group carrying both
            # would order their collectives differently on different ranks.
            key = str((name in _GRADIENT_GROUPS, sorted(lists)))
            if key not in seen:  # every rank decides alike: the lists are the same everywhere
                seen[key] = _group_of(me, lists, device)
            built[name] = seen[key]
        state = cls(**built, world=CommGroup.world(device),
                    embedding=_embedding_group(groups["pp"], device), device=device)
        state.rng.tp_rank = state.tp.rank
        if shared_memory and device.type == "cpu":
            from domino.tensor_parallel.shm import open_transport

            try:
                for name in _SHARED:  # every rank, in the same order: it is collective
                    g = getattr(state, name)
                    g.transport = open_transport(g.group, g.rank, g.size, name)
            except BaseException:
                state.close()
                raise
        return state

    def transports(self) -> dict[str, str]:
        """How the TP and DP groups (and, in a pipeline with tied embeddings, the embedding
        group; with expert parallelism the EP group) move bytes: ``shm``, ``gloo``, ``nccl``,
        or ``-`` (one rank)."""
        out = {}
        for name in _SHARED:
            g = getattr(self, name)
            if name not in _ALWAYS_REPORTED and g.size == 1:
                continue
            out[name] = ("-" if g.size == 1 else "shm" if g.transport is not None
                         else str(dist.get_backend(g.group)))
        return out

    def close(self, wait: bool = True) -> None:
        """Stop the shared-memory transports' worker threads (the end of a rank's run;
        ``wait=False`` when leaving on an error: a worker may be waiting on a peer)."""
        for g in (getattr(self, name) for name in _SHARED):
            if g.transport is not None:
                g.transport.close(wait)
                g.transport = None


# The groups gradients are summed over (by a reducer, as blocks become final).
_GRADIENT_GROUPS = tuple(g.name for g in GROUP_TABLE if g.gradients)
# The groups whose collectives carry bulk data (the embedding group: the tied word table's
# gradient, once a step; ep: the MoE layers' token all-to-alls); pp and cp move their data
# point to point, world only small agreements.
_SHARED = (*(g.name for g in GROUP_TABLE if g.shared_memory), "embedding")
_ALWAYS_REPORTED = ("tp", "dp")  # transports() lists the others only when they have peers


def _group_of(me: int, lists: list[list[int]], device: torch.device) -> CommGroup:
    """This rank's group among ``lists`` (every rank creates every group, in one order)."""
    if len(lists[0]) == 1:
        return CommGroup(device=device)
    mine = CommGroup(device=device)
    timeout = world_timeout(device)
    for ranks in lists:
        # A new group's timeout is torch's default (30 min on gloo), not the world's: a rank
        # that stopped would hold its peers that long whatever the run asked for.
        group = dist.new_group(ranks, timeout=timeout)
        if me in ranks:
            # torch numbers a group's ranks in sorted order, whatever the list's (expert-DP x
            # TP lists are not sorted): chunks of a collective go by that number.
            mine = CommGroup(group, len(ranks), sorted(ranks).index(me), device=device)
    return mine


def group_among(lists: list[list[int]], device: torch.device) -> CommGroup:
    """This rank's group among ``lists`` of global ranks, every group created (a collective:
    every rank calls it with the same lists, in the same order): groups a run derives beyond
    :data:`GROUPS` (HSDP's, ``training.fsdp.hybrid_groups``)."""
    return _group_of(dist.get_rank(), lists, device)


def world_timeout(device: torch.device) -> datetime.timedelta | None:
    """The default process group's timeout (``init_process_group(timeout=...)``), or None
    where the backend does not expose it (torch's default then applies)."""
    try:
        return dist.group.WORLD._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _embedding_group(pp_groups: list[list[int]], device: torch.device) -> CommGroup:
    """First and last pipeline stage at each DP x CP x TP position (``pp_groups``: the ranks of
    each pipeline)."""
    if len(pp_groups[0]) == 1:
        return CommGroup(device=device)
    pairs = [[stages[0], stages[-1]] for stages in pp_groups]
    return _group_of(dist.get_rank(), pairs, device)


def check_sizes(world_size: int, tensor_model_parallel_size: int,
                pipeline_model_parallel_size: int = 1,
                expert_model_parallel_size: int = 1, context_parallel_size: int = 1,
                **sizes: int) -> None:
    """Raise ValueError unless world = tp * pp * cp * dp for some integer dp >= 1, with EP
    dividing dp * cp (``sizes``: the keywords of any other dimension)."""
    ParallelSizes.from_fields(world_size, tensor_model_parallel_size=tensor_model_parallel_size,
                              pipeline_model_parallel_size=pipeline_model_parallel_size,
                              context_parallel_size=context_parallel_size,
                              expert_model_parallel_size=expert_model_parallel_size, **sizes)
