"""Helpers shared by the tensor-parallel tests: configs, weight sharding, error measures.

Sharding here is written from its definition (a parameter tagged ``partition_dim`` d and
``partition_stride`` s is s equal blocks along d, each cut into ``tp`` contiguous chunks), not
with the library's own helpers, so that a sharding bug in the library shows up as a mismatch.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from domino import TransformerConfig
from domino.tensor_parallel import CommGroup

TOL = 1e-5  # fp32: relative to the largest magnitude of the expected tensor
FLOOR = 1e-3  # below this scale the error is absolute: TOL * FLOOR = 1e-8


@contextlib.contextmanager
def one_thread():
    """Run in-process model code on one thread: on a busy 2-core machine, OpenMP threads that
    spin against other processes make tiny models tens of times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- one spawn per TP size for the whole session ------------------------------------------------
#
# Starting gloo ranks costs seconds (much more on a busy machine), so every test module
# registers its rank checks per TP size at import; the first test that needs a TP size runs all
# registered checks of that size in one spawn, each on a fresh ParallelState, and caches what
# each returned. A check that raises is reported to its own module's tests only; checks after it
# in that spawn are retried in a new spawn.

_REGISTRY: dict[int, list] = {}
_DONE: dict[int, dict] = {}


def _key(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def register(world: int, fn) -> None:
    """Run ``fn(state)`` (module level) on ``world`` TP ranks in the session's shared spawn."""
    fns = _REGISTRY.setdefault(world, [])
    if _key(fn) not in {_key(f) for f in fns}:
        fns.append(fn)


def _suite_rank(rank: int, world: int, fns: list) -> dict:
    import traceback

    from domino import ParallelState

    out = {}
    for fn in fns:
        try:
            out[_key(fn)] = ("ok", fn(ParallelState.build(world)))
        except Exception:  # noqa: BLE001 - reported to the check's own tests
            out[_key(fn)] = ("error", f"rank {rank}:\n{traceback.format_exc()}")
            break  # the other ranks may now be out of step: stop this spawn here
    return out


def tp_results(world: int, fn) -> list:
    """What ``fn`` returned on each of ``world`` ranks (rank order)."""
    from dist import run_distributed

    register(world, fn)
    done = _DONE.setdefault(world, {})
    while _key(fn) not in done:
        pending = [f for f in _REGISTRY[world] if _key(f) not in done]
        try:
            per_rank = run_distributed(_suite_rank, world, pending)
        except Exception as exc:  # noqa: BLE001 - a rank died outright: blame the asker only
            done[_key(fn)] = ("error", f"the TP={world} spawn failed: {exc!r}")
            break
        for f in pending:
            entries = [r.get(_key(f)) for r in per_rank]
            errors = [e[1] for e in entries if e is not None and e[0] == "error"]
            if errors:
                done[_key(f)] = ("error", "\n".join(errors))
            elif all(e is not None for e in entries):
                done[_key(f)] = ("ok", [e[1] for e in entries])
    kind, value = done[_key(fn)]
    if kind == "error":
        raise RuntimeError(f"{_key(fn)} failed at TP={world}:\n{value}")
    return value


def config(**overrides) -> TransformerConfig:
    """A tiny deterministic (dropout-free, sync-schedule) model config."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=100,
                seq_length=8, max_position_embeddings=16, hidden_dropout=0.0,
                attention_dropout=0.0, domino_micro_batches=1, domino_overlap="none")
    base.update(overrides)
    return TransformerConfig(**base)


def rel_err(a: torch.Tensor | None, b: torch.Tensor | None, floor: float = FLOOR) -> float:
    """max |a - b| / max(max |b|, floor); inf on a shape mismatch or a missing tensor."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    if not torch.isfinite(a).all():
        return math.inf
    return (a - b).abs().max().item() / max(b.abs().max().item(), floor)


def is_vocab_param(name: str) -> bool:
    """Parameters whose first dim is the (TP-dependent) padded vocabulary."""
    return name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight") \
        or name == "word_embeddings"


def fit_rows(full: torch.Tensor, rows: int, valid: int) -> torch.Tensor:
    """Keep the first ``valid`` rows of ``full`` and zero-pad to ``rows`` rows."""
    out = full.new_zeros((rows, *full.shape[1:]))
    out[:valid] = full[:valid]
    return out


def shard(full: torch.Tensor, like: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """This rank's shard of ``full`` for a parameter ``like`` (replicated: ``full`` itself)."""
    if group.size == 1 or not getattr(like, "tensor_model_parallel", False):
        return full
    dim, stride = like.partition_dim, like.partition_stride
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(group.size, dim=dim)[group.rank] for b in blocks], dim=dim)


def expected_local(name: str, full: torch.Tensor, like: torch.Tensor, group: CommGroup,
                   vocab: int) -> torch.Tensor:
    """What the TP parameter (or gradient) ``like`` should hold, given the unsharded ``full``."""
    if is_vocab_param(name):
        full = fit_rows(full, like.shape[0] * group.size, vocab)
    return shard(full, like, group)


def perturb(model: nn.Module, seed: int, scale: float = 0.05, vocab: int | None = None) -> None:
    """Add noise to every parameter (biases and norm weights included, which init leaves at
    0 / 1 and would hide bugs); padded vocabulary rows stay zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * scale
            if vocab is not None and is_vocab_param(name):
                noise[vocab:] = 0
            p.add_(noise.to(p.dtype))


def copy_weights(model: nn.Module, ref: nn.Module, group: CommGroup, vocab: int) -> None:
    """Load the unsharded weights of ``ref`` into the TP ``model`` (same structure)."""
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(expected_local(name, ref_params[name], p, group, vocab))


def grad_errors(model: nn.Module, ref: nn.Module, group: CommGroup, vocab: int) -> dict:
    """Per parameter: error of this rank's gradient vs its share of the reference gradient."""
    ref_params = dict(ref.named_parameters())
    out = {}
    for name, p in model.named_parameters():
        r = ref_params[name]
        if p.grad is None or r.grad is None:
            out[name] = math.inf
            continue
        out[name] = rel_err(p.grad, expected_local(name, r.grad, p, group, vocab))
    return out


def weight_errors(model: nn.Module, ref: nn.Module, group: CommGroup, vocab: int) -> dict:
    ref_params = dict(ref.named_parameters())
    return {name: rel_err(p, expected_local(name, ref_params[name], p, group, vocab))
            for name, p in model.named_parameters()}


class TinyOptimizer:
    """SGD with momentum, or AdamW, written out (``torch.optim`` imports ``torch._dynamo``,
    seconds per process). Element-wise, so a sharded and an unsharded model given the same
    gradients take the same steps. Adam's ``eps`` is large on purpose: a gradient that is
    mathematically zero (e.g. the key bias) is rounding noise that Adam would blow up to a
    full-size step of random sign."""

    def __init__(self, params, kind: str, lr: float, momentum: float = 0.9,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-4,
                 weight_decay: float = 0.01) -> None:
        self.params, self.kind, self.lr = list(params), kind, lr
        self.momentum, self.betas, self.eps, self.weight_decay = momentum, betas, eps, weight_decay
        self.state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self.params]
        self.steps = 0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        b1, b2 = self.betas
        for p, (m, v) in zip(self.params, self.state, strict=True):
            if p.grad is None:
                continue
            g = p.grad
            if self.kind == "sgd":
                m.mul_(self.momentum).add_(g)
                p.sub_(self.lr * m)
                continue
            p.mul_(1.0 - self.lr * self.weight_decay)
            m.mul_(b1).add_((1 - b1) * g)
            v.mul_(b2).add_((1 - b2) * g * g)
            m_hat, v_hat = m / (1 - b1 ** self.steps), v / (1 - b2 ** self.steps)
            p.sub_(self.lr * m_hat / (v_hat.sqrt() + self.eps))


def snapshot_grads(model: nn.Module) -> dict:
    return {n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters()}


def grads_vs(model: nn.Module, expected: dict) -> dict:
    return {n: rel_err(p.grad, expected[n]) for n, p in model.named_parameters()}


def failures(errors: dict, tol: float = TOL) -> dict:
    return {k: v for k, v in errors.items() if not v <= tol}
