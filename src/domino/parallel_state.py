"""Parallel state: one object holding the TP x DP (x PP) groups of this rank.

Model code receives a :class:`ParallelState` explicitly. The Megatron-style module functions
(``initialize_model_parallel``, ``get_tensor_model_parallel_world_size``, ...) exist for code
written against Megatron's ``mpu``; they read and write the one *current* state below, which is
the only module-level mutable value in the package.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from domino.tensor_parallel.comm import CommGroup
from domino.tensor_parallel.random import RNGTracker


@dataclass(eq=False)
class ParallelState:
    """Groups of one rank: ``tp`` (tensor), ``dp`` (data), ``pp`` (pipeline), ``world`` (every
    rank: run-level agreement such as barriers and the autotuner's choice) and ``embedding``
    (the first and last pipeline stage of this rank's TP x DP position: their tied word
    tables' gradients are summed over it) + device."""

    tp: CommGroup = field(default_factory=CommGroup)
    dp: CommGroup = field(default_factory=CommGroup)
    pp: CommGroup = field(default_factory=CommGroup)
    world: CommGroup = field(default_factory=CommGroup)
    embedding: CommGroup = field(default_factory=CommGroup)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rng: RNGTracker = field(default_factory=RNGTracker)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelState:
        """The single-process state: every group has size 1."""
        device = torch.device(device)
        return cls(*(CommGroup(device=device) for _ in range(5)), device=device)

    @classmethod
    def build(cls, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
              device: torch.device | str | None = None,
              shared_memory: bool = True) -> ParallelState:
        """Build the groups over the initialised default process group with a DeviceMesh.

        Ranks are laid out ``[pp, dp, tp]`` with TP innermost, so a TP group holds consecutive
        ranks (on one host when ranks are packed per node). On CPU, ``shared_memory`` gives the
        TP, DP and embedding groups whose ranks share a host the shared-memory transport
        (``tensor_parallel.shm``) for their all-reduces, reduce-scatters and all-gathers;
        ``False`` keeps every collective on gloo. :meth:`transports` says what each got.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call domino.parallel_state."
                "init_distributed() (or run under torchrun) before initialize_model_parallel().")
        world = dist.get_world_size()
        tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
        check_sizes(world, tp, pp)
        dp = world // (tp * pp)
        if device is None:
            device = default_device()
        device = torch.device(device)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))

        def group(dim: str) -> CommGroup:
            return CommGroup(mesh.get_group(dim), mesh.size(mesh.mesh_dim_names.index(dim)),
                             mesh.get_local_rank(dim), device=device)

        state = cls(tp=group("tp"), dp=group("dp"), pp=group("pp"),
                    world=CommGroup.world(device), embedding=_embedding_group(mesh, device),
                    device=device)
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


def _embedding_group(mesh, device: torch.device) -> CommGroup:
    """First and last pipeline stage at each TP x DP position (every rank builds every group,
    in the same order, as torch.distributed requires)."""
    ranks = mesh.mesh  # [pp, dp, tp] global ranks
    if ranks.shape[0] == 1:
        return CommGroup(device=device)
    me = dist.get_rank()
    mine = CommGroup(device=device)
    for d in range(ranks.shape[1]):
        for t in range(ranks.shape[2]):
            pair = [int(ranks[0, d, t]), int(ranks[-1, d, t])]
            group = dist.new_group(pair)
            if me in pair:
                mine = CommGroup(group, 2, pair.index(me), device=device)
    return mine


def check_sizes(world_size: int, tensor_model_parallel_size: int,
                pipeline_model_parallel_size: int = 1) -> None:
    """Raise ValueError unless world = tp * pp * dp for some integer dp >= 1."""
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    if tp * pp > world_size:
        raise ValueError(
            f"tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} = {tp * pp} is "
            f"larger than the world size {world_size}; start more processes or lower the sizes.")
    if world_size % (tp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size={tp} x "
            f"pipeline_model_parallel_size={pp} = {tp * pp}; the data-parallel size would not be "
            "an integer: change the number of processes or the parallel sizes.")


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
