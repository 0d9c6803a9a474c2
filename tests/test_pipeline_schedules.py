"""Pipeline schedules and layouts, in one process: every schedule's action lists are feasible
(simulated against their data dependencies), run every pass once, send and receive messages in
the same order on every link (NCCL matches them by order), hold at most the activations the
schedule promises, and have the textbook bubble; layer partitions and every bad pipeline input
fail before any process starts."""

from __future__ import annotations

import itertools

import pytest

from domino.cli import main
from domino.pipeline.partition import partition
from domino.pipeline.schedules import (
    Action,
    build,
    check_schedule,
    consumption_order,
    simulate,
    theoretical_bubble,
)

CASES = [(s, p, m, 1) for s, p, m in itertools.product(
    ("gpipe", "1f1b", "zero_bubble"), (1, 2, 3, 4), (1, 2, 3, 4, 8))]
CASES += [("interleaved", p, m, v) for p, m, v in itertools.product(
    (2, 3, 4), (4, 8, 12), (2, 3)) if m % p == 0]


@pytest.mark.parametrize(("schedule", "stages", "micro", "chunks"), CASES)
def test_schedules_are_feasible_complete_and_ordered(schedule, stages, micro, chunks) -> None:
    lists = build(schedule, stages, micro, chunks)
    zb = schedule == "zero_bubble"
    kinds = ("F", "B", "W") if zb else ("F", "B")
    for rank, actions in enumerate(lists):
        want = sorted(Action(k, m, c) for k in kinds for m in range(micro)
                      for c in range(chunks))
        assert sorted(actions) == want, (rank, actions)  # every pass once
    sim = simulate(lists, chunks, cost_f=1, cost_b=2, cost_w=1 if zb else 0, split_backward=zb)
    assert sim.links == consumption_order(lists, chunks)  # sender order == receiver order
    for rank, peak in enumerate(sim.peak_activations):
        if schedule in ("1f1b", "zero_bubble"):
            assert peak <= min(stages - rank, micro), (rank, peak)
        elif schedule == "gpipe":
            assert peak == micro
    if schedule in ("gpipe", "1f1b"):  # the textbook bubble: (p - 1) / (m + p - 1)
        assert sim.bubble == pytest.approx((stages - 1) / (micro + stages - 1))
    if schedule == "interleaved":  # (p - 1) / (v m + p - 1) with m a multiple of p
        assert sim.bubble == pytest.approx((stages - 1) / (chunks * micro + stages - 1))


def test_zero_bubble_fills_the_bubble_with_weight_gradients() -> None:
    for stages, micro in ((2, 4), (4, 8), (4, 16)):
        zb = theoretical_bubble("zero_bubble", stages, micro)
        assert zb < theoretical_bubble("1f1b", stages, micro) * 0.8, (stages, micro)
    lists = build("zero_bubble", 4, 8)
    assert any(a.kind == "W" for a in lists[0][:12])  # W work moves into the schedule


def test_deadlocks_are_detected() -> None:
    bad = [[Action("B", 0), Action("F", 0)], [Action("F", 0), Action("B", 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(bad)


@pytest.mark.parametrize(("args", "match"), [
    (("interleaved", 2, 3, 2), "not a multiple of 2"),
    (("interleaved", 2, 4, 1), "needs virtual stages"),
    (("1f1b", 2, 4, 2), "need the interleaved schedule"),
    (("fastest", 2, 4, 1), "not one of"),
])
def test_schedule_checks(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_schedule(*args)


def test_partitions() -> None:
    assert partition(8, 2).bounds == ((0, 4), (4, 8))
    layout = partition(8, 2, layers_per_virtual_stage=2)
    assert layout.chunks == 2 and layout.layers(0, 1) == (4, 6) and layout.layers(1, 0) == (2, 4)
    assert layout.is_first(0, 0) and layout.is_last(1, 1) and not layout.is_last(1, 0)
    assert partition(5, 2, stage_layers=(3, 2)).bounds == ((0, 3), (3, 5))
    for kw, match in ((dict(num_layers=6, stages=4), "does not divide into 4 pipeline stages"),
                      (dict(num_layers=6, stages=2, layers_per_virtual_stage=2),
                       "multiple of 4"),
                      (dict(num_layers=5, stages=2, stage_layers=(4, 2)), "adding up to"),
                      (dict(num_layers=4, stages=2, stage_layers=(4,)), "one count per stage")):
        with pytest.raises(ValueError, match=match):
            partition(**kw)


@pytest.fixture(scope="module")
def data(byte_dataset) -> list[str]:
    return ["--data-path", byte_dataset(100_000), "--split", "90,10,0"]


def _error(capsys, *argv: str) -> str:
    assert main(["train", *argv]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_pipeline_inputs_fail_before_spawn(capsys, data, tmp_path) -> None:
    small = [*data, "--num-layers", "6", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "2", "--save", str(tmp_path / "r")]
    msg = _error(capsys, *small, "--pipeline-model-parallel-size", "4",
                 "--tensor-model-parallel-size", "1")
    assert "--num-layers 6 does not divide into 4 pipeline stages" in msg
    msg = _error(capsys, *small, "--pipeline-model-parallel-size", "2", "--nproc", "6")
    assert "world size 6 is not divisible" in msg and "--pipeline-model-parallel-size 2" in msg
    msg = _error(capsys, *small, "--pipeline-model-parallel-size", "2",
                 "--tensor-model-parallel-size", "1", "--num-layers-per-virtual-pipeline-stage",
                 "2")
    assert "multiple of 4" in msg
    msg = _error(capsys, *small, "--pipeline-model-parallel-size", "3",
                 "--tensor-model-parallel-size", "1", "--pipeline-schedule", "interleaved",
                 "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4")
    assert "2 pipeline micro-batches per step is not a multiple of 3" in msg
    msg = _error(capsys, *small, "--pipeline-model-parallel-size", "2",
                 "--tensor-model-parallel-size", "1", "--domino-autotune")
    assert "--domino-autotune" in msg and "pipeline" in msg
    msg = _error(capsys, *small, "--pipeline-stage-layers", "3,3")
    assert "add --pipeline-model-parallel-size > 1" in msg


def test_too_few_pipeline_micro_batches_say_the_bubble(capsys, data, tmp_path) -> None:
    from domino.training.arguments import TrainArgs
    from domino.training.prepare import prepare_run

    args = TrainArgs(data_path=data[1], split=data[3], tokenizer_type="byte", num_layers=4,
                     hidden_size=32, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                     global_batch_size=2, tensor_model_parallel_size=1,
                     pipeline_model_parallel_size=4, save=str(tmp_path / "r"))
    prepare_run(args, world_size=4)
    out = capsys.readouterr().out
    assert "1 pipeline micro-batch(es) per step for 4 stages: 1f1b's bubble will be about 75%" \
        in out
