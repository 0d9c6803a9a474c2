"""The dtype conversions of one bf16 training step (fp32 masters, TP=1, AdamW), counted as they
dispatch (``aten::_to_copy`` and ``aten::copy_`` between floating dtypes) and held to an
itemised table: each one there for a reason (docs/performance.md#casts-per-step). A new cast
anywhere in the step, or one more per use of something already cast, fails the test."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tp_helpers import config, one_thread, perturb

from domino import ParallelState
from domino.gpt_model import GPTModel
from domino.runtime import RuntimeConfig
from domino.tensor_parallel.layers import LATE_WGRAD_CHUNKS
from domino.training.adamw import AdamW
from domino.transformer import Plan

B, S, H, FFN, HEADS = 4, 12, 32, 128, 4  # (S != head dim: distinct shapes)
F32, BF16 = "float32", "bfloat16"
VARIANTS = {"ln_gelu": {}, "rms_swiglu_rope_gqa": dict(
    normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
    num_query_groups=2, add_bias_linear=False)}


class _Casts(TorchDispatchMode):
    """(source dtype, target dtype, shape) of every conversion between floating dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        src, dst = ((args[0], out) if name == "_to_copy" else
                    (args[1], args[0]) if name == "copy_" else (None, None))
        if (src is not None and src.is_floating_point() and dst.is_floating_point()
                and src.dtype != dst.dtype):
            self.seen[(_name(src.dtype), _name(dst.dtype), tuple(src.shape))] += 1
        return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _step_casts(variant: str, path: str) -> tuple[Counter, GPTModel, object]:
    """The conversions of the second of two training steps (the first makes the optimizer's
    state; the second casts the weights its update changed, as every later step does)."""
    cfg = config(hidden_size=H, num_attention_heads=HEADS, seq_length=S, **VARIANTS[variant])
    torch.manual_seed(0)
    model = GPTModel(cfg, parallel_state=ParallelState.single(), runtime=RuntimeConfig(
        plan=Plan(1, "none", 1), compute_dtype=torch.bfloat16, attention_backend=path))
    perturb(model, seed=1, vocab=cfg.vocab_size)
    opt = AdamW(list(model.parameters()), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(2))
    record = _Casts()
    for counted in (False, True):
        with record if counted else contextlib.nullcontext():
            opt.zero_grad()
            model(ids[:, :-1], None, None, labels=ids[:, 1:]).mean().backward()
            opt.step()
    return record.seen, model, cfg


# The attention's own conversions per layer, by path (kernels.attention), in bf16:
# (source, target, shape) -> count.
SCORES = (B, HEADS, S, S)
QKV = (B, HEADS, S, H // HEADS)
KT = (B, HEADS, H // HEADS, S)  # K transposed
ATTENTION = {
    "flash": {},  # PyTorch's fused kernel accumulates in fp32 inside: no conversion
    # Scores to fp32 for the softmax (softmax_in_fp32), probabilities back to bf16 for P V;
    # in backward each one's gradient the other way.
    "explicit": {(BF16, F32, SCORES): 2, (F32, BF16, SCORES): 2},
    # Also Q, K^T, V and P up for the two fp32 matmuls and the context down; their
    # gradients the other way.
    "explicit_fp32": {(BF16, F32, QKV): 3, (F32, BF16, QKV): 3, (BF16, F32, KT): 1,
                      (F32, BF16, KT): 1, (BF16, F32, SCORES): 2, (F32, BF16, SCORES): 2},
    # PyTorch's own math backend (torch 2.13) computes bf16 in fp32: Q, K, V and the output
    # gradient up, the output and the three input gradients down, and one scores tensor.
    "math": {(BF16, F32, QKV): 4, (F32, BF16, QKV): 4, (F32, BF16, SCORES): 1},
}


def _expected(model: GPTModel, cfg, variant: str, path: str) -> dict[str, tuple[Counter, str]]:
    """The itemised table: reason -> (conversions, why it must happen)."""
    layers, vocab = cfg.num_layers, model.language_model.embedding.word_embeddings.weight.shape[0]
    params = list(model.parameters())
    rms, rope = variant != "ln_gelu", variant != "ln_gelu"
    rows: dict[str, tuple[Counter, str]] = {}

    def row(name: str, why: str, items: dict) -> None:
        rows[name] = (Counter({k: v for k, v in items.items() if v}), why)

    row("compute copies", "each fp32 master cast to bf16 once per step (domino.precision)",
        Counter((F32, BF16, tuple(p.shape)) for p in params))
    # Gradients made in bf16, added into the fp32 main gradient (.grad) of their master:
    linears = [p for n, p in model.named_parameters()
               if p.dim() == 2 and "embeddings" not in n]
    biases = [p for n, p in model.named_parameters() if n.endswith(("qkv.bias", "fc1.bias"))]
    row("linear weight gradients", "the weight-gradient GEMM runs in bf16; its result is added "
        "into the fp32 master gradient (a CPU GEMM cannot write fp32 from bf16 inputs)",
        Counter((BF16, F32, tuple(p.shape)) for p in linears + biases))
    row("LM head weight gradient", f"the same, in {LATE_WGRAD_CHUNKS} row chunks (late work "
        "that runs under the last all-reduces)",
        {(BF16, F32, (vocab // LATE_WGRAD_CHUNKS, H)): LATE_WGRAD_CHUNKS})
    through_copy = [p for n, p in model.named_parameters()
                    if p.dim() == 1 and not n.endswith(("qkv.bias", "fc1.bias"))
                    or "embeddings" in n]
    row("other parameters' gradients", "norm weights and biases, row-parallel biases and "
        "embeddings: their bf16 gradient is cast where autograd adds it into the fp32 master's",
        Counter((BF16, F32, tuple(p.shape)) for p in through_copy))
    row("loss", "the cross entropy in fp32 (its logits cast up), its gradient back to the bf16 "
        "LM head", {(BF16, F32, (S, B, vocab)): 1, (F32, BF16, (S, B, vocab)): 1})
    norms = 2 * layers + 1
    row("RMSNorm statistics", "RMSNorm normalises in fp32 and rounds (transformers' Llama, bit "
        "for bit), and its backward casts the gradient both ways", {
            (BF16, F32, (S, B, H)): 2 * norms * rms, (F32, BF16, (S, B, H)): 2 * norms * rms})
    row("RoPE cos/sin", "fp32 angles' cos and sin rounded to bf16 once per layer for q and k, "
        "as transformers does", {(F32, BF16, (S, B, 1, H // HEADS)): 2 * layers * rope})
    row(f"attention ({path})", "the path's own conversions per layer (see ATTENTION)",
        {k: v * layers for k, v in ATTENTION[path].items()})
    return rows


CASES = [("ln_gelu", path) for path in ATTENTION] + [("rms_swiglu_rope_gqa", "flash")]


@pytest.mark.parametrize(("variant", "path"), CASES)
def test_bf16_step_casts_only_what_it_must(variant: str, path: str) -> None:
    with one_thread():
        seen, model, cfg = _step_casts(variant, path)
    table = _expected(model, cfg, variant, path)
    expected = sum((c for c, _ in table.values()), Counter())
    rows = "\n".join(f"  {sum(c.values()):3d} {name}: {why}" for name, (c, why) in table.items())
    assert seen == expected, (f"unexpected conversions: {dict(seen - expected)}; missing: "
                              f"{dict(expected - seen)}; the table:\n{rows}")
    # The totals per step (docs/performance.md): with PyTorch's fused kernel, the attention
    # adds none; before the attention path was measured, bf16 on a CPU always ran the math
    # backend (+9 per layer) and RoPE rounded cos and sin for q and k apart (+2 per layer).
    per_model = {"ln_gelu": 62, "rms_swiglu_rope_gqa": 58}[variant]
    attention = sum(table[f"attention ({path})"][0].values())
    assert sum(seen.values()) == per_model + attention == per_model + {
        "flash": 0, "explicit": 8, "explicit_fp32": 24, "math": 18}[path]
