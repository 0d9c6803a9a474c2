"""The MoE MLP (``domino.transformer.moe``) against a per-token reference written straight from
the definitions: routing (softmax with and without re-normalised top-k
weights, sigmoid with DeepSeek's selection bias and scaling), dropless and capacity routing (both
drop policies, padded or not), shared experts with their gate, GELU and SwiGLU experts (and
GPT-OSS's: a router bias, expert biases, the clamped, scaled, offset SwiGLU), the
auxiliary losses (and that a micro-batch's losses are the sum of its pieces' statistics, whatever
the split), the expert-bias update, and the corner cases: an expert no token reaches, every token
to one expert, top-k = all experts. Forward and every gradient within fp32 tolerance. With expert
parallelism (EP = 2 and 4, each rank its own tokens, hot and idle experts, drops) every rank's
outputs and input gradients, its experts' gradients and the summed router gradients equal the
single-rank model's on all the ranks' tokens. (The model and the trainer:
test_moe_training.py.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dist import run_distributed

from domino.tensor_parallel import CommGroup
from domino.transformer.moe import MoEMLP, aux_losses, update_expert_bias
from domino.transformer.moe.experts import capacity_of

H, FFN, E = 16, 24, 4
TOL = 1e-5


def _naive_expert(m: MoEMLP, e: int, x: torch.Tensor) -> torch.Tensor:
    ex = m.experts
    h = x @ ex.fc1[e] + (0.0 if ex.fc1_bias is None else ex.fc1_bias[e])
    if ex.swiglu:
        g, up = h.chunk(2, dim=-1)
        alpha, offset, clamp = ex.glu  # GPT-OSS's: clamped, scaled gate, offset linear half
        if clamp is not None:
            g, up = g.clamp(max=clamp), up.clamp(-clamp, clamp)
        h = g * torch.sigmoid(alpha * g) * (up + offset)
    else:
        h = F.gelu(h)
    return h @ ex.fc2[e] + (0.0 if ex.fc2_bias is None else ex.fc2_bias[e])


def _naive(m: MoEMLP, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(output [T, h], dropped) token by token."""
    r = m.router
    chosen = []  # per token: [(expert, weight)]
    for t in range(x.shape[0]):
        logits = x[t].float() @ r.weight.float().t()
        if r.bias is not None:  # (GPT-OSS's: it moves the weights too)
            logits = logits + r.bias.float()
        scores = torch.softmax(logits, -1) if r.score_function == "softmax" else \
            torch.sigmoid(logits)
        choice = scores if r.expert_bias is None else scores + r.expert_bias
        top = sorted(range(E), key=lambda e: -float(choice[e].detach()))[:r.topk]
        w = scores[top]
        if r.renormalize if r.score_function == "softmax" else r.topk > 1:
            w = w / w.sum()  # a top-1 sigmoid weight stays its score (Megatron)
        chosen.append([(e, w[i] * r.scaling) for i, e in enumerate(top)])
    keep = {(t, e) for t in range(x.shape[0]) for e, _ in chosen[t]}
    dropped = 0
    if m.capacity_factor is not None:
        cap = math.ceil(x.shape[0] * r.topk / E * m.capacity_factor)
        keep = set()
        for e in range(E):
            mine = [(t, float(w.detach())) for t in range(x.shape[0])
                    for ee, w in chosen[t] if ee == e]
            if m.drop_policy == "probs":
                mine.sort(key=lambda tw: -tw[1])  # stable: token order among equal weights
            keep |= {(t, e) for t, _ in mine[:cap]}
            dropped += max(0, len(mine) - cap)
    rows = []
    for t in range(x.shape[0]):
        parts = [w * _naive_expert(m, e, x[t]) for e, w in chosen[t] if (t, e) in keep]
        rows.append(torch.stack(parts).sum(0) if parts else torch.zeros_like(x[t]))
    out = torch.stack(rows)
    if m.shared is not None:
        s = m.shared
        h = x @ s.fc1.t()
        if s.swiglu:
            g, up = h.chunk(2, dim=-1)
            h = F.silu(g) * up
        else:
            h = F.gelu(h)
        shared = h @ s.fc2.t()
        if s.gate is not None:
            shared = shared * torch.sigmoid(x @ s.gate.t())
        out = out + shared
    return out, dropped


def _pair(**kw) -> tuple[MoEMLP, torch.Tensor]:
    torch.manual_seed(0)
    m = MoEMLP(H, FFN, E, kw.pop("topk", 2), init_method_std=0.3, **kw)
    x = torch.randn(13, H, generator=torch.Generator().manual_seed(1))
    return m, x


def _check(m: MoEMLP, x: torch.Tensor) -> int:
    """Forward and gradients (input, router, experts, shared expert) against the reference."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, stats, dropped = m(xa)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * gy).sum().backward()
    mine = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    ref, ref_dropped = _naive(m, xb)
    (ref * gy).sum().backward()
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=TOL, atol=TOL)
    for n, p in m.named_parameters():
        torch.testing.assert_close(mine.get(n, torch.zeros_like(p)),
                                   p.grad if p.grad is not None else torch.zeros_like(p),
                                   rtol=TOL, atol=TOL, msg=n)
    assert dropped == ref_dropped
    assert int(stats.counts.sum()) == x.shape[0] * m.topk
    return dropped


ROUTERS = {
    "softmax-renorm-swiglu": dict(),
    "softmax-raw-gelu-shared-gated": dict(renormalize=False, swiglu=False,
                                          shared_ffn_hidden_size=8, shared_gate=True),
    "sigmoid-bias-scaled-shared": dict(score_function="sigmoid", expert_bias=True, scaling=2.5,
                                       shared_ffn_hidden_size=8, topk=3),
    "sigmoid-top1": dict(score_function="sigmoid", topk=1),
    "softmax-gpt-oss-biases-clamped": dict(router_bias=True, expert_linear_bias=True,
                                           glu=(1.702, 1.0, 0.4)),
}


@pytest.mark.parametrize("case", list(ROUTERS))
def test_dropless_routing_matches_the_definition(case: str) -> None:
    m, x = _pair(**ROUTERS[case])
    if m.router.expert_bias is not None:  # a bias that changes the choice, not the weights
        m.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # learned biases (they start at 0)
        for p in (m.router.bias, m.experts.fc1_bias, m.experts.fc2_bias):
            if p is not None:
                p.copy_(torch.randn(p.shape, generator=gen))
    assert _check(m, x) == 0


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_by_its_policy_and_padding_changes_nothing(policy: str) -> None:
    m, x = _pair(capacity_factor=0.5, drop_policy=policy)
    dropped = _check(m, x)
    assert dropped > 0  # 13 tokens x 2 slots over 4 experts, capacity 4: some must go
    padded, _ = _pair(capacity_factor=0.5, drop_policy=policy, pad_to_capacity=True)
    padded.load_state_dict(m.state_dict())
    with torch.no_grad():
        a, _, da = m(x)
        b, _, db = padded(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert da == db == dropped
    assert capacity_of(13, 2, 4, 0.5) == 4


def test_corner_routes() -> None:
    """An expert no token reaches; every token to one expert (top-1, and with a capacity that
    keeps only some); top-k = every expert."""
    m, x = _pair(expert_bias=True)
    m.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, -10.0]))  # expert 3: never
    _check(m, x)
    assert m(x)[1].counts[3] == 0
    one, x = _pair(topk=1, expert_bias=True)
    one.router.expert_bias.copy_(torch.tensor([0.0, 10.0, 0.0, 0.0]))  # all to expert 1
    _check(one, x)
    assert m(x)[1].counts.max() <= 13 and one(x)[1].counts.tolist() == [0, 13, 0, 0]
    capped, _ = _pair(topk=1, expert_bias=True, capacity_factor=1.0)
    capped.load_state_dict(one.state_dict())
    assert _check(capped, x) == 13 - 4  # capacity ceil(13 / 4) = 4
    every, x = _pair(topk=E, swiglu=False)
    _check(every, x)


def test_aux_losses_are_the_sum_of_their_pieces() -> None:
    """The load-balancing loss and z-loss of a micro-batch from its pieces' summed statistics
    equal the unsplit ones, values and gradients (a Domino split must not change them)."""
    m, x = _pair()
    _, whole, _ = m(x)
    balance, z = aux_losses(whole, m.topk)
    # By hand: E * sum_e (assignments_e / (T k)) * mean normalised score_e; mean logsumexp^2.
    logits = x @ m.router.weight.t()
    probs = torch.softmax(logits, -1)
    top = probs.topk(2, -1).indices
    f = torch.bincount(top.reshape(-1), minlength=E).float() / (13 * 2)
    torch.testing.assert_close(balance, E * (f * probs.mean(0)).sum())
    torch.testing.assert_close(z, torch.logsumexp(logits, -1).pow(2).mean())
    (balance + 0.1 * z).backward()
    want = m.router.weight.grad.clone()
    m.zero_grad()
    parts = [m(piece)[1] for piece in (x[:5], x[5:6], x[6:])]
    total = parts[0] + parts[1] + parts[2]
    b2, z2 = aux_losses(total, m.topk)
    torch.testing.assert_close(b2, balance, rtol=1e-6, atol=0)
    torch.testing.assert_close(z2, z, rtol=1e-6, atol=0)
    (b2 + 0.1 * z2).backward()
    torch.testing.assert_close(m.router.weight.grad, want, rtol=1e-5, atol=1e-7)


def test_expert_bias_moves_towards_the_mean_load() -> None:
    bias = torch.zeros(4)
    update_expert_bias(bias, torch.tensor([10, 2, 6, 6]), 0.01)
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="topk=5 must be between 1 and num_experts=4"):
        MoEMLP(H, FFN, E, 5)
    with pytest.raises(ValueError, match="score_function='tanh'"):
        MoEMLP(H, FFN, E, 2, score_function="tanh")
    with pytest.raises(ValueError, match="capacity_factor=0.0 must be > 0"):
        MoEMLP(H, FFN, E, 2, capacity_factor=0.0)
    with pytest.raises(ValueError, match="pad_to_capacity needs a capacity_factor"):
        MoEMLP(H, FFN, E, 2, pad_to_capacity=True)
    m, x = _pair(capacity_factor=1.0, drop_policy="largest")
    with pytest.raises(ValueError, match="drop_policy='largest'"):
        m(x)


# ---- expert parallelism ----------------------------------------------------------------------

EP_EXPERTS = 8
EP_CASES = {
    "softmax-dropless-shared": dict(shared_ffn_hidden_size=8, shared_gate=True),
    # Hot experts 0 and 5, expert 7 idle: uneven splits, and ranks that receive little.
    "sigmoid-skewed": dict(score_function="sigmoid", expert_bias=True, topk=3),
    "capacity-drops": dict(capacity_factor=1.0, expert_bias=True),
    # Experts 4-7 idle: the last EP rank(s) receive no row at all, and send theirs away.
    "idle-ranks": dict(expert_bias=True, bias=torch.tensor([0.0] * 4 + [-10.0] * 4)),
}
SKEW = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, -10.0])


def _ep_model(kw: dict, ep: CommGroup | None = None) -> MoEMLP:
    kw = dict(kw)
    bias = kw.pop("bias", SKEW)
    torch.manual_seed(0)
    m = MoEMLP(H, FFN, EP_EXPERTS, kw.pop("topk", 2), init_method_std=0.3, ep=ep, **kw)
    if m.router.expert_bias is not None:
        m.router.expert_bias.copy_(bias)
    return m


def _ep_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + rank)
    return torch.randn(11 + 3 * rank, H, generator=gen), torch.randn(11 + 3 * rank, H,
                                                                     generator=gen)


def _ep_rank(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, kw in EP_CASES.items():
        m = _ep_model(kw, CommGroup.world())
        x, gy = _ep_data(rank)
        x.requires_grad_()
        y, stats, dropped = m(x)
        (y * gy).sum().backward()
        out[name] = {"y": y.detach(), "dx": x.grad, "dropped": dropped,
                     "grads": {n: p.grad for n, p in m.named_parameters()}}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_one_rank(world: int) -> None:
    ranks = run_distributed(_ep_rank, world)
    for name, kw in EP_CASES.items():
        ref = _ep_model(kw)
        local = EP_EXPERTS // world
        for rank, res in enumerate(ranks):
            x, gy = _ep_data(rank)
            x.requires_grad_()
            y, _, dropped = ref(x)
            (y * gy).sum().backward()  # the reference's grads: every rank's tokens summed
            got = res[name]
            torch.testing.assert_close(got["y"], y.detach(), rtol=TOL, atol=TOL)
            torch.testing.assert_close(got["dx"], x.grad, rtol=TOL, atol=TOL)
            assert got["dropped"] == dropped
        assert name != "capacity-drops" or sum(r[name]["dropped"] for r in ranks) > 0
        for n, p in ref.named_parameters():
            if not p.requires_grad:  # the expert bias: moved by its rule, not by gradients
                continue
            if n.startswith("experts."):  # each rank's share of the experts
                for rank, res in enumerate(ranks):
                    torch.testing.assert_close(res[name]["grads"][n],
                                               p.grad[rank * local:(rank + 1) * local],
                                               rtol=TOL, atol=TOL, msg=f"{name} {n} {rank}")
            else:  # replicated: each rank's part, summed (DP would sum them)
                total = sum(res[name]["grads"][n] for res in ranks)
                torch.testing.assert_close(total, p.grad, rtol=TOL, atol=TOL, msg=f"{name} {n}")
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by the expert-parallel"):
        MoEMLP(H, FFN, 6, 2, ep=CommGroup(size=4, rank=0, enabled=False))
