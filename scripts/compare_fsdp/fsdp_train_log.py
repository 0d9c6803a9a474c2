"""What ``domino train``'s log says of memory and size, read back (``compare.py`` and
``largest.py`` of this folder use it): the closing line's peaks and model state per rank, the
start-up line's implied model state, the parameter count."""

from __future__ import annotations

import re


def parse_peaks_mib(log: str) -> list[float]:
    """``domino train``'s closing line -> each rank's peak memory, MiB."""
    m = re.search(r"peak memory per rank \(.*?\): ([\d., ]+?) MiB", log)
    if m is None:
        raise ValueError("no 'peak memory per rank' line in the domino train log")
    return [float(x) for x in m.group(1).split(",")]


def parse_model_state_mib(log: str) -> list[float]:
    """The closing line's model state per rank (weights + gradients + optimizer), MiB."""
    m = re.search(r"model state per rank \(weights \+ gradients \+ optimizer\): (.*)", log)
    if m is None:
        return []
    return [float(x) for x in re.findall(r"(?:^|, )([\d.]+) \(", m.group(1))]


def parse_implied_mib(log: str) -> float | None:
    """The start-up line: the model state per rank the strategy implies, MiB."""
    m = re.search(r"model state per rank implied by [^:]*: ([\d.]+) MiB", log)
    return float(m.group(1)) if m else None


def parse_param_count(log: str) -> int | None:
    """``model: 13,790,208 parameters`` -> 13790208."""
    m = re.search(r"model: ([\d,]+) parameters", log)
    return int(m.group(1).replace(",", "")) if m else None
