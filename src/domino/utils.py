"""Small helpers shared across the package."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch


def init_method_normal(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """Init that fills a tensor from N(0, std)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def scaled_init_method_normal(std: float,
                              num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Init for layers that write into the residual stream: N(0, std / sqrt(2 num_layers))."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


@contextlib.contextmanager
def init_scope(tag: str) -> Iterator[None]:
    """Draw the weights built inside from a stream of their own, seeded by the current seed
    (``torch.manual_seed``) and ``tag``, and leave the global stream where it was.

    Each part of a model (the embedding, layer i, the output layer) gets the same weights
    whatever else is built in the process: a pipeline stage holding layers 4-7 draws exactly
    the full model's layers 4-7.
    """
    digest = hashlib.sha256(f"{torch.initial_seed()}:{tag}".encode()).digest()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        yield


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; an uneven split is a bug upstream (configs validate first)."""
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def even_splits(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of ``parts`` contiguous ranges covering ``range(total)``; sizes differ by
    at most one (the first ranges take the remainder)."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a local rendezvous), taken below the
    kernel's ephemeral range: a port the kernel handed out (``bind`` to port 0) is one it may
    give the very next outgoing connection (gloo opens many) before the rendezvous listens on
    it, which then fails with "address already in use"."""
    low, _ = _ephemeral_range()
    candidates = list(range(max(1024, low - 12000), low))
    random.SystemRandom().shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every one tried is taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux; else IANA's)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def process_state(pid: int) -> str | None:
    """Linux's one-letter state of process ``pid`` (R, S, T for stopped, Z for zombie, ...), or
    None where it cannot be read (another system, a process gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            # The state follows the parenthesised command name, which may hold spaces and ")".
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def stop_processes(procs: Sequence[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every live child, then SIGKILL whatever is left after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (``512 B``, ``3.4 MiB``,
    ``1.20 GiB``): a small model's checkpoint must not read as 0.00 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{1 if abs(n) >= 10 else 2}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_output_dir(path: str | os.PathLike, what: str) -> None:
    """``path`` is a folder this process can create or write into; ValueError naming ``what``
    (the flag or argument), the rule and the fix otherwise. Creates nothing: the probe file it
    writes into the folder (or its nearest existing parent) is gone when it returns."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{what} {target} is a file, not a folder; pass a folder path")
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{what} {target}: cannot write there ({existing} is a file, so no "
                         "folder can be made under it); pass a folder path")
    try:  # a real write answers for every reason one can fail (read-only mount, mode, ACL)
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".domino-write-test-"):
            pass
    except OSError as err:
        raise ValueError(f"{what} {target}: cannot write there ({existing}: "
                         f"{err.strerror or err}); pass a folder you can write to") from None


@contextlib.contextmanager
def removed_on_error(path: str | os.PathLike | None) -> Iterator[None]:
    """On an exception inside, delete the folders of ``path`` that did not exist on entry (the
    outermost of them, with what was written into it): a refused or failed command leaves
    nothing behind. Folders that existed are left alone."""
    made = None
    if path is not None:
        for folder in (Path(path).absolute(), *Path(path).absolute().parents):
            if folder.exists():
                break
            made = folder
    try:
        yield
    except BaseException:
        if made is not None and made.is_dir():
            shutil.rmtree(made, ignore_errors=True)
        raise


def cache_root() -> Path:
    """Where domino caches what it derives (the tokenized stdlib corpus, measured GEMM rates):
    ``$DOMINO_CACHE_DIR`` or ``~/.cache/domino``."""
    env = os.environ.get("DOMINO_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "domino"
