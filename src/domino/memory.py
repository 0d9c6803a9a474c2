"""Peak memory of this process, the same way everywhere (train and bench report it).

CUDA: ``torch.cuda.max_memory_allocated`` (tensors only; reset with :func:`reset_peak`).
CPU: the process's resident-set high-water mark (``VmHWM`` in ``/proc/self/status``: weights,
activations, optimizer state, the allocator's cache and the interpreter; reset by writing "5" to
``/proc/self/clear_refs``). None where neither can be read.
"""

from __future__ import annotations

import torch

CUDA_METHOD = "torch.cuda.max_memory_allocated"
CPU_METHOD = "process RSS high-water mark (VmHWM)"


def method(device: torch.device) -> str:
    return CUDA_METHOD if device.type == "cuda" else CPU_METHOD


def reset_peak(device: torch.device) -> bool:
    """Start a new peak; False when this platform cannot reset it."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5" resets the peak RSS (VmHWM) of this process
        return True
    except OSError:
        return False


def peak_bytes(device: torch.device) -> int | None:
    """The peak since the last :func:`reset_peak` (or the process start)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _PieceBytes:
    """A CommHook (``domino.tensor_parallel.comm``) that only follows the schedule's compute
    spans, attributing the bytes autograd saves to the kind of piece running."""

    def __init__(self, skip: set[int]) -> None:
        self.current = "other"
        self.saved: dict[str, int] = {}
        self.seen = set(skip)

    def launch(self, tensor, group, kind="all_reduce"):
        return None  # the group's own transport

    def finished(self, *args) -> None:
        pass

    def region(self, name: str, category: str, **tags):
        import contextlib

        @contextlib.contextmanager
        def span():
            # "fwd local 1" -> local, "fwd par 0" -> par, "fwd embed" -> embed
            parts = name.split()
            before, self.current = self.current, parts[1] if len(parts) > 1 else name
            try:
                yield
            finally:
                self.current = before
        return span()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if t.is_floating_point() and storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.saved[self.current] = self.saved.get(self.current, 0) + storage.nbytes()
        return t


def kept_by_piece(group, weights, forward) -> dict[str, int]:
    """Bytes autograd keeps for backward while ``forward()`` runs, by the kind of Domino piece
    that saved them: ``local`` (norms, dropout, residuals, the embedding's finish), ``par``
    (the TP regions), ``embed`` (the embedding's lookups); ``other`` outside the stack (the
    LM head, the loss). Each storage counts once and whole (a view keeps all of it); the
    ``weights`` and integer tensors (token and position ids) are not counted. ``group`` is the
    TP group whose schedule spans are followed (its hook is replaced meanwhile)."""
    probe = _PieceBytes({w.untyped_storage().data_ptr() for w in weights})
    before, group.hook = group.hook, probe
    try:
        with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t):
            forward()
    finally:
        group.hook = before
    return probe.saved
