"""The shared-memory transport (``domino.tensor_parallel.shm``): its collectives give gloo's
results (bit for bit where gloo's sum order is the same: two ranks, and the reduce-scatter's rank
order), across pieces, dtypes, ops and several in flight; every rank gets the same bits; a peer
that exits or stops taking part makes the others fail, never hang; nothing is left in /dev/shm;
ranks that are not on one host (another network namespace, a refused /dev/shm) keep to gloo on
every rank alike; training over it equals training over gloo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from dist import run_distributed

from domino import ParallelState, megatron_compat
from domino.tensor_parallel import CommGroup, shm

SIZES = [1, 7, 64, 1000, 4099]  # with 256-byte slots: one piece, several, a ragged last one


def _gloo(group: CommGroup) -> CommGroup:
    return CommGroup(group.group, group.size, group.rank)


def _collectives(rank: int, world: int) -> dict:
    group = CommGroup.world()
    t = shm.open_transport(group.group, rank, world, "test", slot_bytes=256)
    assert t is not None
    fast = CommGroup(group.group, world, rank, transport=t)
    gen = torch.Generator().manual_seed(100 + rank)
    out: dict = {"equal": {}, "close": {}}
    for n in SIZES:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            x = (torch.randn(n, generator=gen) * 100).to(dtype)
            ref, mine = x.clone(), x.clone()
            group.all_reduce(ref)
            fast.all_reduce(mine)
            key = f"ar/{n}/{dtype}"
            out["equal"][key] = torch.equal(ref, mine) if world == 2 or dtype == torch.int64 \
                else None
            bf16 = dtype == torch.bfloat16  # values ~100: a bf16 ulp there is 0.5
            out["close"][key] = torch.allclose(ref.double(), mine.double(),
                                               rtol=2e-2 if bf16 else 1e-5,
                                               atol=4.0 if bf16 else 1e-3)
            out[f"bits/{key}"] = mine.view(-1).double().tolist()[:50]
        for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            x = torch.randn(n, generator=gen)
            ref, mine = x.clone(), x.clone()
            group.all_reduce(ref, op=op)
            fast.all_reduce(mine, op=op)
            out["equal"][f"{op}/{n}"] = torch.equal(ref, mine)
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            x = (torch.randn(world * n, 3, generator=gen) * 100).to(dtype)
            ref_rs, mine_rs = x.new_empty(n, 3), x.new_empty(n, 3)
            group.reduce_scatter(ref_rs, x)  # gloo: pairwise exchanges, summed in rank order
            fast.reduce_scatter(mine_rs, x)
            out["equal"][f"rs/{n}/{dtype}"] = torch.equal(ref_rs, mine_rs)
            y = (torch.randn(n, 2, generator=gen) * 100).to(dtype)
            ref_ag, mine_ag = y.new_empty(world * n, 2), y.new_empty(world * n, 2)
            group.all_gather_into(ref_ag, y)
            fast.all_gather_into(mine_ag, y)
            out["equal"][f"ag/{n}/{dtype}"] = torch.equal(ref_ag, mine_ag)
        # In place: the output is this rank's chunk of the input itself.
        x = torch.randn(world * n, generator=gen)
        ref_rs = x.new_empty(n)
        group.reduce_scatter(ref_rs, x.clone())
        inplace = x.clone()
        fast.reduce_scatter(inplace.view(world, n)[rank], inplace)
        out["equal"][f"rs_in_place/{n}"] = torch.equal(inplace.view(world, n)[rank], ref_rs)
        # The same memory seen through two storages (e.g. two numpy views).
        arr = x.clone().numpy()
        twin = torch.from_numpy(arr[rank * n:(rank + 1) * n])
        fast.reduce_scatter(twin, torch.from_numpy(arr))
        out["equal"][f"rs_overlapping_storages/{n}"] = torch.equal(twin, ref_rs)
        ints = torch.randint(-1000, 1000, (n,), generator=gen)
        for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            ref, mine = ints.clone(), ints.clone()
            group.all_reduce(ref, op=op)
            fast.all_reduce(mine, op=op)
            out["equal"][f"{op}/int/{n}"] = torch.equal(ref, mine)
    # Several in flight, waited for in another order than launched (the schedule does that).
    xs = [torch.randn(333 * (k + 1), generator=gen) for k in range(4)]
    refs = [x.clone() for x in xs]
    for r in refs:
        group.all_reduce(r)
    handles = [fast.all_reduce(x, async_op=True) for x in xs]
    rs_out = torch.empty(100)
    rs_in = torch.randn(world * 100, generator=gen)
    rs_ref = torch.empty(100)
    group.reduce_scatter(rs_ref, rs_in)
    handles.append(fast.reduce_scatter(rs_out, rs_in, async_op=True))
    for h in reversed(handles):
        h.wait()
    out["close"]["in_flight"] = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(xs, refs))
    out["equal"]["in_flight_rs"] = torch.equal(rs_out, rs_ref)
    out["pieces"] = t._channel._step  # the pieces it moved: the transport did carry them
    # A malformed call fails on the caller's thread and leaves the transport working.
    try:
        fast.reduce_scatter(torch.empty(3), torch.ones(7))
        out["malformed"] = "no error"
    except ValueError as e:
        out["malformed"] = str(e)
    for name, call in {"op": lambda: t.all_reduce(torch.ones(4), dist.ReduceOp.PRODUCT),
                       "strided": lambda: t.all_reduce(torch.ones(4, 4).t()),
                       "strided_out": lambda: t.all_gather(torch.ones(4, world).t(),
                                                           torch.ones(4))}.items():
        try:
            call()
            out[f"malformed_{name}"] = "no error"
        except ValueError as e:
            out[f"malformed_{name}"] = str(e)
    y = torch.ones(5)
    t._channel._timeout_s = 1e12  # beyond poll()'s limit: waited for in steps
    fast.all_reduce(y)
    out["equal"]["after_malformed_and_huge_timeout"] = torch.equal(y, torch.full((5,), world))
    t.close()
    try:
        fast.all_reduce(torch.ones(3))
        out["after_close"] = "no error"
    except RuntimeError as e:
        out["after_close"] = str(e)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_match_gloo(world: int) -> None:
    results = run_distributed(_collectives, world)
    for r in results:
        assert r["pieces"] > 3 * len(SIZES) * 5, r["pieces"]
        assert "does not fit input" in r["malformed"], r["malformed"]
        for name in ("op", "strided", "strided_out"):
            assert "takes contiguous CPU tensors" in r[f"malformed_{name}"], r
        assert "is closed" in r["after_close"], r["after_close"]
        bad = [k for k, v in r["equal"].items() if v is False]
        assert not bad, f"not bit-equal to gloo at {world} ranks: {bad}"
        bad = [k for k, v in r["close"].items() if not v]
        assert not bad, f"not equal to gloo at {world} ranks: {bad}"
    # Every rank holds the same bits, whatever the sum order.
    for key in results[0]:
        if key.startswith("bits/"):
            assert all(r[key] == results[0][key] for r in results), key


def _made_here(before: set[str], pids: list[int]) -> list[str]:
    """What appeared in /dev/shm since ``before`` that processes ``pids`` made (their set-up
    folders are named after them): another test's ranks may come and go meanwhile."""
    now = set(os.listdir("/dev/shm")) - before
    return sorted(n for n in now if any(n.startswith(f"{shm.setup._PREFIX}{p}-") for p in pids))


def _build(rank: int, world: int, shared: bool) -> dict:
    before = set(os.listdir("/dev/shm"))
    state = ParallelState.build(world, shared_memory=shared)
    left = _made_here(before, CommGroup.world().all_gather_json(os.getpid()))
    names = state.transports()
    state.close()

    def workers() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("domino-shm")]

    threads = workers()
    # The Megatron-style API: the current state's transports stop with it.
    current = megatron_compat.initialize_model_parallel(world, shared_memory=shared)
    api = (current.transports(), len(workers()))
    megatron_compat.destroy_model_parallel()
    return {"transports": names, "left": left, "threads": threads, "api": api,
            "api_after": workers()}


def test_parallel_state_uses_it_on_one_host_and_leaves_nothing() -> None:
    on = run_distributed(_build, 2, True)
    assert all(r["transports"] == {"tp": "shm", "dp": "-"} for r in on)
    assert all(r["left"] == [] for r in on), "files left in /dev/shm"
    assert all(r["threads"] == [] for r in on), "worker threads still running after close()"
    assert all(r["api"] == ({"tp": "shm", "dp": "-"}, 1) and r["api_after"] == [] for r in on)
    off = run_distributed(_build, 2, False)
    assert all(r["transports"] == {"tp": "gloo", "dp": "-"} for r in off)


def _expert_exchange(rank: int, world: int) -> dict:
    """At EP = world the MoE layers' token all-to-alls ride the transport too: uneven splits,
    launched asynchronously back to back, as the Domino schedule launches them."""
    out = {}
    for shared in (True, False):
        state = ParallelState.build(expert_model_parallel_size=world, shared_memory=shared)
        ep = state.ep
        sends = [[1, 5, 0, 7], [3, 0, 2, 4], [6, 2, 0, 1], [0, 9, 3, 2]]  # rows q -> d
        rows = [torch.full((sends[rank][d], 3), 100.0 * rank + d) for d in range(world)]
        bufs, handles = [], []
        for k in range(2):  # two in flight at once
            flat = torch.cat(rows) + k
            buf = flat.new_empty(sum(sends[q][rank] for q in range(world)), 3)
            handles.append(ep.all_to_all(buf, flat, [sends[q][rank] for q in range(world)],
                                         sends[rank][:world], async_op=True))
            bufs.append(buf)
        for h in handles:
            h.wait()
        want = torch.cat([torch.full((sends[q][rank], 3), 100.0 * q + rank)
                          for q in range(world)])
        out[shared] = {"transports": state.transports(),
                       "right": all(torch.equal(b, want + k) for k, b in enumerate(bufs))}
        state.close()
    return out


def test_expert_parallel_exchanges_use_it() -> None:
    for r in run_distributed(_expert_exchange, 4):
        assert r[True] == {"transports": {"tp": "-", "dp": "shm", "ep": "shm"}, "right": True}
        assert r[False] == {"transports": {"tp": "-", "dp": "gloo", "ep": "gloo"},
                            "right": True}


def _refused(rank: int, world: int, how: str) -> dict:
    if how == "host" and rank == 1:
        shm.setup.host_key = lambda: "another host"  # this rank's copy of the module only
    if how == "create" and rank == 0:
        shm.setup._create = lambda size, nbytes: ""
    if how == "open" and rank == 1:
        def fail(*a, **k):
            raise RuntimeError("cannot map")
        torch.from_file = fail
    before = set(os.listdir("/dev/shm"))
    t = shm.open_transport(CommGroup.world().group, rank, world, "test")
    CommGroup.world().barrier()
    return {"none": t is None,
            "left": _made_here(before, CommGroup.world().all_gather_json(os.getpid()))}


@pytest.mark.parametrize("how", ["host", "create", "open"])
def test_every_rank_keeps_to_gloo_when_one_cannot_share(how: str) -> None:
    results = run_distributed(_refused, 2, how)
    assert all(r["none"] for r in results), results
    assert all(r["left"] == [] for r in results), results


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs root and unshare(1) for a network namespace")
def test_another_network_namespace_is_another_host() -> None:
    import inspect

    # host_key's own source run there: importing it from domino would import torch (seconds).
    code = f"import os, socket\n{inspect.getsource(shm.host_key)}\nprint(host_key())"
    here = shm.host_key() + "\n"  # this process: the test's own namespace
    there = subprocess.run(["unshare", "--net", sys.executable, "-c", code],
                           capture_output=True, text=True, check=True).stdout
    assert here.split("|")[1] == there.split("|")[1]  # same boot
    assert here != there


def _error_of(call) -> str:
    try:
        call()
        return "no error"
    except RuntimeError as e:
        return str(e)


def _report(result: dict) -> None:
    """Hand the result to the test and leave at once: the process group's peer is gone, so a
    normal shutdown would wait for it."""
    import json

    with open(os.environ["DOMINO_TEST_OUT"], "w") as f:
        json.dump(result, f)
    os._exit(0)


def _peer_exits(rank: int, world: int) -> None:
    group = CommGroup.world()
    fast = CommGroup(group.group, world, rank,
                     transport=shm.open_transport(group.group, rank, world, "tp"))
    fast.all_reduce(torch.ones(10))  # works while both are there
    if rank == 1:
        os._exit(0)  # gone without a word: its FIFOs close
    first = _error_of(lambda: fast.all_reduce(torch.ones(10)))
    second = _error_of(lambda: fast.all_reduce(torch.ones(10)))  # and every later one at once
    _report({"first": first, "second": second})


def _stalled(rank: int, world: int) -> None:
    group = CommGroup.world()
    t = shm.open_transport(group.group, rank, world, "tp")
    t._channel._timeout_s = 2.0  # the process group's timeout, shortened
    fast = CommGroup(group.group, world, rank, transport=t)
    if rank == 1:
        _alive_until(os.environ["DOMINO_TEST_OUT"], 6)  # alive, but not taking part
        os._exit(0)
    t0 = time.perf_counter()
    msg = _error_of(lambda: fast.all_reduce(torch.ones(10)))
    _report({"msg": msg, "s": time.perf_counter() - t0})


def _alive_until(path: str, at_most_s: float) -> None:
    """Stay alive until the other rank has written ``path`` (its result), at most this long."""
    deadline = time.monotonic() + at_most_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _run_failing(fn, tmp_path) -> dict:
    import json

    import torch.multiprocessing as mp
    from dist import start_ranks

    out = tmp_path / "result.json"
    os.environ["DOMINO_TEST_OUT"] = str(out)
    try:
        ctx = start_ranks(fn, 2, str(tmp_path), join=False)
        deadline = time.monotonic() + 60
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "ranks hung"
    except mp.ProcessExitedException:
        pass
    finally:
        del os.environ["DOMINO_TEST_OUT"]
    return json.loads(out.read_text())


def test_a_peer_that_exits_fails_the_others_at_once(tmp_path) -> None:
    r = _run_failing(_peer_exits, tmp_path)
    assert "rank 1 of the group left a collective (it exited" in r["first"], r
    assert "tp group" in r["first"], r
    assert "left a collective" in r["second"], r


def test_a_peer_that_stops_taking_part_fails_the_others_after_the_timeout(tmp_path) -> None:
    r = _run_failing(_stalled, tmp_path)
    assert "did not join a collective" in r["msg"] and "rank(s) 1" in r["msg"], r
    assert r["s"] > 1.5, r  # it did wait for the (shortened) timeout


def test_slot_size_is_checked() -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        shm.open_transport(None, 0, 2, slot_bytes=100)
    with pytest.raises(ValueError, match="one 8-byte element per rank"):
        shm.open_transport(None, 0, 9, slot_bytes=64)


def _peer_fails(rank: int, world: int) -> None:
    group = CommGroup.world()
    t = shm.open_transport(group.group, rank, world, "tp")
    fast = CommGroup(group.group, world, rank, transport=t)
    fast.all_reduce(torch.ones(10))
    if rank == 1:  # a failure inside rank 1's worker (a bug, a bad tensor)

        def boom() -> None:
            raise OSError("boom")

        work = t._submit(boom)
        msg = _error_of(work.wait)
        cause = repr(_cause_of(work.wait))
        # alive: rank 0 must learn of it from the closed FIFOs, not by timeout
        _alive_until(os.environ["DOMINO_TEST_OUT"] + ".0", 5)
        _report({"msg": msg, "cause": cause})
    t0 = time.perf_counter()
    msg = _error_of(lambda: fast.all_reduce(torch.ones(10)))
    with open(os.environ["DOMINO_TEST_OUT"] + ".0", "w") as f:
        import json
        json.dump({"msg": msg, "s": time.perf_counter() - t0}, f)
    os._exit(0)


def _cause_of(call):
    try:
        call()
    except RuntimeError as e:
        return e.__cause__
    return None


def test_a_failure_in_one_workers_reaches_the_others_at_once(tmp_path) -> None:
    import json

    r1 = _run_failing(_peer_fails, tmp_path)
    assert "boom" in r1["msg"] and "OSError('boom')" in r1["cause"], r1
    r0 = json.loads((tmp_path / "result.json.0").read_text())
    assert "rank 1 of the group left a collective" in r0["msg"], r0


def test_a_full_dev_shm_is_refused_at_set_up_not_mid_run() -> None:
    """The mapping's pages are reserved when it is made: a /dev/shm too small fails there (and
    removes what it made) instead of killing a rank with SIGBUS when a page is first touched."""
    before = set(os.listdir("/dev/shm"))
    assert shm.setup._create(2, 1 << 50) == ""  # 1 PiB
    assert _made_here(before, [os.getpid()]) == []


def test_set_up_folders_of_dead_processes_are_removed(tmp_path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = f"/dev/shm/{shm.setup._PREFIX}{dead}-test"
    live = f"/dev/shm/{shm.setup._PREFIX}{os.getpid()}-test"
    young = f"/dev/shm/{shm.setup._PREFIX}{dead}-young"  # a dead pid's, but set up just now
    old = time.time() - 2 * shm.setup._STALE_S
    for d in (stale, live, young):
        os.makedirs(d)
    os.utime(stale, (old, old))
    os.utime(live, (old, old))
    try:
        shm.setup._remove_stale()
        assert not os.path.exists(stale) and os.path.exists(live) and os.path.exists(young)
    finally:
        for d in (stale, live, young):
            shutil.rmtree(d, ignore_errors=True)


def _pipeline_state(rank: int, world: int) -> dict:
    state = ParallelState.build(1, 2)  # two stages: the tied word table's sum is a 2-rank group
    g = torch.full((1000,), float(rank + 1))
    state.embedding.all_reduce(g)
    out = {"transports": state.transports(), "sum": bool((g == 3.0).all())}
    # A group listed out of order (as expert-DP x TP lists are): its rank is torch's, which
    # places each rank's chunk of a gather.
    from domino.parallel_state import group_among

    rev = group_among([[1, 0]], state.device)
    full = torch.empty(2)
    rev.all_gather_into(full, torch.tensor([float(rank)]))
    out["rank"] = (rev.rank == dist.get_group_rank(rev.group, rank), float(full[rev.rank]))
    state.close()
    return out


def test_the_tied_embedding_group_of_a_pipeline_uses_it() -> None:
    for rank, r in enumerate(run_distributed(_pipeline_state, 2)):
        assert r == {"transports": {"tp": "-", "dp": "-", "embedding": "shm"}, "sum": True,
                     "rank": (True, float(rank))}
