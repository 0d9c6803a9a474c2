"""Placement records: what the layers record, Megatron's attributes, the norm's "each element
counted once" rule, gradient buckets per reducing group and the one place that decides the
reduction. All in one process (groups of fake sizes with their collectives off)."""

from __future__ import annotations

import pytest
import torch
from tp_helpers import config, one_thread

from domino import ParallelState
from domino.checkpoint.shards import describe
from domino.gpt_model import GPTModel
from domino.tensor_parallel import (
    ColumnParallelLinear,
    CommGroup,
    Placement,
    RowParallelLinear,
    VocabParallelEmbedding,
    place,
    placement_of,
)
from domino.tensor_parallel.placement import REPLICATED, counts_in_norm
from domino.training.grad_sync import BUCKET_NUMEL, GradReducer, make_reducer
from domino.training.optim import global_grad_norm

INIT = torch.nn.init.normal_


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _off(size: int, rank: int) -> CommGroup:
    return CommGroup(size=size, rank=rank, enabled=False)


class _Groups:
    """Groups by name of the given (size, rank); every other group has one rank."""

    def __init__(self, **dims: tuple[int, int]) -> None:
        self.dims = dims

    def group(self, name: str) -> CommGroup:
        return _off(*self.dims.get(name, (1, 0)))


def test_records_and_megatron_attributes() -> None:
    plain = torch.nn.Parameter(torch.zeros(3))
    assert placement_of(plain) == REPLICATED
    assert (REPLICATED.shard, REPLICATED.grad_group, REPLICATED.tied_copy) == (None, "dp_cp", False)
    g = _off(2, 1)
    col = ColumnParallelLinear(8, 12, group=g, init_method=INIT, stride=2)
    row = RowParallelLinear(8, 6, group=g, init_method=INIT)
    emb = VocabParallelEmbedding(16, 4, group=g, init_method=INIT, real_num_embeddings=13)
    assert placement_of(col.weight) == Placement("tp", 0, 2)
    assert placement_of(col.bias) == Placement("tp", 0, 2)
    assert placement_of(row.weight) == Placement("tp", 1)
    assert placement_of(row.bias) == REPLICATED  # added after the reduction
    assert placement_of(emb.weight) == Placement("tp", 0, rows=13)
    # Megatron's spelling, for code written against it.
    w = row.weight
    assert (w.tensor_model_parallel, w.partition_dim, w.partition_stride) == (True, 1, 1)
    assert col.weight.partition_stride == 2
    expert = torch.nn.Parameter(torch.zeros(2, 2))
    place(expert, Placement("ep", 0, grad_group="expert_dp"))
    assert expert.tensor_model_parallel is False  # not TP-sharded
    # A tensor tagged by hand, Megatron's way, reads as TP-sharded.
    tagged = torch.zeros(2)
    tagged.tensor_model_parallel, tagged.partition_dim, tagged.partition_stride = True, 0, 2
    assert placement_of(tagged) == Placement("tp", 0, 2)


@pytest.mark.parametrize("bad", [dict(shard="pp"), dict(grad_group="dp"), dict(stride=0)])
def test_placement_refuses_unknown_groups(bad) -> None:
    with pytest.raises(ValueError, match="Placement"):
        Placement(**bad)


def test_norm_counts_each_element_once() -> None:
    sharded, replicated = Placement("tp", 0), REPLICATED
    tied = Placement("tp", 0, tied_copy=True)
    expert = Placement("ep", 0, grad_group="expert_dp")
    for rank in (0, 1):
        state = _Groups(tp=(2, rank))
        assert counts_in_norm(sharded, state)
        assert counts_in_norm(replicated, state) == (rank == 0)  # TP rank 0 only
        assert not counts_in_norm(tied, state)  # the first stage's table counts
    for tp in (0, 1):
        for ep in (0, 1):
            state = _Groups(tp=(2, tp), ep=(2, ep))
            assert counts_in_norm(expert, state) == (tp == 0)  # every EP rank: its experts
            assert counts_in_norm(replicated, state) == (tp == 0 and ep == 0)
            assert counts_in_norm(sharded, state) == (ep == 0)
            # Summed over a gradient group holding EP first (ZeRO's chunks): TP decides.
            assert counts_in_norm(replicated, state, skip=("ep",)) == (tp == 0)
            # Expert chunks summed over expert-DP x TP: every rank's counts.
            assert counts_in_norm(expert, state, skip=("tp",))


def test_mesh_cuts_experts_out_of_dp_and_reduces_them_over_tp() -> None:
    """TP=2 x DP=2 x EP=2 (ranks: TP innermost): EP groups are DP peers at one TP position;
    expert gradients are summed over expert-DP x TP, i.e. every rank with the same experts."""
    from domino.parallel_state import ParallelSizes

    groups = ParallelSizes.for_world(8, tp=2, ep=2).rank_groups()
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["ep"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups["expert_dp"] == [[0, 4, 1, 5], [2, 6, 3, 7]]


def test_global_norm_at_tp2_equals_the_full_norm() -> None:
    """Each TP rank's part of the squared norm (the sum over TP off): shards on both ranks,
    replicated parameters on rank 0 only, the tied copy nowhere; together the full norm."""
    gen = torch.Generator().manual_seed(0)
    full_w, bias = torch.randn(6, 4, generator=gen), torch.randn(4, generator=gen)
    parts = []
    for rank in (0, 1):
        w = torch.nn.Parameter(full_w[3 * rank:3 * rank + 3].clone())
        place(w, Placement("tp", 0))
        b = torch.nn.Parameter(bias.clone())
        copy = torch.nn.Parameter(torch.zeros(3, 4))
        place(copy, Placement("tp", 0, tied_copy=True))
        for p, g in ((w, w.detach()), (b, b.detach()), (copy, torch.ones(3, 4))):
            p.grad = g.clone()
        parts.append(global_grad_norm([w, b, copy], ParallelState(tp=_off(2, rank))) ** 2)
    full = float(torch.cat([full_w.reshape(-1), bias]).double().norm() ** 2)
    assert sum(parts) == pytest.approx(full, rel=1e-6)  # fp32 per-parameter norms
    assert parts[1] == pytest.approx(float(full_w[3:].double().norm() ** 2), rel=1e-6)


def _model(state: ParallelState) -> tuple[GPTModel, list]:
    torch.manual_seed(0)
    model = GPTModel(config(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64),
                     parallel_state=state)
    return model, [p for p in model.parameters() if p.requires_grad]


def test_zero_norm_sums_disjoint_chunks_to_the_unsharded_norm() -> None:
    """ZeRO-1 at DP=2 (collectives off, so each rank's norm is its chunks' part): the two
    ranks' squares add up to the plain norm of the same gradients."""
    from domino.training.dist_optim import DistributedAdamW

    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    parts, plain = [], None
    for rank in (0, 1):
        state = ParallelState(dp=_off(2, rank))
        model, params = _model(state)
        reducer = GradReducer(model, params, state, shard=True)
        opt = DistributedAdamW(reducer, 1e-3, (0.9, 0.95), 1e-8, 0.1)
        with reducer.armed() as context:
            model(ids[:, :-1], None, None, labels=ids[:, 1:], context=context).sum().backward()
        reducer.finish()
        parts.append(opt.grad_norm(state) ** 2)
        plain = global_grad_norm(params, state) ** 2
    # fp32 norms of the chunks against fp32 norms of whole tensors: summed in another order
    # (the vectorised reduction's blocks differ), so equal within fp32 rounding; a chunk
    # missing or counted twice would be off by its share (percents).
    assert sum(parts) == pytest.approx(plain, rel=1e-6)


def test_buckets_per_gradient_group() -> None:
    state = ParallelState(dp=_off(2, 0))
    model, params = _model(state)
    experts = {id(p) for p in params[1::3]}  # as if every third parameter were an expert's
    for p in params:
        if id(p) in experts:
            place(p, Placement(grad_group="expert_dp"))
    reducer = GradReducer(model, params, state, bucket_numel=2000)
    assert {b.group for b in reducer.buckets} == {"dp_cp", "expert_dp"}
    for b in reducer.buckets:
        assert {id(p) in experts for p in b.params} == {b.group == "expert_dp"}
    assert sorted(id(p) for b in reducer.buckets for p in b.params) == sorted(map(id, params))
    assert reducer.groups() == [state.dp]  # both groups are DP's while EP and CP are 1


def test_make_reducer_decides_once() -> None:
    class Runner:
        def __init__(self, overlaps: bool) -> None:
            self.overlaps_dp = overlaps

    single = ParallelState()
    model, params = _model(single)
    assert make_reducer(model, params, single, distributed_optimizer=True) is None
    state = ParallelState(dp=_off(2, 0))
    model, params = _model(state)
    on = make_reducer(model, params, state)
    assert on.overlap and not on.shard
    off = make_reducer(model, params, state, overlap=False)
    assert not off.overlap and len(off.buckets) == 1  # blocking: the largest buckets
    assert sum(p.numel() for p in params) <= BUCKET_NUMEL
    zero = make_reducer(model, params, state, distributed_optimizer=True, overlap=False)
    assert zero.shard and zero.overlap  # ZeRO-1 reduce-scatters during the backward
    bubble = make_reducer(model, params, state, distributed_optimizer=True,
                          runner=Runner(False))
    assert bubble.shard and not bubble.overlap  # zero-bubble: after its W passes
    assert make_reducer(model, params, state, runner=Runner(True)).overlap


def test_checkpoints_refuse_other_shard_groups() -> None:
    like = torch.nn.Parameter(torch.zeros(2, 3))
    place(like, Placement("tp", 1, rows=None))
    assert describe(like.detach(), like, 2, ["a", "b"]).shape == (2, 6)
    place(like, Placement("ep", 0, grad_group="expert_dp"))
    with pytest.raises(NotImplementedError, match="experts.w is sharded over 'ep'"):
        describe(like.detach(), like, 2, ["a", "b"], "experts.w")
