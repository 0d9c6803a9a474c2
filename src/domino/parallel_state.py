"""Parallel state: one object holding the TP x DP (x PP) groups of this rank.

Model code receives a :class:`ParallelState` explicitly. The Megatron-style module functions
(``initialize_model_parallel``, ``get_tensor_model_parallel_world_size``, ...) exist for code
written against Megatron's ``mpu``; they read and write the one *current* state below, which is
the only module-level mutable value in the package.
"""

from __future__ import annotations

import datetime
import os
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
    mesh: object = None
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
                    device=device, mesh=mesh)
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
        # device_id binds NCCL's communicator to this GPU (no guessing in barrier()).
        dist.init_process_group(backend=backend_for(device),
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return device


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


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the TP-replicated and TP-distinct dropout streams of the current state."""
    _current().rng.seed(seed)
