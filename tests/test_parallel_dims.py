"""The table of parallel dimensions drives the sizes, the mesh and its groups, the commands'
size flags and the flag spelling of library errors. All in-process, no spawning."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math

import pytest
import torch

from domino import parallel_dims
from domino.commands import bench
from domino.parallel_dims import DIMS, MESH_DIMS, SIZED
from domino.parallel_state import GROUPS, ParallelSizes, ParallelState, check_sizes
from domino.runtime import RuntimeConfig
from domino.tensor_parallel import CommGroup
from domino.training import arguments, runtime_flags
from domino.training.arguments import TrainArgs
from domino.training.flag_text import as_flags, command_flags, train_flags


def _reference_groups(tp: int, pp: int, cp: int, ep: int, dp: int) -> dict:
    """The mesh written out by hand: ranks [pp, dp, cp, tp], TP innermost; experts re-cut each
    (PP, TP) position's DP x CP ranks into [expert-DP, EP], EP innermost."""
    mesh = torch.arange(pp * dp * cp * tp).reshape(pp, dp, cp, tp)

    def along(t, *axes):
        rest = [a for a in range(t.dim()) if a not in axes]
        return t.permute(*rest, *axes).reshape(-1, math.prod(t.shape[a] for a in axes)).tolist()

    experts = mesh.permute(0, 3, 1, 2).reshape(pp, tp, -1, ep)
    return {"tp": along(mesh, 3), "cp": along(mesh, 2), "dp": along(mesh, 1),
            "pp": along(mesh, 0), "dp_cp": along(mesh, 1, 2), "ep": along(experts, 3),
            "expert_dp": along(experts, 1, 2)}


def test_the_table_drives_sizes_mesh_and_groups() -> None:
    assert MESH_DIMS == ("pp", "dp", "cp", "tp")
    assert [f.name for f in dataclasses.fields(ParallelSizes)] == [d.name for d in DIMS]
    assert GROUPS == ("tp", "cp", "dp", "pp", "dp_cp", "ep", "expert_dp")
    assert {f.name for f in dataclasses.fields(ParallelState)} >= set(GROUPS)
    checked = 0
    for world in (1, 2, 4, 6, 8, 12, 16):
        for tp, pp, cp, ep in itertools.product((1, 2, 3), (1, 2), (1, 2), (1, 2, 4)):
            try:
                sizes = ParallelSizes.for_world(world, tp=tp, pp=pp, cp=cp, ep=ep)
            except ValueError:
                continue
            assert sizes.world == world
            assert sizes.rank_groups() == _reference_groups(tp, pp, cp, ep, sizes.dp), sizes
            checked += 1
    assert checked > 50


def test_sizes_by_keyword_and_their_messages() -> None:
    assert ParallelSizes.from_fields(8, tensor_model_parallel_size=2, context_parallel_size=2) \
        == ParallelSizes(tp=2, cp=2, dp=2)
    with pytest.raises(TypeError, match="the sizes are tp, pp, cp, ep"):
        ParallelSizes.for_world(4, xp=2)
    with pytest.raises(KeyError, match="context_parallel_size"):
        ParallelSizes.from_fields(4, context_size=2)
    with pytest.raises(ValueError, match="context_parallel_size=0 must be a positive integer"):
        check_sizes(4, 1, context_parallel_size=0)
    with pytest.raises(ValueError, match=r"world size 3 is not divisible by context_parallel_"
                                         r"size=2; the data-parallel size"):
        check_sizes(3, 1, context_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 x context_parallel_size"
                                         r"=4 = 8 is larger than the world size 4"):
        check_sizes(4, 2, context_parallel_size=4)
    with pytest.raises(ValueError, match=r"expert_model_parallel_size=4 must divide data-"
                                         r"parallel x context-parallel size 2 x 1 = 2"):
        check_sizes(4, 2, expert_model_parallel_size=4)


def test_a_hand_built_state_falls_back_to_its_base_groups() -> None:
    dp = CommGroup(size=2, rank=1, enabled=False)
    state = ParallelState(dp=dp)
    assert state.dp_cp is dp and state.expert_dp is dp
    with pytest.raises(ValueError, match="with context parallelism the DP x CP group must be"):
        ParallelState(cp=CommGroup(size=2, rank=0, enabled=False))
    with pytest.raises(ValueError, match="with expert parallelism the expert-DP group must be"):
        ParallelState(ep=CommGroup(size=2, rank=0, enabled=False))
    assert ParallelState.single().sizes == ParallelSizes()


def test_the_commands_size_flags_come_from_the_table() -> None:
    train, bench_parser = argparse.ArgumentParser(), argparse.ArgumentParser()
    arguments.add_arguments(train)
    bench.add_arguments(bench_parser)
    for d in SIZED:
        assert d.flag in train._option_string_actions, d.flag
        assert (d.flag in bench_parser._option_string_actions) == (d.bench_help is not None)
        assert getattr(TrainArgs(), str(d.size_field)) == d.cli_default
    assert TrainArgs(context_parallel_size=2).parallel_sizes()["context_parallel_size"] == 2
    # the benchmark-only router setting is the bench's flag, not a training one
    assert "--moe-router-force-load-balancing" in bench_parser._option_string_actions
    assert "--moe-router-force-load-balancing" not in train._option_string_actions


def test_the_runtime_flags_are_runtime_config_fields() -> None:
    covered = set(runtime_flags.SAME_NAMED) | set(runtime_flags.FROM_FLAGS)
    assert covered == {f.name for f in dataclasses.fields(RuntimeConfig)}
    assert TrainArgs().runtime() == RuntimeConfig()
    args = TrainArgs(sequence_parallel=True, recompute_granularity="full", compile=True,
                     compile_backend="aot_eager", cp_comm_type="a2a", domino_micro_batches=4,
                     bf16=True)
    assert args.runtime() == RuntimeConfig(
        plan=args.plan(), sequence_parallel=True, recompute_granularity="full", compile=True,
        compile_backend="aot_eager", cp_comm_type="a2a", compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="--cp-comm-type='ring' is not one of"):
        TrainArgs(cp_comm_type="ring")


@pytest.mark.parametrize(("library", "shown"), [
    ("seq_length=30 is not divisible by 2 x context_parallel_size = 4; change context_"
     "parallel_size.",
     "--seq-length 30 is not divisible by 2 x --context-parallel-size = 4; change "
     "--context-parallel-size."),
    ("all-to-all (cp_comm_type='a2a') needs num_attention_heads=2 divisible by TP x CP",
     "all-to-all (--cp-comm-type a2a) needs --num-attention-heads 2 divisible by TP x CP"),
    ("sequence_parallel=True at tp 2; compile=False; layernorm_epsilon=0.0",
     "--sequence-parallel at tp 2; --no-compile; --norm-epsilon 0.0"),
    # not config names, a flag already, a dotted name, a path: left alone
    ("token_ids x.json; --seq-length=3; TransformerConfig.decoder_num_layers; /d/seq_length/a",
     "token_ids x.json; --seq-length=3; TransformerConfig.decoder_num_layers; /d/seq_length/a"),
    ("vocab_file x.json, merges_file y.txt", "--vocab-file x.json, --merge-file y.txt"),
])
def test_library_errors_are_shown_with_the_flags(library: str, shown: str) -> None:
    assert as_flags(library, train_flags()) == shown


def test_the_bench_maps_the_library_names_it_has() -> None:
    names = command_flags(["seq_length", "modes", "context_parallel_size"])
    assert names == {"seq_length": "--seq-length",
                     "context_parallel_size": "--context-parallel-size"}
    assert parallel_dims.by_size_field("context_parallel_size").flag == "--context-parallel-size"


def test_a_saved_config_with_the_retired_bench_setting_still_loads(tmp_path) -> None:
    """Earlier runs wrote moe_router_force_load_balancing into config.toml: read back at its
    value (false), refused at another (it is the bench's flag now)."""
    (tmp_path / "old.toml").write_text("[model]\nmoe_router_force_load_balancing = false\n"
                                       "num_layers = 2\n")
    assert arguments.load_toml(tmp_path / "old.toml") == {"num_layers": 2}
    (tmp_path / "on.toml").write_text("moe_router_force_load_balancing = true\n")
    with pytest.raises(ValueError, match="is not a `domino train` setting.*domino bench"):
        arguments.load_toml(tmp_path / "on.toml")
