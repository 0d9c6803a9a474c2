"""A LoRA run's exports against the real ``transformers`` and ``peft`` (random-weight models,
no downloads): a Llama (GQA) and a Qwen3 folder are imported with ``domino import``, LoRA
adapters with random values are put on every targeted linear and saved as a LoRA checkpoint;
then ``domino export --format hf`` of it (merged) gives our LoRA model's logits in
transformers, ``--format peft`` loaded by ``peft.PeftModel.from_pretrained`` onto the base's
export gives them too, and peft's ``merge_and_unload`` is our merged export. The dtype follows
the base's (a bf16 import exports bf16); GPT-2 (Conv1D, transposed) exports merged but is
refused as PEFT, and a plain checkpoint is refused as PEFT."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hf_compat import hf, hf_class, load_hf
from safetensors.torch import load_file

from domino.checkpoint import lora
from domino.checkpoint.layout import Meta, open_checkpoint
from domino.checkpoint.store import save
from domino.cli import main
from domino.config import TransformerConfig
from domino.data import BPETokenizer
from domino.inference.loading import load_saved_model
from domino.models.gpt import GPTModel
from domino.models.lora import LoraSpec, adapters_of, apply_lora
from domino.parallel_state import ParallelState

TEXT = "def forward(self, x):\n    return self.alpha * x + beta"
HF_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    corpus = [TEXT * 3, "alpha beta gamma delta epsilon " * 20, "import torch\n" * 10] * 5
    return BPETokenizer.train(corpus, vocab_size=300)


def _perturb(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * std)


def _hf_folder(tmp: Path, bpe: BPETokenizer, arch: str, dtype=torch.float32) -> Path:
    """A transformers Llama (GQA, untied) or Qwen3 (per-head q/k norms, head_dim 16 != 64 / 4,
    tied) with random weights, saved in ``dtype`` as the Hub holds models."""
    common = dict(vocab_size=bpe.vocab_size, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=bpe.eod,
                  eos_token_id=bpe.eod)
    torch.manual_seed(1)
    if arch == "llama":
        model = hf().LlamaForCausalLM(hf().LlamaConfig(**common, tie_word_embeddings=False))
    else:
        model = hf_class("Qwen3ForCausalLM")(hf_class("Qwen3Config")(
            **common, head_dim=16, tie_word_embeddings=True))
    _perturb(model, 3)
    folder = tmp / f"hf-{arch}"
    model.to(dtype).save_pretrained(folder)
    bpe._tok.save(str(folder / "tokenizer.json"))
    return folder


def _lora_checkpoint(base: Path, run: Path, spec: LoraSpec, seed: int) -> GPTModel:
    """Our model of checkpoint ``base`` with ``spec``'s adapters, random A and B (B is zero at
    the start of training: random values test every factor's mapping), saved in ``run`` as a
    LoRA checkpoint naming ``base``; returns the model (fp32, eval mode)."""
    state = ParallelState.single()
    base_dir, base_meta, _ = open_checkpoint(base)
    model, config, tokenizer, _ = load_saved_model(base_dir, state)
    apply_lora(model, spec, state, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for adapter in adapters_of(model):
            for p in adapter.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    meta = Meta(step=1, consumed_samples=0, config=config.to_dict(), layout={}, tensors={},
                files={}, extra={lora.KEY: lora.record(spec, base_dir, run)})
    save(run, 1, state, model, None, meta, tokenizer=tokenizer)
    return model.eval()


@dataclass
class Case:
    base: Path  # the imported run
    run: Path  # the LoRA run
    model: GPTModel  # ours, with the adapters
    logits: torch.Tensor  # ours on ``ids``
    ids: torch.Tensor


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 agreement: merging the update into W rounds otherwise than adding B A x, so the
    absolute tolerance is 2e-6 of the logits' magnitude (the adapters move them by > 1)."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * float(want.abs().max()))


def _logits(model: torch.nn.Module, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, None, None)[..., :vocab]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request, tmp_path_factory, bpe: BPETokenizer) -> Case:
    tmp = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = tmp / "base"
    assert main(["import", str(_hf_folder(tmp, bpe, request.param)), str(base)]) == 0
    spec = LoraSpec(rank=4, alpha=8.0)
    model = _lora_checkpoint(base, tmp / "lora", spec, seed=5)
    ids = torch.tensor([bpe.encode(TEXT)[:30]])
    logits = _logits(model, ids, bpe.vocab_size)
    plain, _, _, _ = load_saved_model(open_checkpoint(base)[0], ParallelState.single())
    # The adapters change the model a lot: an export that dropped one would show.
    assert (logits - _logits(plain, ids, bpe.vocab_size)).abs().max() > 1.0
    return Case(base, tmp / "lora", model, logits, ids)


def test_merged_export_matches_transformers(case: Case, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    assert main(["export", "--format", "hf", str(case.run), str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    _close(load_hf(out)(case.ids).logits.detach(), case.logits)


def test_peft_export_loads_in_peft(case: Case, tmp_path: Path) -> None:
    """The adapter folder on the base's export, in peft: our logits; merged by peft: our
    merged export's weights."""
    import peft

    base_hf, adapter, merged = tmp_path / "base-hf", tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", "--format", "hf", str(case.base), str(base_hf)]) == 0
    assert main(["export", "--format", "peft", str(case.run), str(adapter),
                 "--base-model-path", str(base_hf)]) == 0
    assert main(["export", "--format", "hf", str(case.run), str(merged)]) == 0
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    assert cfg["target_modules"] == HF_MODULES and cfg["base_model_name_or_path"] == str(base_hf)
    tensors = load_file(adapter / "adapter_model.safetensors")
    q = "base_model.model.model.layers.1.self_attn.q_proj."
    assert tensors[q + "lora_A.weight"].shape == (4, 64)
    assert tensors[q + "lora_B.weight"].shape == (64, 4)
    assert len(tensors) == 2 * len(HF_MODULES) * 2  # two layers, A and B each
    model = peft.PeftModel.from_pretrained(load_hf(base_hf), adapter).eval()
    loaded = {n for n, _ in model.named_parameters() if ".lora_" in n}
    assert len(loaded) == len(tensors)  # peft adapted the modules we wrote, and only those
    with torch.no_grad():
        _close(model(case.ids).logits, case.logits)
    theirs = model.merge_and_unload().state_dict()
    for name, t in load_file(merged / "model.safetensors").items():
        torch.testing.assert_close(theirs[name], t, rtol=1e-6, atol=1e-6)


def test_dtype_follows_the_base(tmp_path: Path, bpe: BPETokenizer) -> None:
    """A LoRA run on a bf16 import (its checkpoint records no dtype of its own: the adapters
    are fp32) exports bf16: the merged fp32 weights rounded once; --dtype overrides it."""
    base = tmp_path / "base"
    assert main(["import", str(_hf_folder(tmp_path, bpe, "qwen3", torch.bfloat16)),
                 str(base)]) == 0
    run = tmp_path / "lora"
    _lora_checkpoint(base, run, LoraSpec(rank=2, alpha=4.0, targets=("qkv", "fc2")), seed=2)
    assert "dtype" not in open_checkpoint(run)[1].extra
    auto, wide, adapter = tmp_path / "auto", tmp_path / "fp32", tmp_path / "adapter"
    assert main(["export", "--format", "hf", str(run), str(auto)]) == 0
    assert main(["export", "--format", "hf", str(run), str(wide), "--dtype", "float32"]) == 0
    assert json.loads((auto / "config.json").read_text())["dtype"] == "bfloat16"
    narrow, full = load_file(auto / "model.safetensors"), load_file(wide / "model.safetensors")
    assert narrow.keys() == full.keys()
    for name, t in full.items():
        assert t.dtype == torch.float32 and torch.equal(narrow[name], t.to(torch.bfloat16))
    assert main(["export", "--format", "peft", str(run), str(adapter)]) == 0
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["q_proj", "k_proj", "v_proj", "down_proj"]
    assert cfg["r"] == 2 and cfg["base_model_name_or_path"] is None
    assert {t.dtype for t in load_file(adapter / "adapter_model.safetensors").values()} == {
        torch.float32}


def _our_base(run: Path, config: TransformerConfig, bpe: BPETokenizer) -> None:
    """A random-weight model of ours saved as a plain checkpoint."""
    state = ParallelState.single()
    torch.manual_seed(0)
    model = GPTModel(config, parallel_state=state)
    meta = Meta(step=0, consumed_samples=0, config=config.to_dict(), layout={}, tensors={},
                files={})
    save(run, 0, state, model, None, meta, tokenizer=bpe)


def test_refusals_and_gpt2_merged(tmp_path: Path, bpe: BPETokenizer, capfd) -> None:
    """GPT-2's Conv1D weights are stored transposed: its LoRA exports merged (transformers
    gives our logits) and is refused as PEFT, naming the way out; a plain checkpoint is
    refused as PEFT, --base-model-path with --format hf too."""
    base, run = tmp_path / "base", tmp_path / "lora"
    _our_base(base, TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=80,
        vocab_size=bpe.vocab_size, seq_length=32, max_position_embeddings=32,
        activation="gelu_tanh", hidden_dropout=0.0, attention_dropout=0.0), bpe)
    ours = _lora_checkpoint(base, run, LoraSpec(rank=4, alpha=8.0), seed=3)
    ids = torch.tensor([bpe.encode(TEXT)[:30]])
    assert main(["export", "--format", "hf", str(run), str(tmp_path / "merged")]) == 0
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "gpt2"
    _close(load_hf(tmp_path / "merged")(ids).logits.detach(), _logits(ours, ids, bpe.vocab_size))
    capfd.readouterr()
    assert main(["export", "--format", "peft", str(run), str(tmp_path / "no1")]) == 2
    err = capfd.readouterr().err
    assert ("gpt2's transformer.h.0.attn.c_attn.weight is our language_model.encoder.layers.0."
            "self_attention.query_key_value.weight stored transposed ([in, out], as GPT-2's "
            "Conv1D)") in err
    assert "export the merged model with --format hf instead" in err
    assert not (tmp_path / "no1").exists()
    assert main(["export", "--format", "peft", str(base), str(tmp_path / "no2")]) == 2
    err = capfd.readouterr().err
    assert "is not a LoRA checkpoint" in err and "--lora-rank R" in err
    assert main(["export", "--format", "hf", str(run), str(tmp_path / "no3"),
                 "--base-model-path", "x"]) == 2
    assert "for --format peft only" in capfd.readouterr().err


def test_refuses_dense_mlps_named_like_experts(tmp_path: Path, bpe: BPETokenizer,
                                               capfd) -> None:
    """Qwen3-MoE with a dense first layer: peft (on transformers 5) would map that layer's
    gate_proj / up_proj / down_proj adapters onto the experts and drop them, so --format peft
    refuses (merged export is the way out)."""
    from domino.checkpoint.hf_config import config_from_hf

    _, config, _ = config_from_hf(_qwen3_moe(bpe, mlp_only_layers=[0]).to_dict())
    base, run = tmp_path / "base", tmp_path / "lora"
    _our_base(base, config, bpe)
    _lora_checkpoint(base, run, LoraSpec(rank=2, alpha=4.0), seed=1)
    capfd.readouterr()
    assert main(["export", "--format", "peft", str(run), str(tmp_path / "no")]) == 2
    err = capfd.readouterr().err
    assert "the adapted model.layers.0.mlp.gate_proj of a dense layer is named like" in err
    assert "export the merged model with --format hf" in err


def _qwen3_moe(bpe: BPETokenizer, **kw):
    return hf_class("Qwen3MoeConfig")(
        vocab_size=bpe.vocab_size, hidden_size=32, intermediate_size=48,
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        rms_norm_eps=1e-6, bos_token_id=bpe.eod, eos_token_id=bpe.eod, **kw)


def test_moe_experts_export(tmp_path: Path, bpe: BPETokenizer) -> None:
    """Qwen3-MoE, LoRA on attention and every expert's fc1 and fc2: merged, transformers gives
    our logits; as PEFT (each expert's gate_proj, up_proj and down_proj, as transformers 4.x
    stores experts: peft fuses them for transformers 5), peft gives them too."""
    import peft

    torch.manual_seed(1)
    hf_model = hf_class("Qwen3MoeForCausalLM")(_qwen3_moe(bpe))
    _perturb(hf_model, 4)
    hf_model.save_pretrained(tmp_path / "hf")
    bpe._tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    base, run = tmp_path / "base", tmp_path / "lora"
    assert main(["import", str(tmp_path / "hf"), str(base)]) == 0
    ours = _lora_checkpoint(base, run, LoraSpec(rank=4, alpha=8.0), seed=6)
    ids = torch.tensor([bpe.encode(TEXT)[:30]])
    want = _logits(ours, ids, bpe.vocab_size)
    adapter, base_hf, merged = tmp_path / "adapter", tmp_path / "base-hf", tmp_path / "merged"
    for argv in (["hf", str(run), str(merged)], ["peft", str(run), str(adapter)],
                 ["hf", str(base), str(base_hf)]):
        assert main(["export", "--format", *argv]) == 0
    _close(load_hf(merged)(ids).logits.detach(), want)
    tensors = load_file(adapter / "adapter_model.safetensors")
    e3 = "base_model.model.model.layers.1.mlp.experts.3."
    assert tensors[e3 + "gate_proj.lora_B.weight"].shape == (16, 4)
    assert tensors[e3 + "down_proj.lora_A.weight"].shape == (4, 16)
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == \
        HF_MODULES
    model = peft.PeftModel.from_pretrained(load_hf(base_hf), adapter).eval()
    with torch.no_grad():
        _close(model(ids).logits, want)


def test_probe_takes_links_that_move_rows_only() -> None:
    """The check behind --format peft's mapping: links that pick rows (the QKV split, gate/up)
    map B by those rows; a transposed, column-moving or scaling link is refused."""
    from domino.checkpoint.families.weights import ApartQKV, GateUp, Heads, Same
    from domino.checkpoint.peft_export import Factors, _modules, _Probes

    w = "qkv.weight"
    f = Factors(w, torch.randn(2, 16), torch.randn(32, 2))
    heads = Heads(heads=4, groups=2, head_dim=4)  # rows: [q0 q1 k v] per group, 16 each

    def found(link) -> dict[str, list[int]]:
        return {m: rows.tolist() for m, _, _, rows in _modules(link, _Probes({w: f}, {}), "x")}

    assert found(ApartQKV(w, ("q.weight", "k.weight", "v.weight"), heads)) == {
        "q": [*range(8), *range(16, 24)], "k": [*range(8, 12), *range(24, 28)],
        "v": [*range(12, 16), *range(28, 32)]}
    assert found(GateUp(w, "g.weight", "u.weight")) == {"g": list(range(16)),
                                                        "u": list(range(16, 32))}

    class Flip(Same):
        def to_hf(self, ours):
            return {self.theirs: ours[self.ours].flip(1)}

    class Double(Same):
        def to_hf(self, ours):
            return {self.theirs: ours[self.ours] * 2}

    for link, what in ((Same(w, "t.weight", transposed=True), "stored transposed"),
                       (Flip(w, "f.weight"), "not whole rows"),
                       (Double(w, "d.weight"), "not whole rows")):
        with pytest.raises(ValueError, match=f"x's {link.theirs} is (our qkv.weight )?{what}"):
            found(link)
