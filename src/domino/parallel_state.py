"""Parallel state: one object holding this rank's groups by name (TP, CP, DP, PP, EP and the
derived DP x CP and expert-DP groups), built from named sizes by one mesh builder.

Model code receives a :class:`ParallelState` explicitly. The Megatron-style module functions
(``initialize_model_parallel``, ``get_tensor_model_parallel_world_size``, ...) for code written
against Megatron's ``mpu`` live in :mod:`domino.megatron_compat`; joining the ranks
(``init_distributed``) in :mod:`domino.distributed`.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from domino.distributed import default_device
from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.random import RNGTracker

# The mesh's axes, outermost first: TP innermost, so a TP group holds consecutive ranks (one
# host when ranks are packed per node), then CP, DP, PP. Experts re-cut the DP x CP ranks of
# each (PP, TP) position into EP x expert-DP, EP innermost, as Megatron lays them out with
# expert tensor parallelism 1: experts are whole on a rank (replicated over TP), so their
# gradients are reduced over expert-DP x TP.
MESH_DIMS = ("pp", "dp", "cp", "tp")
# Every group a state holds, in the order every rank builds them (torch.distributed requires
# one order): the named dimensions, then the derived ones: ``dp_cp`` reduces dense gradients
# (DP x CP), ``ep`` shards experts, ``expert_dp`` reduces expert gradients (over the TP ranks
# too: under sequence parallelism each TP rank routes its own tokens to whole experts).
GROUPS = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "expert_dp")
_SIZE_NAMES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
               "cp": "context_parallel_size", "ep": "expert_model_parallel_size"}


@dataclass(frozen=True)
class ParallelSizes:
    """The size of every named parallel dimension; ``dp`` is what the world leaves."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1,
                  ep: int = 1) -> ParallelSizes:
        """The sizes of a world of ``world_size`` ranks (ValueError naming the size to change)."""
        given = {"tp": tp, "pp": pp, "cp": cp, "ep": ep}
        for dim, value in given.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{_SIZE_NAMES[dim]}={value!r} must be a positive integer.")
        model = tp * pp * cp
        names = f"tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp}" + (
            f" x context_parallel_size={cp}" if cp > 1 else "")
        if model > world_size:
            raise ValueError(f"{names} = {model} is larger than the world size {world_size}; "
                             "start more processes or lower the sizes.")
        if world_size % model:
            raise ValueError(
                f"world size {world_size} is not divisible by {names} = {model}; the "
                "data-parallel size would not be an integer: change the number of processes or "
                "the parallel sizes.")
        dp = world_size // model
        if (dp * cp) % ep:
            raise ValueError(f"expert_model_parallel_size={ep} must divide data-parallel x "
                             f"context-parallel size {dp} x {cp} = {dp * cp}.")
        return cls(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def rank_groups(self) -> dict[str, list[list[int]]]:
        """For each name of :data:`GROUPS`, the global ranks of each of its groups."""
        mesh = torch.arange(self.world).reshape(self.pp, self.dp, self.cp, self.tp)

        def along(t: torch.Tensor, *axes: int) -> list[list[int]]:
            rest = [a for a in range(t.dim()) if a not in axes]
            flat = t.permute(*rest, *axes).reshape(-1, math.prod(t.shape[a] for a in axes))
            return flat.tolist()

        # Experts: each (PP, TP) position's DP x CP ranks as [expert_dp, ep], EP innermost;
        # expert gradients are reduced over expert-DP x TP.
        experts = mesh.permute(0, 3, 1, 2).reshape(self.pp, self.tp, -1, self.ep)
        return {"tp": along(mesh, 3), "cp": along(mesh, 2), "dp": along(mesh, 1),
                "pp": along(mesh, 0), "dp_cp": along(mesh, 1, 2), "ep": along(experts, 3),
                "expert_dp": along(experts, 1, 2)}


@dataclass(eq=False)
class ParallelState:
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

    tp: CommGroup = field(default_factory=CommGroup)
    dp: CommGroup = field(default_factory=CommGroup)
    pp: CommGroup = field(default_factory=CommGroup)
    world: CommGroup = field(default_factory=CommGroup)
    embedding: CommGroup = field(default_factory=CommGroup)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rng: RNGTracker = field(default_factory=RNGTracker)
    cp: CommGroup = field(default_factory=CommGroup)
    ep: CommGroup = field(default_factory=CommGroup)
    dp_cp: CommGroup | None = None
    expert_dp: CommGroup | None = None

    def __post_init__(self) -> None:
        if self.dp_cp is None:
            if self.cp.size != 1:
                raise ValueError("with context parallelism the DP x CP group must be given")
            self.dp_cp = self.dp
        if self.expert_dp is None:
            if self.ep.size != 1:
                raise ValueError("with expert parallelism the expert-DP group must be given")
            self.expert_dp = self.dp_cp

    def group(self, name: str) -> CommGroup:
        """The group called ``name`` (one of :data:`GROUPS`, ``world`` or ``embedding``)."""
        if name not in (*GROUPS, "world", "embedding"):
            raise KeyError(f"no parallel group {name!r}; the groups are "
                           f"{', '.join((*GROUPS, 'world', 'embedding'))}")
        return getattr(self, name)

    @property
    def sizes(self) -> ParallelSizes:
        return ParallelSizes(tp=self.tp.size, pp=self.pp.size, cp=self.cp.size,
                             ep=self.ep.size, dp=self.dp.size)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelState:
        """The single-process state: every group has size 1."""
        device = torch.device(device)
        return cls(**{name: CommGroup(device=device) for name in (
            "tp", "dp", "pp", "world", "embedding", "cp", "ep")}, device=device)

    @classmethod
    def build(cls, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
              device: torch.device | str | None = None, shared_memory: bool = True, *,
              context_parallel_size: int = 1,
              expert_model_parallel_size: int = 1) -> ParallelState:
        """The groups of the named sizes over the initialised default process group (the data-
        parallel size is what the world leaves); see :meth:`from_sizes`."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call domino.parallel_state."
                "init_distributed() (or run under torchrun) before initialize_model_parallel().")
        sizes = ParallelSizes.for_world(
            dist.get_world_size(), tp=tensor_model_parallel_size,
            pp=pipeline_model_parallel_size, cp=context_parallel_size,
            ep=expert_model_parallel_size)
        return cls.from_sizes(sizes, device, shared_memory)

    @classmethod
    def from_sizes(cls, sizes: ParallelSizes, device: torch.device | str | None = None,
                   shared_memory: bool = True) -> ParallelState:
        """The one mesh builder: every group of :data:`GROUPS` (ranks laid out as
        :data:`MESH_DIMS` say, TP innermost), a derived group that has the same ranks as an
        earlier one being that group. On CPU, ``shared_memory`` gives the TP, DP and embedding
        groups whose ranks share a host the shared-memory transport (``tensor_parallel.shm``)
        for their all-reduces, reduce-scatters and all-gathers; ``False`` keeps every
        collective on gloo. :meth:`transports` says what each got."""
        if sizes.world != dist.get_world_size():
            raise ValueError(f"the sizes {sizes} make {sizes.world} ranks, the world has "
                             f"{dist.get_world_size()}")
        device = torch.device(device) if device is not None else default_device()
        me, built, seen = dist.get_rank(), {}, {}
        for name, lists in sizes.rank_groups().items():
            # A group is shared only within its use: the schedule's groups launch at fixed
            # places, the gradient groups where a backward's sums happen to be final (under
            # sequence parallelism, when the TP sums finish); one process group carrying both
            # would order their collectives differently on different ranks.
            key = str((name in _GRADIENT_GROUPS, sorted(lists)))
            if key not in seen:  # every rank decides alike: the lists are the same everywhere
                seen[key] = _group_of(me, lists, device)
            built[name] = seen[key]
        state = cls(**built, world=CommGroup.world(device),
                    embedding=_embedding_group(sizes, device), device=device)
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
            if name in ("embedding", "ep") and g.size == 1:
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
_GRADIENT_GROUPS = ("dp", "dp_cp", "expert_dp")
# The groups whose collectives carry bulk data (the embedding group: the tied word table's
# gradient, once a step; ep: the MoE layers' token all-to-alls); pp and cp move their data
# point to point, world only small agreements.
_SHARED = ("tp", "dp", "embedding", "ep")


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
            mine = CommGroup(group, len(ranks), ranks.index(me), device=device)
    return mine


def world_timeout(device: torch.device) -> datetime.timedelta | None:
    """The default process group's timeout (``init_process_group(timeout=...)``), or None
    where the backend does not expose it (torch's default then applies)."""
    try:
        return dist.group.WORLD._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _embedding_group(sizes: ParallelSizes, device: torch.device) -> CommGroup:
    """First and last pipeline stage at each DP x CP x TP position."""
    if sizes.pp == 1:
        return CommGroup(device=device)
    stages = torch.arange(sizes.world).reshape(sizes.pp, -1)
    pairs = [[int(a), int(b)] for a, b in zip(stages[0], stages[-1], strict=True)]
    return _group_of(dist.get_rank(), pairs, device)


def check_sizes(world_size: int, tensor_model_parallel_size: int,
                pipeline_model_parallel_size: int = 1,
                expert_model_parallel_size: int = 1, context_parallel_size: int = 1) -> None:
    """Raise ValueError unless world = tp * pp * cp * dp for some integer dp >= 1, with EP
    dividing dp * cp."""
    ParallelSizes.for_world(world_size, tp=tensor_model_parallel_size,
                            pp=pipeline_model_parallel_size, cp=context_parallel_size,
                            ep=expert_model_parallel_size)
