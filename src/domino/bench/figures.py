"""Figures of a comparison of Domino modes from the workers' raw measurements (pure functions:
no processes, no files).

Per mode (medians over rounds; a round's time is its slowest rank's): exposed comm = T_mode -
T_nocomm, comm hidden = 1 - exposed(mode) / exposed(sync), speedup = T_sync / T_mode, tokens/s =
micro_batch_size * seq_length / T_mode (per TP group); a sequence-parallel mode (``...:sp``) takes
sync:sp and nocomm:sp as its sync and nocomm. The same share *paired by round*
(``comm_hidden_paired``) takes each exposed time as the median over rounds of T_mode - T_nocomm
within a round: the modes of a round run back to back, so a drift of the host's speed between
rounds (which moves the medians of different modes apart) cancels.
"""

from __future__ import annotations

import statistics
from typing import Any

from domino.bench.modes import Mode
from domino.flops import utilisation
from domino.transformer.autotune import regime_of


def _split_nocomm(mode: Mode, modes: list[Mode]) -> Mode | None:
    """The comm-free run with the same split (same overlap preferred; it is moot without comm)."""
    same = [m for m in modes if not m.comm and m.split == mode.split
            and m.sequence_parallel == mode.sequence_parallel and m.compiled == mode.compiled]
    exact = [m for m in same if m.plan == mode.plan]
    return (exact or same or [None])[0]


def compute_results(raw: dict[str, Any], modes: list[Mode], tokens: int) -> list[dict[str, Any]]:
    """One figures dict per mode from the workers' raw measurements."""
    measured = _Measured(raw, modes)
    return [measured.row(mode, tokens) for mode in modes]


class _Measured:
    """The workers' raw measurements and the medians every mode's figures are read against."""

    def __init__(self, raw: dict[str, Any], modes: list[Mode]) -> None:
        self.raw, self.modes = raw, modes
        self.sent = raw.get("allreduce_bytes_per_step", {})
        self.exchanged = raw.get("exchange_bytes_per_step", {})
        self.med = {m.name: statistics.median(raw["step_times_s"][m.name]) for m in modes}
        self.cpu_rounds = raw.get("per_rank_step_cpu_s") or {}
        # A mode's CPU per step and rank: the ranks' mean in each round, the median over rounds.
        self.cpu = {n: statistics.median(statistics.fmean(r) for r in zip(*v, strict=True))
                    for n, v in self.cpu_rounds.items() if v and v[0]}

    def baselines(self, mode: Mode) -> tuple[str | None, str | None]:
        """The names of the sync and nocomm runs ``mode`` is compared with (None: not run).

        Sequence-parallel and compiled modes against their own sync and nocomm when those
        ran; a sequence-parallel one falls back to those of its kind (eager or compiled), a
        compiled one never to eager ones (they would mix eager compute into its figures)."""
        fam = mode.family
        kind = ":compiled" if mode.compiled else ""
        sync = next((n for n in ("sync" + fam, "sync" + kind) if n in self.med), None)
        nocomm = next((n for n in ("nocomm" + fam, "nocomm" + kind) if n in self.med), None)
        return sync, nocomm

    def hidden(self, mode: Mode, exposed: float | None, sync: str | None,
               nocomm: str | None) -> tuple[float | None, float | None]:
        """The share of sync's exposed comm ``mode`` hides: from the medians, and paired by
        round (None for modes that are not Domino's or without the baselines)."""
        f_sync, f_nocomm = self.med.get(sync), self.med.get(nocomm)
        f_exposed_sync = (f_sync - f_nocomm if f_sync is not None and f_nocomm is not None
                          else None)
        hidden = None
        if (mode.is_domino and exposed is not None and f_exposed_sync is not None
                and f_exposed_sync > 0):
            hidden = 1.0 - exposed / f_exposed_sync
        paired = (hidden_share_paired(self.raw["step_times_s"], mode.name, sync, nocomm)
                  if mode.is_domino and sync and nocomm else None)
        return hidden, paired

    def cpu_figures(self, mode: Mode, split: Mode | None) -> dict[str, Any]:
        """The CPU time (all threads, kernel work included) a rank's process spent per step,
        and over the same split without comm: what the comm costs the CPUs."""
        cpu, name = self.cpu, mode.name
        return {
            "cpu_s_per_step": cpu.get(name),
            "cpu_s_per_step_per_rank": ([statistics.median(v) for v in self.cpu_rounds[name]]
                                        if name in cpu else None),
            "cpu_vs_split_nocomm_s": (cpu[name] - cpu[split.name]
                                      if split is not None and name in cpu
                                      and split.name in cpu else None),
        }

    def row(self, mode: Mode, tokens: int) -> dict[str, Any]:
        raw, med = self.raw, self.med
        t = med[mode.name]
        per_rank, mfu = utilisation(raw.get("model_flops_per_step"),
                                    len(raw["per_rank_step_times_s"][mode.name]), t,
                                    raw.get("peak_flops_per_s"))
        sync, nocomm = self.baselines(mode)
        f_sync, f_nocomm = med.get(sync), med.get(nocomm)
        base = t - f_nocomm if f_nocomm is not None else None
        exposed = base if mode.comm else None
        split = _split_nocomm(mode, self.modes) if mode.is_domino else None
        hidden, hidden_paired = self.hidden(mode, exposed, sync, nocomm)
        peaks = raw["peak_bytes"][mode.name]
        known = [p for p in peaks if p is not None]
        sent, exchanged = self.sent.get(mode.name), self.exchanged.get(mode.name, 0)
        return {
            "mode": mode.name,
            "comm_enabled": mode.comm,
            "micro_batches": mode.plan.micro_batches,
            "overlap": mode.plan.overlap,
            "column_chunks": mode.plan.column_chunks,
            "sequence_parallel": mode.sequence_parallel,
            "compiled": mode.compiled,
            "step_time_s": t,
            "step_times_s": raw["step_times_s"][mode.name],
            "step_times_s_per_rank": raw["per_rank_step_times_s"][mode.name],
            "tokens_per_s": tokens / t,
            # Model FLOPs (domino.flops) per second per rank, and over the peak (MFU).
            "model_flops_per_s_per_rank": per_rank,
            "mfu": mfu,
            "exposed_comm_s": exposed,
            "exposed_comm_vs_split_nocomm_s": t - med[split.name] if split is not None else None,
            **self.cpu_figures(mode, split),
            # For comm-free split runs: what splitting alone costs over unsplit compute.
            "split_cost_s": base if not mode.comm and mode.split != (1, 1) else None,
            "comm_hidden": hidden,
            "comm_hidden_paired": hidden_paired,
            "speedup_vs_sync": f_sync / t if f_sync is not None else None,
            "peak_mem_bytes": max(known) if known else None,
            # Bytes this rank's collectives sent in one step (of them, in exchanges: EP's
            # all-to-alls, CP's transfers), and the host CPU that moving them takes (scaled
            # from the 8 MiB probes): overlapped comm still costs this much CPU.
            "allreduce_bytes_per_step": sent,
            "exchange_bytes_per_step": exchanged,
            "comm_cpu_s_per_step": comm_cpu_s(raw, sent, exchanged),
            "peak_mem_bytes_per_rank": peaks,
            "peak_rss_bytes_per_rank": raw["peak_rss_bytes"][mode.name],
            "timeline_png": None,
            "chrome_trace": None,
            "traced_work_s_per_rank": None,
            "traced_wait_s_per_rank": None,
        }


def paired_exposed_s(times: dict[str, list[float]], mode: str, nocomm: str) -> float:
    """Median over rounds of ``mode``'s time less ``nocomm``'s in the same round (``times``:
    seconds per round of each mode, rounds aligned)."""
    return statistics.median(t - n for t, n in zip(times[mode], times[nocomm], strict=True))


def hidden_share_paired(times: dict[str, list[float]], mode: str, sync: str,
                        nocomm: str) -> float | None:
    """1 - paired exposed(mode) / paired exposed(sync) (None when sync exposes nothing)."""
    exposed_sync = paired_exposed_s(times, sync, nocomm)
    if exposed_sync <= 0:
        return None
    return 1.0 - paired_exposed_s(times, mode, nocomm) / exposed_sync


def comm_cpu_s(raw: dict[str, Any], sent: int | None, exchanged: int) -> float | None:
    """Host CPU seconds that moving a step's bytes takes: the all-reduced ones at the
    all-reduce probe's cost per byte, the exchanged ones at the all-to-all probe's (None where
    bytes of a kind were sent and its probe did not run or could not read the CPU)."""
    if sent is None:
        return None
    total = 0.0
    for nbytes, cpu_8mib in ((sent - exchanged, raw.get("allreduce_8mib_cpu_s")),
                             (exchanged, raw.get("exchange_8mib_cpu_s"))):
        if nbytes:
            if cpu_8mib is None:
                return None
            total += cpu_8mib * nbytes / (8 << 20)
    return total


def best_mode(rows: list[dict[str, Any]]) -> str | None:
    """The comm-enabled Domino mode with the lowest median step time (None without one). Beside
    eager modes, ``:compiled`` ones do not count: they are compared with ``sync:compiled``, and
    ``sync`` (which this pick is read against) runs eager."""
    domino = [r for r in rows if r["comm_enabled"] and r["mode"].startswith("domino:")]
    eager = [r for r in domino if not r.get("compiled")]
    domino = eager or domino
    return min(domino, key=lambda r: r["step_time_s"])["mode"] if domino else None


def detect_regime(rows: list[dict[str, Any]], raw: dict[str, Any], cpus: int,
                  busy: bool) -> dict[str, Any] | None:
    """Which regime the measured link is in (:func:`domino.transformer.autotune.regime_of`) and
    the plan that wins there: no split when communication is negligible, else the fastest
    Domino mode. Needs ``sync`` and ``nocomm`` rows; the host-CPU share of an all-reduce comes
    from the link probe and counts only when the ranks' compute fills the host's CPUs."""
    med = {r["mode"]: r["step_time_s"] for r in rows}
    if "sync" not in med or "nocomm" not in med:
        return None
    wall, cpu = raw.get("allreduce_8mib_s"), raw.get("allreduce_8mib_cpu_s")
    if wall is None:  # no TP group: the exchanges' probe (EP, CP)
        wall, cpu = raw.get("exchange_8mib_s"), raw.get("exchange_8mib_cpu_s")
    # cpu_s is host-wide busy CPU seconds per all-reduce: the share of the host's CPU capacity
    # a transfer takes while it runs.
    share = cpu / (wall * max(1, cpus)) if busy and wall and cpu is not None else None
    regime = regime_of(med["sync"], t_nocomm=med["nocomm"], comm_cpu_share=share)
    best = best_mode(rows)
    pick = "sync" if regime.name == "negligible" or best is None or med[best] >= med["sync"] \
        else best
    return {"name": regime.name, "why": regime.why, "comm_cpu_share": share, "pick": pick}


def comm_cpu_bound(rows: list[dict[str, Any]], cpus: int) -> dict[str, Any] | None:
    """What moving sync's bytes costs the host's CPUs, and the share of sync's exposed comm that
    overlap can hide at most when compute already keeps every CPU busy: the comm's CPU time is
    then taken from compute (``floor_s`` = CPU seconds / CPUs), hidden or not.

    None without a ``sync`` row (or ``sync:sp``, ...) or a CPU probe.
    """
    syncs = [r for r in rows if r["mode"].split(":")[0] == "sync"]
    # ``sync`` where it ran, else its sequence-parallel or compiled kind
    sync = next((r for r in syncs if r["mode"] == "sync"), syncs[0] if syncs else None)
    if sync is None or sync.get("comm_cpu_s_per_step") is None:
        return None
    cpu = sync["comm_cpu_s_per_step"]
    floor = cpu / max(1, cpus)
    exposed = sync["exposed_comm_s"]
    return {
        "allreduce_bytes_per_step": sync["allreduce_bytes_per_step"],
        "exchange_bytes_per_step": sync["exchange_bytes_per_step"],
        "comm_cpu_s_per_step": cpu,
        "cpus": cpus,
        "floor_s": floor,
        "comm_hidden_ceiling": (max(0.0, 1.0 - floor / exposed)
                                if exposed is not None and exposed > 0 else None),
    }


def mfu_line(config: dict[str, Any]) -> str | None:
    """The report line saying what a step's model FLOPs are and what MFU is taken against."""
    if not config.get("model_flops_per_step"):
        return None
    peak = config.get("peak_flops_per_s")
    return (f"model FLOPs {config['model_flops_per_step'] / 1e9:.1f} GFLOP per step (all "
            f"ranks); MFU {config.get('mfu_of')}"
            + (f" = {peak / 1e12:.3g} TFLOP/s per rank" if peak else ""))


def header_lines(config: dict[str, Any]) -> list[str]:
    """A report's lines under its first: MFU's denominator, the attention's paths (the
    backend and what was measured), what compiling cost."""
    attention = f"attention {config['attention']}" if config.get("attention") else None
    return [x for x in (mfu_line(config), attention, compile_line(config)) if x is not None]


def compile_line(config: dict[str, Any]) -> str | None:
    """The report line saying what compiling the pieces cost (None when nothing compiled)."""
    if not config.get("compile_graphs"):
        return None
    line = (f"compiled pieces ({config['compile_backend']}): {config['compile_graphs']} forward "
            f"graphs in {config['compile_s']:.1f} s before the timed steps")
    later = config.get("compile_graphs_timed")
    if later:
        line += f"; {later} more during them (a recompile: those steps' times include it)"
    return line


def compile_figures(gathered: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's compile figures from every rank's ``compile`` ([graphs, seconds] before
    the timed steps, graphs during them): the slowest rank's pair, and the most any rank
    compiled while timed."""
    slowest = max((g["compile"] for g in gathered), key=lambda c: c[1])
    return {"compile_graphs": slowest[0], "compile_s": slowest[1],
            "compile_graphs_timed": max(g["compile"][2] for g in gathered)}
