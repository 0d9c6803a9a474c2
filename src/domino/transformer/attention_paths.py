"""The core attention's path chosen by measurement on the machine, not by a rule.

Which of the attention's paths (:class:`~domino.runtime.AttentionChoice`: SDPA with PyTorch's
own backend choice, SDPA's math backend, explicit batched matmuls in the compute dtype or in
fp32) is fastest depends on the CPU (AVX2, AVX-512 with or without BF16, AMX), the dtype, the
shapes and the mask: on one AVX2 host bf16 SDPA was 4x slower than its math backend, on an
AMX host it is 2.3x faster (docs/performance.md#attention). So a run times them, forward and
backward of ``kernels.attention`` itself, at its own shapes (:class:`AttentionShapes`: the
attention call's batch, heads and K/V heads per rank, sequence, head size, dtype and the mask
kinds the model will use), once per machine, torch version, thread count and shape set, and
caches the times as JSON in ``$DOMINO_CACHE_DIR`` (:data:`CACHE_FILE`) beside the GEMM rates; a
cache entry that is damaged or incomplete is measured again, never trusted.

Every rank must take the same path (the same numerics on every TP rank's heads): the ranks of
``group`` measure together (as they will run: each on its own cores, at once), or read the
cache if every one of them has it, and take the slowest rank's time per path (a MAX
all-reduce), so all of them choose from one table.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from domino.gemm_rate import machine
from domino.runtime import ATTENTION_PATHS, MASK_KINDS, AttentionChoice, RuntimeConfig
from domino.safe_files import read_cache, update_cache
from domino.tensor_parallel.comm import CommGroup
from domino.timing import time_rotated
from domino.transformer.kernels import attention
from domino.utils import cache_root

__all__ = ["CACHE_FILE", "AttentionShapes", "attention_text", "choose", "measure",
           "measured_choice", "resolve_attention", "time_paths"]

CACHE_FILE = "attention_paths.json"
ROUNDS = 3  # timed rounds per path after its screening call (median)
SCREEN = 4.0  # a path whose first call took this many times the fastest one's is not timed more
MARGIN = 0.03  # a path must beat an earlier one of ATTENTION_PATHS by this much to be chosen

# (mask kind -> {path: step seconds}): one measurement
Table = dict[str, dict[str, float]]
# Given each path's step (forward + backward) of one mask kind, its seconds per step.
Timer = Callable[[Mapping[str, Callable[[], None]]], dict[str, float]]


@dataclass(frozen=True)
class AttentionShapes:
    """What one rank's core attention computes in a run: ``batch`` sequences per call (the
    micro-batch, or its largest Domino piece), ``heads`` query heads and ``groups`` K/V heads
    per rank, ``seq`` queries and keys, ``head_dim``, in ``dtype`` on ``device``, for the mask
    ``kinds`` the model uses (``windowed`` with ``window``; ``masked`` merged with the causal
    rule when ``causal``), the softmax in fp32 when ``softmax_fp32``."""

    batch: int
    heads: int
    groups: int
    seq: int
    head_dim: int
    dtype: torch.dtype
    kinds: tuple[str, ...] = ("causal",)
    window: int | None = None
    causal: bool = True
    softmax_fp32: bool = True
    device: str = "cpu"

    def __post_init__(self) -> None:
        bad = [k for k in self.kinds if k not in MASK_KINDS]
        if not self.kinds or bad:
            raise ValueError(f"AttentionShapes.kinds={self.kinds!r}: each must be one of "
                             f"{', '.join(MASK_KINDS)} (at least one).")
        if "windowed" in self.kinds and not (self.window and self.window < self.seq):
            raise ValueError(f"the windowed kind needs a window shorter than seq={self.seq}, "
                             f"got window={self.window!r}.")
        if min(self.batch, self.heads, self.groups, self.seq, self.head_dim) < 1 \
                or self.heads % self.groups:
            raise ValueError(f"{self}: sizes must be >= 1 and groups must divide heads.")

    @property
    def candidates(self) -> tuple[str, ...]:
        """The paths to time: explicit_fp32 only where the dtype is not fp32 already."""
        low = self.dtype != torch.float32
        return tuple(p for p in ATTENTION_PATHS if low or p != "explicit_fp32")

    def describe(self) -> str:
        kv = f" ({self.groups} K/V)" if self.groups != self.heads else ""
        dtype = str(self.dtype).removeprefix("torch.")
        window = f", window {self.window}" if "windowed" in self.kinds else ""
        return (f"{dtype}, batch {self.batch} x {self.heads} heads{kv} x seq {self.seq} x "
                f"{self.head_dim}, {'/'.join(self.kinds)} masks{window}")

    def cache_key(self, threads: int) -> str:
        return (f"{machine()} | torch {torch.__version__} | {self.device} | {threads} threads | "
                f"{self.describe()} | softmax fp32 {self.softmax_fp32} | causal {self.causal}")

    @classmethod
    def of_run(cls, config, micro_batch: int, tp: int, micro_batches: int,
               dtype: torch.dtype, device: torch.device | str, masked: bool = False
               ) -> AttentionShapes:
        """A run's shapes: ``config`` (a TransformerConfig) at ``tp`` ranks, ``micro_batch``
        sequences per step cut into ``micro_batches`` Domino pieces (only at TP > 1, where
        the stack splits), and ``masked`` when the data brings masks (documents)."""
        batch = -(-micro_batch // micro_batches) if tp > 1 else micro_batch
        window = config.window_size
        windowed = window is not None and window < config.seq_length
        full = not windowed or bool(config.full_attention_layers)
        kinds = (("masked",) if masked else ("causal",)) if full else ()
        return cls(batch, config.num_attention_heads // tp, config.num_query_groups // tp,
                   config.seq_length, config.kv_channels, dtype,
                   kinds + (("windowed",) if windowed else ()), window if windowed else None,
                   softmax_fp32=config.attention_softmax_in_fp32,
                   device=torch.device(device).type)


def path_steps(shapes: AttentionShapes, kind: str) -> dict[str, Callable[[], None]]:
    """Each candidate path's forward + backward of ``kernels.attention`` for ``kind``."""
    s, b, d = shapes.seq, shapes.batch, shapes.head_dim
    gen = torch.Generator().manual_seed(0)

    def leaf(heads: int) -> torch.Tensor:
        t = torch.randn(s, b, heads, d, generator=gen).to(shapes.device, shapes.dtype)
        return t.requires_grad_()

    q, k, v = leaf(shapes.heads), leaf(shapes.groups), leaf(shapes.groups)
    dy = torch.randn(s, b, shapes.heads * d, generator=gen).to(shapes.device, shapes.dtype)
    mask, causal, window = None, True, None
    if kind == "windowed":
        window = shapes.window
    elif kind == "masked":  # key padding: the last eighth of each sequence's keys
        mask = torch.zeros(b, 1, 1, s, dtype=torch.bool, device=shapes.device)
        mask[..., s - max(1, s // 8):] = True
        causal = shapes.causal

    def step(path: str) -> Callable[[], None]:
        paths = AttentionChoice.fixed(path)

        def run() -> None:
            q.grad = k.grad = v.grad = None
            out = attention(q, k, v, mask, causal, None, 0.0, shapes.softmax_fp32,
                            shapes.heads // shapes.groups, window, paths=paths)
            out.backward(dy)
        return run

    return {path: step(path) for path in shapes.candidates}


def time_paths(steps: Mapping[str, Callable[[], None]], group: CommGroup | None = None,
               device: torch.device | str = "cpu") -> dict[str, float]:
    """Seconds per step of each path: after a warm-up call (first-call costs), one screening
    call each (the ranks of ``group`` agree on the slowest rank's times); a path slower than
    :data:`SCREEN` x the fastest keeps that time, the others the median of :data:`ROUNDS`
    rotated rounds, all ranks at once."""
    group = group if group is not None else CommGroup()
    device = torch.device(device)
    names = list(steps)
    first = _agreed([t[0] for t in time_rotated(
        len(names), lambda i: steps[names[i]](), 1, 1, group, device)], group)
    kept = [n for n, t in zip(names, first, strict=True) if t <= SCREEN * min(first)]
    rows = time_rotated(len(kept), lambda i: steps[kept[i]](), 0, ROUNDS, group, device)
    out = dict(zip(names, first, strict=True))
    out.update({n: statistics.median(r) for n, r in zip(kept, rows, strict=True)})
    return out


def _agreed(values: list[float], group: CommGroup) -> list[float]:
    """The slowest rank's value of each entry (every rank returns the same list)."""
    if group.size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=group.device)
    group.all_reduce(t, op=dist.ReduceOp.MAX, name="attention paths")
    return t.tolist()


def measure(shapes: AttentionShapes, timer: Timer) -> Table:
    """Seconds per forward + backward of every candidate path for each of ``shapes.kinds``."""
    return {kind: {p: float(t) for p, t in timer(path_steps(shapes, kind)).items()}
            for kind in shapes.kinds}


def _valid(table: object, shapes: AttentionShapes) -> bool:
    """A table holding a positive, finite time of every candidate for every kind."""
    return isinstance(table, dict) and all(
        isinstance(table.get(kind), dict) and all(
            isinstance(t := table[kind].get(p), (int, float)) and not isinstance(t, bool)
            and math.isfinite(t) and t > 0 for p in shapes.candidates)
        for kind in shapes.kinds)


def choose(table: Table, shapes: AttentionShapes, source: str = "measured"
           ) -> AttentionChoice:
    """Each kind's path: the first of :data:`~domino.runtime.ATTENTION_PATHS` within
    :data:`MARGIN` of the fastest (a path must win clearly to replace PyTorch's own choice);
    the explicit variant under dropout: the one of lower total time over the kinds. Kinds the
    run does not use keep PyTorch's choice."""
    picks = {}
    for kind in shapes.kinds:
        times = {p: table[kind][p] for p in shapes.candidates}
        best = min(times.values())
        picks[kind] = next(p for p, t in times.items() if t <= best * (1.0 + MARGIN))
    variants = [p for p in ("explicit", "explicit_fp32") if p in shapes.candidates]
    explicit = min(variants, key=lambda p: (sum(table[k][p] for k in shapes.kinds),
                                            variants.index(p)))
    times = "; ".join(f"{k}: " + ", ".join(f"{p} {table[k][p] * 1e3:.3g}"
                                           for p in shapes.candidates)
                      for k in shapes.kinds)
    return AttentionChoice(**picks, explicit=explicit,
                           source=f"{source} at {shapes.describe()}; ms per fwd+bwd {times}")


def measured_choice(shapes: AttentionShapes, group: CommGroup | None = None,
                    timer: Timer | None = None) -> AttentionChoice:
    """The paths for ``shapes``: from the cache when every rank of ``group`` has them, else
    measured by all of them together with ``timer`` (default :func:`time_paths`) and cached;
    chosen (:func:`choose`) from the slowest rank's times."""
    group = group if group is not None else CommGroup()
    key = shapes.cache_key(torch.get_num_threads())
    path = cache_root() / CACHE_FILE
    table = read_cache(path).get(key)
    cached = _agreed([0.0 if _valid(table, shapes) else 1.0], group)[0] == 0.0
    if not cached:
        if timer is None:
            def timer(steps: Mapping[str, Callable[[], None]]) -> dict[str, float]:
                return time_paths(steps, group, shapes.device)
        table = measure(shapes, timer)
    assert isinstance(table, dict)
    order = [(k, p) for k in shapes.kinds for p in shapes.candidates]
    flat = _agreed([float(table[k][p]) for k, p in order], group)
    table = {k: {p: flat[order.index((k, p))] for p in shapes.candidates} for k in shapes.kinds}
    if not cached:
        update_cache(path, key, table)  # (a read-only cache folder: measured again next time)
    return choose(table, shapes, "cached" if cached else "measured")


def resolve_attention(runtime: RuntimeConfig, shapes: AttentionShapes | None,
                      group: CommGroup | None = None, timer: Timer | None = None
                      ) -> RuntimeConfig:
    """``runtime`` with ``attention_backend='auto'`` measured for ``shapes`` (every rank of
    ``group`` calls this, before it builds its model); a fixed backend, or no shapes (context
    parallelism runs its own attention kernels), is returned as it is."""
    if runtime.attention_backend != "auto" or shapes is None:
        return runtime
    return runtime.replace(attention_measured=measured_choice(shapes, group, timer))


def attention_text(runtime: RuntimeConfig, cp: int = 1) -> str:
    """What a run's header says of its core attention: the backend asked for, each mask
    kind's path and where the choice came from (``cp`` > 1: the ring's own kernels run)."""
    if cp > 1:
        return (f"context parallel ({runtime.cp_comm_type}): its own fused kernels per K/V "
                "block (attention_backend not used)")
    return f"{runtime.attention_backend}: {runtime.attention_paths.describe()}"
