"""Hugging Face interop against the real ``transformers`` (models built locally from configs with
random weights, no downloads): our GPT exported as GPT-2, as a Llama-family member and as
StarCoder2 gives the same logits in transformers, and transformers' greedy generate equals ours
(with and without the KV cache); real GPT-2 (gelu_new), Llama 3 (GQA, llama3 RoPE scaling,
float rope_theta, head_dim), Qwen, Mistral and StarCoder2 models imported at TP=1 and TP=2 give
the original's logits; tokenizers encode alike."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch
from dist import run_distributed
from hf_compat import hf, hf_class, hf_version, load_hf, needs_model_type, rope_kwargs

from domino.checkpoint.families import family_for
from domino.checkpoint.hf_export import export_hf
from domino.checkpoint.hf_import import import_hf, read_hf_weights
from domino.checkpoint.layout import Meta, open_checkpoint
from domino.checkpoint.store import save
from domino.cli import main
from domino.config import TransformerConfig
from domino.data import BPETokenizer
from domino.data.tokenizer import Tokenizer
from domino.inference.loading import load_saved_model
from domino.inference.sampling import generate
from domino.models.gpt import GPTModel
from domino.parallel_state import ParallelState
from domino.tensor_parallel import placement_of


def _hf():
    """``transformers``, imported when a test first needs it: its import costs each xdist
    worker seconds at collection, and only this file's worker runs these tests."""
    return hf()


TEXT = "def forward(self, x):\n    return self.alpha * x + beta"


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    corpus = [TEXT * 3, "alpha beta gamma delta epsilon " * 20, "import torch\n" * 10] * 5
    return BPETokenizer.train(corpus, vocab_size=300)


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Random values everywhere (biases and norms too, so their mapping is tested)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)


def _ours(tmp: Path, config: TransformerConfig, tokenizer, seed: int = 0):
    """A randomly weighted model of ours saved as a weights-only checkpoint (one process)."""
    state = ParallelState.single()
    torch.manual_seed(seed)
    model = GPTModel(config, parallel_state=state)
    _perturb(model, seed)
    with torch.no_grad():  # padding rows stay zero, as a trained model's do
        for p in model.parameters():
            if placement_of(p).rows:
                p[placement_of(p).rows:] = 0
    meta = Meta(step=0, consumed_samples=0, config=config.to_dict(), layout={}, tensors={},
                files={})
    folder = save(tmp, 0, state, model, None, meta, tokenizer=tokenizer)
    return model.eval(), folder


def _hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_hf(folder)(ids).logits


def _gpt2_config(vocab: int, **kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=80,
                vocab_size=vocab, seq_length=32, max_position_embeddings=32,
                activation="gelu_tanh", hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def _llama_config(vocab: int, **kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2,
                kv_channels=16, ffn_hidden_size=64, vocab_size=vocab, seq_length=64,
                max_position_embeddings=64, position_embedding_type="rope",
                rotary_base=500000.0, rope_scaling_type="llama3", rope_scaling_factor=4.0,
                rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                rope_original_max_position_embeddings=16, normalization="RMSNorm",
                activation="swiglu", add_bias_linear=False, layernorm_epsilon=1e-6,
                untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


CASES = {
    "gpt2-tanh-tied": lambda v: _gpt2_config(v),
    "gpt2-exact-gelu-untied": lambda v: _gpt2_config(
        v, activation="gelu", untie_embeddings_and_output_weights=True),
    "llama3-gqa": lambda v: _llama_config(v),
    "llama-bias-tied-plain-rope": lambda v: _llama_config(
        v, add_bias_linear=True, untie_embeddings_and_output_weights=False,
        rope_scaling_type=None, rotary_base=10000.0),
    "qwen2-untied": lambda v: _llama_config(v, add_qkv_bias=True, rope_scaling_type=None,
                                            rotary_base=1000000.0),
    # A window shorter than the 30-token sequence, the prompt and generation: it must bite.
    "mistral-window-tied": lambda v: _llama_config(
        v, window_size=7, untie_embeddings_and_output_weights=False, rope_scaling_type=None),
    "qwen3-window-tied": lambda v: _llama_config(
        v, qk_layernorm=True, window_size=9, untie_embeddings_and_output_weights=False,
        rope_scaling_type=None, rotary_base=1000000.0),
    # GPT-2's LayerNorm and GELU MLP on Llama's attention: GQA, head size 16 (not 48 / 4).
    "starcoder2-window-bias-tied": lambda v: _llama_config(
        v, normalization="LayerNorm", activation="gelu_tanh", add_bias_linear=True,
        window_size=7, untie_embeddings_and_output_weights=False, rope_scaling_type=None),
    "starcoder2-exact-gelu-llama3-untied": lambda v: _llama_config(
        v, normalization="LayerNorm", activation="gelu", layernorm_epsilon=1e-5),
    # No RoPE on the middle layer of three, a window of 7 on every layer, tied.
    "smollm3-nope-window-tied": lambda v: _llama_config(
        v, num_layers=3, nope_layers=(1,), window_size=7, rope_scaling_type=None,
        rotary_base=2000000.0, untie_embeddings_and_output_weights=False),
}
ARCH_OF = {"gpt2": "gpt2", "llama3": "llama", "llama": "llama", "qwen2": "qwen2",
           "qwen3": "qwen3", "mistral": "mistral", "starcoder2": "starcoder2",
           "smollm3": "smollm3"}


@pytest.mark.parametrize("case", list(CASES))
def test_export_matches_transformers(tmp_path: Path, bpe: BPETokenizer, case: str) -> None:
    needs_model_type(ARCH_OF[case.split("-")[0]])
    config = _as_old_transformers_runs(CASES[case](bpe.vocab_size), tmp_path / "old", bpe)
    ours, folder = _ours(tmp_path / "run", config, bpe)
    meta = open_checkpoint(folder)[1]
    out = tmp_path / "hf"
    arch = export_hf(folder, meta, out)
    assert arch == ARCH_OF[case.split("-")[0]]
    assert json.loads((out / "config.json").read_text())["model_type"] == arch
    ids, mine = export_matches(ours, config, out, bpe)
    assert mine.abs().max() > 1.0  # informative logits, not near-zero noise
    hf_tok = _hf().AutoTokenizer.from_pretrained(out)
    assert hf_tok.encode(TEXT, add_special_tokens=False) == bpe.encode(TEXT)
    assert hf_tok.decode(bpe.encode(TEXT)) == TEXT
    state = ParallelState.single()
    # The window and the NoPE layers changed the logits: they were applied.
    for field, off in (("window_size", None), ("nope_layers", ())):
        if getattr(config, field):
            other = GPTModel(dataclasses.replace(config, **{field: off}), parallel_state=state)
            other.load_state_dict(ours.state_dict())
            with torch.no_grad():
                assert not torch.allclose(other.eval()(ids, None, None)[..., :config.vocab_size],
                                          mine, atol=1e-3), field


def _as_old_transformers_runs(config: TransformerConfig, tmp: Path,
                              bpe: BPETokenizer) -> TransformerConfig:
    """``config`` as a transformers older than the fixes below computes it. Before 4.48 Qwen2's,
    StarCoder2's and Granite's attention take hidden size / heads as the head size, ignoring
    ``head_dim`` (such an export does not load there: checked); before 4.46 StarCoder2 slides
    its window only under flash attention, not the eager and SDPA attentions these tests run."""
    arch = family_for(config).model_type
    if arch in ("qwen2", "starcoder2", "granite") and hf_version() < (4, 48) and (
            config.kv_channels * config.num_attention_heads != config.hidden_size):
        _, folder = _ours(tmp / "run", config, bpe)
        export_hf(folder, open_checkpoint(folder)[1], tmp / "hf")
        with pytest.raises(RuntimeError, match="size mismatch for model.layers.0.self_attn"):
            load_hf(tmp / "hf")
        config = dataclasses.replace(
            config, kv_channels=config.hidden_size // config.num_attention_heads)
    if arch == "starcoder2" and hf_version() < (4, 46):
        config = dataclasses.replace(config, window_size=None)
    return config


def export_matches(ours: GPTModel, config: TransformerConfig, out: Path, bpe: BPETokenizer,
                   cache_tokens: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Our model and transformers' reading of its export ``out`` agree: the same logits on
    TEXT, and greedy generation by ``transformers.generate`` == ours with the KV cache == ours
    without. Returns (the ids, our logits) for further checks."""
    ids = torch.tensor([bpe.encode(TEXT)[:30]])
    with torch.no_grad():
        mine = ours(ids, None, None)[..., :config.vocab_size]
    torch.testing.assert_close(_hf_logits(out, ids), mine, rtol=1e-5, atol=1e-5)
    hf_model = load_hf(out)
    prompt = bpe.encode("def forward")
    hf_ids = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               pad_token_id=bpe.eod)[0, len(prompt):].tolist()
    state = ParallelState.single()
    for cache in (True, False):
        assert generate(ours, state, prompt, 12, config.vocab_size, cache_tokens,
                        stop=(bpe.eod,), use_cache=cache) == hf_ids
    assert hf_ids
    return ids, mine


def _arch(config: TransformerConfig) -> str:
    """The model_type export writes ``config`` as."""
    return family_for(config).model_type


def test_export_refuses_what_neither_expresses(tmp_path: Path, bpe: BPETokenizer) -> None:
    # GPT-2 with RoPE is StarCoder2's; with query/key norms too, no family's.
    assert _arch(_gpt2_config(bpe.vocab_size, position_embedding_type="rope")) == "starcoder2"
    config = _gpt2_config(bpe.vocab_size, position_embedding_type="rope", qk_layernorm=True)
    with pytest.raises(ValueError) as err:
        _arch(config)
    msg = str(err.value)
    assert "neither GPT-2 nor the Llama family" in msg and "rope positions" in msg
    assert "RMSNorm" in msg
    assert "nor StarCoder2 nor the Gemma family (Gemma, Gemma 2, Gemma 3, VaultGemma) can" in msg
    assert "query/key norms (StarCoder2 has none)" in msg
    _, folder = _ours(tmp_path / "run", config, bpe)
    assert main(["export", "--format", "hf", str(folder), str(tmp_path / "hf")]) == 2
    assert _arch(_llama_config(bpe.vocab_size, num_experts=4)) == "mixtral"
    with pytest.raises(ValueError, match=r"biases \(Mixtral has none\)"):
        _arch(_llama_config(bpe.vocab_size, num_experts=4, add_bias_linear=True))
    family = r"Llama family \(Mixtral, Qwen3-MoE, OLMoE, FlexOlmo\)"
    with pytest.raises(ValueError, match=family + ".*a shared expert"):
        _arch(_llama_config(bpe.vocab_size, num_experts=4,
                                          moe_shared_expert_intermediate_size=8))
    olmoe = dict(num_experts=4, qk_layernorm=True, qk_layernorm_full_width=True,
                 add_bias_linear=False, kv_channels=12)
    assert _arch(_llama_config(bpe.vocab_size, **olmoe)) == "olmoe"
    with pytest.raises(ValueError, match=r"OLMoE's query norm spans hidden_size"):
        _arch(_llama_config(bpe.vocab_size, **{**olmoe, "kv_channels": 16}))
    with pytest.raises(ValueError, match=family + ".*dense layers among the MoE ones"):
        _arch(_llama_config(bpe.vocab_size, **olmoe, moe_first_k_dense_layers=1))
    with pytest.raises(ValueError, match="query/key norms over all heads in a dense model"):
        _arch(_llama_config(bpe.vocab_size, **{**olmoe, "num_experts": None}))
    from domino.checkpoint.hf_config import config_from_hf

    raw = {"model_type": "olmoe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_experts": 4,
           "num_experts_per_tok": 2, "clip_qkv": 8.0}
    with pytest.raises(ValueError, match=r"OLMoE clip_qkv=8.0 is not supported"):
        config_from_hf(raw)
    assert config_from_hf({**raw, "clip_qkv": None})[1].qk_layernorm_full_width


def test_families_it_cannot_express_are_refused_with_the_reason(tmp_path: Path) -> None:
    from domino.checkpoint.hf_config import config_from_hf

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    t = _hf()
    cases = {
        "gemma2-bidirectional": (t.Gemma2Config(**small, use_bidirectional_attention=True),
                                 ["Gemma 2 use_bidirectional_attention=true"]),
        "qwen2-some-layers": (t.Qwen2Config(**small, use_sliding_window=True,
                                            max_window_layers=1, sliding_window=8),
                              ["layers 1-1 only"]),
    }
    # Qwen3's case where this transformers has Qwen3 (4.51 on); the rest runs on older ones.
    qwen3 = getattr(t, "Qwen3Config", None)
    if qwen3 is not None:
        cases["qwen3-bias"] = (qwen3(**small, attention_bias=True), ["Qwen3 attention_bias"])
    for name, (cfg, reasons) in cases.items():
        with pytest.raises(ValueError) as err:
            config_from_hf(cfg.to_dict())
        assert all(r in str(err.value) for r in reasons), (name, str(err.value))
    # Qwen2 sliding on every layer (max_window_layers 0) is Mistral's window; on none, full.
    every = t.Qwen2Config(**small, use_sliding_window=True, max_window_layers=0,
                          sliding_window=8).to_dict()
    assert config_from_hf(every)[1].window_size == 8
    assert config_from_hf(t.Qwen2Config(**small).to_dict())[1].window_size is None
    folder = tmp_path / "gemma"
    folder.mkdir()
    refused = cases["qwen3-bias" if qwen3 is not None else "qwen2-some-layers"][0]
    (folder / "config.json").write_text(json.dumps(refused.to_dict()))
    assert main(["import", str(folder), str(tmp_path / "out")]) == 2


# ---- import --------------------------------------------------------------------------------------


def _hf_folder(tmp: Path, bpe: BPETokenizer, arch: str) -> tuple[Path, torch.nn.Module]:
    """A transformers model with random weights, saved the way the Hub holds models."""
    eod = bpe.eod
    if arch == "gpt2":
        cfg = _hf().GPT2Config(vocab_size=bpe.vocab_size, n_positions=32, n_embd=32,
                                      n_layer=2, n_head=4, activation_function="gelu_new",
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=eod, eos_token_id=eod)
        model = _hf().GPT2LMHeadModel(cfg)
    elif arch == "qwen2":  # as Qwen2.5-0.5B: tied, Q/K/V biases, theta 1e6
        cfg = _hf().Qwen2Config(
            vocab_size=bpe.vocab_size, hidden_size=48, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
            rope_theta=1000000.0, bos_token_id=eod, eos_token_id=eod)
        model = _hf().Qwen2ForCausalLM(cfg)
    elif arch == "qwen3":  # RMSNorm on each head's q and k; head_dim 16 != hidden / heads
        cfg = hf_class("Qwen3Config")(
            vocab_size=bpe.vocab_size, hidden_size=48, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_theta=1000000.0, bos_token_id=eod, eos_token_id=eod)
        model = hf_class("Qwen3ForCausalLM")(cfg)
    elif arch == "starcoder2":  # as StarCoder2-3B: biases, GQA, tied; a window of 6
        # (none before 4.46, whose StarCoder2 slides it only under flash attention)
        cfg = _hf().Starcoder2Config(
            vocab_size=bpe.vocab_size, hidden_size=48, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, norm_epsilon=1e-5, use_bias=True,
            sliding_window=6 if hf_version() >= (4, 46) else None,
            hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
            **rope_kwargs({"rope_type": "default", "rope_theta": 999999.4420358813}),
            bos_token_id=eod, eos_token_id=eod)
        model = _hf().Starcoder2ForCausalLM(cfg)
    elif arch == "smollm3":  # no RoPE on layer 1 of 3 (one in 2), tied, theta 2e6
        cfg = hf_class("SmolLM3Config")(
            vocab_size=bpe.vocab_size, hidden_size=48, intermediate_size=64,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, no_rope_layer_interval=2, bos_token_id=eod,
            eos_token_id=eod, pad_token_id=None)
        model = hf_class("SmolLM3ForCausalLM")(cfg)
    elif arch == "mistral":  # a sliding window shorter than the 30-token sequence
        cfg = _hf().MistralConfig(
            vocab_size=bpe.vocab_size, hidden_size=48, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=64, rms_norm_eps=1e-5, sliding_window=6,
            tie_word_embeddings=False, bos_token_id=eod, eos_token_id=eod)
        model = _hf().MistralForCausalLM(cfg)
    else:
        cfg = _hf().LlamaConfig(
            vocab_size=bpe.vocab_size, hidden_size=48, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
            **rope_kwargs({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 16}),
            bos_token_id=eod, eos_token_id=eod)
        model = _hf().LlamaForCausalLM(cfg)
    _perturb(model, 3)
    folder = tmp / f"hf-{arch}"
    model.save_pretrained(folder)
    bpe._tok.save(str(folder / "tokenizer.json"))
    return folder, model.eval()


def _imported_logits(rank: int, world: int, run: str, ids: torch.Tensor) -> torch.Tensor:
    state = ParallelState.build(world)
    step_dir, _, _ = open_checkpoint(run)
    model, config, _, _ = load_saved_model(step_dir, state)
    with torch.no_grad():
        part = model(ids, None, None)
    return state.tp.all_gather_last_dim(part)[..., :config.vocab_size]


@dataclasses.dataclass
class Imported:
    """What :func:`import_matches` leaves for a test's own checks."""

    model: GPTModel  # the TP=1 import, loaded in this process
    config: TransformerConfig
    tokenizer: Tokenizer
    state: ParallelState
    two: Path  # the TP=2 import's run folder
    ids: torch.Tensor
    expected: torch.Tensor  # transformers' logits on ids
    hf_ids: list[int]  # transformers' greedy tokens after "def forward"


def import_matches(tmp_path: Path, folder: Path, original: torch.nn.Module, bpe: BPETokenizer,
                   capfd, new_tokens: int = 10) -> Imported:
    """transformers' ``original`` (saved in ``folder``) imported at TP=1 (the library) and TP=2
    (``domino import``) gives its logits at both sizes, and ``domino generate`` at TP=2 its
    greedy tokens."""
    ids = torch.tensor([bpe.encode(TEXT)[:30]])
    with torch.no_grad():
        expected = original(ids).logits
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    import_hf(folder, one, 1)
    assert main(["import", str(folder), str(two), "--tensor-model-parallel-size", "2"]) == 0
    state = ParallelState.single()
    model, config, tokenizer, _ = load_saved_model(open_checkpoint(one)[0], state)
    with torch.no_grad():
        got = model(ids, None, None)[..., :config.vocab_size]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for logits in run_distributed(_imported_logits, 2, str(two), ids):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    prompt = bpe.encode("def forward")
    hf_ids = original.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                               do_sample=False, pad_token_id=bpe.eod)[0, len(prompt):].tolist()
    capfd.readouterr()
    assert main(["generate", str(two), "--prompt", "def forward", "--greedy", "--ids",
                 "--max-new-tokens", str(new_tokens), "--tensor-model-parallel-size", "2"]) == 0
    assert [int(x) for x in capfd.readouterr().out.split()] == hf_ids
    return Imported(model, config, tokenizer, state, two, ids, expected, hf_ids)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "qwen3", "mistral", "starcoder2",
                                  "smollm3"])
def test_import_matches_the_original(tmp_path: Path, bpe: BPETokenizer, arch: str,
                                     capfd) -> None:
    folder, original = _hf_folder(tmp_path, bpe, arch)
    got = import_matches(tmp_path, folder, original, bpe, capfd)
    step_dir, meta, _ = open_checkpoint(got.two)
    assert meta.layout["tp"] == 2 and not meta.has_optimizer
    assert (got.two / "config.toml").is_file()
    assert got.tokenizer.encode(TEXT) == bpe.encode(TEXT)
    # Round trip: the imported model exported again is the original.
    back = tmp_path / "back"
    export_hf(step_dir, meta, back)
    torch.testing.assert_close(_hf_logits(back, got.ids), got.expected, rtol=1e-5, atol=1e-5)


def _moe_folder(tmp: Path, bpe: BPETokenizer, arch: str) -> tuple[Path, torch.nn.Module]:
    eod, t = bpe.eod, _hf()
    common = dict(vocab_size=bpe.vocab_size, hidden_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6, bos_token_id=eod, eos_token_id=eod, num_experts_per_tok=2)
    if arch == "mixtral":  # 4 experts of width 40, untied, no window
        model = t.MixtralForCausalLM(t.MixtralConfig(
            **common, intermediate_size=40, num_local_experts=4, tie_word_embeddings=False,
            sliding_window=None))
    elif arch == "olmoe":  # q/k norms over all heads, top-k weights as scored, untied
        model = t.OlmoeForCausalLM(t.OlmoeConfig(
            **common, intermediate_size=24, num_experts=4, norm_topk_prob=False,
            tie_word_embeddings=False, pad_token_id=None))
    else:  # Qwen3-MoE: a dense first layer, re-normalised top-k, q/k norms, tied
        model = hf_class("Qwen3MoeForCausalLM")(hf_class("Qwen3MoeConfig")(
            **common, intermediate_size=64, moe_intermediate_size=24, num_experts=4,
            head_dim=16, mlp_only_layers=[0], norm_topk_prob=True, tie_word_embeddings=True,
            rope_theta=1000000.0))
    _perturb(model, 5)
    folder = tmp / f"hf-{arch}"
    model.save_pretrained(folder)
    bpe._tok.save(str(folder / "tokenizer.json"))
    return folder, model.eval()


def _moe_parallel(rank: int, world: int, run: str, ids: torch.Tensor, prompt: list[int],
                  vocab: int) -> dict:
    """Four ranks: the imported TP=2 checkpoint at TP=2 x EP=2 and at TP=1 x EP=4 (resharded
    as it loads): logits, and greedy generation at TP=2 x EP=2."""
    out = {}
    for tp, ep in ((2, 2), (1, 4)):
        state = ParallelState.build(tp, expert_model_parallel_size=ep)
        model, config, _, _ = load_saved_model(open_checkpoint(run)[0], state)
        with torch.no_grad():
            part = model(ids, None, None)
        out[tp, ep] = state.tp.all_gather_last_dim(part)[..., :vocab]
        if tp == 2:
            out["generated"] = generate(model, state, prompt, 10, vocab, 32)
    return out


def moe_import_matches(tmp_path: Path, folder: Path, original: torch.nn.Module,
                       bpe: BPETokenizer, model_type: str) -> TransformerConfig:
    """transformers' MoE ``original`` (saved in ``folder``) imported at TP=1 gives its logits
    and greedy tokens and exports back (as ``model_type``, in ``tmp_path / "back"``) to the
    same logits; imported at TP=2 it gives them at TP=2 x EP=2 and TP=1 x EP=4. Returns the
    imported config."""
    ids = torch.tensor([bpe.encode(TEXT)[:30]])
    with torch.no_grad():
        expected = original(ids).logits
    step_dir = import_hf(folder, tmp_path / "run", 1)
    state = ParallelState.single()
    model, config, _, _ = load_saved_model(step_dir, state)
    with torch.no_grad():
        got = model(ids, None, None)[..., :config.vocab_size]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    prompt = bpe.encode("def forward")
    hf_ids = original.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                               pad_token_id=bpe.eod)[0, len(prompt):].tolist()
    assert generate(model, state, prompt, 10, config.vocab_size, 32, stop=(bpe.eod,)) == hf_ids
    meta = open_checkpoint(step_dir)[1]
    assert export_hf(step_dir, meta, tmp_path / "back") == model_type
    torch.testing.assert_close(_hf_logits(tmp_path / "back", ids), expected, rtol=1e-5,
                               atol=1e-5)
    import_hf(folder, tmp_path / "tp2", 2)
    for res in run_distributed(_moe_parallel, 4, str(tmp_path / "tp2"), ids, prompt,
                               config.vocab_size):
        for sizes in ((2, 2), (1, 4)):
            torch.testing.assert_close(res[sizes], expected, rtol=1e-5, atol=1e-5)
        assert res["generated"] == hf_ids
    return config


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe"])
def test_moe_families_import_and_export(tmp_path: Path, bpe: BPETokenizer, arch: str) -> None:
    """Mixtral, Qwen3-MoE and OLMoE (random weights, the Hub's per-expert files) import with the
    original's logits and greedy generation, export back to the same logits; imported at TP=2
    they give the same logits at TP=2 x EP=2 and TP=1 x EP=4, and the same greedy tokens."""
    folder, original = _moe_folder(tmp_path, bpe, arch)
    config = moe_import_matches(tmp_path, folder, original, bpe, arch)
    assert config.num_experts == 4 and config.moe_first_k_dense_layers == (arch == "qwen3_moe")
    assert config.qk_layernorm_full_width == (arch == "olmoe")


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_import_never_unpickles(tmp_path: Path, bpe: BPETokenizer) -> None:
    folder, _ = _hf_folder(tmp_path, bpe, "gpt2")
    for f in folder.glob("*.safetensors"):
        f.unlink()
    marker = tmp_path / "ran"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom(str(marker))))
    with pytest.raises(ValueError, match="pytorch_model.bin: pickles.*safe_serialization"):
        read_hf_weights(folder)
    assert main(["import", str(folder), str(tmp_path / "out")]) == 2
    assert not marker.exists()
    (folder / "model.safetensors").write_bytes(pickle.dumps(_Boom(str(marker))))
    with pytest.raises(ValueError, match="model.safetensors: not a safetensors file"):
        import_hf(folder, tmp_path / "out2", 1)
    assert not marker.exists()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_import_refuses_damaged_or_mismatched_folders(tmp_path: Path, bpe: BPETokenizer,
                                                      arch: str, capfd) -> None:
    """A truncated weights file, or a config.json of another shape than the weights: one line
    naming the file (and the tensor), exit 2, no output folder."""
    folder, _ = _hf_folder(tmp_path, bpe, arch)
    weights = folder / "model.safetensors"
    whole = weights.read_bytes()

    def refused(expect: list[str]) -> None:
        capfd.readouterr()
        assert main(["import", str(folder), str(tmp_path / "out")]) == 2
        err = capfd.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("domino import: error: "), err
        assert all(text in err for text in expect), err
        assert not (tmp_path / "out").exists()

    weights.write_bytes(whole[: len(whole) * 2 // 3])
    refused([str(weights), "truncated or damaged"])
    weights.write_bytes(whole)
    config = json.loads((folder / "config.json").read_text())
    wider = {"gpt2": "n_inner", "llama": "intermediate_size"}[arch]
    config[wider] = 96
    (folder / "config.json").write_text(json.dumps(config))
    tensor = {"gpt2": ".mlp.c_", "llama": ".mlp."}[arch]  # (whichever the file lists first)
    refused([str(weights), tensor, "has shape", "use the config.json saved with these weights"])


def test_fine_tune_an_imported_llama(tmp_path: Path, bpe: BPETokenizer, capfd) -> None:
    """`domino import` writes the settings that rebuild the model (head size, no biases, RMSNorm
    epsilon, llama3 RoPE, float theta, its tokenizer): `domino train --config OUT/config.toml
    --load OUT` trains on from its weights, and the result exports as Llama again."""
    from domino.data import HFTokenizer, preprocess
    from domino.data.preprocess import stdlib_corpus_files

    folder, _ = _hf_folder(tmp_path, bpe, "llama")
    out = tmp_path / "imported"
    assert main(["import", str(folder), str(out)]) == 0
    tok_dir = out / "checkpoints" / "step_0000000" / "tokenizer"
    data = tmp_path / "data"
    preprocess(stdlib_corpus_files(limit_bytes=60_000), data, HFTokenizer.load(tok_dir),
               progress=False)
    ft = tmp_path / "ft"
    capfd.readouterr()
    assert main(["train", "--config", str(out / "config.toml"), "--load", str(out),
                 "--data-path", str(data), "--split", "90,10,0", "--train-iters", "2",
                 "--micro-batch-size", "2", "--seq-length", "32", "--eval-iters", "1",
                 "--sample-tokens", "0", "--no-tensorboard", "--nproc", "1",
                 "--save", str(ft)]) == 0
    assert "initialised from the weights of" in capfd.readouterr().out
    step_dir, meta, _ = open_checkpoint(ft)
    assert meta.step == 2 and meta.has_optimizer
    assert export_hf(step_dir, meta, tmp_path / "again") == "llama"
    raw = _hf().AutoConfig.from_pretrained(tmp_path / "again")
    assert raw.head_dim == 16 and raw.num_key_value_heads == 2 and not raw.attention_bias
