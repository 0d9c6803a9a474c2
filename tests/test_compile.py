"""Compiled pieces (``RuntimeConfig.compile``, ``--compile``): the same losses and gradients as
eager under every plan, sequence parallelism, recomputation, dropout, bf16 and pipelines; no
graph break (each kernel is compiled whole); no recompilation once every micro-batch size and
mode has been seen; and inductor's generated code equal to the eager kernels.

Most checks use the ``aot_eager`` backend: the same dynamo capture, guards and AOTAutograd
graphs as inductor without generating C++ (seconds per graph on this machine); one test runs
inductor on the kernels themselves."""

from __future__ import annotations

import pytest
import torch
from dist import fit, run_distributed
from tp_helpers import config, one_thread, rel_err

from domino import ParallelState, Plan, RuntimeConfig
from domino.gpt_model import GPTModel
from domino.runtime import check_compile
from domino.transformer import kernels, set_plan
from domino.transformer.kernels import Kernels

V, S = 100, 8


def _graphs() -> tuple[int, int]:
    """(graphs compiled, graph breaks) in this process so far."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"]), sum(counters["graph_break"].values())


def _take_report(log, reported: set[int]) -> str | None:
    """A one-line report of a model's CompileLog the first time anything was compiled, then
    None (``reported``: the logs already reported)."""
    if id(log) in reported or not log.graphs:
        return None
    reported.add(id(log))
    return f"compiled {log.graphs} forward graphs in {log.seconds:.1f} s"


def _model(compile: bool, seed_state: int, **over) -> GPTModel:
    torch.manual_seed(0)
    state = ParallelState.single()
    state.rng.seed(seed_state)
    cfg = config(**{**dict(seq_length=S, vocab_size=V, hidden_dropout=0.1, attention_dropout=0.1,
                           position_embedding_type="rope", num_query_groups=2,
                           activation="swiglu"), **over})
    runtime = RuntimeConfig(compile=compile, compile_backend="aot_eager")
    model = GPTModel(cfg, parallel_state=state, runtime=runtime)
    set_plan(model, Plan(2, "cross_layer", 2), force=True)  # split even with one TP rank
    return model


def _step(model: GPTModel, batch: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (batch, S), generator=g)
    model.zero_grad(set_to_none=True)
    loss = model(ids, None, None, labels=torch.roll(ids, -1, 1)).mean()
    loss.backward()
    with torch.no_grad():  # an evaluation forward: the no-grad graphs
        model.eval()
        model(ids, None, None, labels=ids)
        model.train()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("recompute", [None, "full", "selective"])
def test_compiled_equals_eager_and_compiles_once(recompute) -> None:
    """Uneven micro-batches (5 -> 3 + 2), dropout, RoPE, GQA, SwiGLU, each recomputation: the
    compiled model's losses and gradients equal eager's. The first step (its evaluation
    forward included) compiles every graph; the next, on other data, compiles nothing; a new
    batch size (7 -> 4 + 3) compiles its graphs once; no graph breaks."""
    with one_thread():
        eager = _model(False, 11, recompute_granularity=recompute)
        compiled = _model(True, 11, recompute_granularity=recompute)
        ks = compiled.language_model.encoder.kernels
        log = ks.log
        assert ks.backend == "aot_eager" and isinstance(ks.local, kernels._Compiled)
        assert eager.language_model.encoder.kernels.local is kernels.local  # eager: the function
        seen, logged = [], []
        for i, batch in enumerate((5, 5, 7, 7)):
            (l0, g0), (l1, g1) = _step(eager, batch, i), _step(compiled, batch, i)
            assert rel_err(l1, l0) < 1e-6
            assert max(rel_err(a, b) for a, b in zip(g1, g0, strict=True)) < 1e-6
            seen.append(_graphs())
            logged.append(log.graphs)
        assert seen[0][0] > 0  # the kernels' graphs exist (this model's or an earlier one's)
        assert seen[1] == seen[0] and logged[1] == logged[0]  # nothing compiled in step 2
        assert seen[3] == seen[2] and logged[3] == logged[2]  # a new size: in its first step only
        assert seen[3][1] == 0  # no graph break
        # The model's own log counts what it compiled: the process's first model compiles every
        # graph, a later one only the variants no earlier model ran.
        assert logged[3] - logged[0] == seen[3][0] - seen[0][0]
        reported: set[int] = set()
        if log.graphs:
            assert log.seconds > 0
            assert _take_report(log, reported).startswith(
                f"compiled {log.graphs} forward graphs in ")
        assert _take_report(log, reported) is None  # reported once


def test_compiled_granite_scalars_equal_eager() -> None:
    """Granite's residual multiplier (in the local piece) and softmax scale (in the attention,
    with its dropout: the explicit softmax) compile with the rest: the compiled model's loss
    and gradients equal eager's."""
    over = dict(embedding_multiplier=3.0, residual_multiplier=0.5, softmax_scale=0.2,
                logits_scaling=4.0)
    with one_thread():
        eager, compiled = (_model(c, 11, **over) for c in (False, True))
        (l0, g0), (l1, g1) = _step(eager, 5, 0), _step(compiled, 5, 0)
    assert rel_err(l1, l0) < 1e-6
    assert max(rel_err(a, b) for a, b in zip(g1, g0, strict=True)) < 1e-6


def test_compiled_norms_after_sublayer_equal_eager() -> None:
    """OLMo 2's norms after each sublayer (the local piece's exit norm, with dropout after it)
    compile with the rest: the compiled model's loss and gradients equal eager's."""
    over = dict(normalization="RMSNorm", norm_after_sublayer=True)
    with one_thread():
        eager, compiled = (_model(c, 11, **over) for c in (False, True))
        (l0, g0), (l1, g1) = _step(eager, 5, 0), _step(compiled, 5, 0)
    assert rel_err(l1, l0) < 1e-6
    assert max(rel_err(a, b) for a, b in zip(g1, g0, strict=True)) < 1e-6


def test_generation_with_a_kv_cache_runs_eager() -> None:
    """A compiled model generates with its KV cache through the eager kernels (the key length
    grows every token: static shapes would compile a graph per token, 64 at most): 80 greedy
    tokens, past the cache's rebuild at the position table's end, equal the eager model's and
    compile nothing."""
    from domino.inference.sampling import generate

    with one_thread():
        models = [_model(c, 3, max_position_embeddings=32, seq_length=32) for c in (False, True)]
        before = _graphs()
        outs = [generate(m, m.language_model.encoder.state, [1, 2, 3], 80, V, 32)
                for m in models]
        assert outs[0] == outs[1] and len(outs[0]) == 80
        assert _graphs() == before


def test_inductor_kernels_equal_eager() -> None:
    """inductor's generated code for the local piece (bias, dropout, residual, LayerNorm and
    RMSNorm) and the activations: forward and gradients equal the eager functions."""
    compiled = Kernels("inductor")
    g = torch.Generator().manual_seed(0)

    def leaves(*shapes):
        return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]

    keep = (torch.rand(4, 3, 16, generator=g) > 0.1).float()
    for rms in (False, True):
        out, bias, res, w, b = leaves((4, 3, 16), (16,), (4, 3, 16), (16,), (16,))
        results = []
        for fn in (kernels.local, compiled.local):
            ln, r = fn(out, bias, keep, 1 / 0.9, res, (w, None if rms else b, 1e-5, rms), False)
            grads = torch.autograd.grad((ln * ln).sum() + r.sum(), [out, bias, res, w])
            results.append([ln, r, *grads])
        assert max(rel_err(a, b) for a, b in zip(*results, strict=True)) < 1e-5
    for swiglu, approximate in ((False, "none"), (True, "none")):
        (h,) = leaves((4, 3, 32))
        ys = [fn(h, swiglu, approximate) for fn in (kernels.activation, compiled.activation)]
        gs = [torch.autograd.grad(y.square().sum(), h)[0] for y in ys]
        assert rel_err(ys[1], ys[0]) < 1e-5 and rel_err(gs[1], gs[0]) < 1e-5
    assert compiled.log.graphs >= 4 and compiled.log.seconds > 0


def test_inductor_without_a_compiler_is_refused_before_anything_runs(monkeypatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(ValueError, match="'no-such-compiler-here' is not on PATH.*aot_eager"):
        check_compile(True, "inductor", "cpu", "--compile")
    with pytest.raises(ValueError, match="is not on PATH"):
        GPTModel(config(), parallel_state=ParallelState.single(),
                 runtime=RuntimeConfig(compile=True))
    check_compile(True, "aot_eager", "cpu", "--compile")  # no code generated: nothing needed
    with pytest.raises(ValueError, match="compile_backend='tvm' is not one of"):
        RuntimeConfig(compile=True, compile_backend="tvm")


# ---- training runs, eager against compiled, on two ranks ----------------------------------------

RUNS = {
    # TP=2, two uneven micro-batches (5 -> 3 + 2) with column chunks, dropout, bf16, sequence
    # parallelism with full recomputation
    "tp2_uneven_bf16_sp_full": dict(
        micro_batch_size=5, global_batch_size=5, domino_micro_batches=2,
        domino_column_chunks=2, hidden_dropout=0.1, attention_dropout=0.1, bf16=True,
        sequence_parallel=True, recompute_granularity="full"),
    # selective recomputation of dropout attention, RoPE, SwiGLU, intra-layer overlap
    "tp2_selective": dict(recompute_granularity="selective", attention_dropout=0.1,
                          position_embedding_type="rope", swiglu=True,
                          domino_overlap="intra_layer"),
    # a two-stage pipeline, Domino inside each stage
    "pp2": dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                global_batch_size=8),
}


def _runs(rank: int, world: int, data: str, tmp: str) -> dict:
    from domino.training.arguments import TrainArgs

    out = {}
    for name, over in RUNS.items():
        for compile in (False, True):
            args = TrainArgs(**{
                **dict(data_path=data, tokenizer_type="byte", split="80,20,0", num_layers=2,
                       hidden_size=32, num_attention_heads=4, seq_length=16,
                       micro_batch_size=4, global_batch_size=4, train_iters=3,
                       tensor_model_parallel_size=2, lr_warmup_iters=1, eval_interval=1,
                       eval_iters=1, log_interval=1, sample_tokens=0, tensorboard=False,
                       device="cpu", hidden_dropout=0.0, attention_dropout=0.0,
                       compile_backend="aot_eager"),
                **over, "compile": compile})
            res = fit(args, f"{tmp}/{name}_{compile}")
            out[(name, compile)] = {"losses": res.losses, "val": res.val_losses,
                                    "compiled": res.compiled, "breaks": _graphs()[1]}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    from domino.data import ByteTokenizer, preprocess
    from domino.data.preprocess import stdlib_corpus_files

    folder = tmp_path_factory.mktemp("data")
    preprocess(stdlib_corpus_files(limit_bytes=100_000), folder / "d", ByteTokenizer(),
               progress=False)
    return run_distributed(_runs, 2, str(folder / "d"), str(tmp_path_factory.mktemp("runs")))


@pytest.mark.parametrize("name", list(RUNS))
def test_compiled_training_equals_eager(runs, name) -> None:
    """Every rank: the compiled run's losses and validation equal the eager run's; it compiled
    in its first step (training, then the evaluation's no-grad forward) and never again; no
    graph breaks."""
    for res in runs:
        eager, compiled = res[(name, False)], res[(name, True)]
        assert eager["compiled"] == []
        tol = 1e-2 if "bf16" in name else 1e-5
        for a, b in zip(compiled["losses"], eager["losses"], strict=True):
            assert abs(a - b) <= tol * abs(b)
        for (sa, a), (sb, b) in zip(compiled["val"], eager["val"], strict=True):
            assert sa == sb and abs(a - b) <= tol * abs(b)
        # Training compiled in step 1, the evaluation's no-grad forward in its first call
        # (step 1 too), nothing later.
        assert [(step, kind) for step, kind, _, _ in compiled["compiled"]] == [
            (1, "training"), (1, "evaluation")]
        assert compiled["breaks"] == 0
