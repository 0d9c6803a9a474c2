"""Sequence parallelism under Domino: at TP=2 and TP=4 with real collectives, a sequence-parallel
model gives the losses, outputs and gradients of the same model without it (which the TP tests
hold to the single-process reference), for GPT (every position, norm, activation and output
variant), an encoder-decoder with a pooler, under sync and Domino plans with column chunks,
with dropout (the same masks: each rank takes its rows of the whole sequence's), with full and
selective recomputation, and over accumulated backwards."""

from __future__ import annotations

import pytest
import torch
from tp_helpers import FLOOR, config, one_thread, register, rel_err, tp_results

from domino import AttnMaskType, ParallelState, TransformerConfig
from domino.gpt_model import GPTModel
from domino.language_model import get_language_model
from domino.tensor_parallel import CommGroup
from domino.transformer import DominoTransformer, Plan

TOL = 2e-5  # fp32; the shards' norm and bias gradients are summed in another order
PLANS = [Plan(1, "none", 1), Plan(2, "cross_layer", 1), Plan(3, "intra_layer", 2),
         Plan(4, "cross_layer", 2), Plan(2, "none", 1)]
GPT_VARIANTS = {
    "learned_gelu_dropout": dict(hidden_dropout=0.2, attention_dropout=0.2),
    # Qwen2's Q/K/V-only bias, Qwen3's query/key norms and Mistral's sliding window (3 keys).
    "rope_swiglu_gqa_rms_qkvbias_qknorm_window": dict(
        position_embedding_type="rope", activation="swiglu", num_attention_heads=8,
        num_query_groups=4, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=True,
        qk_layernorm=True, window_size=3, hidden_dropout=0.1),
    "post_ln_untied_tokentypes": dict(apply_residual_connection_post_layernorm=True,
                                      untie_embeddings_and_output_weights=True),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _gpt_run(state, over: dict, plan: Plan, sp: bool, recompute=None, tokentypes=False):
    over = {"num_attention_heads": 4, **over}
    cfg = config(hidden_size=32, vocab_size=64, seq_length=8, sequence_parallel=sp,
                 recompute_granularity=recompute, **over)
    torch.manual_seed(0)
    state.rng.seed(3)
    model = GPTModel(cfg, num_tokentypes=3 if tokentypes else 0, parallel_state=state,
                     plan=plan)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 9), generator=gen)
    types = torch.randint(0, 3, (4, 8), generator=gen) if tokentypes else None
    losses = []
    for _ in range(2):  # accumulated: each pass's shard sums join .grad once
        loss = model(ids[:, :-1], None, None, labels=ids[:, 1:], tokentype_ids=types)
        loss.sum().backward()
        losses.append(loss.detach())
    model.eval()
    with torch.no_grad():
        logits = model(ids[:, :-1], None, None, tokentype_ids=types)
    return losses, logits, _grads(model)


def _encdec_run(state, plan: Plan, sp: bool, recompute=None):
    cfg = config(hidden_size=32, num_attention_heads=4, vocab_size=64, decoder_num_layers=2,
                 seq_length=8, hidden_dropout=0.1, attention_dropout=0.1,
                 sequence_parallel=sp, recompute_granularity=recompute)
    torch.manual_seed(0)
    state.rng.seed(4)
    model, _ = get_language_model(cfg, 0, True, AttnMaskType.padding, add_decoder=True,
                                  parallel_state=state, plan=plan)
    gen = torch.Generator().manual_seed(2)
    enc = torch.randint(0, 64, (4, 8), generator=gen)
    dec = torch.randint(0, 64, (4, 4), generator=gen)
    weights = torch.randn(8, 4, 32, generator=gen)
    tp = state.tp
    rows = slice(None) if not sp or tp.size == 1 else slice(
        tp.rank * 8 // tp.size, (tp.rank + 1) * 8 // tp.size)
    drows = slice(None) if not sp or tp.size == 1 else slice(
        tp.rank * 4 // tp.size, (tp.rank + 1) * 4 // tp.size)
    d, e, pooled = model(enc, None, None, dec, None, None)
    # Each rank's part of the loss (under SP the outputs are its sequence shards).
    loss = (d * weights[:4][drows]).sum() + (e * weights[rows]).sum()
    (loss + pooled.square().sum()).backward()
    if sp and tp.size > 1:  # gather the shards to compare with the unsharded run
        d, e = tp.all_gather_seq(d.detach())[0], tp.all_gather_seq(e.detach())[0]
        loss = loss.detach().clone()
        tp.all_reduce(loss)
    return [loss.detach()], (d.detach(), e.detach(), pooled.detach()), _grads(model)


def _compare(got, ref, loss_tol: float = TOL) -> list[str]:
    bad = []
    for i, (a, b) in enumerate(zip(got[0], ref[0], strict=True)):
        if rel_err(a, b) > loss_tol:
            bad.append(f"loss[{i}] {rel_err(a, b):.2e}")
    outs_a = got[1] if isinstance(got[1], tuple) else (got[1],)
    outs_b = ref[1] if isinstance(ref[1], tuple) else (ref[1],)
    for i, (a, b) in enumerate(zip(outs_a, outs_b, strict=True)):
        if rel_err(a, b) > TOL:
            bad.append(f"output[{i}] {rel_err(a, b):.2e}")
    if set(got[2]) != set(ref[2]):
        bad.append(f"gradients of {sorted(set(got[2]) ^ set(ref[2]))}")
    for name in ref[2]:
        if name in got[2] and rel_err(got[2][name], ref[2][name], FLOOR) > TOL:
            bad.append(f"grad {name} {rel_err(got[2][name], ref[2][name], FLOOR):.2e}")
    return bad


def _sp_checks(state: ParallelState) -> dict:
    out = {}
    # The runs without sequence parallelism each comparison is against: a run is a function of
    # its arguments (seeded), so one that two comparisons share runs once.
    refs: dict = {}

    def gpt_ref(name: str, plan: Plan, types: bool = False):
        if (name, str(plan)) not in refs:
            refs[name, str(plan)] = _gpt_run(state, GPT_VARIANTS[name], plan, False,
                                             tokentypes=types)
        return refs[name, str(plan)]

    def encdec_ref(plan: Plan):
        if ("encdec", str(plan)) not in refs:
            refs["encdec", str(plan)] = _encdec_run(state, plan, False)
        return refs["encdec", str(plan)]

    for name, over in GPT_VARIANTS.items():
        types = name.endswith("tokentypes")
        for plan in PLANS:
            ref = gpt_ref(name, plan, types)
            out[("gpt", name, str(plan), None)] = _compare(
                _gpt_run(state, over, plan, True, tokentypes=types), ref)
    over = GPT_VARIANTS["learned_gelu_dropout"]
    for recompute in ("full", "selective"):
        for plan in (Plan(1, "none", 1), Plan(2, "cross_layer", 2)):
            ref = gpt_ref("learned_gelu_dropout", plan)
            out[("gpt", "recompute", str(plan), recompute)] = _compare(
                _gpt_run(state, over, plan, True, recompute), ref)
    for plan in (Plan(1, "none", 1), Plan(2, "cross_layer", 1), Plan(4, "intra_layer", 2)):
        ref = encdec_ref(plan)
        # (Its loss sums random-signed products: cancellation magnifies the order's rounding;
        # the outputs themselves are held to TOL.)
        out[("encdec", "pooler", str(plan), None)] = _compare(_encdec_run(state, plan, True), ref,
                                                              loss_tol=1e-4)
    ref = encdec_ref(Plan(2, "cross_layer", 1))
    out[("encdec", "pooler", "m2:cross", "full")] = _compare(
        _encdec_run(state, Plan(2, "cross_layer", 1), True, "full"), ref, loss_tol=1e-4)
    return out


def _collective_checks(state: ParallelState) -> dict:
    """The sequence collectives (gloo: reduce-scatter as pairwise exchanges), several in
    flight at once, against what they must compute: integer-valued floats, so sums are exact."""
    tp = state.tp
    gen = torch.Generator().manual_seed(5)
    full = [torch.randint(-50, 50, (8, 3, 5), generator=gen).float() for _ in range(tp.size)]
    mine = full[tp.rank]
    launched = [tp.reduce_scatter_seq(mine * (k + 1), async_op=True) for k in range(3)]
    gathered, handle = tp.all_gather_seq(mine.chunk(tp.size)[tp.rank], async_op=True)
    out = {}
    total = sum(full)
    for k, (shard, h) in enumerate(launched):
        h.wait()
        out[f"rs{k}"] = torch.equal(shard, (total * (k + 1)).chunk(tp.size)[tp.rank])
    handle.wait()
    out["ag"] = torch.equal(gathered, torch.cat([f.chunk(tp.size)[r] for r, f in enumerate(full)]))
    return out


class _LaunchOrder:
    """A CommHook recording every TP collective's launch and moving it over a simulated link
    whose speed depends on the rank (rank 0's instant, rank 1's slow; tensors are left as a
    disabled group leaves them): a schedule that picked places by which collectives had
    finished would launch in a different order on each rank - a deadlock or wrong sums on a
    real run."""

    def __init__(self, rank: int) -> None:
        from domino.bench.hooks import BenchHook, SimulatedLink

        self.launched = []
        self.inner = BenchHook(link=SimulatedLink(1e15 if rank == 0 else 2e6))

    def launch(self, tensor, group, kind="all_reduce"):
        self.launched.append((kind, tuple(tensor.shape)))
        return self.inner.launch(tensor, group, kind)

    def finished(self, *args) -> None:
        pass

    def region(self, name: str, category: str, **tags):
        return self.inner.region(name, category, **tags)


def _launch_order_checks(state: ParallelState) -> dict:
    out = {}
    for plan in (Plan(2, "cross_layer", 1), Plan(4, "cross_layer", 2), Plan(3, "intra_layer", 1)):
        cfg = config(hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                     max_position_embeddings=16, sequence_parallel=True, hidden_dropout=0.1)
        torch.manual_seed(0)
        model = GPTModel(cfg, parallel_state=state, plan=plan)
        ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
        state.tp.hook = hook = _LaunchOrder(state.tp.rank)
        try:
            model(ids[:, :-1], None, None, labels=ids[:, 1:]).sum().backward()
        finally:
            state.tp.hook = None
        out[str(plan)] = hook.launched
    return out


register(2, _sp_checks)
register(4, _sp_checks)
register(2, _launch_order_checks)


def test_every_rank_launches_the_same_collectives_in_the_same_order() -> None:
    ranks = tp_results(2, _launch_order_checks)
    for plan, launched in ranks[0].items():
        assert len(launched) > 20, plan
        assert launched == ranks[1][plan], plan
register(2, _collective_checks)
register(4, _collective_checks)


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_collectives(world: int) -> None:
    for rank, res in enumerate(tp_results(world, _collective_checks)):
        assert all(res.values()), (rank, res)


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_equals_tp(world: int) -> None:
    for rank, res in enumerate(tp_results(world, _sp_checks)):
        bad = {k: v for k, v in res.items() if v}
        assert not bad, f"TP={world} rank {rank}: {bad}"


def test_sequence_parallel_shards_activations() -> None:
    """The stack's input, output and every tensor between its TP regions is the rank's
    sequence shard: [s/tp, b, h] (one rank of TP=2, collectives disabled)."""
    state = ParallelState(tp=CommGroup(size=2, rank=1, enabled=False))
    cfg = config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                 sequence_parallel=True)
    stack = DominoTransformer(cfg, state, self_attn_mask_type=AttnMaskType.causal,
                              plan=Plan(2, "cross_layer", 1))
    seen = []
    local = stack.kernels.local

    def spy(*args):  # every local piece: its norm output and the residual stream
        ln, res = local(*args)
        seen.append((tuple(ln.shape), tuple(res.shape)))
        return ln, res

    object.__setattr__(stack.kernels, "local", spy)
    y = stack(torch.randn(8, 4, 32, requires_grad=True), None)
    assert y.shape == (8, 4, 32)
    # Four blocks and the final norm x two micro-batches, each [s/2, b/2, h].
    assert seen == [((8, 2, 32), (8, 2, 32))] * 10
    y.sum().backward()


def test_sequence_parallel_validation() -> None:
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=10,
                            sequence_parallel=True)
    with pytest.raises(ValueError, match="seq_length=10 is not divisible by 4"):
        cfg.runtime().check(cfg, 4)  # the run-time config's check (the model's is SP-free)
    cfg.runtime().check(cfg, 2)
    state = ParallelState(tp=CommGroup(size=2, rank=0, enabled=False))
    model = GPTModel(config(hidden_size=32, num_attention_heads=4, vocab_size=64,
                            sequence_parallel=True), parallel_state=state)
    with pytest.raises(ValueError, match="sequence of 7 tokens is not divisible by 2"):
        model(torch.zeros(2, 7, dtype=torch.long), None, None)


def _kept_by_piece(sp: bool, tp: int) -> dict[str, int]:
    from domino.memory import kept_by_piece

    state = ParallelState(tp=CommGroup(size=tp, rank=1, enabled=False))
    cfg = config(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=64,
                 seq_length=32, max_position_embeddings=32, hidden_dropout=0.1,
                 attention_dropout=0.1, sequence_parallel=sp)
    torch.manual_seed(0)
    model = GPTModel(cfg, parallel_state=state, plan=Plan(2, "cross_layer", 1))
    ids = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(0))
    out = []
    kept = kept_by_piece(state.tp, model.parameters(), lambda: out.append(
        model(ids[:, :-1], None, None, labels=ids[:, 1:]).sum()))
    out[0].backward()
    return kept


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_divides_local_activations_by_tp(tp: int) -> None:
    """What backward keeps from the local pieces (norm inputs and statistics, dropout masks,
    the embedding's sums and mask) is 1/TP of it without sequence parallelism: every such
    tensor is the rank's sequence shard (and none is a view keeping the whole alive)."""
    plain, sp = _kept_by_piece(False, tp), _kept_by_piece(True, tp)
    assert plain["local"] > 0
    assert sp["local"] * tp == plain["local"], (plain, sp)
    assert sp["par"] <= plain["par"]  # the TP regions compute on the whole sequence either way


def test_sp_memory_script_prints_the_halved_local_part(monkeypatch, capsys) -> None:
    import importlib.util
    import sys
    from pathlib import Path

    # The script's main() in this process (a fresh interpreter would import torch again).
    path = Path(__file__).resolve().parents[1] / "scripts" / "sp_memory.py"
    spec = importlib.util.spec_from_file_location("sp_memory_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", [str(path), "--hidden-size", "128",
                                      "--num-attention-heads", "4", "--num-layers", "1",
                                      "--seq-length", "256", "--vocab-size", "128",
                                      "--micro-batch-size", "4"])
    script.main()
    out = capsys.readouterr().out
    rows = {line[:28].strip(): [float(v) for v in line[28:].split()]
            for line in out.splitlines() if line.startswith(("SP", "no SP"))}
    for recompute in ("none", "selective"):
        plain, sp = rows[f"no SP, recompute {recompute}"], rows[f"SP, recompute {recompute}"]
        assert sp[0] == pytest.approx(plain[0] / 2, abs=0.051)  # local: half, at TP=2
        assert sp[1] == plain[1]  # par: the TP regions see the whole sequence


def test_a_whole_sequence_given_as_a_shard_is_refused() -> None:
    state = ParallelState(tp=CommGroup(size=2, rank=0, enabled=False))
    cfg = config(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8,
                 sequence_parallel=True)
    stack = DominoTransformer(cfg, state, plan=Plan(1, "none", 1))
    mask = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    stack(torch.randn(4, 2, 32), mask)  # the shard: 4 of 8 positions
    with pytest.raises(ValueError, match="attention_mask must cover 16 positions"):
        stack(torch.randn(8, 2, 32), mask)  # the whole sequence passed as if a shard
