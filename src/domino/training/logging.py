"""Rank-0 run logging: progress bar, log lines, metrics.jsonl, TensorBoard and the loss plot."""

from __future__ import annotations

import io
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from domino.safe_files import open_for_write, read_regular, write_atomic


class RunLogger:
    """Everything a run reports. Inactive (all no-ops) on ranks other than 0."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, active: bool,
                 tensorboard: bool = True) -> None:
        self.active, self.run_dir = active, Path(run_dir)
        self.train_curve: list[tuple[int, float]] = []
        self.val_curve: list[tuple[int, float]] = []
        self.bar = None
        self.tb = None
        self.metrics = None
        if not active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        if start_step > 0 and os.path.lexists(path):
            # Continuing this run from a checkpoint: records of steps after it are undone.
            # (Never through a link: domino writes none in a run folder.)
            kept = [line for line in read_regular(path).decode("utf-8").splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= start_step]
            write_atomic(path, "".join(line + "\n" for line in kept))
            for rec in map(json.loads, kept):
                if "loss" in rec:
                    self.train_curve.append((rec["step"], rec["loss"]))
                if "val_loss" in rec:
                    self.val_curve.append((rec["step"], rec["val_loss"]))
        self.metrics = open_for_write(path, "a")
        # No monitor thread: a daemon thread holding tqdm's lock at exit deadlocks the
        # interpreter's teardown (the bar refreshes on updates anyway).
        tqdm.monitor_interval = 0
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                        dynamic_ncols=True, file=sys.stderr, mininterval=1.0)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs `tensorboard`

                self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                self.tb = None

    def print(self, text: str) -> None:
        """A line that does not break the progress bar."""
        if self.active:
            tqdm.write(text, file=sys.stdout)
            sys.stdout.flush()

    def note(self, step: int, text: str) -> None:
        """An event line (e.g. a checkpoint written), printed but not a metrics record."""
        self.print(f"step {step}: {text}")

    def step(self, step: int, loss: float) -> None:
        if not self.active:
            return
        self.train_curve.append((step, loss))
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    def record(self, rec: dict[str, Any]) -> None:
        """One metrics.jsonl object, one log line and TensorBoard scalars."""
        if not self.active:
            return
        if "val_loss" in rec:
            self.val_curve.append((rec["step"], rec["val_loss"]))
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        if self.tb is not None:
            for key, value in rec.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, rec["step"])
        self.print(format_record(rec, self.bar.total if self.bar else 0))

    def close(self) -> None:
        if not self.active:
            return
        self.bar.close()
        self.metrics.close()
        if self.tb is not None:
            self.tb.close()

    def plot(self) -> Path | None:
        """loss_curve.png: training loss per step and validation loss points."""
        if not self.active or not self.train_curve:
            return None
        return plot_loss_curve(self.run_dir / "loss_curve.png", self.train_curve, self.val_curve)


# The parts of a log line, in order: (the record key that brings it, its text).
_PARTS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("loss", lambda r: f"loss {r['loss']:.4f}"),
    ("val_loss", lambda r: f"val loss {r['val_loss']:.4f} ppl {r['val_ppl']:.2f}"),
    ("lr", lambda r: f"lr {r['lr']:.2e}"),
    ("grad_norm", lambda r: f"grad norm {r['grad_norm']:.3f}"),
    ("tokens_per_s", lambda r: f"{r['tokens_per_s']:,.0f} tok/s"),
    ("step_time_s", lambda r: f"{r['step_time_s'] * 1e3:.0f} ms/step"),
    ("model_tflops_per_rank", lambda r: f"{r['model_tflops_per_rank']:.3g} TFLOP/s/rank"
     + (f" MFU {r['mfu'] * 100:.1f}%" if "mfu" in r else "")),
    ("moe_aux_loss", lambda r: f"moe aux {r['moe_aux_loss']:.3f} z {r['moe_z_loss']:.3g} max "
     f"load {r['moe_max_load']:.2f}x dropped {r['moe_dropped'] * 100:.1f}%"),
    ("exposed_comm_s", lambda r: f"exposed comm {r['exposed_comm_s'] * 1e3:.1f} ms"),
    ("peak_mem_bytes", lambda r: f"peak mem {r['peak_mem_bytes'] / 2**20:.0f} MiB"),
    ("exposed_dp_comm_s", lambda r: f"exposed DP comm {r['exposed_dp_comm_s'] * 1e3:.1f} ms"),
    ("skipped", lambda r: f"skipped {r['skipped']}" if r["skipped"] else ""),
    ("loss_scale", lambda r: f"scale {r['loss_scale']:.0f}"),
)


def format_record(rec: dict[str, Any], total: int) -> str:
    """One log line of a metrics record (``total``: the run's steps)."""
    width = len(str(total)) if total else 1
    parts = [f"step {rec['step']:>{width}}/{total}"]
    parts += [text for key, part in _PARTS if key in rec and (text := part(rec))]
    return " | ".join(parts)


def plot_loss_curve(path: Path, train: list[tuple[int, float]],
                    val: list[tuple[int, float]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe in worker processes
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    steps, losses = zip(*train, strict=True)
    ax.plot(steps, losses, lw=0.8, alpha=0.45, color="C0", label="train (per step)")
    if len(losses) >= 10:
        k = max(len(losses) // 30, 2)
        smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(steps, smooth, lw=1.8, color="C0", label=f"train (mean of {k})")
    if val:
        vs, vl = zip(*val, strict=True)
        ax.plot(vs, vl, "o-", color="C3", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    finite = [v for v in losses if math.isfinite(v)]
    if finite:
        ax.set_ylim(bottom=max(0.0, min(finite) * 0.9))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("domino train")
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format=Path(path).suffix.lstrip(".") or "png")
    write_atomic(path, image.getvalue())
    plt.close(fig)
    return path
