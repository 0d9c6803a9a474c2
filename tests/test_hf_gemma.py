"""Gemma 1, 2 and 3 (text) and VaultGemma against the real ``transformers`` (random weights from a
config, nothing downloaded, every norm's weight moved off zero): imported at TP=1 and TP=2 they
give the original's logits and greedy tokens (ours with and without the KV cache), export back
to the same logits, and a model of ours with Gemma's settings exports as its Gemma with
transformers' logits and greedy output. The sizes make each feature bite (a window of 6 in a
30-token text, sliding and full layers, soft-caps small enough to cap, Gemma 3's local RoPE base
apart from its global one, linear scaling on the global layers, GQA, head_dim 16 != 48 / 4):
each is shown to change the logits. A bf16 Gemma 3 exports as bf16, weight for weight. An
imported Gemma 2 and Gemma 3 train alike (losses of two steps) at DP=2, TP=2 with sequence
parallelism under each Domino plan, PP=2, and (Gemma 3; Gemma 2's soft-capped attention is
refused there) CP=2. The refusals name the key and its value. The features themselves are
checked against the independent reference under TP in ``test_gpt_tp.py``
(``gemma2_sandwich_softcaps``, ``gemma3_local_rope_sp``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from dist import fit, run_distributed
from hf_compat import (
    SOFT_CAPPED,
    dtype_kwarg,
    hf_class,
    hf_version,
    is_v5,
    load_hf,
    needs_model_type,
    sdpa_skips_softcap,
)
from test_bad_inputs import _refused
from test_hf_interop import (
    TEXT,
    _hf,
    _hf_logits,
    _llama_config,
    _ours,
    _perturb,
    export_matches,
    import_matches,
)

from domino.checkpoint.families import family_for
from domino.checkpoint.hf_config import config_from_hf
from domino.checkpoint.hf_export import export_hf
from domino.checkpoint.layout import open_checkpoint
from domino.cli import main
from domino.context_parallel import check_context_parallel
from domino.data import BPETokenizer
from domino.inference.sampling import generate
from domino.models.gpt import GPTModel
from domino.parallel_state import ParallelState

S, F = "sliding_attention", "full_attention"
TYPES = {"gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text",
         "vaultgemma": "vaultgemma"}
CLASSES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
           "gemma3": "Gemma3ForCausalLM", "vaultgemma": "VaultGemmaForCausalLM"}
# What each import must read (beyond every Gemma's norms, GeGLU and embedding scale).
READ = {
    "gemma": dict(sandwich_norms=False, window_size=None, qk_layernorm=False,
                  softmax_scale=None, untie_embeddings_and_output_weights=False),
    "gemma2": dict(sandwich_norms=True, window_size=6, full_attention_layers=(1, 3),
                   softmax_scale=24 ** -0.5, attention_softcap=5.0, output_softcap=3.0,
                   qk_layernorm=False, local_rotary_base=None,
                   untie_embeddings_and_output_weights=True),
    "gemma3": dict(sandwich_norms=True, qk_layernorm=True, window_size=6,
                   full_attention_layers=(1,), local_rotary_base=100.0, rotary_base=1e6,
                   rotary_seq_len_interpolation_factor=2.0, attention_softcap=None,
                   output_softcap=None, untie_embeddings_and_output_weights=False),
    "vaultgemma": dict(sandwich_norms=False, window_size=6, full_attention_layers=(1, 3),
                       softmax_scale=24 ** -0.5, attention_softcap=5.0, output_softcap=3.0,
                       qk_layernorm=False, untie_embeddings_and_output_weights=False),
}
# Settings whose removal must change the logits (they were applied).
BITES = {"gemma": [dict(layernorm_zero_centered_gamma=False)],
         "gemma2": [dict(window_size=None, full_attention_layers=()),
                    dict(full_attention_layers=()), dict(attention_softcap=None),
                    dict(output_softcap=None), dict(softmax_scale=None)],
         "gemma3": [dict(window_size=None, full_attention_layers=(), local_rotary_base=None),
                    dict(local_rotary_base=None), dict(rotary_seq_len_interpolation_factor=None),
                    dict(full_attention_layers=())],
         "vaultgemma": [dict(full_attention_layers=()), dict(attention_softcap=None),
                        dict(output_softcap=None), dict(softmax_scale=None)]}


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    corpus = [TEXT * 3, "alpha beta gamma delta epsilon " * 20, "import torch\n" * 10] * 5
    return BPETokenizer.train(corpus, vocab_size=300)


def _hf_config(bpe: BPETokenizer, kind: str):
    """The transformers config of each Gemma at test size."""
    t = _hf()
    common = dict(vocab_size=bpe.vocab_size, hidden_size=48, intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=bpe.eod,
                  eos_token_id=bpe.eod, pad_token_id=bpe.eod)
    if kind == "gemma":
        return t.GemmaConfig(**common, num_hidden_layers=2)
    if kind == "gemma2":  # layer_types by default: sliding, full, sliding, full
        return t.Gemma2Config(**common, num_hidden_layers=4, sliding_window=6,
                              query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                              final_logit_softcapping=3.0, tie_word_embeddings=False,
                              attn_implementation="eager")
    if kind == "vaultgemma":  # Gemma 2's layer kinds, no norms after the sublayers
        return hf_class("VaultGemmaConfig")(**common, num_hidden_layers=4, sliding_window=6,
                                  query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                  final_logit_softcapping=3.0, attn_implementation="eager")
    rope = {F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            S: {"rope_type": "default", "rope_theta": 100.0}}
    if not is_v5():  # 4.x: the full layers' RoPE at the top level, the local base apart
        rope = dict(rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0},
                    rope_local_base_freq=100.0)
    else:
        rope = {"rope_parameters": rope}
    # (before 4.53 Gemma 3 has no layer_types: every sliding_window_pattern-th layer is full)
    kinds = dict(layer_types=[S, F, S, S]) if hf_version() >= (4, 53) else dict(
        sliding_window_pattern=2)
    return hf_class("Gemma3TextConfig")(**common, num_hidden_layers=4, **kinds,
                                        sliding_window=6, query_pre_attn_scalar=24, **rope)


def _folder(tmp: Path, bpe: BPETokenizer, kind: str,
            dtype: torch.dtype = torch.float32) -> tuple[Path, torch.nn.Module]:
    """A Gemma of ``kind`` with random weights, saved as the Hub holds models."""
    torch.manual_seed(0)
    model = _hf().AutoModelForCausalLM.from_config(_hf_config(bpe, kind))
    assert model.config._attn_implementation == "eager" or kind not in SOFT_CAPPED
    _perturb(model, 3)
    model = model.to(dtype)
    folder = tmp / f"hf-{kind}"
    model.save_pretrained(folder)
    bpe._tok.save(str(folder / "tokenizer.json"))
    return folder, model.eval()


def _bites(model: GPTModel, ids: torch.Tensor, want: torch.Tensor, **change) -> None:
    """The model without ``change``'s settings gives other logits than ``want``."""
    config = dataclasses.replace(model.config, **change)
    other = GPTModel(config, parallel_state=ParallelState.single())
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        got = other.eval()(ids, None, None)[..., :config.vocab_size]
    assert not torch.allclose(got, want, atol=1e-3), change


@pytest.mark.parametrize("kind", list(TYPES))
def test_gemma_imports_and_exports_with_transformers_logits(
        tmp_path: Path, bpe: BPETokenizer, kind: str, capfd) -> None:
    folder, original = _folder(tmp_path, bpe, kind)
    got = import_matches(tmp_path, folder, original, bpe, capfd)
    config = got.config
    assert config.layernorm_zero_centered_gamma and config.activation == "geglu_tanh"
    assert config.embedding_multiplier == 48 ** 0.5 and config.kv_channels == 16
    assert config.num_query_groups == 2 and not config.add_bias_linear
    want = dict(READ[kind])
    if kind == "gemma3" and hf_version() < (4, 53):  # (sliding_window_pattern 2: S, F, S, F)
        want["full_attention_layers"] = (1, 3)
    assert {k: getattr(config, k) for k in want} == want
    prompt = bpe.encode("def forward")
    for cache in (True, False):
        assert generate(got.model, got.state, prompt, 10, config.vocab_size, 32,
                        use_cache=cache) == got.hf_ids
    step_dir, meta, _ = open_checkpoint(got.two)
    assert export_hf(step_dir, meta, tmp_path / "back") == TYPES[kind]
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert saved["architectures"] == [CLASSES[kind]]
    torch.testing.assert_close(_hf_logits(tmp_path / "back", got.ids), got.expected,
                               rtol=1e-5, atol=1e-5)
    for change in BITES[kind]:
        _bites(got.model, got.ids, got.expected, **change)


GEMMA = dict(activation="geglu_tanh", layernorm_zero_centered_gamma=True,
             embedding_multiplier=48 ** 0.5, embedding_multiplier_rounded=True,
             rope_scaling_type=None, rotary_base=10000.0)
OURS = {
    "gemma": dict(GEMMA),
    "gemma2": dict(GEMMA, num_layers=3, sandwich_norms=True, window_size=7,
                   full_attention_layers=(1,), softmax_scale=20 ** -0.5, attention_softcap=4.0,
                   output_softcap=2.5, untie_embeddings_and_output_weights=False),
    # llama3 scaling on the full-attention layer, the sliding ones a base of their own.
    "gemma3": dict(GEMMA, num_layers=3, sandwich_norms=True, qk_layernorm=True, window_size=7,
                   full_attention_layers=(2,), local_rotary_base=50.0, output_softcap=2.5,
                   rope_scaling_type="llama3", rotary_base=500000.0),
    # Gemma 2's scores and layer kinds on pre-norm layers only.
    "vaultgemma": dict(GEMMA, num_layers=3, window_size=7, full_attention_layers=(1,),
                       softmax_scale=20 ** -0.5, attention_softcap=4.0, output_softcap=2.5),
}


@pytest.mark.parametrize("kind", list(OURS))
def test_our_gemma_exports_as_its_family(tmp_path: Path, bpe: BPETokenizer, kind: str) -> None:
    needs_model_type(TYPES[kind])
    config = _llama_config(bpe.vocab_size, **OURS[kind])
    assert family_for(config).model_type == TYPES[kind]
    ours, folder = _ours(tmp_path / "run", config, bpe)
    out = tmp_path / "hf"
    assert export_hf(folder, open_checkpoint(folder)[1], out) == TYPES[kind]
    ids, mine = export_matches(ours, config, out, bpe)
    if kind in SOFT_CAPPED and sdpa_skips_softcap():
        # transformers 4.48 to 4.57 load it with SDPA unless told otherwise, which skips the
        # attention soft-cap: other logits (export_matches loads it with eager attention).
        default = _hf().AutoModelForCausalLM.from_pretrained(out, **dtype_kwarg(torch.float32))
        assert default.config._attn_implementation == "sdpa"
        with torch.no_grad():
            assert not torch.allclose(default.eval()(ids).logits, mine, atol=1e-3)
    # Read back, the export is the model it came from.
    saved = json.loads((out / "config.json").read_text())
    assert config_from_hf(saved)[1].architecture() == config.architecture()
    if kind == "gemma3":  # the same layer kinds for transformers 4.50-4.52, which read this
        p = saved["sliding_window_pattern"]
        kinds = [F if (i + 1) % p == 0 else S for i in range(config.num_layers)]
        assert kinds == saved["layer_types"] == [S, S, F], (p, saved["layer_types"])


def test_bf16_gemma3_exports_as_bf16_weight_for_weight(tmp_path: Path, bpe: BPETokenizer,
                                                       capfd) -> None:
    folder, _ = _folder(tmp_path, bpe, "gemma3", torch.bfloat16)
    run, back = tmp_path / "run", tmp_path / "back"
    assert main(["import", str(folder), str(run)]) == 0
    assert "(gemma3_text, bfloat16)" in capfd.readouterr().out
    assert open_checkpoint(run)[1].extra["dtype"] == "bfloat16"
    assert main(["export", "--format", "hf", str(run), str(back)]) == 0
    assert json.loads((back / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((back / "config.json").read_text())["torch_dtype"] == "bfloat16"  # 4.x
    first, again = load_hf(folder, "auto"), load_hf(back, "auto")
    assert again.dtype == first.dtype == torch.bfloat16
    weights = first.state_dict()
    assert weights.keys() == again.state_dict().keys()
    assert all(torch.equal(w, weights[k]) for k, w in again.state_dict().items())
    ids = torch.tensor([bpe.encode(TEXT)[:30]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, first(ids).logits)


# ---- config.json both ways, and what is refused -----------------------------------------------


def test_older_gemma3_keys_read_as_transformers_reads_them(bpe: BPETokenizer) -> None:
    """rope_theta, rope_local_base_freq, rope_scaling and sliding_window_pattern (the keys of
    Gemma 3's first config.json files) read as transformers 5 completes them."""
    raw = _hf_config(bpe, "gemma3").to_dict()
    for key in ("rope_parameters", "layer_types"):
        raw.pop(key, None)  # (4.x has no rope_parameters)
    raw.update(rope_theta=5e5, rope_local_base_freq=20.0, sliding_window_pattern=3,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    theirs = json.loads(hf_class("Gemma3TextConfig").from_dict(raw).to_json_string())
    if hf_version() >= (4, 53):  # (older ones keep the pattern only)
        assert theirs["layer_types"] == [S, S, F, S]
    config = config_from_hf(raw)[1]
    assert config.architecture() == config_from_hf(theirs)[1].architecture()
    assert (config.full_attention_layers, config.local_rotary_base, config.rotary_base,
            config.rotary_seq_len_interpolation_factor) == ((2,), 20.0, 5e5, 8.0)
    # Without any RoPE key: Gemma 3's bases, 1e6 global and 1e4 local.
    bare = {k: v for k, v in raw.items() if not k.startswith("rope")}
    assert (config_from_hf(bare)[1].rotary_base, config_from_hf(bare)[1].local_rotary_base) \
        == (1e6, 1e4)


def _gemma_raw(kind: str, **kw) -> dict:
    raw = {"model_type": kind, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8}
    return {**raw, **kw}


REFUSED = {
    "bidirectional": (_gemma_raw("gemma2", use_bidirectional_attention=True),
                      "Gemma 2 use_bidirectional_attention=true is not supported: every layer "
                      "here is causal"),
    "rope-type": (_gemma_raw("gemma2", rope_parameters={"rope_type": "dynamic",
                                                        "factor": 2.0}),
                  "Gemma 2 RoPE type 'dynamic' is not supported (default, linear, llama3)"),
    "attention-bias": (_gemma_raw("gemma", attention_bias=True),
                       "Gemma attention_bias=true is not supported"),
    "exact-gelu": (_gemma_raw("gemma3_text", hidden_activation="gelu"),
                   "Gemma 3 hidden_activation='gelu' (exact GELU) is not supported"),
    "layer-types": (_gemma_raw("gemma2", layer_types=[S]),
                    '"layer_types" is ["sliding_attention"]; it must be a list of '
                    "num_hidden_layers (2) attention kinds"),
    "local-rope": (_gemma_raw("gemma3_text", rope_parameters={
        F: {"rope_type": "default"}, S: {"rope_type": "linear", "factor": 2.0}}),
                   'Gemma 3 rope_parameters.sliding_attention.rope_type "linear" is not '
                   "supported"),
    "no-window": (_gemma_raw("gemma2", sliding_window=None),
                  'Gemma 2 layer_types marks sliding_attention layers but "sliding_window" is '
                  "null"),
    "vision": ({"model_type": "gemma3", "text_config": _gemma_raw("gemma3_text"),
                "vision_config": {"model_type": "siglip_vision_model"}},
               "model_type 'gemma3' is not supported: it has a model in several parts "
               "(text_config, vision_config; domino import reads a text decoder's own "
               "config.json)"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_gemma_cannot_express_is_refused_naming_the_key(case: str) -> None:
    raw, message = REFUSED[case]
    with pytest.raises(ValueError) as err:
        config_from_hf(raw)
    assert message in str(err.value), str(err.value)


def test_import_refuses_in_one_line_and_writes_nothing(tmp_path: Path, bpe: BPETokenizer,
                                                      capfd) -> None:
    folder, _ = _folder(tmp_path, bpe, "gemma2")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "use_bidirectional_attention": True}))
    line = _refused(capfd, ["import", str(folder), str(tmp_path / "out")])
    assert "use_bidirectional_attention=true is not supported" in line
    assert not (tmp_path / "out").exists()


def test_only_gemma_expresses_gemma_settings() -> None:
    """No other family claims a model with any of Gemma's settings; each Gemma refuses what it
    lacks."""
    llama = _llama_config(64)
    for change, words in (
            (dict(layernorm_zero_centered_gamma=True), "norms scaling by (1 + weight) (only "
                                                       "Gemma has them)"),
            (dict(sandwich_norms=True), "norms before and after each sublayer"),
            (dict(attention_softcap=30.0), "attention scores soft-capped at 30.0"),
            (dict(output_softcap=30.0), "logits soft-capped at 30.0"),
            (dict(window_size=4, full_attention_layers=(1,)), "full attention on layers 1"),
            (dict(window_size=4, local_rotary_base=100.0), "a RoPE base of 100.0 on the")):
        with pytest.raises(ValueError, match="can express this model") as err:
            family_for(dataclasses.replace(llama, **change))
        assert words in str(err.value), (change, str(err.value))
    from test_hf_interop import _gpt2_config

    with pytest.raises(ValueError, match=r"norms scaling by \(1 \+ weight\)"):
        family_for(_gpt2_config(64, layernorm_zero_centered_gamma=True))
    gemma = _llama_config(64, **OURS["gemma3"])
    for change, words in ((dict(qk_layernorm=False), "As Gemma 3 it has no query/key norms"),
                          (dict(softmax_scale=0.3), "scaled by 0.3, which is not 1/sqrt of an "
                                                    "integer"),
                          (dict(embedding_multiplier=2.0), "multiplied by 2.0 (Gemma "
                                                            "multiplies them by sqrt")):
        with pytest.raises(ValueError) as err:
            family_for(dataclasses.replace(gemma, **change))
        assert words in str(err.value), (change, str(err.value))


def test_attention_softcap_is_refused_with_context_parallelism(tmp_path: Path, capfd) -> None:
    with pytest.raises(ValueError, match=r"attention_softcap=50.0 \(Gemma 2's attention "
                                         r"soft-capping\) is not supported with context "
                                         r"parallelism \(context_parallel_size=2\)"):
        check_context_parallel(seq_length=32, context_parallel_size=2, num_attention_heads=4,
                               attention_softcap=50.0)
    line = _refused(capfd, [
        "train", "--data-path", str(tmp_path / "none"), "--num-layers", "2", "--hidden-size",
        "32", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
        "--train-iters", "1", "--attention-dropout", "0", "--attention-softcap", "50",
        "--context-parallel-size", "2", "--tensor-model-parallel-size", "1", "--nproc", "2",
        "--no-tensorboard"])
    assert ("--attention-softcap 50.0 (Gemma 2's attention soft-capping) is not supported with "
            "context parallelism (--context-parallel-size 2)") in line, line


# ---- an imported Gemma under every parallel layout --------------------------------------------


def _layouts(cp: bool) -> dict[str, dict]:
    """Two-rank layouts of the same global batches (DP=2 is the reference)."""
    out = {"dp2": {},
           "pp2": dict(pipeline_model_parallel_size=2, pipeline_schedule="1f1b")}
    for name, plan in (("sync", (1, "none", 1)), ("intra", (2, "intra_layer", 1)),
                       ("cross_chunks", (2, "cross_layer", 2))):
        out[f"tp2_sp_{name}"] = dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                     domino_micro_batches=plan[0], domino_overlap=plan[1],
                                     domino_column_chunks=plan[2])
    if cp:
        out["cp2"] = dict(context_parallel_size=2, micro_batch_size=4)
        out["cp2_allgather"] = dict(context_parallel_size=2, micro_batch_size=4,
                                    cp_comm_type="all_gather")
    return out


def _trained(rank: int, world: int, runs: dict[str, str], data: str, tmp: str) -> dict:
    from domino.training.arguments import resolve_args

    out = {}
    # (config.toml's parallel settings are the TP=2 import's)
    base = dict(data_path=[data], split="90,10,0", seq_length=32, micro_batch_size=2,
                global_batch_size=4, train_iters=2, lr=1e-3, min_lr=1e-4, lr_warmup_iters=0,
                adam_eps=1e-4, eval_iters=0, sample_tokens=0, tensorboard=False, device="cpu",
                log_interval=1, save_interval=0, save_interval_minutes=0.0,
                tensor_model_parallel_size=1, sequence_parallel=False, domino_micro_batches=1,
                domino_overlap="none", domino_column_chunks=1)
    for kind, run in runs.items():
        for name, layout in _layouts(cp=kind == "gemma3").items():
            args = resolve_args({"config": f"{run}/config.toml", "load": run, **base, **layout})
            out[kind, name] = fit(args, f"{tmp}/{kind}-{name}").losses
    return out


def test_imported_gemma_trains_alike_under_every_layout(tmp_path: Path, bpe: BPETokenizer,
                                                       capfd) -> None:
    from domino.data import HFTokenizer, preprocess
    from domino.data.preprocess import stdlib_corpus_files

    runs = {}
    for kind in ("gemma2", "gemma3"):
        folder, _ = _folder(tmp_path, bpe, kind)
        runs[kind] = str(tmp_path / f"run-{kind}")
        assert main(["import", str(folder), runs[kind], "--tensor-model-parallel-size", "2"]) == 0
    data = tmp_path / "data"
    tok = HFTokenizer.load(Path(runs["gemma3"]) / "checkpoints" / "step_0000000" / "tokenizer")
    preprocess(stdlib_corpus_files(limit_bytes=30_000), data, tok, progress=False)
    ranks = run_distributed(_trained, 2, runs, str(data), str(tmp_path / "fits"))
    for kind in runs:
        ref = ranks[0][kind, "dp2"]
        assert len(ref) == 2 and ref[0] != ref[1]
        for name in _layouts(cp=kind == "gemma3"):
            for rank in ranks:
                assert rank[kind, name] == pytest.approx(ref, rel=1e-5), (kind, name)
