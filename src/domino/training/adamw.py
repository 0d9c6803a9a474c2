"""AdamW that holds its own state and runs PyTorch's own update (``torch.optim.adam.adam`` with
decoupled weight decay: the function ``torch.optim.AdamW.step`` calls, so the bits are the same).

Why not ``torch.optim.AdamW`` itself: every method of ``torch.optim.Optimizer`` is wrapped to
keep TorchDynamo out, and the first call of one imports ``torch._dynamo``, which costs each rank
about 2.5 s of CPU at start on a 2-core machine (more than the whole first step of the default
run); the update function underneath has no such wrapper. The state layout is
``torch.optim.AdamW``'s (``state[param] = {"step", "exp_avg", "exp_avg_sq"}``,
``param_groups`` with ``lr``/``betas``/``eps``/``weight_decay``), which is what checkpoints
hold and what :class:`~domino.training.dist_optim.DistributedAdamW` keeps per chunk.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim.adam import adam


class AdamW:
    """AdamW over ``groups``: dicts with ``params`` and optionally ``weight_decay`` (or, as
    ``torch.optim.AdamW`` takes, the parameters themselves: one group)."""

    def __init__(self, groups: Iterable[dict] | Iterable[torch.Tensor], lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        self.param_groups: list[dict] = []
        groups = list(groups)
        if groups and isinstance(groups[0], torch.Tensor):
            groups = [{"params": groups}]
        for group in groups:
            params = list(group["params"])
            if not params:
                raise ValueError("an AdamW parameter group needs at least one parameter")
            self.param_groups.append({"params": params, "lr": lr, "betas": tuple(betas),
                                      "eps": eps,
                                      "weight_decay": group.get("weight_decay", weight_decay)})
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient (state created on first use, as
        ``torch.optim.AdamW`` does: a float32 CPU step counter and zero moments)."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p not in self.state:
                    self.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                     "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            adam(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                 [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                 amsgrad=False, has_complex=any(torch.is_complex(p) for p in params),
                 beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                 eps=group["eps"], maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, grad_scale=None, found_inf=None,
                 decoupled_weight_decay=True)
