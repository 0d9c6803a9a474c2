"""GPT-OSS against the real ``transformers`` (random weights from a small ``GptOssConfig``,
nothing downloaded; its eager attention, the only one it has besides flash kernels): attention
sinks, biases on Q/K/V/O, the router and the experts, the fused experts with gate and up
interleaved, the clamped SwiGLU, yarn RoPE, sliding and full layers alternating. Imported at
TP=1 and TP=2 it gives the original's logits and greedy tokens over a text longer than the
window, and the same at TP=2 x EP=2 and TP=1 x EP=4; exported back, the same logits. A model
of ours with those settings exports as GPT-OSS with transformers' logits and greedy tokens
(with and without the KV cache). The features themselves are checked against the independent
reference under TP / EP in ``test_gpt_tp.py`` (``gpt_oss_sinks_yarn_clamped_swiglu``) and
``test_moe_domino.py`` (``gpt_oss``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from dist import run_distributed
from hf_compat import hf_class, is_v5, needs_model_type, rope_kwargs
from test_hf_interop import (
    TEXT,
    _hf,
    _hf_logits,
    _llama_config,
    _moe_parallel,
    _ours,
    _perturb,
    export_matches,
    import_matches,
)

from domino.checkpoint.families import family_for
from domino.checkpoint.hf_config import config_from_hf
from domino.checkpoint.hf_export import export_hf
from domino.checkpoint.layout import open_checkpoint
from domino.data import BPETokenizer

YARN = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 8.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    corpus = [TEXT * 3, "alpha beta gamma delta epsilon " * 20, "import torch\n" * 10] * 5
    return BPETokenizer.train(corpus, vocab_size=300)


def _limit() -> float:
    """The SwiGLU limit the tests give GPT-OSS: 0.5, which clamps; 7.0 on transformers 4.x,
    whose GPT-OSS experts compute with limit 7.0 and alpha 1.702 whatever config.json says."""
    return 0.5 if is_v5() else 7.0


def _gpt_oss_folder(tmp: Path, bpe: BPETokenizer) -> tuple[Path, torch.nn.Module]:
    """A GptOssForCausalLM: 4 experts of width 40, GQA with head size 16 (not 48 / 4), a
    window of 6 on layers 0 and 2, full attention on 1, a limit that clamps, yarn, untied."""
    t = _hf()
    cfg = hf_class("GptOssConfig")(
        vocab_size=bpe.vocab_size, hidden_size=48, intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=6, max_position_embeddings=64,
        swiglu_limit=_limit(), **rope_kwargs(YARN), bos_token_id=bpe.eod, eos_token_id=bpe.eod,
        pad_token_id=bpe.eod)
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(cfg)
    _perturb(model, 3)
    folder = tmp / "hf-gpt-oss"
    model.save_pretrained(folder)
    bpe._tok.save(str(folder / "tokenizer.json"))
    return folder, model.eval()


def test_gpt_oss_imports_at_tp_and_ep_and_exports_back(tmp_path: Path, bpe: BPETokenizer,
                                                       capfd) -> None:
    folder, original = _gpt_oss_folder(tmp_path, bpe)
    got = import_matches(tmp_path, folder, original, bpe, capfd)
    config = got.config
    assert got.ids.shape[1] > config.window_size  # the window bites
    assert config.full_attention_layers == (1,) and config.attention_sinks
    assert config.rope_scaling_type == "yarn" and config.activation_func_clamp_value == _limit()
    assert config.moe_router_bias and config.moe_expert_linear_bias
    step_dir, meta, _ = open_checkpoint(got.two)
    assert export_hf(step_dir, meta, tmp_path / "back") == "gpt_oss"
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert saved["architectures"] == ["GptOssForCausalLM"]
    assert saved["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    torch.testing.assert_close(_hf_logits(tmp_path / "back", got.ids), got.expected,
                               rtol=1e-5, atol=1e-5)
    # The TP=2 import at TP=2 x EP=2 and TP=1 x EP=4 (resharded as it loads).
    prompt = bpe.encode("def forward")  # (import_matches' prompt; greedy tokens past it)
    for res in run_distributed(_moe_parallel, 4, str(got.two), got.ids, prompt,
                               config.vocab_size):
        for sizes in ((2, 2), (1, 4)):
            torch.testing.assert_close(res[sizes], got.expected, rtol=1e-5, atol=1e-5)
        assert res["generated"][:len(got.hf_ids)] == got.hf_ids  # (no stop token there)


OURS = dict(num_layers=3, num_experts=4, moe_ffn_hidden_size=40, moe_router_topk=2,
            add_bias_linear=True, attention_sinks=True, moe_router_bias=True,
            moe_expert_linear_bias=True, swiglu_alpha=1.702, glu_linear_offset=1.0,
            activation_func_clamp_value=0.5, window_size=7, full_attention_layers=(1,),
            rotary_base=1000.0, rope_scaling_type="yarn", rope_scaling_factor=4.0,
            rope_original_max_position_embeddings=16, rope_yarn_beta_fast=8.0,
            rope_yarn_truncate=False, norm_scale_in_fp32=True)


def test_our_gpt_oss_model_exports_with_transformers_logits(tmp_path: Path,
                                                           bpe: BPETokenizer) -> None:
    needs_model_type("gpt_oss")
    config = _llama_config(bpe.vocab_size, **OURS)
    ours, folder = _ours(tmp_path / "run", config, bpe)
    out = tmp_path / "hf"
    assert export_hf(folder, open_checkpoint(folder)[1], out) == "gpt_oss"
    if not is_v5():  # 4.x computes with limit 7.0, not the 0.5 config.json says: other logits
        ids = torch.tensor([bpe.encode(TEXT)[:30]])
        with torch.no_grad():
            mine = ours(ids, None, None)[..., :config.vocab_size]
        assert not torch.allclose(_hf_logits(out, ids), mine, atol=1e-3)
        config = _llama_config(bpe.vocab_size, **{**OURS, "activation_func_clamp_value": 7.0})
        ours, folder = _ours(tmp_path / "run7", config, bpe)
        out = tmp_path / "hf7"
        assert export_hf(folder, open_checkpoint(folder)[1], out) == "gpt_oss"
    export_matches(ours, config, out, bpe)
    # Without yarn: rope_scaling null, which transformers 4.x reads as none (not its default
    # yarn), 5.x from rope_parameters.
    plain = dataclasses.replace(config, rope_scaling_type=None)
    ours, folder = _ours(tmp_path / "plain", plain, bpe)
    assert export_hf(folder, open_checkpoint(folder)[1], tmp_path / "hf-plain") == "gpt_oss"
    assert json.loads((tmp_path / "hf-plain" / "config.json").read_text())["rope_scaling"] is None
    export_matches(ours, plain, tmp_path / "hf-plain", bpe)


def test_what_gpt_oss_cannot_express_is_refused(bpe: BPETokenizer) -> None:
    with pytest.raises(ValueError, match=r"attention sinks \(only GPT-OSS has them\)"):
        family_for(_llama_config(64, num_experts=4, attention_sinks=True))
    with pytest.raises(ValueError, match=r"As GPT-OSS it has no attention sinks \(GPT-OSS "
                                         r"has them\)"):
        family_for(_llama_config(64, **{**OURS, "attention_sinks": False}))
    with pytest.raises(ValueError, match=r"As GPT-OSS it has llama3 RoPE scaling \(GPT-OSS "
                                         r"has yarn"):
        family_for(_llama_config(64, **{**OURS, "rope_scaling_type": "llama3"}))
    with pytest.raises(ValueError, match=r"full attention on layers 1 among sliding-window ones "
                                         r"\(only Gemma 2, Gemma 3 and GPT-OSS have them\)"):
        family_for(_llama_config(64, window_size=4, full_attention_layers=(1,)))


RAW = {"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16,
       "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5}


def test_gpt_oss_config_json_is_read_or_refused_in_its_keys() -> None:
    config = config_from_hf(RAW)[1]  # transformers' defaults: layers alternate, no yarn key
    assert (config.window_size, config.full_attention_layers) == (5, (1, 3))
    assert config.rotary_base == 150000.0 and config.rope_scaling_type is None
    assert (config.swiglu_alpha, config.activation_func_clamp_value) == (1.702, 7.0)
    full = config_from_hf({**RAW, "layer_types": ["full_attention"] * 4})[1]
    assert full.window_size is None and not full.full_attention_layers
    mxfp4 = {**RAW, "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(ValueError, match=r"GPT-OSS quantization_config \(quant_method 'mxfp4'"
                                         r".*dequantize it first"):
        config_from_hf(mxfp4)
    bad = {"layer_types": ["sliding_attention"] * 3,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4},
           "num_experts_per_tok": 5}
    for key, value in bad.items():
        with pytest.raises(ValueError, match=key.replace("rope_parameters", "RoPE type")):
            config_from_hf({**RAW, key: value})
    mscale = {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}
    with pytest.raises(ValueError, match="mscale_all_dim"):
        config_from_hf({**RAW, "rope_parameters": mscale})
    assert config_from_hf({**RAW, "rope_parameters": {**mscale, "attention_factor": 1.0}})[1]


def test_yarn_without_its_original_length_reads_as_transformers_computes_it() -> None:
    """A yarn ``rope_scaling`` without ``original_max_position_embeddings`` (GptOssConfig's
    default as transformers 4.55 saved it) is read with max_position_embeddings there, as
    transformers computes it: the same inverse frequencies and cos/sin factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from domino.transformer.rope import RotaryEmbedding, cos_sin_scale

    rope = {k: v for k, v in YARN.items() if k not in ("rope_theta",
                                                       "original_max_position_embeddings")}
    raw = {**RAW, "max_position_embeddings": 256, "rope_theta": 1000.0, "rope_scaling": rope}
    config = config_from_hf(raw)[1]
    assert (config.rope_scaling_type, config.rope_original_max_position_embeddings) == (
        "yarn", 256)
    theirs = hf_class("GptOssConfig").from_dict(dict(raw))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    torch.testing.assert_close(RotaryEmbedding.of(config).inv_freq, inv_freq, rtol=1e-6, atol=0)
    assert cos_sin_scale(config) == pytest.approx(factor, rel=1e-12)
