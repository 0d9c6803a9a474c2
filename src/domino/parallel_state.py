"""Parallel state: one object holding the TP x DP (x PP) groups of this rank.

Model code receives a :class:`ParallelState` explicitly. The Megatron-style module functions
(``initialize_model_parallel``, ``get_tensor_model_parallel_world_size``, ...) exist for code
written against Megatron's ``mpu``; they read and write the one *current* state below, which is
the only module-level mutable value in the package.
"""

from __future__ import annotations

import datetime
import ipaddress
import math
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.random import RNGTracker

# The mesh's axes, outermost first: TP innermost, so a TP group holds consecutive ranks (one
# host when ranks are packed per node), then CP, DP, PP. Experts re-cut the DP x CP ranks of
# each (PP, TP) position into EP x expert-DP, EP innermost, as Megatron lays them out.
MESH_DIMS = ("pp", "dp", "cp", "tp")
# Every group a state holds, in the order every rank builds them (torch.distributed requires
# one order): the named dimensions, then the derived ones: ``dp_cp`` reduces dense gradients
# (DP x CP), ``ep`` shards experts, ``expert_dp`` reduces expert gradients.
GROUPS = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "expert_dp")
_SIZE_NAMES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
               "cp": "context_parallel_size", "ep": "expert_model_parallel_size"}
_NOT_YET = ("cp", "ep")  # accepted as 1 until context and expert parallelism land


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
        for dim in _NOT_YET:
            if given[dim] != 1:
                raise ValueError(f"{_SIZE_NAMES[dim]}={given[dim]}: this dimension is not "
                                 "implemented yet; use 1.")
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

        # Experts: each (PP, TP) position's DP x CP ranks as [expert_dp, ep], EP innermost.
        experts = mesh.permute(0, 3, 1, 2).reshape(self.pp, self.tp, -1, self.ep)
        return {"tp": along(mesh, 3), "cp": along(mesh, 2), "dp": along(mesh, 1),
                "pp": along(mesh, 0), "dp_cp": along(mesh, 1, 2), "ep": along(experts, 3),
                "expert_dp": along(experts, 2)}


@dataclass(eq=False)
class ParallelState:
    """The groups of one rank, by name (:data:`GROUPS`): ``tp`` (tensor), ``cp`` (context),
    ``dp`` (data), ``pp`` (pipeline), ``dp_cp`` (DP x CP: what dense gradients are reduced
    over), ``ep`` (expert) and ``expert_dp`` (what expert gradients are reduced over); plus
    ``world`` (every rank: run-level agreement such as barriers and the autotuner's choice),
    ``embedding`` (the first and last pipeline stage of this rank's position: their tied word
    tables' gradients are summed over it), the device and the dropout RNG streams.

    A derived group left unset is its base group where they coincide (``dp_cp`` = ``dp`` while
    CP is 1, ``expert_dp`` = ``dp_cp`` while EP is 1).
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
            key = str(sorted(lists))
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
        group) move bytes: ``shm``, ``gloo``, ``nccl``, or ``-`` (one rank)."""
        out = {}
        for name in _SHARED:
            g = getattr(self, name)
            if name == "embedding" and g.size == 1:
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


# The groups whose collectives carry bulk data (the embedding group: the tied word table's
# gradient, once a step); pp moves its data point to point, world only small agreements.
_SHARED = ("tp", "dp", "embedding")


def _group_of(me: int, lists: list[list[int]], device: torch.device) -> CommGroup:
    """This rank's group among ``lists`` (every rank creates every group, in one order)."""
    if len(lists[0]) == 1:
        return CommGroup(device=device)
    mine = CommGroup(device=device)
    for ranks in lists:
        group = dist.new_group(ranks)
        if me in ranks:
            mine = CommGroup(group, len(ranks), ranks.index(me), device=device)
    return mine


def _embedding_group(sizes: ParallelSizes, device: torch.device) -> CommGroup:
    """First and last pipeline stage at each DP x CP x TP position."""
    if sizes.pp == 1:
        return CommGroup(device=device)
    stages = torch.arange(sizes.world).reshape(sizes.pp, -1)
    pairs = [[int(a), int(b)] for a, b in zip(stages[0], stages[-1], strict=True)]
    return _group_of(dist.get_rank(), pairs, device)


def check_sizes(world_size: int, tensor_model_parallel_size: int,
                pipeline_model_parallel_size: int = 1) -> None:
    """Raise ValueError unless world = tp * pp * dp for some integer dp >= 1."""
    ParallelSizes.for_world(world_size, tp=tensor_model_parallel_size,
                            pp=pipeline_model_parallel_size)


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(device: torch.device | str | None = None,
                     timeout_s: float = 300.0) -> torch.device:
    """Initialise the default process group from torchrun's environment variables.

    Picks NCCL on CUDA and gloo on CPU. Returns this rank's device. ``timeout_s`` bounds how long a
    collective may wait for a peer, so a crashed rank makes the others fail instead of hanging.
    """
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        if device.index is None:  # plain "cuda": this process's local GPU, as torchrun numbers it
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"environment variables {', '.join(missing)} are not set: launch with torchrun "
                "(or `domino train --nproc N`) so each process knows its rank.")
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        timeout = datetime.timedelta(seconds=timeout_s)
        # device_id binds NCCL's communicator to this GPU (no guessing in barrier()).
        dist.init_process_group(backend=backend_for(device),
                                store=_rendezvous_store(rank, world_size, timeout),
                                rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    return device


def _rendezvous_store(rank: int, world_size: int,
                      timeout: datetime.timedelta) -> dist.Store:
    """The store of env:// rendezvous, except that rank 0's server listens on MASTER_ADDR only.

    torch's own server binds every interface, and the store takes unauthenticated writes.
    Under torchrun's default rendezvous the agent hosts the store and every rank connects.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        listener = _listen(host, port, world_size)
        # The store's server owns the descriptor (it closes it at the end, or when start-up
        # fails once it has it): detach, so Python never closes it too. Checked to work with
        # the default libuv server as with the older one (use_libuv=False).
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                              master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    # The prefix env:// adds: keys stay apart from the agent's when its store is shared.
    return dist.PrefixStore("default_pg", store)


def _listen(host: str, port: int, world_size: int) -> socket.socket:
    """A TCP socket listening at ``port`` on the first of ``host``'s addresses (IPv4 or IPv6)
    that can take it."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise OSError(exc.errno, f"rendezvous store: MASTER_ADDR={host}: {exc.strerror}") from exc
    error: OSError | None = None
    for family, kind, proto, _, address in found:
        if (ipaddress.ip_address(address[0]).is_loopback
                and int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) < world_size):
            # Ranks on other hosts could never connect (torch's server, bound to every
            # interface, hid this): fail now rather than at the timeout.
            raise RuntimeError(
                f"MASTER_ADDR={host} is a loopback address on this host ({address[0]}) but "
                "the run has ranks on other hosts: set MASTER_ADDR to an address they reach.")
        sock = socket.socket(family, kind, proto)
        try:
            # As torch's own server: a port in TIME_WAIT from an earlier run is reusable.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise OSError(getattr(error, "errno", None),
                  f"rendezvous store: cannot listen on {host}:{port}: {error}") from error


def shutdown_distributed() -> None:
    """Destroy the default process group if there is one (end of a rank's run)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---- Megatron-style module API over the one current state ---------------------------------

_CURRENT: ParallelState | None = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              device: torch.device | str | None = None,
                              shared_memory: bool = True) -> ParallelState:
    """Build TP x DP (x PP) groups over the current world and make them current (see
    :meth:`ParallelState.build` for ``shared_memory``)."""
    global _CURRENT
    if _CURRENT is not None:
        raise RuntimeError("model parallel is already initialised; call destroy_model_parallel().")
    _CURRENT = ParallelState.build(tensor_model_parallel_size, pipeline_model_parallel_size,
                                   device, shared_memory)
    return _CURRENT


def model_parallel_is_initialized() -> bool:
    return _CURRENT is not None


def destroy_model_parallel() -> None:
    """Forget the current state, stopping its shared-memory transports."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.close()
    _CURRENT = None


def get_parallel_state() -> ParallelState:
    """The current state, or the single-process one when nothing was initialised."""
    return _CURRENT if _CURRENT is not None else ParallelState.single()


def resolve(state: ParallelState | None) -> ParallelState:
    """``state`` if given, else the current one (seed API functions take no state argument)."""
    return state if state is not None else get_parallel_state()


def _current() -> ParallelState:
    if _CURRENT is None:
        raise RuntimeError("model parallel is not initialised: call initialize_model_parallel().")
    return _CURRENT


def get_tensor_model_parallel_world_size() -> int:
    return _current().tp.size


def get_tensor_model_parallel_rank() -> int:
    return _current().tp.rank


def get_tensor_model_parallel_group():
    return _current().tp.group


def get_data_parallel_world_size() -> int:
    return _current().dp.size


def get_data_parallel_rank() -> int:
    return _current().dp.rank


def get_data_parallel_group():
    return _current().dp.group


def get_pipeline_model_parallel_world_size() -> int:
    return _current().pp.size


def get_pipeline_model_parallel_rank() -> int:
    return _current().pp.rank
