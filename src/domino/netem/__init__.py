"""Link emulation: run ranks as if on separate hosts joined by a slow link, on one machine
(Linux network namespaces and ``tc``; root only). A launch facility shared by ``domino train
--emulate-link`` and ``domino bench --emulate-link``: the launcher wraps each rank's command
with :meth:`EmulatedLink.wrap` and adds :meth:`EmulatedLink.env_for` to its environment.

- :mod:`~domino.netem.rates`: the tc values (rates, burst, latency) and their validation;
- :mod:`~domino.netem.namespaces`: whether this machine can emulate, and removing namespaces
  (also those that runs killed earlier left behind);
- :mod:`~domino.netem.link`: :class:`EmulatedLink`, the namespaces and shaped veths of one run.
"""

from domino.netem.link import EmulatedLink
from domino.netem.namespaces import PREFIX, check_can_emulate, cleanup_stale
from domino.netem.rates import parse_rate, rate_bits_per_s

__all__ = [
    "PREFIX",
    "EmulatedLink",
    "check_can_emulate",
    "cleanup_stale",
    "parse_rate",
    "rate_bits_per_s",
]
