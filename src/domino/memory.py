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
