"""The figures of the FSDP2 comparison (``compare.py``; ``largest.py`` reads the logs too):
what ``domino train``'s log and ``metrics.jsonl`` and the FSDP2 worker's report say, each
(link, dtype, system) cell over the rounds, issue 48's goals, and the markdown tables. Pure:
nothing here starts a process."""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from typing import Any

from peer_compare import LOOPBACK, summarize

MIB = 2 ** 20
FSDP2 = "fsdp2"
OGP = "optim_grads_params"
WAITED = "optim_grads_params_waited"
LABELS = {
    FSDP2: "FSDP2 (prefetch 1)",
    "fsdp2_no_prefetch": "FSDP2 (its defaults)",
    "no_shard": "ours no_shard",
    "optim": "ours optim",
    "optim_grads": "ours optim_grads",
    "optim_grads_params": "ours optim_grads_params",
    WAITED: "ours optim_grads_params, waited",
    "optim_grads_params_gloo": "ours optim_grads_params over gloo",
}



def parse_peaks_mib(log: str) -> list[float]:
    """``domino train``'s closing line -> each rank's peak memory, MiB."""
    m = re.search(r"peak memory per rank \(.*?\): ([\d., ]+?) MiB", log)
    if m is None:
        raise ValueError("no 'peak memory per rank' line in the domino train log")
    return [float(x) for x in m.group(1).split(",")]


def parse_model_state_mib(log: str) -> list[float]:
    """The closing line's model state per rank (weights + gradients + optimizer), MiB."""
    m = re.search(r"model state per rank \(weights \+ gradients \+ optimizer\): (.*)", log)
    if m is None:
        return []
    return [float(x) for x in re.findall(r"(?:^|, )([\d.]+) \(", m.group(1))]


def parse_implied_mib(log: str) -> float | None:
    """The start-up line: the model state per rank the strategy implies, MiB."""
    m = re.search(r"model state per rank implied by [^:]*: ([\d.]+) MiB", log)
    return float(m.group(1)) if m else None


def parse_param_count(log: str) -> int | None:
    """``model: 13,790,208 parameters`` -> 13790208."""
    m = re.search(r"model: ([\d,]+) parameters", log)
    return int(m.group(1).replace(",", "")) if m else None


def ours_figures(records: Sequence[dict[str, Any]], log: str, warmup: int,
                 tokens_per_step: int) -> dict[str, Any]:
    """One ``domino train`` run (its ``metrics.jsonl`` records, one per step, and its log) ->
    the run's figures; the first ``warmup`` steps are left out."""
    kept = [r for r in records if r["step"] > warmup]
    if not kept:
        raise ValueError(f"no metrics records after the {warmup} warm-up steps")
    step = statistics.median(r["step_time_s"] for r in kept)
    exposed = [r["exposed_dp_comm_s"] for r in kept if "exposed_dp_comm_s" in r]
    peaks = parse_peaks_mib(log)
    return {"step_s": step, "tokens_s": tokens_per_step / step,
            "step_min_s": min(r["step_time_s"] for r in kept), "peak_mib": max(peaks),
            "peak_mib_per_rank": peaks,
            "exposed_dp_s": statistics.median(exposed) if exposed else None,
            "model_state_mib": parse_model_state_mib(log), "implied_mib": parse_implied_mib(log),
            "params": parse_param_count(log), "losses": [r["loss"] for r in records]}


def fsdp2_figures(report: dict[str, Any], tokens_per_step: int) -> dict[str, Any]:
    """The worker's JSON report -> the run's figures (the same keys as :func:`ours_figures`)."""
    step = statistics.median(report["step_times_s"])
    peaks = [b / MIB for b in report["peak_mem_bytes_per_rank"]]
    state = report["model_state_bytes_rank0"]
    return {"step_s": step, "tokens_s": tokens_per_step / step,
            "step_min_s": min(report["step_times_s"]), "peak_mib": max(peaks),
            "peak_mib_per_rank": peaks, "exposed_dp_s": None,
            "model_state_mib": [sum(state.values()) / MIB], "implied_mib": None,
            "params": report["params"], "losses": report["losses"]}


def cell_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One (link, dtype, system) cell over the rounds: median, min, max of each figure."""
    exposed = [r["exposed_dp_s"] for r in runs if r.get("exposed_dp_s") is not None]
    states = [r["model_state_mib"][0] for r in runs if r.get("model_state_mib")]
    fastest = [r["step_min_s"] for r in runs if r.get("step_min_s") is not None]
    return {"step_s": summarize([r["step_s"] for r in runs]),
            "tokens_s": summarize([r["tokens_s"] for r in runs]),
            "fastest_step_s": min(fastest) if fastest else None,
            "peak_mib": summarize([r["peak_mib"] for r in runs]),
            "exposed_dp_s": summarize(exposed),
            "model_state_mib": states[0] if states else None}


def _med(cell: dict[str, Any] | None, key: str) -> float | None:
    if cell is None or cell.get(key) is None:
        return None
    return cell[key]["median"]


def _fast(cell: dict[str, Any] | None) -> float | None:
    return None if cell is None else cell.get("fastest_step_s")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def goals(cells: dict[str, dict[str, Any]], emulated: bool) -> dict[str, Any]:
    """Issue 48's goals for one (link, dtype) from its cells (system -> :func:`cell_summary`):
    optim_grads_params' step over no_shard's (<= 1.10 on loopback), its tokens/s over FSDP2's
    (>= 1.2 at 1 Gbit, >= 1.0 on loopback), its peak over FSDP2's (<= 1), and on an emulated
    link the share of its exposed DP communication hidden against the waited variant
    (1 - exposed / waited's exposed; >= 0.8), the same share of what the waited variant exposes
    beyond no_shard's exposed time, and the step time saved per waited ms."""
    ogp, ns, peer, waited = (cells.get(k) for k in (OGP, "no_shard", FSDP2, WAITED))
    out: dict[str, Any] = {
        "ogp_over_no_shard_step": _ratio(_med(ogp, "step_s"), _med(ns, "step_s")),
        "ogp_over_fsdp2_tokens": _ratio(_med(ogp, "tokens_s"), _med(peer, "tokens_s")),
        "ogp_over_fsdp2_peak": _ratio(_med(ogp, "peak_mib"), _med(peer, "peak_mib")),
        "hidden_share": None, "step_saved_share": None,
        # the same ratios on the fastest single steps: what the machine's other load spared
        "fastest_ogp_over_no_shard": _ratio(_fast(ogp), _fast(ns)),
        "fastest_fsdp2_over_ogp": _ratio(_fast(peer), _fast(ogp))}
    e_o, e_w = _med(ogp, "exposed_dp_s"), _med(waited, "exposed_dp_s")
    e_n = _med(ns, "exposed_dp_s")
    out["hidden_beyond_no_shard"] = None
    if e_o is not None and e_w:
        out["hidden_share"] = 1.0 - e_o / e_w
        if e_n is not None and e_w > e_n:  # of what the waited sharding exposes over no_shard
            out["hidden_beyond_no_shard"] = (e_w - e_o) / (e_w - e_n)
        t_o, t_w = _med(ogp, "step_s"), _med(waited, "step_s")
        out["step_saved_share"] = (t_w - t_o) / e_w if t_o and t_w else None
    r, t, p, h = (out[k] for k in ("ogp_over_no_shard_step", "ogp_over_fsdp2_tokens",
                                   "ogp_over_fsdp2_peak", "hidden_share"))
    out["met"] = {
        "within_1.10x_of_no_shard": None if emulated or r is None else r <= 1.10,
        "tokens_vs_fsdp2": None if t is None else t >= (1.2 if emulated else 1.0),
        "memory_vs_fsdp2": None if p is None else p <= 1.0,
        "hidden_80pct": None if not emulated or h is None else h >= 0.8}
    return out


def fmt(summary: dict[str, float] | None, scale: float = 1.0, digits: int = 0) -> str:
    """``"812 (670-1013)"``: the median, then the range over rounds (none for one round)."""
    if summary is None:
        return "-"
    med, lo, hi = (f"{summary[k] * scale:.{digits}f}" for k in ("median", "min", "max"))
    return med if summary["rounds"] < 2 else f"{med} ({lo}-{hi})"


def row_label(link: str) -> str:
    return LOOPBACK if link == LOOPBACK else f"{link} emulated"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (link, dtype, system): ``rows`` items carry ``link``, ``dtype``,
    ``system`` and the :func:`cell_summary` keys."""
    head = ("link", "dtype", "system", "step ms", "fastest step ms", "tokens/s",
            "peak MiB per rank", "exposed DP comm ms", "model state MiB per rank")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * 6) + "|"]
    for r in rows:
        state, fastest = r.get("model_state_mib"), r.get("fastest_step_s")
        cells = (row_label(r["link"]), r["dtype"], LABELS.get(r["system"], r["system"]),
                 fmt(r["step_s"], 1e3), "-" if fastest is None else f"{fastest * 1e3:.0f}",
                 fmt(r["tokens_s"]), fmt(r["peak_mib"]),
                 fmt(r["exposed_dp_s"], 1e3), "-" if state is None else f"{state:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _yes(met: bool | None) -> str:
    return "" if met is None else (" (met)" if met else " (not met)")


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def _fastest(g: dict[str, Any], key: str) -> str:
    return "" if g.get(key) is None else f"; fastest steps {g[key]:.2f}x"


def format_goals(rows: Sequence[dict[str, Any]]) -> str:
    """One line per (link, dtype): ``rows`` items carry ``link``, ``dtype`` and
    :func:`goals`' keys."""
    head = ("link", "dtype", "optim_grads_params / no_shard step (<= 1.10 on loopback)",
            "ours / FSDP2 tokens/s (>= 1.0 loopback, >= 1.2 1 Gbit)",
            "ours / FSDP2 peak per rank (<= 1)",
            "exposed DP comm hidden vs waited (>= 80%)", "of the waited excess over no_shard",
            "waited ms saved from the step")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * 6) + "|"]
    for g in rows:
        met = g["met"]
        cells = (row_label(g["link"]), g["dtype"],
                 _x(g["ogp_over_no_shard_step"]) + _yes(met["within_1.10x_of_no_shard"])
                 + _fastest(g, "fastest_ogp_over_no_shard"),
                 _x(g["ogp_over_fsdp2_tokens"]) + _yes(met["tokens_vs_fsdp2"])
                 + _fastest(g, "fastest_fsdp2_over_ogp"),
                 _x(g["ogp_over_fsdp2_peak"]) + _yes(met["memory_vs_fsdp2"]),
                 _pct(g["hidden_share"]) + _yes(met["hidden_80pct"]),
                 _pct(g["hidden_beyond_no_shard"]), _pct(g["step_saved_share"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
