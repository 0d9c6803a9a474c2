"""Joining the ranks of a run: the default process group from torchrun's environment, with a
rendezvous store bound to MASTER_ADDR only (torch's own binds every interface), and the device
and backend of this rank."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

import torch
import torch.distributed as dist


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
