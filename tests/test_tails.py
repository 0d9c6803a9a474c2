"""No exposed tails: the embedding's all-reduce runs inside the schedule, and the LM head's and
the embedding's weight gradients are left for the stack's last backward all-reduces.

These run "half" of a TP=2 model in one process: a group of size 2 whose collectives go to a
simulated link (they take wall time, move no data), so a schedule runs exactly as at TP=2 and
its timeline shows what ran under which all-reduce. Equality with sync TP at TP=2 and 4 (real
collectives) is checked by ``test_schedules.py`` for every plan.
"""

from __future__ import annotations

import pytest
import torch
from tp_helpers import config, one_thread

from domino import ParallelState
from domino.bench.hooks import BenchHook, SimulatedLink
from domino.bench.timeline import Timeline
from domino.gpt_model import GPTModel
from domino.language_model import Embedding, parallel_lm_logits
from domino.tensor_parallel import CommGroup
from domino.tensor_parallel.layers import LATE_WGRAD_CHUNKS
from domino.transformer import BackwardContext, LateWork, MicroBatch, Plan, split_batch

B, S, V = 4, 8, 96


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _half_tp2(bits_per_s: float, timeline: Timeline | None = None) -> ParallelState:
    link = SimulatedLink(bits_per_s)
    return ParallelState(tp=CommGroup(size=2, rank=0, hook=BenchHook(timeline=timeline,
                                                                     link=link)))


def _gpt(state: ParallelState, plan: Plan, **over) -> GPTModel:
    torch.manual_seed(0)
    cfg = config(hidden_size=32, num_attention_heads=4, vocab_size=V, **over)
    return GPTModel(cfg, parallel_state=state, plan=plan)


def _batch():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (B, S + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _grads(model: GPTModel) -> dict[str, torch.Tensor]:
    """Gradients accumulated over two backward passes (so that summation order shows)."""
    tokens, labels = _batch()
    model.zero_grad(set_to_none=True)
    for k in range(2):
        model(tokens.roll(k, 1), None, None, labels=labels).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.serial
def test_tail_runs_late_work_under_the_last_backward_all_reduce() -> None:
    """On a slow link the last input-gradient all-reduce (block 0, last micro-batch) has the
    head's and the embedding's weight-gradient work under it, and the embedding's forward
    all-reduces are launched for every micro-batch before the first block waits for any."""
    tl = Timeline(0)
    # 2 Mbit/s: each all-reduce takes milliseconds, far longer than a late item even on a
    # loaded machine (at 20 Mbit/s a busy machine could finish the last one before any ran).
    model = _gpt(_half_tp2(2e6, tl), Plan(2, "cross_layer", 1))
    tokens, labels = _batch()
    context = BackwardContext()
    model(tokens, None, None, labels=labels, context=context).sum().backward()
    comm = tl.by_category("comm")
    embed = [s for s in comm if s.name == "fwd b-1"]
    assert sorted(s.args["mb"] for s in embed) == [0, 1]
    first_block = min(s.start_s for s in tl.spans if s.name == "fwd par 0")
    assert all(s.start_s < first_block for s in embed)  # launched before block 0 runs
    last = max((s for s in comm if s.name == "bwd b0"), key=lambda s: s.start_s)
    late = [s for s in tl.spans if s.name == "bwd late"]
    assert late, "no late work ran"
    under = [s for s in late if last.start_s <= s.start_s < last.end_s]
    assert under, "the last backward all-reduce had no late work under it"
    # Every late item ran inside the backward: the head's gradient is complete.
    assert len(context.late) == 0


class _PolledGroup(CommGroup):
    """A TP=2 half whose all-reduces move nothing and report ready after ``polls`` polls:
    where the schedule's waits fall, and what runs under them, without any timing."""

    polls: int = 0  # the last input-gradient all-reduces (block 0's); the others: none
    head_polls: int = 0  # the LM head's input-gradient all-reduce

    def all_reduce(self, tensor, async_op=False, name="", **_):
        return _PolledHandle({"dgrad_all_reduce": self.head_polls,
                              "bwd b0": self.polls}.get(name, 0))


class _PolledHandle:
    def __init__(self, polls: int) -> None:
        self.left = polls

    def ready(self) -> bool:
        self.left -= 1
        return self.left < 0

    def wait(self) -> None:
        pass


def test_gradients_do_not_depend_on_where_the_late_split_falls() -> None:
    """How much of the head's weight gradient runs under its own all-reduce, and which late
    items run under which wait, depends on timing; the gradients must not (bit for bit): each
    part accumulates in a fixed order."""
    plan = Plan(2, "cross_layer", 1)
    grads = {}
    for head_polls in range(LATE_WGRAD_CHUNKS + 1):
        for polls in (*range(10), 40):
            group = _PolledGroup(size=2, rank=0)
            group.polls, group.head_polls = polls, head_polls
            grads[(head_polls, polls)] = _grads(_gpt(ParallelState(tp=group), plan))
    first = grads[(0, 0)]
    for key, g in grads.items():
        for name in g:
            assert torch.equal(g[name], first[name]), (key, name)
    # And they are the gradients of the unsplit model (fp32 tolerance: other summation order).
    ref = _grads(_gpt(ParallelState(tp=_PolledGroup(size=2, rank=0)), Plan(1, "none", 1)))
    for name in ref:
        torch.testing.assert_close(first[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("ready_after", range(LATE_WGRAD_CHUNKS + 1))
def test_head_weight_gradient_split_is_exact(ready_after: int) -> None:
    """The head's dL/dW computed in row chunks, ``ready_after`` of them under the all-reduce and
    the rest as late work, equals the one-GEMM gradient; the late part runs at the end of the
    backward pass even when no stack backward follows (the engine callback)."""
    class _Group(CommGroup):
        def all_reduce(self, tensor, async_op=False, **_):
            return _Handle()

    class _Handle:
        calls = 0

        def ready(self) -> bool:
            _Handle.calls += 1
            return _Handle.calls > ready_after

        def wait(self) -> None:
            pass

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(S, B, 16, generator=gen, requires_grad=True)
    w = torch.randn(10, 16, generator=gen, requires_grad=True)
    up = torch.randn(S, B, 10, generator=gen)
    late = LateWork()
    state = ParallelState(tp=_Group(size=2, rank=0))
    (parallel_lm_logits(x, w, True, parallel_state=state, late=late) * up).sum().backward()
    assert len(late) == 0
    expected = up.reshape(-1, 10).t() @ x.detach().reshape(-1, 16)
    torch.testing.assert_close(w.grad, expected, rtol=1e-6, atol=1e-6)


def test_embedding_prologue_equals_forward() -> None:
    """Micro-batch by micro-batch, the prologue gives what Embedding.forward gives, dropout mask
    included (drawn once for the whole batch), with [1, s] positions and token types."""
    cfg = config(hidden_size=16, num_attention_heads=2, vocab_size=V)
    state = ParallelState.single()
    torch.manual_seed(0)
    emb = Embedding(16, V, cfg.max_position_embeddings, 0.3, cfg, num_tokentypes=3,
                    parallel_state=state).train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (5, S), generator=gen)
    types = torch.randint(0, 3, (5, S), generator=gen)
    pos = torch.arange(S).unsqueeze(0)
    state.rng.seed(7)
    want = emb(ids, pos, types)
    for m in (1, 2, 3):
        state.rng.seed(7)
        todo = emb.prologue(ids, pos, types)
        parts = []
        for i, (b0, b1) in enumerate(split_batch(5, m)):
            mb = MicroBatch(index=i, batch_start=b0, batch_size=b1 - b0)
            parts.append(todo.finish(todo.partial(mb), mb))
        assert torch.equal(torch.cat(parts, dim=1), want), m
