"""TransformerConfig validation and derived defaults; parallel_state size checks."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from domino import TransformerConfig, distributed, megatron_compat
from domino.parallel_state import ParallelState, check_sizes

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=1000)


def make(**overrides) -> TransformerConfig:
    return TransformerConfig(**{**BASE, **overrides})


@pytest.mark.parametrize("overrides, names", [
    (dict(hidden_size=60, num_attention_heads=8), ["hidden_size=60", "num_attention_heads=8"]),
    (dict(num_attention_heads=8, num_query_groups=3),
     ["num_attention_heads=8", "num_query_groups=3"]),
    (dict(position_embedding_type="alibi"), ["position_embedding_type", "alibi"]),
    (dict(normalization="BatchNorm"), ["normalization", "BatchNorm"]),
    (dict(activation="relu"), ["activation", "relu"]),
    (dict(domino_overlap="full"), ["domino_overlap", "full"]),
    (dict(hidden_dropout=1.0), ["hidden_dropout"]),
    (dict(hidden_dropout=-0.1), ["hidden_dropout"]),
    (dict(attention_dropout=1.5), ["attention_dropout"]),
    (dict(position_embedding_type="rope", kv_channels=7), ["rotary_percent", "kv_channels"]),
    (dict(position_embedding_type="rope", rotary_percent=0.25, kv_channels=4),
     ["rotary_percent"]),
    (dict(rotary_percent=0.0), ["rotary_percent"]),
    (dict(window_size=0), ["window_size=0", ">= 1"]),
    (dict(qk_layernorm_full_width=True), ["qk_layernorm_full_width", "qk_layernorm=False"]),
    (dict(qk_layernorm=True, qk_layernorm_full_width=True),
     ["qk_layernorm_full_width", "normalization='LayerNorm'"]),
    (dict(window_size=True), ["window_size=True"]),
    (dict(nope_layers=(0,)), ["nope_layers=[0]", "position_embedding_type='rope'"]),
    (dict(position_embedding_type="rope", nope_layers=(0, 9)), ["nope_layers=(0, 9)",
                                                                "num_layers="]),
    (dict(position_embedding_type="rope", nope_layers=(0, 0)), ["nope_layers=(0, 0)"]),
    (dict(position_embedding_type="rope", nope_layers="1"), ["nope_layers='1'"]),
    (dict(position_embedding_type="rope", rope_scaling_type="longrope"),
     ["rope_short_factor=()", "must be 4 numbers > 0"]),
    (dict(position_embedding_type="rope", rope_scaling_type="longrope",
          rope_short_factor=(1, 2, 3, 4), rope_long_factor=(1, 2, 3, -4)),
     ["rope_long_factor=(1, 2, 3, -4)", "must be 4 numbers > 0"]),
    (dict(position_embedding_type="rope", rope_long_factor=(1.0,) * 4),
     ["rope_long_factor=(1.0, 1.0, 1.0, 1.0) is set", "rope_scaling_type=None", "'longrope'"]),
    (dict(rope_scaling_type="longrope", rope_short_factor=(1.0,) * 4,
          rope_long_factor=(1.0,) * 4), ["needs position_embedding_type='rope'"]),
    (dict(position_embedding_type="rope", rope_scaling_type="longrope",
          rope_short_factor=(1.0,) * 4, rope_long_factor=(1.0,) * 4,
          rope_original_max_position_embeddings=1), ["rope_original_max_position_embeddings=1"]),
    (dict(embedding_multiplier=0.0), ["embedding_multiplier=0.0", "> 0"]),
    (dict(residual_multiplier=float("inf")), ["residual_multiplier=inf", "finite"]),
    (dict(softmax_scale=-1.0), ["softmax_scale=-1.0", "None: 1/sqrt(kv_channels)"]),
    (dict(logits_scaling=True), ["logits_scaling=True"]),
    (dict(rotary_percent=1.5), ["rotary_percent"]),
    (dict(rotary_seq_len_interpolation_factor=0.0), ["rotary_seq_len_interpolation_factor"]),
    (dict(seq_length=2048, max_position_embeddings=1024),
     ["seq_length=2048", "max_position_embeddings=1024"]),
    (dict(num_layers=0), ["num_layers"]),
    (dict(hidden_size=-64), ["hidden_size"]),
    (dict(num_attention_heads=0), ["num_attention_heads"]),
    (dict(seq_length=0), ["seq_length"]),
    (dict(max_position_embeddings=0), ["max_position_embeddings"]),
    (dict(make_vocab_size_divisible_by=0), ["make_vocab_size_divisible_by"]),
    (dict(domino_micro_batches=0), ["domino_micro_batches"]),
    (dict(domino_column_chunks=0), ["domino_column_chunks"]),
    (dict(ffn_hidden_size=0), ["ffn_hidden_size"]),
    (dict(kv_channels=0), ["kv_channels"]),
    (dict(num_query_groups=0), ["num_query_groups"]),
    (dict(decoder_num_layers=0), ["decoder_num_layers"]),
    (dict(vocab_size=-1), ["vocab_size"]),
    (dict(num_layers=2.0), ["num_layers"]),
    (dict(num_layers=True), ["num_layers"]),
    (dict(layernorm_epsilon=0.0), ["layernorm_epsilon"]),
    (dict(init_method_std=0.0), ["init_method_std"]),
    (dict(params_dtype=torch.int32), ["params_dtype"]),
])
def test_config_error_names_field(overrides, names) -> None:
    with pytest.raises(ValueError) as info:
        make(**overrides)
    msg = str(info.value)
    for name in names:
        assert name in msg, f"{name!r} not in {msg!r}"


def test_rope_allows_long_sequences_but_learned_does_not() -> None:
    make(position_embedding_type="rope", seq_length=4096, max_position_embeddings=1024)
    make(position_embedding_type="none", seq_length=4096, max_position_embeddings=1024)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make(position_embedding_type="learned_absolute", seq_length=4096,
             max_position_embeddings=1024)


def test_rotary_dims_checked_only_for_rope() -> None:
    make(kv_channels=7)  # odd head size is fine without RoPE
    make(position_embedding_type="rope", kv_channels=8, rotary_percent=0.5)
    with pytest.raises(ValueError, match="rotary_percent"):
        make(position_embedding_type="rope", kv_channels=6, rotary_percent=0.5)  # 3 dims


def test_explicit_kv_channels_allows_indivisible_hidden() -> None:
    cfg = make(hidden_size=60, num_attention_heads=8, kv_channels=8)
    assert cfg.kv_channels == 8


@pytest.mark.parametrize("overrides, tp, field", [
    (dict(num_attention_heads=6, hidden_size=48), 4, "num_attention_heads=6"),
    (dict(num_attention_heads=8, num_query_groups=2), 4, "num_query_groups=2"),
    (dict(ffn_hidden_size=100), 8, "ffn_hidden_size=100"),
    (dict(ffn_hidden_size=250), 4, "ffn_hidden_size=250"),
])
def test_validate_parallel_names_field(overrides, tp, field) -> None:
    cfg = make(**overrides)
    with pytest.raises(ValueError) as info:
        cfg.validate_parallel(tp)
    msg = str(info.value)
    assert field in msg and str(tp) in msg, msg


def test_validate_parallel_accepts_divisible_sizes() -> None:
    cfg = make(num_attention_heads=8, num_query_groups=4)
    for tp in (1, 2, 4):
        cfg.validate_parallel(tp)


def test_derived_defaults() -> None:
    cfg = make()
    assert cfg.ffn_hidden_size == 4 * 64
    assert cfg.kv_channels == 64 // 8
    assert cfg.num_query_groups == 8
    assert cfg.decoder_num_layers == 2
    assert callable(cfg.init_method) and callable(cfg.output_layer_init_method)
    cfg = make(ffn_hidden_size=100, kv_channels=16, num_query_groups=2, decoder_num_layers=3)
    assert (cfg.ffn_hidden_size, cfg.kv_channels, cfg.num_query_groups,
            cfg.decoder_num_layers) == (100, 16, 2, 3)


def test_granite_scalars_are_architecture_only_when_set() -> None:
    """At their neutral values they are left out of architecture(), so records written
    before them match; set, they decide the math."""
    names = ("embedding_multiplier", "residual_multiplier", "softmax_scale", "logits_scaling")
    assert not set(names) & set(make().architecture())
    cfg = make(embedding_multiplier=12.0, residual_multiplier=0.22, softmax_scale=0.125,
               logits_scaling=8.0)
    assert {n: cfg.architecture()[n] for n in names} == dict(zip(names, (12.0, 0.22, 0.125,
                                                                          8.0), strict=True))
    assert TransformerConfig.from_dict(cfg.to_dict()).architecture() == cfg.architecture()


def test_nope_layers_read_back_and_are_architecture_only_when_set() -> None:
    """A saved config's list reads back equal (a sorted tuple); empty, it is left out of
    architecture() (records written before it match)."""
    assert "nope_layers" not in make().architecture()
    cfg = make(position_embedding_type="rope", nope_layers=[1, 0])
    assert cfg.nope_layers == (0, 1) and cfg.architecture()["nope_layers"] == (0, 1)
    back = TransformerConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back.to_dict() == cfg.to_dict() and back.architecture() == cfg.architecture()


def test_default_init_methods_use_std() -> None:
    torch.manual_seed(0)
    cfg = make(num_layers=8, init_method_std=0.5)
    w = cfg.init_method(torch.empty(400, 400))
    assert abs(w.std().item() - 0.5) < 0.01
    w = cfg.output_layer_init_method(torch.empty(400, 400))
    assert abs(w.std().item() - 0.5 / 4.0) < 0.005  # std / sqrt(2 * num_layers)


@pytest.mark.parametrize("vocab, divisible, expected", [
    (1000, 128, {1: 1024, 2: 1024, 4: 1024}),
    (100, 128, {1: 128, 2: 256, 4: 512}),
    (128, 128, {1: 128, 2: 256, 4: 512}),
    (50257, 128, {1: 50304, 2: 50432, 4: 50688}),
    (1000, 1, {1: 1000, 2: 1000, 4: 1000}),
    (1001, 1, {1: 1001, 2: 1002, 4: 1004}),
])
def test_padded_vocab_size(vocab, divisible, expected) -> None:
    cfg = make(vocab_size=vocab, make_vocab_size_divisible_by=divisible)
    for tp, padded in expected.items():
        assert cfg.padded_vocab_size(tp) == padded
        assert padded % (divisible * tp) == 0 and padded >= vocab


@pytest.mark.parametrize("world, tp, pp, numbers", [
    (4, 3, 1, ["4", "3"]),
    (4, 8, 1, ["8", "4"]),
    (8, 2, 3, ["8", "2", "3", "6"]),
    (4, 2, 4, ["2", "4", "8"]),
])
def test_check_sizes_errors_name_numbers(world, tp, pp, numbers) -> None:
    with pytest.raises(ValueError) as info:
        check_sizes(world, tp, pp)
    msg = str(info.value)
    assert "tensor_model_parallel_size" in msg
    for n in numbers:
        assert n in msg, f"{n} not in {msg!r}"


@pytest.mark.parametrize("tp, pp, name", [
    (0, 1, "tensor_model_parallel_size"), (2, 0, "pipeline_model_parallel_size"),
    (1.5, 1, "tensor_model_parallel_size")])
def test_check_sizes_rejects_non_positive(tp, pp, name) -> None:
    with pytest.raises(ValueError, match=name):
        check_sizes(4, tp, pp)


def test_check_sizes_accepts_valid() -> None:
    for world, tp, pp in ((1, 1, 1), (4, 2, 1), (8, 2, 2), (8, 4, 2), (6, 3, 1)):
        check_sizes(world, tp, pp)


needs_no_process_group = pytest.mark.skipif(
    dist.is_available() and dist.is_initialized(),
    reason="a process group is already initialised in this process")


@needs_no_process_group
def test_initialize_model_parallel_without_distributed() -> None:
    if megatron_compat.model_parallel_is_initialized():
        pytest.skip("model parallel is already initialised in this process")
    with pytest.raises(RuntimeError, match="torch.distributed is not initiali"):
        megatron_compat.initialize_model_parallel(2)
    assert not megatron_compat.model_parallel_is_initialized()  # nothing half-built left behind
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        megatron_compat.get_tensor_model_parallel_world_size()
    with pytest.raises(RuntimeError, match="not initiali"):
        ParallelState.build(1)
    # Seed-API code without any initialisation runs single-process.
    state = megatron_compat.get_parallel_state()
    assert state.tp.size == 1 and state.tp.rank == 0


@needs_no_process_group
def test_init_distributed_without_env_names_variables(monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError) as info:
        distributed.init_distributed("cpu")
    msg = str(info.value)
    assert "RANK" in msg and "WORLD_SIZE" in msg and "torchrun" in msg
