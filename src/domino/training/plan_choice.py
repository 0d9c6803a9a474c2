"""``--domino-autotune`` in a run: which Domino plan the run trains with (the timing itself is
:mod:`domino.transformer.autotune`)."""

from __future__ import annotations

import json
import statistics

import torch

from domino.parallel_state import ParallelState
from domino.plan import SYNC, Plan
from domino.safe_files import write_atomic
from domino.training.data import state_batches
from domino.training.logging import RunLogger
from domino.training.prepare import Run
from domino.training.step import forward_loss
from domino.transformer.autotune import autotune, candidate_plans, moe_groups, regime_of
from domino.transformer.stack import set_plan


def choose_plan(model: torch.nn.Module, run: Run, state: ParallelState, consumed: int,
                log: RunLogger) -> None:
    """A resumed run keeps the plan it was tuned to (the same plan is what makes the resume
    exact); a new one times the candidates on this rank's first micro-batch (of the batch at
    sample ``consumed``) and keeps the fastest (gradients and RNG states are restored); rank 0
    writes the timings to autotune.json."""
    resume = run.resume
    if resume is not None and not resume.weights_only and resume.meta.plan:
        plan = Plan.parse(resume.meta.plan)
        set_plan(model, plan)
        log.print(f"autotune: keeping the checkpoint's plan {plan}")
        return
    args = run.args
    batch = state_batches(run.train_ds, consumed, args.global_batch_size,
                          args.micro_batch_size, state)[0]

    def fwd_bwd() -> None:
        forward_loss(model, batch).backward()

    best, times = autotune(model, fwd_bwd, state,
                           candidate_plans(args.micro_batch_size,
                                           groups=moe_groups(args.num_experts, state.ep.size)))
    medians = {str(p): statistics.median(t) for p, t in times.items()}
    splits = [statistics.median(t) for p, t in times.items() if p.splits]
    regime = (regime_of(medians[str(SYNC)], t_best_split=min(splits))
              if splits and str(SYNC) in medians else None)
    log.print("autotune (median fwd+bwd ms of one micro-batch, slowest rank): "
              + ", ".join(f"{n} {t * 1e3:.0f}" for n, t in medians.items())
              + (f"; regime {regime}" if regime else "")
              + f" -> training with {best}")
    if log.active:  # rank 0
        write_atomic(log.run_dir / "autotune.json", json.dumps(
            {"chosen": str(best), "regime": regime.name if regime else None,
             "median_s": medians,
             "times_s": {str(p): t for p, t in times.items()}}, indent=2) + "\n")
