"""What a rank's step loop and its process share: where the rank is in its run (the step and
what it is doing, so that a failure says it), a request to stop at the next step boundary, and
how a collective that timed out waiting for a peer is told apart from other failures."""

from __future__ import annotations

from dataclasses import dataclass

# What gloo and the shared-memory transport say when a peer never joins a collective.
# gloo's words for a collective whose peer did not join in time: a wait that ran out, or (when
# the timeout fires inside a transfer) the pair closed for it; ours from the shm transport.
_TIMEOUT_TEXTS = ("Timed out waiting", "Application timeout caused pair closure",
                  "did not join a collective within")


@dataclass
class StopRequest:
    """Set (by a signal handler) to stop at the next step boundary with a checkpoint."""

    signum: int | None = None

    def request(self, signum: int) -> None:
        self.signum = signum


@dataclass
class Progress:
    """Set by the step loop as it goes; read by the rank's failure report."""

    step: int | None = None
    doing: str = "setting up"

    def at(self, step: int, doing: str) -> None:
        self.step, self.doing = step, doing

    def __str__(self) -> str:
        return self.doing if self.step is None else f"step {self.step}, {self.doing}"


def is_collective_timeout(err: BaseException) -> bool:
    """Did ``err`` come from a collective whose peers did not all join within the timeout?"""
    seen: BaseException | None = err
    while seen is not None:
        if any(text in str(seen) for text in _TIMEOUT_TEXTS):
            return True
        seen = seen.__cause__
    return False


def timeout_report(err: BaseException, progress: Progress, timeout_minutes: float) -> str:
    """One line for a rank whose collective timed out: what it was doing, the timeout, the
    likely causes and the collective's own words."""
    return (f"{progress}: a collective timed out after --distributed-timeout-minutes "
            f"{timeout_minutes:g}: a peer rank stopped responding (its process stopped or "
            f"hung, or far slower than this one) ({type(err).__name__}: {err})")
