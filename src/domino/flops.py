"""Model FLOPs and model-FLOPs utilisation (MFU).

The count is the standard one (Megatron-LM's, PaLM's): the matrix multiplies a model needs, not
what an implementation happens to run. Per token and layer, forward:

* every linear layer's GEMM: 2 x in x out (QKV: hidden x (heads + 2 x kv groups) x head dim;
  the attention output; the MLP: two GEMMs of hidden x ffn, three with a gated (SwiGLU) unit),
* attention: 2 x 2 x seq x (heads x head dim) for the scores (Q K^T) and the context (P V), the
  full seq x seq matrix even where a causal kernel skips about half of it (with a sliding
  window shorter than the sequence, the window's keys instead of seq),
* and once per token the LM head: 2 x hidden x padded vocabulary (the logits GEMM).

An MoE layer's MLP counts what a token goes through: its top-k experts' MLPs, the shared
expert, and the router (2 x hidden x experts); the experts it does not use are not counted.

A training step costs 3x its forward (backward: an input gradient and a weight gradient per
GEMM). Norms, activations, softmax and embedding look-ups are not counted; nor is activation
recomputation (it repeats work the model does not need). For a plain GPT (4h MLP, no GQA) this is
Megatron's ``72 B s L h^2 (1 + s / 6h + V / 12hL)``.

MFU divides a rank's share of these FLOPs per second by a peak: on CUDA the device's dense peak
for the dtype (:data:`CUDA_PEAK_TFLOPS`), on CPU the rate this machine reaches on the model's own
GEMM shapes (:mod:`domino.gemm_rate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Dense (no sparsity) tensor-core peaks, TFLOP/s, of the SXM parts: (bf16, fp32). fp32 is the
# non-tensor-core FP32 rate (TF32 is not fp32). Matched against torch.cuda.get_device_name.
CUDA_PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "B200": (2250.0, 80.0),
    "H200": (989.0, 67.0),
    "H100 PCIe": (756.0, 51.0),
    "H100": (989.0, 67.0),
    "A100": (312.0, 19.5),
}


@dataclass(frozen=True)
class Gemm:
    """``count`` GEMMs of [m, k] x [k, n] (2 m k n FLOPs each). ``layout`` is how the operands
    lie in memory, as the linear layers run them: ``nt`` the forward (x @ W^T, W stored
    [n, k]), ``nn`` the input gradient (dy @ W), ``tn`` the weight gradient (dy^T @ x). On a
    CPU without bf16 instructions one bf16 shape runs at 1-15 GFLOP/s depending on it."""

    m: int
    k: int
    n: int
    count: int = 1
    layout: str = "nn"

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count


def _layer_linears(config) -> list[tuple[int, int, str]]:
    """(in, out, parallel) of one layer's linear layers; parallel is "column" (output sharded
    over TP) or "row" (input sharded)."""
    h, d = config.hidden_size, config.kv_channels
    qkv = (config.num_attention_heads + 2 * config.num_query_groups) * d
    ffn = config.ffn_hidden_size
    gated = config.activation in ("swiglu", "geglu_tanh")
    return [(h, qkv, "column"), (config.num_attention_heads * d, h, "row"),
            (h, ffn * (2 if gated else 1), "column"), (ffn, h, "row")]


def _mlp_flops(config, moe: bool) -> float:
    """A token's forward FLOPs in a layer's MLP (dense, or MoE: see the module docstring)."""
    h, gemms = config.hidden_size, 3 if config.activation in ("swiglu", "geglu_tanh") else 2

    def mlp(ffn: int) -> float:
        return 2.0 * h * ffn * gemms

    if not moe:
        return mlp(config.ffn_hidden_size)
    out = config.moe_router_topk * mlp(config.moe_ffn_hidden_size) + 2.0 * h * config.num_experts
    if config.moe_shared_expert_intermediate_size:
        out += mlp(config.moe_shared_expert_intermediate_size)
    return out


def forward_flops_per_token(config, *, tp: int = 1, head: bool = True,
                            layers: int | None = None, attention: bool = True) -> float:
    """Model FLOPs of one token's forward (``head``: with the LM head over the vocabulary as
    padded for ``tp`` ranks; ``layers``: this many transformer layers, default the config's;
    ``attention`` False: the layers' MLPs only)."""
    layers = config.num_layers if layers is None else layers
    keys = min(config.seq_length, config.window_size or config.seq_length)
    attention = attention and (sum(2.0 * i * o for i, o, _ in _layer_linears(config)[:2])
                               + 4.0 * keys * config.num_attention_heads * config.kv_channels)
    out = sum(attention + _mlp_flops(config, config.is_moe_layer(i)) for i in range(layers))
    if head:
        out += 2.0 * config.hidden_size * config.padded_vocab_size(tp)
    return out


def train_flops_per_step(config, tokens: int, *, tp: int = 1, head: bool = True,
                         layers: int | None = None, attention: bool = True) -> float:
    """Model FLOPs of a training step over ``tokens`` tokens (all ranks together): 3x forward."""
    return 3.0 * tokens * forward_flops_per_token(config, tp=tp, head=head, layers=layers,
                                                  attention=attention)


def rank_gemms(config, tokens: int, tp: int) -> list[Gemm]:
    """The GEMMs one TP rank runs for one layer's forward and backward over ``tokens`` tokens:
    the shapes a GEMM-rate measurement should time (their rate is what this rank can reach)."""
    out = []
    for i, o, parallel in _layer_linears(config):
        if parallel == "column":
            o //= tp
        else:
            i //= tp
        out += [Gemm(tokens, i, o, layout="nt"), Gemm(tokens, o, i, layout="nn"),
                Gemm(o, tokens, i, layout="tn")]  # forward, input and weight gradients
    return out


def cuda_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The dense peak FLOP/s of ``device`` for ``dtype`` from :data:`CUDA_PEAK_TFLOPS`, or None
    for a device not in the table (give ``--peak-tflops``)."""
    name = torch.cuda.get_device_name(device)
    for key, (bf16, fp32) in CUDA_PEAK_TFLOPS.items():
        if key in name:
            if dtype in (torch.bfloat16, torch.float16):
                return bf16 * 1e12
            return fp32 * 1e12 if dtype == torch.float32 else None
    return None


def check_peak_tflops(value: float | None) -> None:
    """Raise ValueError unless ``--peak-tflops`` is left out or positive."""
    if value is not None and not value > 0:
        raise ValueError(f"--peak-tflops={value} must be > 0 (TFLOP/s per rank); leave it out "
                         "to use the device's peak or the measured GEMM rate")


def utilisation(flops_per_step: float | None, ranks: int, step_time_s: float,
                peak_flops: float | None) -> tuple[float | None, float | None]:
    """(model FLOP/s per rank, MFU) of a step of ``flops_per_step`` model FLOPs over ``ranks``
    ranks taking ``step_time_s``; None where the count or the peak is unknown."""
    if flops_per_step is None:
        return None, None
    per_rank = flops_per_step / ranks / step_time_s
    return per_rank, (per_rank / peak_flops if peak_flops else None)
