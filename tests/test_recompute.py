"""Activation recomputation under every Domino schedule: full (every piece rerun in backward
from its input leaves) and selective (the core attention) give bit for bit the gradients, losses
and dropout streams of no recomputation, at TP=2 with real collectives, and keep less."""

from __future__ import annotations

import pytest
import torch
from tp_helpers import config, one_thread, register, tp_results

from domino import AttnMaskType, ParallelState
from domino.gpt_model import GPTModel
from domino.language_model import get_language_model
from domino.tensor_parallel import CommGroup
from domino.transformer import BackwardContext, DominoTransformer, Plan

PLANS = [Plan(1, "none", 1), Plan(2, "cross_layer", 1), Plan(3, "intra_layer", 2),
         Plan(4, "cross_layer", 2)]
GRANULARITIES = ("full", "selective")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _gpt(state, granularity, plan):
    cfg = config(hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64,
                 hidden_dropout=0.2, attention_dropout=0.2, activation="swiglu",
                 position_embedding_type="rope", recompute_granularity=granularity)
    model = GPTModel(cfg, parallel_state=state, plan=plan)
    ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(1))
    return model, lambda: model(ids[:, :-1], None, None, labels=ids[:, 1:]).sum()


def _encdec(state, granularity, plan):
    cfg = config(hidden_size=32, num_attention_heads=4, vocab_size=64, decoder_num_layers=2,
                 hidden_dropout=0.2, attention_dropout=0.2, recompute_granularity=granularity)
    model, _ = get_language_model(cfg, 0, True, AttnMaskType.padding, add_decoder=True,
                                  parallel_state=state, plan=plan)
    gen = torch.Generator().manual_seed(2)
    enc = torch.randint(0, 64, (4, 8), generator=gen)
    dec = torch.randint(0, 64, (4, 6), generator=gen)

    def loss():
        d, e, pooled = model(enc, None, None, dec, None, None)
        return d.square().sum() + e.sum() + pooled.sum()
    return model, loss


def _run(build, state, granularity, plan) -> tuple:
    torch.manual_seed(0)
    state.rng.seed(3)
    model, loss = build(state, granularity, plan)
    losses = []
    for _ in range(2):  # two accumulated backwards: the dropout streams move on between them
        value = loss()
        value.backward()
        losses.append(value.item())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return losses, grads, state.rng.snapshot(torch.device("cpu"))


def _recompute_checks(state: ParallelState) -> dict:
    """Per (family, granularity, plan): does it equal no recomputation bit for bit."""
    out = {}
    for name, build in (("gpt", _gpt), ("encdec", _encdec)):
        for plan in PLANS:
            ref = _run(build, state, None, plan)
            for granularity in GRANULARITIES:
                got = _run(build, state, granularity, plan)
                out[(name, granularity, str(plan))] = (
                    got[0] == ref[0],
                    [n for n in ref[1] if not torch.equal(got[1][n], ref[1][n])],
                    all(torch.equal(a, b) for a, b in zip(got[2], ref[2], strict=True)))
    return out


register(2, _recompute_checks)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("family", ["gpt", "encdec"])
def test_recompute_equals_no_recompute_tp2(family: str, granularity: str) -> None:
    for rank, res in enumerate(tp_results(2, _recompute_checks)):
        for plan in PLANS:
            same_loss, bad_grads, same_rng = res[(family, granularity, str(plan))]
            where = f"rank {rank} {family} {granularity} {plan}"
            assert same_loss, where
            assert not bad_grads, (where, bad_grads)
            assert same_rng, f"{where}: dropout streams moved differently"


def test_recompute_keeps_less() -> None:
    """Bytes autograd keeps for backward during a stack's forward (a split plan, half of TP=2):
    selective drops the attention scores and probabilities, full keeps nothing inside pieces
    (only the leaves between them, held by the schedule: at most a few [s, b, h] per block)."""
    kept = {}
    for granularity in (None, "selective", "full"):
        state = ParallelState(tp=CommGroup(size=2, rank=0, enabled=False))
        cfg = config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                     attention_dropout=0.1, hidden_dropout=0.1,
                     recompute_granularity=granularity)
        stack = DominoTransformer(cfg, state, self_attn_mask_type=AttnMaskType.causal,
                                  plan=Plan(2, "cross_layer", 1))
        total = 0

        def pack(t: torch.Tensor):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = stack(torch.randn(16, 4, 32), None)
        y.sum().backward()
        kept[granularity] = total
    assert kept["full"] < kept["selective"] < kept[None], kept
    assert kept["full"] == 0, kept


def test_deferred_weight_grads_carry_no_graph() -> None:
    """A zero-bubble W pass runs the deferred weight-gradient GEMMs later, with grad mode on;
    under full recomputation their inputs are graph tensors. The gradients they write must
    still be plain data (a .grad with a graph would keep the step's activations alive)."""
    state = ParallelState(tp=CommGroup(size=2, rank=0, enabled=False))
    cfg = config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                 recompute_granularity="full")
    stack = DominoTransformer(cfg, state, self_attn_mask_type=AttnMaskType.causal,
                              plan=Plan(2, "cross_layer", 1))
    sink: list = []
    stack(torch.randn(8, 4, 32), None, context=BackwardContext(sink=sink)).sum().backward()
    assert sink
    with torch.enable_grad():
        for item in sink:
            item.run()
    grads = [p.grad for p in stack.parameters()]
    assert all(g is not None and not g.requires_grad for g in grads)
