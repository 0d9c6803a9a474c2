"""The model's architecture apart from how it runs: RuntimeConfig passed in, the seed's keywords
building the default one, records written before the split still loading, and `domino train`'s
model flags derived from TransformerConfig's fields (one table, both directions)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

import pytest
import torch

from domino import RuntimeConfig, TransformerConfig
from domino.checkpoint.layout import Meta, open_checkpoint
from domino.checkpoint.store import save
from domino.data import ByteTokenizer
from domino.inference.loading import load_saved_model
from domino.models.gpt import GPTModel
from domino.parallel_state import ParallelState
from domino.plan import Plan
from domino.runtime import SEED_SPELLING
from domino.tensor_parallel import CommGroup
from domino.training import model_flags
from domino.training.arguments import TrainArgs, add_arguments, field_types, help_text
from domino.training.prepare import prepare_run

ARCH = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8,
            max_position_embeddings=8, hidden_dropout=0.1, attention_dropout=0.1)
SEED = dict(domino_micro_batches=2, domino_overlap="intra_layer", domino_column_chunks=2,
            sequence_parallel=True, recompute_granularity="selective")
RUNTIME = RuntimeConfig(plan=Plan(2, "intra_layer", 2), sequence_parallel=True,
                        recompute_granularity="selective")


def test_seed_keywords_build_the_runtime_config() -> None:
    cfg = TransformerConfig(**ARCH, **SEED)
    assert cfg.runtime() == RUNTIME == RuntimeConfig.from_seed(**SEED)
    assert TransformerConfig(**ARCH).runtime() == RuntimeConfig()  # the defaults agree
    assert {k: getattr(cfg, k) for k in SEED} == SEED == RUNTIME.seed_spelling()
    assert dataclasses.replace(cfg, num_layers=3).runtime() == RUNTIME  # kept by replace()
    cfg.sequence_parallel = False  # seed code may set it; the runtime follows
    assert cfg.runtime() == RUNTIME.replace(sequence_parallel=False)
    with pytest.raises(ValueError, match="domino_overlap"):
        cfg.domino_overlap = "full"
    with pytest.raises(ValueError, match="recompute_granularity='some'"):
        RuntimeConfig(recompute_granularity="some")
    with pytest.raises(TypeError, match="Plan.parse"):
        RuntimeConfig(plan="m2:cross")  # type: ignore[arg-type]


def _grads(cfg: TransformerConfig, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    # Half of a TP=2 model with its collectives off: the plan and SP really split the work.
    state = ParallelState(tp=CommGroup(size=2, rank=0, enabled=False))
    torch.manual_seed(0)
    state.rng.seed(0)
    model = GPTModel(cfg, parallel_state=state, **kw)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    loss = model(ids, None, None, labels=ids)
    loss.sum().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_seed_spelling_runs_as_the_explicit_runtime() -> None:
    seed_loss, seed_grads = _grads(TransformerConfig(**ARCH, **SEED))
    loss, grads = _grads(TransformerConfig(**ARCH), runtime=RUNTIME)
    assert torch.equal(seed_loss, loss)
    assert seed_grads.keys() == grads.keys()
    assert all(torch.equal(seed_grads[n], grads[n]) for n in grads)
    model = GPTModel(TransformerConfig(**ARCH, **SEED), plan=Plan(1, "none", 1),
                     parallel_state=ParallelState.single())
    assert model.language_model.encoder.runtime == RUNTIME.replace(plan=Plan(1, "none", 1))
    with pytest.raises(ValueError, match="not both"):
        GPTModel(TransformerConfig(**ARCH), runtime=RUNTIME, plan=Plan(),
                 parallel_state=ParallelState.single())


def test_architecture_and_records_hold_no_run_time_keys() -> None:
    cfg = TransformerConfig(**ARCH, **SEED)
    run_time = set(SEED_SPELLING) | {f.name for f in dataclasses.fields(RuntimeConfig)}
    assert not run_time & set(cfg.architecture())
    assert not run_time & set(cfg.to_dict())
    assert not run_time & {f.name for f in dataclasses.fields(TransformerConfig)}
    assert TransformerConfig.from_dict(cfg.to_dict()).runtime() == RuntimeConfig()


# checkpoint.json's "config" as the code before the split wrote it (run-time keys included).
OLD_CONFIG = {
    "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 257,
    "ffn_hidden_size": 128, "kv_channels": 8, "num_query_groups": 4, "decoder_num_layers": 2,
    "make_vocab_size_divisible_by": 128, "max_position_embeddings": 16, "seq_length": 16,
    "position_embedding_type": "learned_absolute", "rotary_percent": 1.0,
    "rotary_base": 10000.0, "rotary_seq_len_interpolation_factor": None,
    "rope_scaling_type": None, "rope_scaling_factor": 8.0, "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0, "rope_original_max_position_embeddings": 8192,
    "normalization": "LayerNorm", "activation": "gelu", "add_bias_linear": True,
    "hidden_dropout": 0.0, "attention_dropout": 0.0, "layernorm_epsilon": 1e-05,
    "init_method_std": 0.02, "apply_residual_connection_post_layernorm": False,
    "final_layernorm": True, "untie_embeddings_and_output_weights": False,
    "params_dtype": "float32", "attention_softmax_in_fp32": True, "domino_micro_batches": 4,
    "domino_overlap": "cross_layer", "domino_column_chunks": 1,
    "recompute_granularity": "selective", "sequence_parallel": True,
}


def test_a_checkpoint_written_before_the_split_loads(tmp_path: Path, byte_dataset) -> None:
    args = TrainArgs(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                     tensor_model_parallel_size=1, sequence_parallel=True,
                     recompute_granularity="selective", domino_micro_batches=4)
    state = ParallelState.single()
    model = GPTModel(TransformerConfig.from_dict(OLD_CONFIG), parallel_state=state)
    meta = Meta(step=1, consumed_samples=4, config=OLD_CONFIG, layout={}, tensors={}, files={},
                plan="m4:cross", args=args.to_dict(), library_version="before the split")
    save(tmp_path / "old", 1, state, model, torch.optim.AdamW(model.parameters()), meta,
         keep=0, tokenizer=ByteTokenizer())
    step_dir, meta, _ = open_checkpoint(tmp_path / "old", hashes=True)
    assert meta.config["domino_micro_batches"] == 4  # the old keys are on disk
    loaded, config, _, _ = load_saved_model(step_dir, state)
    assert config.architecture() == TransformerConfig.from_dict(OLD_CONFIG).architecture()
    assert loaded.language_model.encoder.runtime == RuntimeConfig(plan=Plan(4, "cross_layer"))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters(),
                                                  strict=True))
    # `domino train --load` of it: the same model, so its resume checks pass.
    data = byte_dataset(200_000)
    resumed = prepare_run(dataclasses.replace(
        args, data_path=data, tokenizer_type="byte", split="90,10,0", micro_batch_size=4,
        load=str(tmp_path / "old"), save=str(tmp_path / "new"), sample_tokens=0),
        world_size=1, progress=False)
    assert resumed.resume.meta.step == 1 and resumed.runtime == args.runtime()


def test_every_config_field_has_a_flag_or_a_reason() -> None:
    """A new TransformerConfig field becomes a `domino train` flag of its name; one whose type
    cannot be a flag must be named in model_flags (renamed or set by the run)."""
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    same = set(model_flags.same_named())
    assert same | set(model_flags.RENAMED) | set(model_flags.SET_BY_RUN) == fields
    assert not same & (set(model_flags.RENAMED) | set(model_flags.SET_BY_RUN))
    kinds = field_types()
    flags = {x.name for r in model_flags.RENAMED.values() for x in r.flags}
    for name in same | flags:
        assert kinds[name] in (int, float, str, bool), (name, kinds[name])
    # Every architecture field is a flag of `domino train`, or the run sets it (and says how).
    for name in TransformerConfig(**ARCH).architecture():
        assert name in same or name in model_flags.RENAMED or name in model_flags.SET_BY_RUN
        assert model_flags.flag_label(name)
    hints = typing.get_type_hints(TransformerConfig)
    for name in same:  # same type as the field (a training default may make it optional)
        assert kinds[name] is hints[name] or kinds[name] in typing.get_args(hints[name]), name
    # ... and `domino train` has the flag, with the field's help.
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = parser.format_help()
    for name in same | flags:
        assert f"--{name.replace('_', '-')}" in text, name
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(TransformerConfig)}
    for name in same - set(model_flags.TRAIN_DEFAULTS):
        assert help_text(name) == helps[name], name


@pytest.mark.parametrize("over", [
    {}, dict(activation="swiglu", add_bias_linear=False, normalization="RMSNorm",
             position_embedding_type="rope", layernorm_epsilon=1e-6, num_query_groups=2,
             rope_scaling_type="llama3", untie_embeddings_and_output_weights=True,
             nope_layers=(1,)),
    dict(activation="gelu_tanh", ffn_hidden_size=48, kv_channels=16),
    # LongRoPE's factor lists: comma-separated flags, each float written exactly
    dict(position_embedding_type="rope", rotary_percent=0.5, rope_scaling_type="longrope",
         rope_short_factor=(1.0, 0.1 + 0.2), rope_long_factor=(1 / 3, 2e-7),
         rope_original_max_position_embeddings=4, rope_attention_factor=1.25),
])
def test_train_settings_and_model_config_are_inverse(over) -> None:
    cfg = TransformerConfig(**{**ARCH, **over})
    args = TrainArgs(**model_flags.train_settings(cfg))
    back = model_flags.model_config(args, cfg.vocab_size)
    assert back.architecture() == cfg.architecture()
    assert back.to_dict() == cfg.to_dict()
