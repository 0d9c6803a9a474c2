"""Model FLOPs against hand counts and Megatron's closed formula; the GEMM-rate cache; the peak
MFU is taken against."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from domino import gemm_rate
from domino.config import TransformerConfig
from domino.flops import (
    Gemm,
    check_peak_tflops,
    cuda_peak_flops,
    rank_gemms,
    train_flops_per_step,
    utilisation,
)


def _gpt2_like() -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100,
                             seq_length=32, max_position_embeddings=32)


def _llama_like() -> TransformerConfig:
    return TransformerConfig(num_layers=3, hidden_size=96, num_attention_heads=6,
                             num_query_groups=2, ffn_hidden_size=160, activation="swiglu",
                             normalization="RMSNorm", position_embedding_type="rope",
                             add_bias_linear=False, vocab_size=300, seq_length=16,
                             max_position_embeddings=16)


def test_a_plain_gpt_is_megatrons_formula() -> None:
    c = _gpt2_like()
    tokens, (L, h, s, V) = 4 * 32, (2, 64, 32, 128)  # vocabulary 100 padded to 128
    megatron = 72 * tokens * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert train_flops_per_step(c, tokens) == pytest.approx(megatron, rel=1e-12)


def test_gqa_swiglu_by_hand() -> None:
    c = _llama_like()
    # Per token, per layer, forward: QKV 2*96*(6+2*2)*16, output 2*96*96, SwiGLU 2*96*(2*160)
    # + 2*160*96, attention 2*2*16*96 (seq 16, heads x head dim = 96).
    layer = 2 * 96 * 160 + 2 * 96 * 96 + (2 * 96 * 320 + 2 * 160 * 96) + 4 * 16 * 96
    assert layer == 147456
    head = 2 * 96 * 384  # vocabulary 300 padded to 384 (128 x TP=1)
    assert train_flops_per_step(c, 10) == 3 * 10 * (3 * layer + head)
    # The head's padding follows TP (128 x 4 = 512); a stack without head counts layers only.
    assert train_flops_per_step(c, 10, tp=4) == 3 * 10 * (3 * layer + 2 * 96 * 512)
    assert train_flops_per_step(c, 10, head=False) == 3 * 10 * 3 * layer
    assert train_flops_per_step(c, 10, head=False, layers=1) == 3 * 10 * layer
    # A sliding window of 5 keys: attention 2*2*5*96 instead of seq 16; one as long as the
    # sequence changes nothing.
    windowed = dataclasses.replace(c, window_size=5)
    assert train_flops_per_step(windowed, 10, head=False, layers=1) == 3 * 10 * (
        layer - 4 * 16 * 96 + 4 * 5 * 96)
    assert train_flops_per_step(dataclasses.replace(c, window_size=64), 10) == \
        train_flops_per_step(c, 10)
    # MoE on layers 1 and 2 (the first stays dense): 8 experts of width 40, top-2, a shared
    # expert of width 24; per MoE layer 2 x SwiGLU(40) + SwiGLU(24) + the router 2*96*8.
    moe = dataclasses.replace(c, num_experts=8, moe_ffn_hidden_size=40, moe_router_topk=2,
                              moe_first_k_dense_layers=1,
                              moe_shared_expert_intermediate_size=24)
    dense_mlp = 2 * 96 * 320 + 2 * 160 * 96
    moe_mlp = 2 * (3 * 2 * 96 * 40) + 3 * 2 * 96 * 24 + 2 * 96 * 8
    assert train_flops_per_step(moe, 10, head=False) == 3 * 10 * (
        3 * layer + 2 * (moe_mlp - dense_mlp))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_ranks_gemms_are_its_share_of_the_layers(tp: int) -> None:
    c = _llama_like()
    gemms = rank_gemms(c, 64, tp)
    assert len(gemms) == 12  # 4 linears x (forward, input gradient, weight gradient)
    # QKV forward (x @ W^T) and weight gradient (dy^T @ x), as the layers lay them out
    assert Gemm(64, 96, 160 // tp, layout="nt") in gemms
    assert Gemm(160 // tp, 64, 96, layout="tn") in gemms
    assert Gemm(64, 160 // tp, 96, layout="nt") in gemms  # the MLP's row-parallel GEMM
    assert Gemm(64, 160 // tp, 96, layout="nn") in gemms  # the QKV input gradient (dy @ W)
    gemm_flops = 3 * 64 * (2 * 96 * 160 + 2 * 96 * 96 + 2 * 96 * 320 + 2 * 160 * 96)
    assert sum(g.flops for g in gemms) * tp == gemm_flops


def test_cuda_peaks_by_device_name(monkeypatch) -> None:
    names = iter(["NVIDIA H200", "NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4",
                  "NVIDIA B200", "NVIDIA H200", "Tesla T4"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: next(names))
    dev = torch.device("cuda", 0)
    assert [cuda_peak_flops(dev, torch.bfloat16) for _ in range(5)] == [
        989e12, 756e12, 989e12, 312e12, 2250e12]
    assert cuda_peak_flops(dev, torch.float32) == 67e12
    assert cuda_peak_flops(dev, torch.bfloat16) is None  # not in the table


def test_peak_override_and_an_unknown_gpu(monkeypatch) -> None:
    assert gemm_rate.peak_flops(torch.device("cpu"), torch.float32, [], 2.5) == (
        2.5e12, "of 2.5 TFLOP/s (--peak-tflops)")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    peak, what = gemm_rate.peak_flops(torch.device("cuda", 0), torch.bfloat16, [])
    assert peak is None and "--peak-tflops" in what and "Tesla T4" in what


def test_the_cpu_rate_is_measured_once_then_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DOMINO_CACHE_DIR", str(tmp_path))
    gemms = [Gemm(16, 32, 8), Gemm(8, 16, 32, count=2)]
    real = gemm_rate.measure
    calls = []

    def counting(g, dtype, device="cpu"):
        calls.append(dtype)
        return real(g, dtype, device)

    monkeypatch.setattr(gemm_rate, "measure", counting)
    peak, what = gemm_rate.peak_flops(torch.device("cpu"), torch.float32, gemms)
    assert peak > 0 and what == "of measured GEMM rate" and calls == [torch.float32]
    assert gemm_rate.gemm_rate(gemms, torch.float32) == peak and len(calls) == 1  # cached
    gemm_rate.gemm_rate(gemms, torch.bfloat16)  # another dtype, another entry
    assert calls == [torch.float32, torch.bfloat16]
    entries = json.loads((tmp_path / gemm_rate.CACHE_FILE).read_text())
    assert len(entries) == 2 and all("16x32x8" in k for k in entries)
    # A damaged cache is measured again (and rewritten), never trusted.
    (tmp_path / gemm_rate.CACHE_FILE).write_text("{not json")
    assert gemm_rate.gemm_rate(gemms, torch.float32) > 0 and len(calls) == 3
    assert len(json.loads((tmp_path / gemm_rate.CACHE_FILE).read_text())) == 1


def test_measure_weights_each_shape_by_its_count(monkeypatch) -> None:
    timed = []

    def fake(g, dtype, device):
        timed.append((g.m, g.k, g.n, g.layout))
        return {(4, 4, 4, "nn"): 1.0, (8, 8, 8, "nn"): 2.0, (8, 8, 8, "tn"): 3.0}[timed[-1]]

    monkeypatch.setattr(gemm_rate, "time_gemm", fake)
    rate = gemm_rate.measure([Gemm(4, 4, 4, count=2), Gemm(8, 8, 8), Gemm(4, 4, 4),
                              Gemm(8, 8, 8, layout="tn")], torch.float32)
    assert rate == pytest.approx((3 * 128 + 2 * 1024) / (3 * 1.0 + 2.0 + 3.0))
    # A repeated shape is timed once; another layout of it is another GEMM.
    assert timed == [(4, 4, 4, "nn"), (8, 8, 8, "nn"), (8, 8, 8, "tn")]


def test_each_layout_multiplies_the_operands_it_names(monkeypatch) -> None:
    seen = []
    real = torch.mm

    def spy(a, b, out=None):
        seen.append((a.shape, a.is_contiguous(), b.shape, b.is_contiguous()))
        return real(a, b, out=out)

    monkeypatch.setattr(torch, "mm", spy)
    for layout in ("nn", "nt", "tn"):
        seen.clear()
        gemm_rate.time_gemm(Gemm(3, 5, 7, layout=layout), torch.float32, torch.device("cpu"))
        a_t, b_t = layout[0] == "t", layout[1] == "t"
        assert set(seen) == {((3, 5), not a_t, (5, 7), not b_t)}, layout


def test_a_slow_gemm_is_timed_by_one_call(monkeypatch) -> None:
    calls = []
    real = torch.mm

    def slow_mm(a, b, out=None):
        calls.append(1)
        time.sleep(gemm_rate.MIN_TIME_S)
        return real(a, b, out=out)

    monkeypatch.setattr(torch, "mm", slow_mm)
    assert gemm_rate.time_gemm(Gemm(4, 4, 4), torch.float32, torch.device("cpu")) >= \
        gemm_rate.MIN_TIME_S
    assert len(calls) == 1
    monkeypatch.setattr(torch, "mm", lambda a, b, out=None: calls.append(1) or real(a, b, out=out))
    calls.clear()
    gemm_rate.time_gemm(Gemm(4, 4, 4), torch.float32, torch.device("cpu"))
    assert len(calls) >= 3  # a fast one: a warm-up, then at least two timed calls


def test_peak_tflops_rule_and_utilisation() -> None:
    check_peak_tflops(None)
    check_peak_tflops(0.5)
    for bad in (0.0, -2.0, float("nan")):
        with pytest.raises(ValueError, match="--peak-tflops=.* must be > 0"):
            check_peak_tflops(bad)
    assert utilisation(8e12, 2, 2.0, 4e12) == (2e12, 0.5)
    assert utilisation(8e12, 2, 2.0, None) == (2e12, None)
    assert utilisation(None, 2, 2.0, 4e12) == (None, None)
