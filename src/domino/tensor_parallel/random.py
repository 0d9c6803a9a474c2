"""Dropout RNG streams for tensor parallelism.

Two streams, each a ``torch.Generator`` owned by the parallel state (no global RNG forking):

* ``replicated``: identical on every TP rank - dropout on activations that all TP ranks hold
  (hidden dropout after the row-parallel reduction), so the replicas stay equal.
* ``model_parallel``: different per TP rank - dropout inside the TP region (attention
  probabilities of a rank's own heads), so shards do not share masks.

Unless :meth:`RNGTracker.seed` is called, both derive from ``torch.initial_seed()`` at first use,
so ``torch.manual_seed(s)`` on every rank is enough.
"""

from __future__ import annotations

import torch

# Offset that separates the TP-distinct stream from the replicated one.
_MODEL_PARALLEL_OFFSET = 2718


class RNGTracker:
    """Per-device generators for the replicated and the TP-distinct dropout streams."""

    def __init__(self, seed: int | None = None, tp_rank: int = 0) -> None:
        self._seed = seed
        self.tp_rank = tp_rank
        self._salt = 0  # moves the TP-distinct streams (see load_state_dict)
        self._generators: dict[tuple[str, str], torch.Generator] = {}

    def seed(self, seed: int) -> None:
        """Reset both streams from ``seed``."""
        self._seed = int(seed)
        self._salt = 0
        self._generators.clear()

    def _get(self, kind: str, device: torch.device) -> torch.Generator:
        key = (kind, str(device))
        gen = self._generators.get(key)
        if gen is None:
            base = self._seed if self._seed is not None else torch.initial_seed()
            if kind == "model_parallel":
                base = base + _MODEL_PARALLEL_OFFSET + self.tp_rank + self._salt
            gen = torch.Generator(device=device)
            gen.manual_seed(base % (2**63))
            self._generators[key] = gen
        return gen

    def replicated(self, device: torch.device) -> torch.Generator:
        return self._get("replicated", device)

    def model_parallel(self, device: torch.device) -> torch.Generator:
        return self._get("model_parallel", device)

    def snapshot(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Both streams' states on ``device`` (to replay a recomputed piece's dropout)."""
        return self.replicated(device).get_state(), self.model_parallel(device).get_state()

    def restore(self, device: torch.device, snap: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.replicated(device).set_state(snap[0])
        self.model_parallel(device).set_state(snap[1])

    def state_dict(self) -> dict:
        return {"seed": self._seed,
                "states": {f"{k[0]}|{k[1]}": g.get_state() for k, g in self._generators.items()}}

    def load_state_dict(self, state: dict, reseed_model_parallel: int | None = None,
                        device: torch.device | None = None) -> None:
        """Restore what :meth:`state_dict` returned. ``reseed_model_parallel``: the saved
        TP-distinct streams do not fit this rank (another TP size), so they restart from the
        seed moved by this amount (e.g. the step). With ``device``, only the streams of that
        device type are restored (a CPU state cannot seed a CUDA generator); the others start
        from the seed."""
        self._seed = state["seed"]
        self._salt = 0 if reseed_model_parallel is None else 1 + int(reseed_model_parallel)
        self._generators.clear()
        for key, value in state["states"].items():
            kind, dev = key.split("|")
            if reseed_model_parallel is not None and kind == "model_parallel":
                continue
            target = torch.device(dev)
            if device is not None:
                if target.type != device.type:
                    continue
                target = device
            self._get(kind, target).set_state(value)


def dropout_mask(x: torch.Tensor, p: float, training: bool, generator: torch.Generator,
                 seq_shard: tuple[int, int] | None = None) -> torch.Tensor | None:
    """The keep mask of inverted dropout on ``x`` drawn from ``generator`` (a stream of an
    RNGTracker), to multiply with ``x`` and 1 / (1 - p); None when no dropout runs.

    ``seq_shard`` = (rank, size): ``x`` [s / size, ...] is rank ``rank``'s sequence shard of a
    tensor whose mask is drawn for the whole sequence (from a stream every rank shares): the
    mask is the shard's rows of the one unsharded dropout would draw, so sequence parallelism
    changes no mask and the masks do not depend on the TP size."""
    if not training or p == 0.0:
        return None
    if seq_shard is None:
        return torch.empty_like(x).bernoulli_(1.0 - p, generator=generator)
    rank, size = seq_shard
    full = (x.shape[0] * size, *x.shape[1:])
    keep = torch.empty(full, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p,
                                                                          generator=generator)
    # A copy of the rows, not a view: backward keeps the mask, and a view would keep all of it.
    return keep.chunk(size)[rank].clone()


def dropout(x: torch.Tensor, p: float, training: bool, generator: torch.Generator) -> torch.Tensor:
    """Inverted dropout whose mask comes from ``generator`` (see :func:`dropout_mask`)."""
    keep = dropout_mask(x, p, training, generator)
    return x if keep is None else x * keep * (1.0 / (1.0 - p))
