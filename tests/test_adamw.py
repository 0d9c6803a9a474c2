"""domino's AdamW takes torch.optim.AdamW's steps bit for bit, keeps its state layout, and does
not import torch._dynamo (the reason it exists)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from domino.training.adamw import AdamW


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((5, 3), (3,), (7,))]


def _grads(step: int, params) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * 10 ** (step % 3 - 1) for p in params]


def _groups(params):
    return [{"params": params[:1], "weight_decay": 0.1},
            {"params": params[1:], "weight_decay": 0.0}]


def test_steps_equal_torch_adamw_bit_for_bit() -> None:
    ours_p, ref_p = _params(0), _params(0)
    ours = AdamW(_groups(ours_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW(_groups(ref_p), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for step in range(6):
        for opt, params in ((ours, ours_p), (ref, ref_p)):
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (step + 1) / 6  # a schedule, as set_lr does
            for p, g in zip(params, _grads(step, params), strict=True):
                p.grad = None if (step == 2 and p.ndim == 1) else g  # unused for a step
            opt.step()
            opt.zero_grad(set_to_none=False)
        for a, b in zip(ours_p, ref_p, strict=True):
            assert torch.equal(a, b), step
    for a, b in zip(ours_p, ref_p, strict=True):
        mine, theirs = ours.state[a], ref.state[b]
        assert set(mine) == set(theirs) == {"step", "exp_avg", "exp_avg_sq"}
        for key in mine:
            assert mine[key].dtype == theirs[key].dtype and torch.equal(mine[key], theirs[key])
    assert [p.grad.abs().sum().item() for p in ours_p] == [0.0] * 3


def test_a_loaded_state_continues_as_torch_adamw_does() -> None:
    """Checkpoints fill ``state[param]``; the next steps match torch's from the same state."""
    ours_p, ref_p = _params(1), _params(1)
    ref = torch.optim.AdamW(ref_p, lr=1e-3)
    for p, g in zip(ref_p, _grads(0, ref_p), strict=True):
        p.grad = g
    ref.step()
    with torch.no_grad():
        for a, b in zip(ours_p, ref_p, strict=True):
            a.copy_(b)
    ours = AdamW([{"params": ours_p}], lr=1e-3)
    for a, b in zip(ours_p, ref_p, strict=True):
        ours.state[a] = {k: v.clone() for k, v in ref.state[b].items()}
    for step in (1, 2):
        for opt, params in ((ours, ours_p), (ref, ref_p)):
            for p, g in zip(params, _grads(step, params), strict=True):
                p.grad = g
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(ours_p, ref_p, strict=True))
    assert float(ours.state[ours_p[0]]["step"]) == 3.0


def test_a_plain_parameter_list_is_one_group() -> None:
    ours_p, ref_p = _params(0), _params(0)
    ours, ref = AdamW(ours_p, lr=1e-2), torch.optim.AdamW(ref_p, lr=1e-2)
    assert len(ours.param_groups) == 1 and ours.param_groups[0]["params"] == ours_p
    for opt, params in ((ours, ours_p), (ref, ref_p)):
        for p, g in zip(params, _grads(0, params), strict=True):
            p.grad = g
        opt.step()
    for a, b in zip(ours_p, ref_p, strict=True):
        assert torch.equal(a, b)


def test_an_empty_group_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one parameter"):
        AdamW([{"params": []}], lr=1e-3)


def test_does_not_import_dynamo() -> None:
    code = ("import sys, torch\n"
            "from domino.training.adamw import AdamW\n"
            "p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)\n"
            "opt = AdamW([{'params': [p]}], lr=0.1); opt.step(); opt.zero_grad()\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
