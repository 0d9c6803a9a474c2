"""Phi-3's LongRoPE (``rope_type`` longrope: Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini) against
the real ``transformers`` (random weights from a config, nothing downloaded), with an original
context of 16 positions of 64: imported at TP=1 and TP=2, the logits of a text within it (16
tokens: short factors), just past it (17: long factors) and well past it (30) equal the
original's, and greedy generation from a short prompt across the boundary (where transformers
recomputes its cache with the long factors) equals ``transformers.generate``, with and without
our KV cache; exported back, transformers gives the same logits. A model of ours with LongRoPE
exports as Phi-3 with transformers' logits and tokens. The rule itself (which factor set, on
every rank, at the boundary) is checked against the independent reference under TP in
``test_gpt_tp.py`` (``longrope_*``) and under context parallelism in
``test_context_parallel_model.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist import run_distributed
from hf_compat import is_v5, load_hf, needs_phi3_partial_rotary
from test_hf_interop import TEXT, _hf, _ours, _perturb, export_matches

from domino.checkpoint.families import family_for
from domino.checkpoint.hf_config import config_from_hf
from domino.checkpoint.hf_export import export_hf
from domino.checkpoint.hf_import import import_hf
from domino.checkpoint.layout import open_checkpoint
from domino.cli import main
from domino.config import TransformerConfig
from domino.data import BPETokenizer
from domino.inference.loading import load_saved_model
from domino.inference.sampling import generate
from domino.parallel_state import ParallelState

ORIGINAL, LENGTHS, NEW = 16, (16, 17, 30), 20  # within, just past, well past; new tokens


def _factors(n: int, first: float, step: float) -> list[float]:
    return [round(first + step * i, 3) for i in range(n)]


# name: Phi3Config settings (head size 16; max_position_embeddings 64, original context 16).
MODELS = {
    # as Phi-3-mini-128k: the Hub's spelling (rope_scaling.type), whole heads (8 pairs), the
    # factor and the attention factor derived (64 / 16; sqrt(1 + ln 4 / ln 16))
    "hub-whole-heads": dict(
        num_key_value_heads=4, tie_word_embeddings=False,
        rope_scaling={"type": "longrope", "short_factor": _factors(8, 1.0, 0.1),
                      "long_factor": _factors(8, 1.5, 0.9)}),
    # as Phi-4-mini: 75% of each head (6 pairs), GQA, tied; as transformers saves it, with
    # the factor and the attention factor given
    "phi4-partial-given": dict(
        partial_rotary_factor=0.75, num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 250000.0, "factor": 3.0,
                         "attention_factor": 1.2, "short_factor": _factors(6, 1.0, 0.2),
                         "long_factor": _factors(6, 2.0, 1.5)}),
}


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    corpus = [TEXT * 3, "alpha beta gamma delta epsilon " * 20, "import torch\n" * 10] * 5
    return BPETokenizer.train(corpus, vocab_size=300)


def _settings(name: str) -> dict:
    """MODELS[name] as the installed transformers takes it. 4.x's Phi3Config takes LongRoPE as
    the Hub's three keys only (type, short_factor, long_factor; it refuses a fourth) and
    derives the factor and the attention factor: there Phi-4-mini is saved so. Its Phi-3
    rotates part of each head from 4.49 on (before: skipped)."""
    settings = dict(MODELS[name])
    if settings.get("partial_rotary_factor", 1.0) < 1:
        needs_phi3_partial_rotary()
    if not is_v5() and "rope_parameters" in settings:
        rope = settings.pop("rope_parameters")
        settings.update(rope_theta=rope["rope_theta"], rope_scaling={
            "type": "longrope", "short_factor": rope["short_factor"],
            "long_factor": rope["long_factor"]})
    return settings


def _given(name: str) -> bool:
    """Whether the model's factor and attention factor are given (5.x), not derived."""
    return name == "phi4-partial-given" and is_v5()


def _folder(tmp: Path, bpe: BPETokenizer, name: str) -> tuple[Path, torch.nn.Module]:
    eod = bpe.eod
    config = _hf().Phi3Config(
        vocab_size=bpe.vocab_size, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64,
        original_max_position_embeddings=ORIGINAL, rms_norm_eps=1e-5, bos_token_id=eod,
        eos_token_id=eod, pad_token_id=eod, **_settings(name))
    model = _hf().Phi3ForCausalLM(config)
    _perturb(model, 7)
    folder = tmp / "hf-phi3"
    model.save_pretrained(folder)
    bpe._tok.save(str(folder / "tokenizer.json"))
    return folder, model.eval()


def _expected(original: torch.nn.Module, bpe: BPETokenizer) -> tuple[torch.Tensor, dict,
                                                                     list[int], list[int]]:
    """(ids, transformers' logits by length, the prompt, its greedy tokens)."""
    ids = torch.tensor([bpe.encode(TEXT)[:LENGTHS[-1]]])
    with torch.no_grad():
        logits = {n: original(ids[:, :n]).logits for n in LENGTHS}
    # The factor sets differ: the first 16 tokens' logits change once the text is longer.
    assert not torch.allclose(logits[17][:, :ORIGINAL], logits[16], atol=1e-3)
    prompt = ids[0, :4].tolist()
    runs = [original.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                              pad_token_id=bpe.eod, use_cache=cache)[0, len(prompt):].tolist()
            for cache in (True, False)]
    assert runs[0] == runs[1]  # (transformers' cache recomputed at the boundary)
    assert len(prompt) + len(runs[0]) > ORIGINAL + 1, "generation must cross the boundary"
    return ids, logits, prompt, runs[0]


def _at_tp2(rank: int, world: int, run: str, ids: torch.Tensor, prompt: list[int],
            vocab: int, eod: int) -> dict:
    """The TP=2 import at TP=2: logits of each length, greedy tokens (KV cache)."""
    state = ParallelState.build(world)
    model, _, _, _ = load_saved_model(open_checkpoint(run)[0], state)
    out = {}
    with torch.no_grad():
        for n in LENGTHS:
            out[n] = state.tp.all_gather_last_dim(model(ids[:, :n], None, None))[..., :vocab]
    out["generated"] = generate(model, state, prompt, NEW, vocab, 64, stop=(eod,))
    return out


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_longrope_imports_and_exports_with_transformers_logits(tmp_path: Path,
                                                               bpe: BPETokenizer,
                                                               name: str) -> None:
    folder, original = _folder(tmp_path, bpe, name)
    ids, expected, prompt, hf_ids = _expected(original, bpe)
    state = ParallelState.single()
    model, config, _, _ = load_saved_model(import_hf(folder, tmp_path / "tp1", 1), state)
    given = _given(name)
    assert config.rope_scaling_type == "longrope"
    assert config.rope_original_max_position_embeddings == ORIGINAL
    assert (config.rope_scaling_factor, config.rope_attention_factor) == (
        (3.0, 1.2) if given else (4.0, None))
    with torch.no_grad():
        for n in LENGTHS:
            _close(model(ids[:, :n], None, None)[..., :config.vocab_size], expected[n])
    for cache in (True, False):
        assert generate(model, state, prompt, NEW, config.vocab_size, 64, stop=(bpe.eod,),
                        use_cache=cache) == hf_ids
    two = tmp_path / "tp2"
    assert main(["import", str(folder), str(two), "--tensor-model-parallel-size", "2"]) == 0
    for res in run_distributed(_at_tp2, 2, str(two), ids, prompt, config.vocab_size, bpe.eod):
        for n in LENGTHS:
            _close(res[n], expected[n])
        assert res["generated"] == hf_ids
    # Exported back (from the TP=2 run): transformers reads the same model.
    step_dir, meta, _ = open_checkpoint(two)
    back = tmp_path / "back"
    assert export_hf(step_dir, meta, back) == "phi3"
    written = json.loads((back / "config.json").read_text())
    assert written["original_max_position_embeddings"] == ORIGINAL
    assert written["rope_parameters"]["rope_type"] == "longrope"
    again = load_hf(back)
    with torch.no_grad():
        for n in LENGTHS:
            _close(again(ids[:, :n]).logits, expected[n])


def _config(vocab: int, **kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=64, vocab_size=vocab, seq_length=64, max_position_embeddings=64,
                position_embedding_type="rope", rotary_percent=0.75, normalization="RMSNorm",
                activation="swiglu", add_bias_linear=False, hidden_dropout=0.0,
                attention_dropout=0.0, untie_embeddings_and_output_weights=True,
                rope_scaling_type="longrope", rope_short_factor=_factors(6, 1.0, 0.3),
                rope_long_factor=_factors(6, 2.0, 2.0),
                rope_original_max_position_embeddings=ORIGINAL, rope_scaling_factor=4.0)
    return TransformerConfig(**{**base, **kw})


@pytest.mark.parametrize("case", ["derived", "given"])
def test_our_longrope_model_exports_as_phi3(tmp_path: Path, bpe: BPETokenizer,
                                            case: str) -> None:
    """With the factor transformers derives (64 / 16) and no attention factor, ``rope_scaling``
    holds the Hub's three keys; with others given, every key (transformers reads it first).
    Either way transformers' logits and greedy tokens across the boundary equal ours."""
    if case == "derived":
        needs_phi3_partial_rotary()
    extra = {} if case == "derived" else dict(rope_scaling_factor=2.5, rope_attention_factor=1.1,
                                              rotary_percent=1.0, rope_short_factor=(1.5,) * 8,
                                              rope_long_factor=_factors(8, 3.0, 0.5))
    config = _config(bpe.vocab_size, **extra)
    ours, folder = _ours(tmp_path / "run", config, bpe)
    out = tmp_path / "hf"
    assert export_hf(folder, open_checkpoint(folder)[1], out) == "phi3"
    legacy = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert (set(legacy) == {"type", "short_factor", "long_factor"}) == (case == "derived")
    if case == "given" and not is_v5():
        # 4.x's Phi3Config derives both factors and refuses a rope_scaling of more keys: such
        # a model is transformers 5's only, and 4.x says so rather than compute another.
        with pytest.raises(ValueError, match="must be a dictionary with three fields"):
            load_hf(out)
        return
    export_matches(ours, config, out, bpe, cache_tokens=64)  # (30 tokens: long factors)
    theirs = load_hf(out)
    ids, _, prompt, hf_ids = _expected(theirs, bpe)
    with torch.no_grad():
        for n in LENGTHS:
            _close(ours(ids[:, :n], None, None)[..., :config.vocab_size], theirs(ids[:, :n]).logits)
    assert generate(ours, ParallelState.single(), prompt, NEW, config.vocab_size, 64,
                    stop=(bpe.eod,)) == hf_ids


def test_only_phi3_expresses_longrope_and_its_keys_are_read(bpe: BPETokenizer) -> None:
    """Whole heads with LongRoPE are not a Llama (listed first) but a Phi-3; with query/key
    norms no family's (not Qwen3's); a Phi-3 with other RoPE scaling is refused. The Hub's
    spellings (``su``, ``yarn``) read as longrope; the top-level original context wins over
    the one inside (as Phi3Config has it)."""
    whole = _config(bpe.vocab_size, rotary_percent=1.0, rope_short_factor=(1.0,) * 8,
                    rope_long_factor=(2.0,) * 8)
    assert family_for(whole).model_type == "phi3"
    with pytest.raises(ValueError, match=r"As Qwen3 it has longrope RoPE scaling \(only Phi-3 "
                                         r"has it\)"):  # (Qwen3 has query/key norms)
        family_for(_config(bpe.vocab_size, rotary_percent=1.0, rope_short_factor=(1.0,) * 8,
                           rope_long_factor=(2.0,) * 8, qk_layernorm=True))
    llama3 = dict(rope_scaling_type="llama3", rope_short_factor=(), rope_long_factor=())
    with pytest.raises(ValueError, match=r"As Phi-3 it has llama3 RoPE scaling \(Phi-3 has "
                                         r"longrope or none\)"):
        family_for(_config(bpe.vocab_size, **llama3))
    raw = {"model_type": "phi3", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256}
    for kind in ("longrope", "su", "yarn"):
        rope = {"type": kind, "short_factor": [1] * 8, "long_factor": [2] * 8,
                "original_max_position_embeddings": 64}
        config = config_from_hf({**raw, "rope_scaling": rope})[1]
        assert config.rope_scaling_type == "longrope"
        assert config.rope_original_max_position_embeddings == 4096  # (Phi3Config's default)
        assert config.rope_long_factor == (2.0,) * 8
    config = config_from_hf({**raw, "rope_scaling": rope,
                             "original_max_position_embeddings": 64})[1]
    assert (config.rope_original_max_position_embeddings, config.rope_scaling_factor) == (64, 4.0)


@pytest.mark.parametrize(("damage", "wanted"), [
    (dict(short_factor=[1.0] * 3), "rope_scaling.short_factor=[1.0, 1.0, 1.0] must be 8 numbers"),
    (dict(long_factor=[1.0] * 7 + [0.0]), '"rope_scaling.long_factor" is [1.0, 1.0'),
    (dict(long_factor=None), '"rope_scaling.long_factor" is null'),
    (dict(attention_factor=-1), '"rope_scaling.attention_factor" is -1'),
])
def test_bad_longrope_keys_are_named(tmp_path: Path, capfd, damage: dict, wanted: str) -> None:
    rope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, **damage}
    raw = {"model_type": "phi3", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "rope_scaling": rope}
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    capfd.readouterr()
    assert main(["import", str(folder), str(tmp_path / "out")]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and wanted in err, err
    assert "rope_short_factor" not in err and "kv_channels" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("last", [ORIGINAL - 1, ORIGINAL, 40])
def test_the_factor_set_is_transformers_choice_for_a_whole_batch(bpe: BPETokenizer,
                                                                 last: int) -> None:
    """Our angles (and cos/sin factor) for a batch whose largest position is ``last`` equal
    Phi3RotaryEmbedding's cos and sin: the short set up to position 15 (16 positions), the
    long one from 16, for every sample of the batch once one reaches past (sample 0 stays
    short on its own)."""
    from domino.transformer.rope import RotaryEmbedding, cos_sin_scale

    hf_config = _hf().Phi3Config(
        vocab_size=64, hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
        original_max_position_embeddings=ORIGINAL, pad_token_id=None,
        **_settings("phi4-partial-given"))
    theirs = _hf().models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf_config)
    config = config_from_hf({**json.loads(hf_config.to_json_string()),
                             "model_type": "phi3"})[1]
    ours, scale = RotaryEmbedding.of(config), cos_sin_scale(config)
    positions = torch.stack([torch.arange(8), torch.arange(last - 7, last + 1)])  # [2, 8]
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions)
    angles = ours(positions)[:, :, 0].transpose(0, 1)  # [b, s, rot]
    torch.testing.assert_close(angles.cos() * scale, cos, rtol=0, atol=0)
    torch.testing.assert_close(angles.sin() * scale, sin, rtol=0, atol=0)
    alone = ours(positions[:1])[:, :, 0].transpose(0, 1)  # (sample 0 alone: short)
    assert torch.equal(alone, angles[:1]) == (last < ORIGINAL)
