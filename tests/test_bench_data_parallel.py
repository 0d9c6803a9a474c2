"""`domino bench --data-parallel-size D`: data-parallel sharding strategies side by side (a real
DP=2 run of two strategies: its table, JSON and every step's loss; bf16 with the units' flags,
on an emulated link where this host can make one) and the checks before any process starts.
No timing assertions."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from domino import netem
from domino.bench.spec import build_config
from domino.cli import main
from domino.commands import bench
from domino.flops import train_flops_per_step

TINY = ["--data-parallel-size", "2", "--tensor-model-parallel-size", "1",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--vocab-size", "64",
        "--steps", "2", "--warmup", "1"]
COLUMNS = ("step ms", "tokens/s", "TFLOP/s/rank", "MFU", "exposed DP ms", "state MiB implied",
           "state MiB held", "peak MiB")


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


def _table_rows(table: str, strategies: list[str]) -> dict[str, dict[str, float]]:
    """Each strategy's row of the printed table, its figures parsed."""
    rows = {}
    for line in table.splitlines():
        cells = line.split()
        if cells and cells[0] in strategies:
            assert len(cells) == 1 + len(COLUMNS), line
            rows[cells[0]] = {c: float(v.rstrip("%")) for c, v in zip(COLUMNS, cells[1:],
                                                                      strict=True)}
    return rows


def _total(parts: dict[str, int]) -> int:
    return sum(parts.values())


def test_two_strategies_at_dp2(tmp_path: Path, capsys) -> None:
    strategies = ["no_shard", "optim_grads_params"]
    out_json = tmp_path / "dp.json"
    assert main(["bench", *TINY, "--data-parallel-sharding-strategy", ",".join(strategies),
                 "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert "domino bench (data parallel)" in table and "DP=2 x TP=1" in table
    rows = _table_rows(table, strategies)
    assert list(rows) == strategies
    for figures in rows.values():
        assert all(math.isfinite(v) for v in figures.values())
        assert min(v for c, v in figures.items() if c != "exposed DP ms") > 0
        assert figures["exposed DP ms"] >= 0
    for column in ("state MiB implied", "state MiB held"):
        assert rows["optim_grads_params"][column] < rows["no_shard"][column]
    report = json.loads(out_json.read_text())
    res = {r["strategy"]: r for r in report["results"]}
    c = report["config"]
    assert c["strategies"] == strategies
    gpt = build_config({**c, "model": "gpt", "dtype": "fp32"})
    assert c["model_flops_per_step"] == train_flops_per_step(gpt, 2 * 2 * 16)
    for r in res.values():
        assert r["step_time_s"] > 0 and len(r["step_times_s"]) == 2
        assert r["tokens_per_s"] == pytest.approx(2 * 2 * 16 / r["step_time_s"])
        assert r["mfu"] == pytest.approx(r["model_flops_per_s_per_rank"]
                                         / c["peak_flops_per_s"], rel=1e-9)
        assert r["exposed_dp_comm_s"] > 0  # (the gradients' reduction, at least its waits)
        assert len(r["peak_mem_bytes_per_rank"]) == 2
        for held, peak in zip(r["model_state_bytes_per_rank"], r["peak_mem_bytes_per_rank"],
                              strict=True):
            assert peak > _total(held) > 0
    # Sharded parameters, gradients and optimizer: less state on every rank, as implied and
    # as held.
    for key in ("model_state_implied_bytes_per_rank", "model_state_bytes_per_rank"):
        for full, sharded in zip(res["no_shard"][key], res["optim_grads_params"][key],
                                 strict=True):
            assert _total(sharded) < _total(full)
            assert sharded["optimizer"] < full["optimizer"]
    # The same model on the same data: every step's loss agrees (warm-up, measured and the
    # memory step), while the steps differ from each other (the model trains).
    a, b = res["no_shard"]["losses"], res["optim_grads_params"]["losses"]
    assert len(a) == len(b) == 1 + 2 + 1
    assert a == pytest.approx(b, rel=1e-5) and len(set(a)) == len(a)
    assert res["no_shard"]["grad_norms"] == pytest.approx(res["optim_grads_params"]["grad_norms"],
                                                          rel=1e-4)
    assert report["loss_spread"] < 1e-5 and "agree to" in table


def test_bf16_units_on_a_link(capsys) -> None:
    """bf16 compute, two-layer units gathered where used, on the emulated 1 Gbit link (each
    replica its own host) where this host can make one, else on loopback."""
    try:
        netem.check_can_emulate()
        link = ["--emulate-link", "1gbit"]
    except RuntimeError:
        link = []
    argv = [*TINY[:-4], "--steps", "1", "--warmup", "0", "--peak-tflops", "1", "--bf16",
            "--data-parallel-sharding-strategy", "optim,optim_grads_params",
            "--fsdp-unit-layers", "2", "--fsdp-prefetch", "0", *link]
    result = bench.run(_args(argv))
    table = capsys.readouterr().out
    assert "bf16 compute from fp32 masters" in table
    assert "units of 2 layer(s) prefetching 0" in table
    if link:
        assert "link 1gbit" in table and "DP over gloo" in table
    res = {r["strategy"]: r for r in result["results"]}
    assert set(_table_rows(table, list(res))) == {"optim", "optim_grads_params"}
    # One unit of both layers: the implied state holds it whole (min(2 + 0, 1) units in
    # flight), less than optim's weights only by what lies outside the units.
    implied = [r["model_state_implied_bytes_per_rank"][0] for r in res.values()]
    assert implied[1]["weights"] == implied[0]["weights"]  # (bf16: both hold 2-byte weights)
    assert implied[1]["optimizer"] == implied[0]["optimizer"]
    held = [r["model_state_bytes_per_rank"][0] for r in res.values()]
    assert held[1]["weights"] < held[0]["weights"]  # the units freed between steps
    assert res["optim"]["losses"] == pytest.approx(res["optim_grads_params"]["losses"],
                                                   rel=1e-3)


@pytest.mark.parametrize(("extra", "match"), [
    (["--data-parallel-sharding-strategy", "no_shard,zero3"], "'zero3' is not one of"),
    (["--data-parallel-sharding-strategy", "optim,optim"], "names optim more than once"),
    (["--data-parallel-size", "1", "--data-parallel-sharding-strategy", "no_shard,optim"],
     "shards over data-parallel ranks, but --data-parallel-size is 1"),
    (["--data-parallel-size", "1"], "--data-parallel-size is 1"),  # (the default: all four)
    (["--pipeline-model-parallel-size", "2"],
     "--pipeline-model-parallel-size 2 with --data-parallel-size"),
    (["--schedules", "1f1b"], "--schedules applies to a pipeline comparison"),
    (["--modes", "sync", "--num-experts", "4"], "--modes sync, --num-experts 4 is not part"),
    (["--compile"], "--compile is not part of it"),
    (["--dtype", "bf16"], "use --bf16"),
    (["--data-parallel-sharding-strategy", "no_shard", "--fsdp-prefetch", "2"],
     "--fsdp-prefetch sets the units of optim_grads_params"),
    (["--fsdp-unit-layers", "3"], "--fsdp-unit-layers 3: between 1 and --num-layers"),
    (["--fsdp-prefetch", "-1"], "--fsdp-prefetch=-1 must be >= 0"),
    (["--data-parallel-size", "1", "--data-parallel-sharding-strategy", "no_shard",
      "--emulate-link", "1gbit"], "needs --data-parallel-size >= 2"),
    (["--micro-batch-size", "1"], "larger than --micro-batch-size=1"),
])
def test_checks_before_spawn(extra: list[str], match: str, monkeypatch) -> None:
    def spawned(spec):
        raise AssertionError("a bad flag reached the ranks")
    monkeypatch.setattr(bench, "execute", spawned)
    # later flags win: an extra --data-parallel-size replaces TINY's
    with pytest.raises(ValueError, match=match):
        bench.run(_args(TINY + extra))


@pytest.mark.parametrize("extra", [["--data-parallel-sharding-strategy", "optim"], ["--bf16"],
                                   ["--fsdp-unit-layers", "1"]])
def test_data_parallel_flags_need_the_size(extra: list[str], monkeypatch) -> None:
    monkeypatch.setattr(bench, "execute", lambda spec: pytest.fail("spawned"))
    assert TINY[0] == "--data-parallel-size"
    with pytest.raises(ValueError, match="add --data-parallel-size D"):
        bench.run(_args(TINY[2:] + extra))
