"""The overlapped DP reduction launches its buckets during the backward, last layers first, as
blocks finish; numbers are checked against the blocking path at DP=2 and TP=2 x DP=2 in
``test_train_parallel.py``."""

from __future__ import annotations

import pytest
import torch
from tp_helpers import config, one_thread

from domino import ParallelState
from domino.bench.hooks import BenchHook, SimulatedLink
from domino.gpt_model import GPTModel
from domino.tensor_parallel import CommGroup
from domino.training.grad_sync import GradReducer
from domino.transformer import Plan


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


class _Recorder(BenchHook):
    """Notes each DP launch (on an instant simulated link: tensors stay as they are)."""

    def __init__(self, log: list) -> None:
        super().__init__(link=SimulatedLink(1e15))
        self.log = log

    def launch(self, tensor, group, kind="all_reduce"):
        self.log.append(("launch", tensor.numel()))
        return super().launch(tensor, group, kind)


@pytest.mark.parametrize("plan", [Plan(1, "none", 1), Plan(2, "cross_layer", 2)],
                         ids=["sync", "m2-c2"])
def test_buckets_launch_during_backward_last_layer_first(plan: Plan) -> None:
    log: list = []
    dp = CommGroup(size=2, rank=0, hook=_Recorder(log))
    state = ParallelState(dp=dp)
    torch.manual_seed(0)
    model = GPTModel(config(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=64),
                     parallel_state=state, plan=plan)
    for stack in [model.language_model.encoder]:
        stack.set_plan(plan, force=True)  # split as at TP=2 (one rank here)
    ids = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]

    def loss(context=None):
        return model(ids[:, :-1], None, None, labels=ids[:, 1:], context=context).sum()

    loss().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    blocks = model.language_model.encoder.layers
    layer_numel = sum(p.numel() for p in blocks[0].parameters())
    reducer = GradReducer(model, params, state, bucket_numel=layer_numel // 2)
    first_layer_params = {id(p) for p in blocks[-1].parameters()}
    with reducer.armed() as context:
        loss(context).backward()
        # Assert inside: launches happened during the backward, before finish().
        launched = [b for b in reducer.buckets if b.handle is not None]
        assert len(launched) >= 2 * len(blocks) - 1
        assert all(id(p) in first_layer_params for p in reducer.buckets[0].params)
        assert reducer.buckets[0].handle is not None  # the last layer's bucket went first
    rest = [b for b in reducer.buckets if b.handle is None]  # embedding, final norm: at finish
    assert rest
    reducer.finish()
    assert all(b.handle is not None for b in reducer.buckets)
    assert len(log) == len(reducer.buckets)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected[name]), name
    with pytest.raises(RuntimeError, match="without an armed backward"):
        reducer.finish()


def test_distributed_optimizer_holds_a_dp_share_of_the_state() -> None:
    """ZeRO-1 at DP=4 (one rank of it, collectives off): AdamW moments for a quarter of the
    parameters, against the full set for the plain optimizer."""
    from domino.training.dist_optim import DistributedAdamW

    state = ParallelState(dp=CommGroup(size=4, rank=1, enabled=False))
    torch.manual_seed(0)
    model = GPTModel(config(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64),
                     parallel_state=state)
    params = [p for p in model.parameters() if p.requires_grad]
    reducer = GradReducer(model, params, state, shard=True)
    opt = DistributedAdamW(reducer, 1e-3, (0.9, 0.95), 1e-8, 0.1)
    plain = torch.optim.AdamW(params, 1e-3)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with reducer.armed() as context:
        model(ids[:, :-1], None, None, labels=ids[:, 1:], context=context).sum().backward()
    reducer.finish()
    assert all(b.shard.numel() == b.padded(4) // 4 for b in reducer.buckets)
    opt.step()
    plain.step()
    full = sum(v.numel() * v.element_size() for st in plain.state.values()
               for v in st.values() if v.dim())
    mine = sum(v.numel() * v.element_size() for st in opt.inner.state.values()
               for v in st.values() if v.dim())
    assert full / 4 <= mine <= full / 4 + 2 * 4 * 4 * len(reducer.buckets), (mine, full)
