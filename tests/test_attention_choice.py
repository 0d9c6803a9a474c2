"""The attention's paths chosen by measurement (domino.transformer.attention_paths): a timing
picks the path (an injected timer), the choice is cached per machine, torch version, threads,
dtype and shapes, a damaged cache is measured again and rewritten, every rank of a TP=2 run
takes the same paths, and the flag and runtime field carry it to the model's kernels."""

from __future__ import annotations

import json
import os

import pytest
import torch
from dist import run_distributed
from tp_helpers import config

from domino import ParallelState, TransformerConfig
from domino.gpt_model import GPTModel
from domino.runtime import AttentionChoice, RuntimeConfig
from domino.transformer import attention_paths as ap
from domino.transformer.attention_paths import AttentionShapes, measured_choice

SHAPES = AttentionShapes(2, 4, 2, 16, 8, torch.bfloat16, ("causal", "windowed"), window=5)


class FakeTimer:
    """Times from a table: ``times[kind][path]``, the kind told by the order of calls."""

    def __init__(self, times: dict[str, dict[str, float]]) -> None:
        self.times, self.calls = times, []

    def __call__(self, steps) -> dict[str, float]:
        kind = list(self.times)[len(self.calls) % len(self.times)]
        self.calls.append((kind, sorted(steps)))
        return {p: self.times[kind][p] for p in steps}


def _times(causal: dict[str, float], windowed: dict[str, float] | None = None):
    base = {"flash": 3.0, "math": 3.0, "explicit": 3.0, "explicit_fp32": 3.0}
    return {"causal": {**base, **causal}, "windowed": {**base, **(windowed or {})}}


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DOMINO_CACHE_DIR", str(tmp_path))
    return tmp_path / ap.CACHE_FILE


def test_a_fake_timing_picks_each_kinds_path(cache) -> None:
    timer = FakeTimer(_times({"math": 1.0, "explicit_fp32": 2.0},
                             {"explicit": 0.5, "explicit_fp32": 0.4}))
    choice = measured_choice(SHAPES, timer=timer)
    # Every candidate was timed for each kind the run uses (explicit_fp32: bf16 only).
    assert timer.calls == [(k, sorted(SHAPES.candidates)) for k in ("causal", "windowed")]
    assert (choice.causal, choice.windowed, choice.masked) == ("math", "explicit_fp32", "flash")
    # Dropout's explicit variant: the lower total over the kinds (2.0 + 0.4 < 3.0 + 0.5).
    assert choice.explicit == "explicit_fp32"
    assert choice.source.startswith("measured at bfloat16, batch 2 x 4 heads (2 K/V) x seq 16")
    # A path must beat PyTorch's own choice (first in order) clearly: within 3% flash stays.
    again = measured_choice(SHAPES.__class__(**{**SHAPES.__dict__, "seq": 17}),
                            timer=FakeTimer(_times({"flash": 1.02, "math": 1.0})))
    assert again.causal == "flash"


def test_fp32_does_not_time_fp32_matmuls_twice(cache) -> None:
    shapes = AttentionShapes(2, 4, 4, 16, 8, torch.float32)
    timer = FakeTimer({"causal": {"flash": 2.0, "math": 1.0, "explicit": 1.5}})
    assert measured_choice(shapes, timer=timer).causal == "math"
    assert timer.calls == [("causal", ["explicit", "flash", "math"])]


def test_the_cache_is_used_and_a_damaged_one_is_measured_again(cache) -> None:
    first = measured_choice(SHAPES, timer=FakeTimer(_times({"math": 1.0})))
    key = SHAPES.cache_key(torch.get_num_threads())
    stored = json.loads(cache.read_text())[key]
    assert stored["causal"]["math"] == 1.0 and set(stored) == {"causal", "windowed"}
    never = FakeTimer({})  # the cache answers: nothing is timed
    cached = measured_choice(SHAPES, timer=never)
    assert never.calls == [] and cached == first and cached.source.startswith("cached at")
    damaged = {
        "not json": "{\"AMD",
        "not an object": "[1, 2]",
        "a path missing": json.dumps({key: {**stored, "causal": {"flash": 1.0}}}),
        "a bad time": json.dumps({key: {**stored, "windowed": {**stored["windowed"],
                                                                "math": -1}}}),
        "a bool time": json.dumps({key: {**stored, "windowed": {**stored["windowed"],
                                                                "math": True}}}),
        "a kind missing": json.dumps({key: {"causal": stored["causal"]}}),
    }
    for why, text in damaged.items():
        cache.write_text(text)
        timer = FakeTimer(_times({"explicit": 1.0}))
        assert measured_choice(SHAPES, timer=timer).causal == "explicit", why
        assert len(timer.calls) == 2, why  # measured again...
        assert json.loads(cache.read_text())[key]["causal"]["explicit"] == 1.0, why  # rewritten


def test_cache_keys_separate_dtype_shapes_masks_and_threads(cache) -> None:
    base = SHAPES.__dict__
    variants = [{"dtype": torch.float32}, {"batch": 3}, {"heads": 8}, {"groups": 4},
                {"seq": 32}, {"head_dim": 16}, {"kinds": ("causal",), "window": None},
                {"window": 6}, {"softmax_fp32": False}, {"causal": False}]
    keys = {SHAPES.cache_key(1), SHAPES.cache_key(2)}
    keys |= {AttentionShapes(**{**base, **v}).cache_key(1) for v in variants}
    assert len(keys) == len(variants) + 2
    assert torch.__version__ in SHAPES.cache_key(1) and ap.machine() in SHAPES.cache_key(1)
    # Another thread count is measured again.
    before = torch.get_num_threads()
    measured_choice(SHAPES, timer=FakeTimer(_times({})))
    try:
        torch.set_num_threads(before + 1)
        timer = FakeTimer(_times({}))
        measured_choice(SHAPES, timer=timer)
        assert len(timer.calls) == 2
    finally:
        torch.set_num_threads(before)


def test_run_shapes_follow_the_run(cache) -> None:
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=8,
                            num_query_groups=4, seq_length=32, max_position_embeddings=32,
                            window_size=8, full_attention_layers=(1,))
    s = AttentionShapes.of_run(cfg, 5, 2, 2, torch.bfloat16, "cpu", masked=True)
    assert (s.batch, s.heads, s.groups, s.seq, s.head_dim) == (3, 4, 2, 32, 8)
    assert s.kinds == ("masked", "windowed") and s.window == 8
    one = AttentionShapes.of_run(cfg, 5, 1, 2, torch.float32, "cpu")  # TP=1: unsplit
    assert one.batch == 5 and one.kinds == ("causal", "windowed")


def test_the_runtime_carries_the_choice_to_the_kernels() -> None:
    assert RuntimeConfig().attention_paths == AttentionChoice()  # auto, unmeasured
    assert RuntimeConfig(attention_backend="math").attention_paths == \
        AttentionChoice.fixed("math")
    measured = AttentionChoice("explicit", "math", "flash", "explicit_fp32")
    runtime = RuntimeConfig(attention_measured=measured)
    model = GPTModel(config(), parallel_state=ParallelState.single(), runtime=runtime)
    assert model.language_model.encoder.kernels.paths == measured
    with pytest.raises(ValueError, match="only with attention_backend='auto'"):
        RuntimeConfig(attention_backend="flash", attention_measured=measured)
    with pytest.raises(ValueError, match="attention_backend='fast' is not one of auto"):
        RuntimeConfig(attention_backend="fast")
    with pytest.raises(ValueError, match="AttentionChoice.causal='fast'"):
        AttentionChoice(causal="fast")
    with pytest.raises(ValueError, match="AttentionChoice.explicit='flash'"):
        AttentionChoice(explicit="flash")
    # A fixed backend, or no shapes (context parallelism), measures nothing.
    fixed = RuntimeConfig(attention_backend="explicit")
    assert ap.resolve_attention(fixed, SHAPES, timer=FakeTimer({})) is fixed
    assert ap.resolve_attention(RuntimeConfig(), None, timer=FakeTimer({})) == RuntimeConfig()


def _tp2(rank: int, world: int, cache_dirs: list[str]) -> tuple:
    """Each rank times its own (different) table; rank 0 reads a cache rank 1 lacks."""
    os.environ["DOMINO_CACHE_DIR"] = cache_dirs[rank]
    state = ParallelState.build(world)
    # Alone, rank 0 would pick flash and rank 1 math: the slowest rank's times decide.
    fake = FakeTimer(_times({"flash": 1.0, "math": 5.0, "explicit": 2.0}) if rank == 0 else
                     _times({"flash": 5.0, "math": 1.0, "explicit": 2.0}))
    faked = measured_choice(SHAPES, state.world, timer=fake)
    # Really measured, both ranks at once, then built into the model both ranks run.
    cfg = config(hidden_size=32, num_attention_heads=4)
    shapes = AttentionShapes.of_run(cfg, 2, world, 1, torch.float32, "cpu")
    rng = torch.get_rng_state()
    runtime = ap.resolve_attention(RuntimeConfig(), shapes, state.world)
    assert torch.equal(rng, torch.get_rng_state())  # timing draws nothing the run would
    model = GPTModel(cfg, parallel_state=state, runtime=runtime)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1),
                        generator=torch.Generator().manual_seed(0))
    model(ids[:, :-1], None, None, labels=ids[:, 1:]).mean().backward()
    state.close()
    paths = model.language_model.encoder.kernels.paths
    return faked, len(fake.calls), paths, paths.source


def test_tp2_ranks_take_the_same_paths(tmp_path) -> None:
    dirs = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    os.makedirs(dirs[0])
    key = SHAPES.cache_key(1)  # ranks run one thread each
    with open(os.path.join(dirs[0], ap.CACHE_FILE), "w", encoding="utf-8") as f:
        json.dump({key: _times({"flash": 0.1})}, f)  # rank 0 only: both measure again
    (c0, n0, p0, s0), (c1, n1, p1, s1) = run_distributed(_tp2, 2, dirs)
    assert n0 == n1 == 2  # both ranks timed: rank 0's cache alone does not decide
    assert c0 == c1 and (c0.causal, c0.windowed) == ("explicit", "flash")
    assert c0.source == c1.source  # the same agreed times
    assert p0 == p1 and s0 == s1 and s0.startswith("measured at float32, batch 2 x 2 heads")
    # Both ranks wrote the agreed times (rank 0's stale entry replaced).
    for d in dirs:
        with open(os.path.join(d, ap.CACHE_FILE), encoding="utf-8") as f:
            assert json.load(f)[key]["causal"]["explicit"] == 2.0
