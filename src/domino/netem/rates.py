"""The ``tc`` values a link is shaped with: rates (``1gbit``), burst sizes and latencies."""

from __future__ import annotations

import re

# tc rate units: bit-based SI units, and byte-based ones ("bps" means bytes per second in tc).
_RATE_UNITS: dict[str, float] = {
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8.0,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
    "tbps": 8e12,
}
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)([a-z]+)$")
_RATE_HELP = (
    "expected <number><unit> with unit one of bit, kbit, mbit, gbit, tbit (bits/s) "
    "or bps, kbps, mbps, gbps, tbps (bytes/s), e.g. '1gbit', '500mbit', '100mbit', '10gbit'"
)
SIZE_RE = re.compile(r"^\d+(?:\.\d+)?(?:b|k|kb|m|mb|g|gb|kbit|mbit|gbit)?$")
TIME_RE = re.compile(r"^\d+(?:\.\d+)?(?:s|sec|secs|ms|msec|msecs|us|usec|usecs)$")


def parse_rate(s: str) -> str:
    """Validate a tc rate such as ``"100mbit"`` and return it normalised (lower case)."""
    norm = s.strip().lower()
    m = _RATE_RE.match(norm)
    if m is None or m.group(2) not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"invalid link rate {s!r}: {_RATE_HELP}")
    return norm


def rate_bits_per_s(s: str) -> float:
    """Return a tc rate string as bits per second, e.g. ``"1gbit"`` -> ``1e9``."""
    m = _RATE_RE.match(parse_rate(s))
    assert m is not None  # parse_rate already validated it
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def check_tbf_value(value: str, pattern: re.Pattern[str], what: str, example: str) -> str:
    """``value`` normalised (lower case) if ``pattern`` matches it, else ValueError naming
    ``what`` (a tbf parameter) with ``example``."""
    norm = value.strip().lower()
    if not pattern.match(norm):
        raise ValueError(f"invalid tbf {what} {value!r}; expected something like {example!r}")
    return norm
