"""The work of each piece between its GEMMs and collectives, as pure functions of tensors that
``torch.compile`` can fuse (``RuntimeConfig.compile``).

A piece (``executor``) is GEMMs, whose weight gradients a schedule defers; collectives, which it
launches and waits; dropout draws from the TP-aware generators; and between them element-wise
and small work - a local piece's bias + dropout + residual + norm, the attention's RoPE and
core attention, the MLP's activation. Only that last kind is compiled, and each function is
compiled whole (``fullgraph=True``: a graph break is an error, not a silent fallback), so a
collective never lands inside a compiled region and the schedule keeps its overlap. The
GEMMs stay eager: compiling one GEMM gains nothing (it calls the same library kernel), and
their deferred weight gradients are side effects a graph cannot hold. Dropout masks are drawn
eagerly from the same generators and passed in, so compiled and eager runs draw the same masks.

Parameters come in as arguments (their compute copies), never as attributes, so every layer
runs the same compiled graph. Shapes are static (``dynamic=False``): each micro-batch size
compiles once - a step's split has at most two, so the first step compiles everything a run
needs - and the generated code is specialised to it. Dynamic shapes would not save those
compiles here: dynamo still specialises the first micro-batch, whose slices start at storage
offset 0, apart from the others. :class:`Kernels` holds the functions a model runs - eager ones, or
compiled ones with a :class:`CompileLog` of what compiling cost.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from domino.runtime import AttentionChoice
from domino.transformer.rope import apply_rotary, rotary_cos_sin

PYTORCHS_CHOICE = AttentionChoice()  # attention's paths where none were measured
# A norm as a kernel reads it: (weight, bias or None, eps, rms).
NormArgs = tuple[torch.Tensor, torch.Tensor | None, float, bool]


def norm(x: torch.Tensor, args: NormArgs) -> torch.Tensor:
    """LayerNorm, or RMSNorm (computed in fp32) when ``args[3]``. An RMSNorm multiplies by
    its weight in the weight's dtype: a weight in x's dtype scales the rounded normalised x
    (Llama's order), an fp32 weight of low-precision x scales before rounding (Gemma's)."""
    weight, bias, eps, rms = args
    if rms:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if weight.dtype == torch.float32:
            return (out * weight).to(x.dtype)
        return out.to(x.dtype) * weight
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def local(out: torch.Tensor | None, bias: torch.Tensor | None, keep: torch.Tensor | None,
          scale: float, residual: torch.Tensor, norm_args: NormArgs | None,
          post_norm: bool, multiplier: float = 1.0,
          exit_norm: NormArgs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A local piece: the previous block's exit (``out`` + ``bias``, normalised by
    ``exit_norm`` when given (OLMo 2's norm after the sublayer), times ``multiplier``
    (Granite's residual_multiplier), dropout by ``keep`` x ``scale``, + ``residual``; with
    ``out`` None, ``residual`` is the stream already) and the next block's entry norm ->
    (norm output, the residual it carries: the norm output itself when ``post_norm``).
    Without a norm both are the stream."""
    h = residual
    if out is not None:
        if bias is not None:
            out = out + bias
        if exit_norm is not None:
            out = norm(out, exit_norm)
        if multiplier != 1.0:
            out = out * multiplier
        if keep is not None:
            out = out * keep * scale
        h = residual + out
    if norm_args is None:
        return h, h
    ln = norm(h, norm_args)
    return ln, (ln if post_norm else h)


def split_qkv(qkv: torch.Tensor, rotary: torch.Tensor | None, groups: int, q_per_group: int,
              head_dim: int, q_norm: NormArgs | None = None, k_norm: NormArgs | None = None,
              rotary_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused QKV GEMM's output [s, b, groups * (q_per_group + 2) * d] -> q [s, b, heads, d]
    and k, v [s, b, groups, d]; each head's q and k normalised by ``q_norm`` / ``k_norm`` when
    given (Qwen3's), then rotated by ``rotary`` (RoPE angles) when given, the rotated channels
    times ``rotary_scale`` (a RoPE scaling's attention factor: YaRN's, LongRoPE's)."""
    sq, b = qkv.shape[0], qkv.shape[1]
    qkv = qkv.view(sq, b, groups, q_per_group + 2, head_dim)
    q = qkv[:, :, :, :q_per_group].reshape(sq, b, groups * q_per_group, head_dim)
    k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
    if q_norm is not None:
        q, k = norm(q, q_norm), norm(k, k_norm)
    if rotary is not None:
        cos_sin = rotary_cos_sin(rotary, q.dtype, rotary_scale)  # once for q and k
        q, k = apply_rotary(q, rotary, cos_sin=cos_sin), apply_rotary(k, rotary, cos_sin=cos_sin)
    return q, k, v


def causal_mask(sq: int, sk: int, device: torch.device,
                window: int | None = None) -> torch.Tensor:
    """[sq, sk] bool, True where key j lies after query i (queries are the last sq positions)
    or, with a sliding ``window``, ``window`` or more positions before it."""
    q_pos = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
    k_pos = torch.arange(sk, device=device).unsqueeze(0)
    masked = k_pos > q_pos
    if window is not None:
        masked = masked | (k_pos <= q_pos - window)
    return masked


def merge_masks(mask: torch.Tensor | None, causal: bool, sq: int, sk: int,
                device: torch.device, window: int | None = None) -> torch.Tensor | None:
    """``mask`` with the causal (and sliding-window) rule added when ``causal``. A window only
    applies to causal attention (as in Mistral)."""
    if not causal:
        return mask
    c = causal_mask(sq, sk, device, window)
    return c if mask is None else (mask | c)


def mask_kind(mask: torch.Tensor | None, causal: bool, sq: int, sk: int,
              window: int | None) -> str:
    """Which :class:`~domino.runtime.AttentionChoice` entry an attention call takes:
    ``windowed`` (a sliding window shorter than the keys), ``causal`` (the causal rule alone,
    as many queries as keys: SDPA's ``is_causal``) or ``masked`` (an additive mask, or none)."""
    if window is not None and causal and window < sk:
        return "windowed"
    return "causal" if mask is None and causal and sq == sk else "masked"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              causal: bool, keep: torch.Tensor | None, p: float,
              softmax_fp32: bool, q_per_group: int = 1,
              window: int | None = None, softmax_scale: float | None = None,
              softcap: float | None = None, sinks: torch.Tensor | None = None,
              paths: AttentionChoice = PYTORCHS_CHOICE) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), masked) v for q [sq, b, n, d], k/v [sk, b, n / q_per_group, d]
    -> [sq, b, n*d]; ``keep`` [b, n, sq, sk] (with ``p``): the dropout mask of the
    probabilities (see :func:`attention_keep`), None without dropout. ``softmax_scale``, when
    given, replaces 1/sqrt(d) (Granite's attention_multiplier); ``softcap`` caps the scaled
    scores at cap * tanh(scores / cap) before the mask (Gemma 2's); ``sinks`` [n] (GPT-OSS's
    attention sinks): a logit per head that joins each query's softmax denominator, then is
    dropped (a query may so attend to less than one whole key).

    ``mask`` is bool (True = masked out); ``causal`` adds the causal rule, and ``window`` (with
    ``causal``) masks keys ``window`` or more positions before the query. Masked scores take the
    dtype's minimum rather than -inf: a row whose keys are all masked (e.g. a padding query) stays
    finite instead of turning into NaN. Without dropout, a cap or sinks this runs the path
    ``paths`` names for the mask (PyTorch's scaled_dot_product_attention, fused or on its math
    backend, or explicit matmuls); with dropout the masks come from our TP-aware generator, and
    a cap or sinks have no fused kernel, so the softmax is explicit. ``paths`` (an
    :class:`~domino.runtime.AttentionChoice`, measured on the machine by
    :mod:`~domino.transformer.attention_paths`) names the path of each kind of mask
    (:func:`mask_kind`), and the explicit variant (matmuls in the dtype or in fp32) where only
    the explicit path can run.
    """
    if q_per_group > 1:  # grouped-query attention: each K/V head serves q_per_group queries
        k, v = k.repeat_interleave(q_per_group, dim=2), v.repeat_interleave(q_per_group, dim=2)
    sq, b, n, d = q.shape
    sk = k.shape[0]
    qh, kh, vh = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b,n,s,d]
    if window is not None and window >= sk:
        window = None  # it covers every key: plain causal attention
    explicit = keep is not None or softcap is not None or sinks is not None
    path = paths.explicit if explicit else paths.path(mask_kind(mask, causal, sq, sk, window))
    if not explicit and path in ("flash", "math"):
        kwargs: dict = {"is_causal": True}
        if not (mask is None and causal and sq == sk and window is None):
            merged = merge_masks(mask, causal, sq, sk, q.device, window)
            bias = None
            if merged is not None:
                bias = torch.zeros(merged.shape, dtype=q.dtype, device=q.device)
                bias = bias.masked_fill(merged, torch.finfo(q.dtype).min)
            kwargs = {"attn_mask": bias}
        if softmax_scale is not None:
            kwargs["scale"] = softmax_scale
        with sdpa_kernel(SDPBackend.MATH) if path == "math" else contextlib.nullcontext():
            ctx = F.scaled_dot_product_attention(qh, kh, vh, **kwargs)
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, n * d)
    # explicit_fp32: the two batched matmuls in fp32 (the dropout mask is still drawn on the
    # compute-dtype probabilities: the same draws).
    fp32 = path == "explicit_fp32" and q.dtype != torch.float32

    def mm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x.float(), y.float()) if fp32 else torch.matmul(x, y)

    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    scores = mm(qh, kh.transpose(-1, -2)) * scale
    if softmax_fp32:
        scores = scores.float()
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    merged = merge_masks(mask, causal, sq, sk, q.device, window)
    if merged is not None:
        scores = scores.masked_fill(merged, torch.finfo(scores.dtype).min)
    probs = _softmax(scores, sinks).to(v.dtype)
    if keep is not None:
        probs = probs * keep * (1.0 / (1.0 - p))
    ctx = mm(probs, vh).to(v.dtype)  # [b, n, sq, d]
    return ctx.permute(2, 0, 1, 3).reshape(sq, b, n * d)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the keys of scores [b, n, sq, sk]; with ``sinks`` [n], each head's sink
    logit joins every row's denominator (one more column, dropped after)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    b, n, sq, _ = scores.shape
    sink = sinks.to(scores.dtype).view(1, n, 1, 1).expand(b, n, sq, 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def attention_keep(q: torch.Tensor, sk: int, p: float, training: bool,
                   generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor | None:
    """The dropout mask of :func:`attention`'s probabilities [b, n, sq, sk] for q
    [sq, b, n, d] (None when no dropout runs): drawn from ``generator`` as the explicit
    dropout of probabilities of ``dtype`` (v's) draws it."""
    if not training or p == 0.0:
        return None
    sq, b, n, _ = q.shape
    return torch.empty((b, n, sq, sk), dtype=dtype, device=q.device).bernoulli_(
        1.0 - p, generator=generator)


def activation(h: torch.Tensor, swiglu: bool, approximate: str, geglu: bool = False,
               alpha: float = 1.0, offset: float = 0.0,
               clamp: float | None = None) -> torch.Tensor:
    """The MLP's activation of fc1's output: SwiGLU of its [gate; up] halves, GeGLU (a GELU
    gate, ``approximate`` as GELU's: Gemma's) when ``geglu``, or GELU. A gated one as GPT-OSS's
    (:func:`glu_args`): the gate clamped to at most ``clamp`` and up to [-clamp, clamp], SwiGLU's
    gate g * sigmoid(``alpha`` g), times (up + ``offset``)."""
    if swiglu or geglu:
        gate, up = h.chunk(2, dim=-1)
        if clamp is not None:
            gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
        if geglu:
            act = F.gelu(gate, approximate=approximate)
        else:
            act = F.silu(gate) if alpha == 1.0 else gate * torch.sigmoid(gate * alpha)
        return act * (up + offset if offset else up)
    return F.gelu(h, approximate=approximate)


def glu_args(config) -> tuple[float, float, float | None]:
    """A config's (alpha, offset, clamp) of :func:`activation` (GPT-OSS's gated activation)."""
    return (config.swiglu_alpha, config.glu_linear_offset, config.activation_func_clamp_value)


@dataclass
class CompileLog:
    """What compiling has cost so far: forward graphs compiled and the wall time of the calls
    that compiled them (tracing, the backend's code generation; a backward graph the backend
    compiles lazily, in the first backward, is not in it)."""

    graphs: int = 0
    seconds: float = 0.0


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


KERNELS = ("local", "split_qkv", "attention", "activation")


@dataclass(frozen=True)
class Kernels:
    """The piece functions a model runs: eager (``backend`` None) or compiled by
    ``torch.compile`` with ``backend`` (``inductor`` generates fused code; ``aot_eager``
    traces and differentiates the same graphs without generating code, which tests use);
    ``attention`` runs the attention ``paths`` (a static argument of its graphs)."""

    backend: str | None = None
    log: CompileLog = field(default_factory=CompileLog, compare=False)
    paths: AttentionChoice = PYTORCHS_CHOICE
    eager: Kernels = field(init=False, compare=False, repr=False)  # see serving()
    local: Callable = field(init=False, compare=False)
    split_qkv: Callable = field(init=False, compare=False)
    attention: Callable = field(init=False, compare=False)
    activation: Callable = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "eager", self if self.backend is None
                           else Kernels(paths=self.paths))
        for name in KERNELS:
            fn = globals()[name]
            if name == "attention":
                fn = functools.partial(fn, paths=self.paths)
            if self.backend is not None:
                fn = _Compiled(torch.compile(fn, fullgraph=True, dynamic=False,
                                             backend=self.backend), self.log)
            object.__setattr__(self, name, fn)

    def serving(self, inference: bool) -> Kernels:
        """The kernels a forward runs: these, or with a KV cache (``inference``: generation)
        the eager ones, whose key length grows by one every token - static shapes would
        compile a graph per token."""
        return self.eager if inference else self

    @classmethod
    def of(cls, compile: bool, backend: str,
           paths: AttentionChoice = PYTORCHS_CHOICE) -> Kernels:
        """The kernels a runtime asks for (``RuntimeConfig.compile`` / ``compile_backend``,
        ``attention_paths``)."""
        return cls(backend if compile else None, paths=paths)


# Graphs one kernel may hold. Each is one kernel's variant: grad or no-grad (training,
# evaluation, a recomputed piece's first run), with or without dropout, bias or norm, dtype,
# micro-batch size (at most two per step: a split's sizes differ by one); a process that builds
# several models (tests, a bench of several modes) adds more. dynamo's default of 8 per
# function would then stop compiling it.
RECOMPILE_LIMIT = 64


class _Compiled:
    """A compiled function whose compiling calls are timed into a :class:`CompileLog`."""

    def __init__(self, fn: Callable, log: CompileLog) -> None:
        self.fn, self.log = fn, log

    def __call__(self, *args, **kwargs):
        import torch._dynamo

        before = _graphs_compiled()
        start = time.perf_counter()
        # Set and restored around the call (config.patch costs 10x more per call); a rank
        # runs its pieces on one thread. Older torch names the limit cache_size_limit.
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        limit = getattr(config, name)
        setattr(config, name, RECOMPILE_LIMIT)
        try:
            out = self.fn(*args, **kwargs)
        finally:
            setattr(config, name, limit)
        done = _graphs_compiled() - before
        if done:
            self.log.graphs += done
            self.log.seconds += time.perf_counter() - start
        return out
