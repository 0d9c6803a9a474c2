"""LoRA on the routed experts (``--lora-target-modules`` fc1 / fc2 of an MoE model): each expert's
adapters equal merging ``scale * A_e B_e`` into its weights (logits, and the adapters'
gradients by the chain rule from the merged weights' own), and a LoRA fine-tune of an MoE model
trains alike at TP=1, EP=2 and TP=2 (sequence parallel) x EP=2 under a Domino plan: the same
losses and the same adapters (saved whole, whatever the EP size)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from domino.checkpoint.layout import open_checkpoint
from domino.checkpoint.shards import ShardReader, TensorSpec
from domino.cli import main
from domino.config import TransformerConfig
from domino.models.gpt import GPTModel
from domino.models.lora import LoraSpec, adapters_of, apply_lora
from domino.parallel_state import ParallelState
from domino.tensor_parallel.lora import LoraAdapter
from domino.transformer.moe.lora import ExpertLora


def _merge_into(ref: torch.nn.Module, model: torch.nn.Module) -> dict:
    """Add every adapter's ``scale * B A`` (experts: ``scale * A_e B_e``) of ``model`` into the
    same weight of ``ref``; returns (adapter, weight name, factor names) per adapted weight."""
    params, merged = dict(ref.named_parameters()), {}
    with torch.no_grad():
        for name, module in model.named_modules():
            owner = name.rsplit(".", 1)[0]
            if isinstance(module, LoraAdapter):
                params[f"{owner}.weight"] += module.scale * module.b @ module.a
                merged[f"{owner}.weight"] = (module, "a", "b")
            elif isinstance(module, ExpertLora):
                for w in module.which:
                    a, b = getattr(module, f"{w}_a"), getattr(module, f"{w}_b")
                    params[f"{owner}.{w}"] += module.scale * a @ b
                    merged[f"{owner}.{w}"] = (module, f"{w}_a", f"{w}_b")
    return merged


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-6)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_expert_adapters_equal_merged_weights(activation: str) -> None:
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               vocab_size=96, seq_length=16, max_position_embeddings=16,
                               num_experts=4, moe_router_topk=2, activation=activation,
                               hidden_dropout=0.0, attention_dropout=0.0)
    state = ParallelState.single("cpu")
    torch.manual_seed(0)
    model = GPTModel(config, parallel_state=state)
    ref = copy.deepcopy(model)
    trained = apply_lora(model, LoraSpec(4, 8.0, targets=("qkv", "fc1", "fc2")), state, 1)
    assert sum(isinstance(a, ExpertLora) for a in adapters_of(model)) == 2
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in trained:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    merged = _merge_into(ref, model)
    ids = torch.randint(0, 96, (2, 17), generator=gen)
    loss = model(ids[:, :-1], None, None, labels=ids[:, 1:]).mean()
    want = ref(ids[:, :-1], None, None, labels=ids[:, 1:]).mean()
    loss.backward()
    want.backward()
    assert _rel(loss.detach(), want.detach()) < 1e-6
    ref_params = dict(ref.named_parameters())
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    for weight, (module, a_name, b_name) in merged.items():
        a, b, g = getattr(module, a_name), getattr(module, b_name), ref_params[weight].grad
        if isinstance(module, ExpertLora):  # W_e [in, out] += s A_e [in, r] B_e [r, out]
            want_a, want_b = g @ b.transpose(1, 2), a.transpose(1, 2) @ g
        else:  # W [out, in] += s B [out, r] A [r, in]
            want_a, want_b = b.t() @ g, g @ a.t()
        assert _rel(a.grad, module.scale * want_a) < 1e-5, f"{weight} A"
        assert _rel(b.grad, module.scale * want_b) < 1e-5, f"{weight} B"


LAYOUTS = {"tp1": ["--tensor-model-parallel-size", "1", "--nproc", "1", "--micro-batch-size",
                   "4"],
           "ep2": ["--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "2",
                   "--nproc", "2", "--micro-batch-size", "2"],
           "tp2_ep2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--expert-model-parallel-size", "2", "--nproc", "4",
                          "--micro-batch-size", "2", "--domino-micro-batches", "2",
                          "--domino-overlap", "cross_layer"]}
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--num-experts", "4", "--seq-length", "32", "--global-batch-size", "4",
         "--eval-iters", "0", "--sample-tokens", "0", "--no-tensorboard", "--log-interval", "1"]


def _adapters(run: Path) -> dict[str, torch.Tensor]:
    """The run's last checkpoint's tensors, whole (TP shards put together)."""
    step_dir, meta, _ = open_checkpoint(run)
    reader = ShardReader(step_dir)
    return {k: reader.full(k, TensorSpec.from_json(k, raw)) for k, raw in meta.tensors.items()}


def test_expert_lora_trains_alike_at_every_layout(tmp_path: Path) -> None:
    base = tmp_path / "base"
    assert main(["train", *MODEL, *LAYOUTS["tp1"], "--train-iters", "1", "--save",
                 str(base)]) == 0
    data = json.loads((base / "config.json").read_text())["data_path"]
    runs = {}
    for name, layout in LAYOUTS.items():
        runs[name] = tmp_path / name
        assert main(["train", "--load", str(base), "--finetune", "--lora-rank", "4",
                     "--data-path", *data, *layout, "--seq-length", "32",
                     "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-2",
                     "--lr-warmup-iters", "0", "--eval-iters", "0", "--sample-tokens", "0",
                     "--no-tensorboard", "--log-interval", "1", "--save",
                     str(runs[name])]) == 0
    losses = {n: [json.loads(line)["loss"] for line in
                  (r / "metrics.jsonl").read_text().splitlines()] for n, r in runs.items()}
    want = _adapters(runs["tp1"])
    assert any(".experts.lora.fc1_a" in k for k in want)
    assert any(".experts.lora.fc2_b" in k for k in want)
    for name in ("ep2", "tp2_ep2_sp"):
        assert losses[name] == pytest.approx(losses["tp1"], rel=1e-5), name
        got = _adapters(runs[name])
        assert set(got) == set(want)
        for k, t in want.items():  # (whole: TP shards joined, experts gathered over EP)
            if "optimizer.step" not in k:
                assert _rel(got[k], t) < 1e-4, (name, k)
