"""``CommGroup.all_to_all`` (uneven splits along dim 0): on gloo and on the shared-memory
transport (tiny slots: everything in pieces) its results are bit-equal to
``torch.distributed.all_to_all_single`` at 2-4 ranks, with zero splits, a rank that sends nothing
and one that receives nothing, several dtypes, in place, and many in flight before any wait; on
gloo its exchanges (and the pairwise reduce-scatter's and ``exchange``'s) post every receive
before any send;
malformed split sizes are refused on the caller's thread with a message, sizes the ranks
disagree on fail every rank alike; a peer that exits fails the others; a disabled group, a
group of one and the benchmark's hook (timing, simulated link) handle it like the other
collectives. NCCL runs the same ``all_to_all_single`` call as gloo (no CUDA test here: the
suite has no multi-GPU pattern)."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist import run_distributed
from test_shm import _error_of, _report, _run_failing

from domino.bench.hooks import BenchHook, SimulatedLink
from domino.tensor_parallel import CommGroup, shm
from domino.transformer.moe.dispatch import launch_counts

CASES = ((torch.float32, (3,)), (torch.bfloat16, (3,)), (torch.int64, ()))  # dtype, row shape


def _matrices(world: int) -> dict[str, list[list[int]] | None]:
    """Rows rank q sends rank d (``m[q][d]``), the same on every rank; None: even splits."""
    gen = torch.Generator().manual_seed(world)
    rand = torch.randint(0, 9, (world, world), generator=gen)
    sparse = rand * (torch.rand(world, world, generator=gen) < 0.5)
    silent = torch.randint(1, 9, (world, world), generator=gen)
    silent[1, :] = 0  # rank 1 sends nothing (not even to itself)
    silent[:, 0] = 0  # rank 0 receives nothing
    big = torch.randint(0, 120, (world, world), generator=gen)
    return {"even": None, "random": rand.tolist(), "sparse": sparse.tolist(),
            "silent": silent.tolist(), "empty": [[0] * world] * world, "big": big.tolist(),
            "symmetric": (rand + rand.T).tolist()}


def _splits(m: list[list[int]] | None, rank: int, world: int):
    if m is None:
        return None, None, 5 * world, 5 * world
    outs = [m[q][rank] for q in range(world)]
    return outs, m[rank], sum(outs), sum(m[rank])


def _refused(call) -> str:
    try:
        call()
        return "no error"
    except ValueError as e:
        return str(e)


def _exchanges(rank: int, world: int) -> dict:
    gloo = CommGroup.world()
    t = shm.open_transport(gloo.group, rank, world, "test", slot_bytes=192)
    tiny = shm.open_transport(gloo.group, rank, world, "tiny", slot_bytes=64)
    assert t is not None and tiny is not None
    fast = CommGroup(gloo.group, world, rank, transport=t)
    gen = torch.Generator().manual_seed(10 + rank)
    equal: dict[str, bool] = {}
    pending = []  # (key, expected, output, handle): all waited for at the end
    for case, m in _matrices(world).items():
        outs, ins, n_out, n_in = _splits(m, rank, world)
        for dtype, rest in CASES:
            x = (torch.randn(n_in, *rest, generator=gen) * 100).to(dtype)
            ref = x.new_empty(n_out, *rest)
            dist.all_to_all_single(ref, x, outs, ins)
            for name, group in (("gloo", gloo), ("shm", fast)):
                y = torch.full_like(ref, 7)
                h = group.all_to_all(y, x, outs, ins, async_op=True)
                pending.append((f"{name}/{case}/{dtype}/{rest}", ref, y, h))
            # A sum in flight among them, on the same transport (launch order).
            s = torch.ones(11)
            pending.append((f"shm_all_reduce/{case}/{dtype}", torch.full((11,), world), s,
                            fast.all_reduce(s, async_op=True)))
        if case in ("even", "symmetric"):  # output and input one tensor
            x = torch.randn(n_in, 2, generator=gen)
            ref = torch.empty_like(x)
            dist.all_to_all_single(ref, x, outs, ins)
            y = x.clone()
            fast.all_to_all(x, x, outs, ins)
            equal[f"shm_in_place/{case}"] = torch.equal(x, ref)
            gloo.all_to_all(y, y, outs, ins)
            equal[f"gloo_in_place/{case}"] = torch.equal(y, ref)
        x = torch.randn(n_in, 5, generator=gen)
        ref = x.new_empty(n_out, 5)
        dist.all_to_all_single(ref, x, outs, ins)
        y = torch.empty_like(ref)
        CommGroup(gloo.group, world, rank, transport=tiny).all_to_all(y, x, outs, ins)
        equal[f"tiny_slots/{case}"] = torch.equal(y, ref)
    for key, ref, y, h in reversed(pending):
        h.wait()
        equal[key] = torch.equal(ref, y)
    # Far larger than a slot (192 bytes): 200 rows of 12 bytes to each peer.
    x = torch.randn(200 * world, 3, generator=gen)
    ref = torch.empty_like(x)
    dist.all_to_all_single(ref, x)
    y = torch.empty_like(x)
    before = t._channel._step
    fast.all_to_all(y, x)
    equal["larger_than_a_slot"] = torch.equal(y, ref)
    out: dict = {"equal": equal, "pieces": t._channel._step - before,
                 "tiny": tiny._channel._step}
    # Malformed calls: refused here, on either path, before any rank waits.
    rows = 2 * world
    x, y = torch.ones(rows, 2), torch.ones(rows, 2)
    bad = {"length": [rows], "negative": [rows + 1, -1] + [0] * (world - 2),
           "sum": [1] * world, "float": [1.5] * world}
    for name, group in (("gloo", gloo), ("shm", fast)):
        call = group.all_to_all
        for what, splits in bad.items():
            out[f"{name}/{what}"] = _refused(partial(call, y, x, None, splits))
        out[f"{name}/uneven"] = _refused(partial(call, y[:-1], x[:-1]))
        out[f"{name}/dtype"] = _refused(partial(call, y.double(), x))
        out[f"{name}/shape"] = _refused(partial(call, torch.ones(rows, 3), x))
    out["shm/strided"] = _refused(lambda: t.all_to_all(y, torch.ones(2, rows).t()))
    out["shm/dtype_unsupported"] = _refused(lambda: t.all_to_all(y.bool(), x.bool()))
    z = torch.empty(rows, 2)
    fast.all_to_all(z, torch.arange(2.0 * rows).view(rows, 2) + 100 * rank)
    ref = torch.empty(rows, 2)
    dist.all_to_all_single(ref, torch.arange(2.0 * rows).view(rows, 2) + 100 * rank)
    equal["after_refusals"] = torch.equal(z, ref)
    # Sizes the peers disagree on: rank 0 expects two rows from itself, it sends itself one.
    expect = [2, 0] + [1] * (world - 2) if rank == 0 else None
    out["disagree"] = _error_of(lambda: fast.all_to_all(torch.empty(world), torch.ones(world),
                                                        expect, None))
    out["posted"] = _posting_order(gloo)
    # Disabled (the benchmark's nocomm): an MoE dispatch's per-expert counts still travel, since
    # they decide how many rows each rank's experts compute; the rows themselves stay put.
    off = CommGroup(gloo.group, world, rank, enabled=False)
    counts = torch.arange(2 * world) * (rank + 1)  # 2 experts per rank, a different load each
    real = torch.empty_like(counts)
    dist.all_to_all_single(real, counts)
    got, handle = launch_counts(counts, off)
    handle.wait()
    equal["nocomm_counts_travel"] = torch.equal(got, real) and not off.enabled
    rows = torch.full((world, 2), float(rank))
    y = torch.empty_like(rows)
    off.all_to_all(y, rows)
    equal["nocomm_rows_stay"] = torch.equal(y, rows) and off.stats.count == 1
    # A simulated link (the bench's --simulate-link) stands in for the rows' transfer, never
    # for the counts: it sees both launched, but the counts travel for real.
    sim = _Recorder(BenchHook(link=SimulatedLink(8e9)))
    linked = CommGroup(gloo.group, world, rank, hook=sim)
    got, handle = launch_counts(counts, linked)
    handle.wait()
    linked.all_to_all(y, rows)
    equal["simulated_counts_travel"] = torch.equal(got, real) and torch.equal(y, rows)
    equal["simulated_sees_both"] = [k for k, _ in sim.launched] == ["all_to_all"] * 2
    t.close()
    tiny.close()
    return out


def _posting_order(gloo: CommGroup) -> dict[str, str]:
    """The point-to-point calls each gloo exchange posts, in order ('r' receive, 's' send): a
    pair whose ranks both send first moves one direction at a time (``CommGroup.pairwise``)."""
    calls: list[str] = []
    real = dist.isend, dist.irecv

    def isend(*a, **k):
        calls.append("s")
        return real[0](*a, **k)

    def irecv(*a, **k):
        calls.append("r")
        return real[1](*a, **k)

    order = {}
    world, rank = gloo.size, gloo.rank
    dist.isend, dist.irecv = isend, irecv
    try:
        x = torch.arange(6.0 * world)
        gloo.all_to_all(torch.empty_like(x), x)
        order["all_to_all"], calls[:] = "".join(calls), []
        gloo.reduce_scatter(torch.empty(6), x)
        order["reduce_scatter"] = "".join(calls)
    finally:
        dist.isend, dist.irecv = real
    batch = dist.batch_isend_irecv  # its ops must name the real isend / irecv

    def batched(ops):
        order["exchange"] = "".join("r" if op.op is dist.irecv else "s" for op in ops)
        return batch(ops)

    dist.batch_isend_irecv = batched
    try:
        peer = (rank + 1) % world, (rank - 1) % world
        gloo.exchange([(peer[0], x)], [(peer[1], torch.empty_like(x))]).wait()
    finally:
        dist.batch_isend_irecv = batch
    return order


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_to_all_matches_torch_distributed(world: int) -> None:
    results = run_distributed(_exchanges, world)
    for r in results:
        bad = [k for k, v in r["equal"].items() if not v]
        assert not bad, f"not bit-equal to all_to_all_single at {world} ranks: {bad}"
        # The transport carried them, in pieces: the agreement's and 2400 bytes per peer.
        assert r["pieces"] == 1 + -(-2400 * (world - 1) // 192), r["pieces"]
        assert r["tiny"] > 50, r
        for name in ("gloo", "shm"):
            for what in ("length", "negative", "sum", "float"):
                msg = r[f"{name}/{what}"]
                assert "input_split_sizes=" in msg and f"must be {world} non-negative" in msg, msg
            assert "do not split evenly" in r[f"{name}/uneven"], r
            for what in ("dtype", "shape"):
                assert "does not fit input" in r[f"{name}/{what}"], r
        for what in ("strided", "dtype_unsupported"):
            assert "takes contiguous CPU tensors" in r[f"shm/{what}"], r
        assert "rank 0 sends rank 0 1 rows" in r["disagree"], r["disagree"]
        assert "rank 0 expects 2" in r["disagree"], r["disagree"]
    assert len({r["disagree"] for r in results}) == 1  # every rank alike
    for r in results:  # on gloo every receive is posted before any send
        n = world - 1
        assert r["posted"] == {"all_to_all": "r" * n + "s" * n, "reduce_scatter": "r" * n + "s" * n,
                               "exchange": "rs"}, r["posted"]


def _peer_exits(rank: int, world: int) -> None:
    group = CommGroup.world()
    fast = CommGroup(group.group, world, rank,
                     transport=shm.open_transport(group.group, rank, world, "tp"))
    x = torch.ones(4)
    fast.all_to_all(torch.empty(4), x)  # works while both are there
    if rank == 1:
        os._exit(0)
    first = _error_of(lambda: fast.all_to_all(torch.empty(4), x))
    _report({"first": first})


def test_a_peer_that_exits_fails_the_others_at_once(tmp_path) -> None:
    r = _run_failing(_peer_exits, tmp_path)
    assert "rank 1 of the group left a collective" in r["first"], r
    assert "tp group" in r["first"], r


class _Recorder:
    def __init__(self, link: BenchHook) -> None:  # records, then lets ``link`` act
        self.link, self.launched, self.done = link, [], []

    def launch(self, tensor, group, kind="all_reduce"):
        self.launched.append((kind, tensor.numel() * tensor.element_size()))
        return self.link.launch(tensor, group, kind)

    def finished(self, name, tags, nbytes, launched_s, wait_s, done_s) -> None:
        self.done.append((name, tags, nbytes))

    def region(self, name, category, **tags):
        return self.link.region(name, category, **tags)


def test_no_op_paths_and_the_hook() -> None:
    x = torch.arange(12.0).view(6, 2)
    # A group of one: the identity.
    y = torch.empty(6, 2)
    assert CommGroup().all_to_all(y, x).ready() and torch.equal(y, x)
    # Disabled (nocomm): the input as it is, rows past it zeroed; nothing counted.
    group = CommGroup(None, 3, 1, enabled=False)
    y = torch.full((8, 2), 7.0)
    group.all_to_all(y, x, [4, 2, 2], [1, 2, 3])
    assert torch.equal(y[:6], x) and not y[6:].any() and group.stats.count == 0
    # The benchmark's simulated link stands in for the transfer: counted, traced, timed.
    hook = _Recorder(BenchHook(link=SimulatedLink(8e9)))
    group = CommGroup(None, 3, 0, hook=hook)
    y = torch.empty(6, 2)
    h = group.all_to_all(y, x, [1, 2, 3], [2, 2, 2], async_op=True, tags={"mb": 1})
    h.wait()
    # Shown to the hook, counted and traced: the 4 rows rank 0 sends ranks 1 and 2 (its own 2
    # cross no link), which the simulated link times.
    assert torch.equal(y, x) and hook.launched == [("all_to_all", 32)]
    assert hook.done == [("all_to_all", {"mb": 1}, 32)]
    assert (group.stats.count, group.stats.bytes) == (1, 32)
    # A disabled stand-in group (no process group): the counts stay local too.
    counts = torch.tensor([3, 1, 4, 1, 5, 9])
    got, handle = launch_counts(counts, CommGroup(None, 3, 1, enabled=False))
    assert handle.ready() and torch.equal(got, counts)
    # Malformed sizes are refused even where nothing is sent.
    with pytest.raises(ValueError, match="output_split_sizes="):
        CommGroup(None, 3, 1, enabled=False).all_to_all(y, x, [1, 1, 1], None)


def test_the_exchange_probe_runs_every_case_on_loopback() -> None:
    """``scripts/probe_exchange.py`` (the docs cite its figures) runs and times every case."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "probe_exchange.py"
    done = subprocess.run([sys.executable, str(script), "--link", "loopback", "--mib", "0.05",
                           "--rounds", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    for case in ("one way", "send first", "receive first", "all_to_all_single",
                 "CommGroup.all_to_all", "CommGroup.exchange", "shared memory all_to_all"):
        assert any(line.strip().startswith(case) and line.endswith(" ms")
                   for line in done.stdout.splitlines()), done.stdout
