"""Domino schedules must equal sync TP.

For TP = 2 and 4 (one spawn each), on the same weights, every plan in the matrix
micro-batches {1, 2, 3, 4} (batch 5: uneven splits) x overlap {none, intra_layer, cross_layer}
x column chunks {1, 2} (plus 3 uneven chunks) is compared with sync TP, Plan(1, "none", 1):
outputs, loss and every parameter gradient, for a GPT model (causal + padding mask) and for an
encoder-decoder model with padding masks. Every plan's eval-mode and no-grad forwards must equal
the training forward with dropout 0. The TP=2 spawn also checks the dropout RNG streams inside
the model, too-many-micro-batches errors and KV-cache decoding with micro-batches.
"""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch
from tp_helpers import (
    config,
    copy_weights,
    failures,
    grads_vs,
    one_thread,
    perturb,
    register,
    rel_err,
    snapshot_grads,
    tp_results,
)

import domino.transformer.attention as attention_module
import domino.transformer.layer as layer_module
from domino import AttnMaskType, ParallelState
from domino.gpt_model import GPTModel
from domino.language_model import get_language_model
from domino.tensor_parallel import ColumnParallelLinear, CommGroup
from domino.transformer import InferenceParams, Plan, split_batch

SYNC = Plan(1, "none", 1)
PLANS = [Plan(m, o, c) for m, o, c in itertools.product(
    (1, 2, 3, 4), ("none", "intra_layer", "cross_layer"), (1, 2))] + [Plan(3, "cross_layer", 3)]
PLAN_IDS = [f"m{p.micro_batches}-{p.overlap}-c{p.column_chunks}" for p in PLANS]
B, S, SE, SD, V = 5, 8, 8, 6, 100


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def key_padding(lengths, sq: int, sk: int) -> torch.Tensor:
    keys = torch.arange(sk).view(1, 1, 1, sk)
    return (keys >= torch.tensor(lengths).view(-1, 1, 1, 1)).expand(len(lengths), 1, sq, sk)


# ---- model families: build (with a dropout twin for eval checks), set plan, run -----------------

class _GPT:
    loss_gives_outputs = False  # its loss pass returns the per-token loss, not the logits
    over = dict(hidden_size=32, num_attention_heads=8, num_query_groups=4, activation="swiglu",
                position_embedding_type="rope")

    def __init__(self, state: ParallelState) -> None:
        cfg = config(**self.over)
        torch.manual_seed(0)
        ref = GPTModel(cfg, parallel_state=ParallelState.single())
        perturb(ref, seed=1, vocab=V)
        self.model = GPTModel(cfg, parallel_state=state)
        copy_weights(self.model, ref, state.tp, V)
        self.dropped = GPTModel(config(**self.over, hidden_dropout=0.3, attention_dropout=0.3),
                                parallel_state=state)
        self.dropped.load_state_dict(self.model.state_dict())
        gen = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, V, (B, S), generator=gen)
        self.labels = torch.randint(0, V, (B, S), generator=gen)
        self.wts = torch.rand(B, S, generator=gen)
        self.mask = key_padding((8, 6, 8, 3, 7), S, S)

    def set_plan(self, plan: Plan) -> None:
        for m in (self.model, self.dropped):
            m.language_model.encoder.set_plan(plan)

    def outputs(self, model) -> list[torch.Tensor]:
        return [model(self.ids, None, self.mask)]  # logits [b, s, v/tp]

    def loss(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Backward of a weighted loss; returns (loss, outputs): the per-token loss [b, s]."""
        loss = self.model(self.ids, None, self.mask, labels=self.labels)
        (loss * self.wts).sum().backward()
        return loss.detach(), [loss.detach()]


class _EncDec:
    loss_gives_outputs = True  # its loss pass returns the training-mode outputs themselves
    over = dict(hidden_size=32, num_attention_heads=4, decoder_num_layers=2)

    def __init__(self, state: ParallelState) -> None:
        cfg = config(**self.over)
        torch.manual_seed(0)

        def build(c, st):
            return get_language_model(c, 0, True, AttnMaskType.padding, add_decoder=True,
                                      parallel_state=st)[0]

        ref = build(cfg, ParallelState.single())
        perturb(ref, seed=1, vocab=V)
        self.model = build(cfg, state)
        copy_weights(self.model, ref, state.tp, V)
        self.dropped = build(config(**self.over, hidden_dropout=0.3, attention_dropout=0.3), state)
        self.dropped.load_state_dict(self.model.state_dict())
        gen = torch.Generator().manual_seed(3)
        self.enc = torch.randint(0, V, (B, SE), generator=gen)
        self.dec = torch.randint(0, V, (B, SD), generator=gen)
        enc_len, dec_len = (8, 5, 3, 8, 6), (6, 4, 2, 1, 5)
        self.masks = (key_padding(enc_len, SE, SE), key_padding(dec_len, SD, SD),
                      key_padding(enc_len, SD, SE))
        self.up = (torch.randn(SD, B, 32, generator=gen), torch.randn(SE, B, 32, generator=gen),
                   torch.randn(B, 32, generator=gen))

    def set_plan(self, plan: Plan) -> None:
        for m in (self.model, self.dropped):
            m.encoder.set_plan(plan)
            m.decoder.set_plan(plan)

    def outputs(self, model) -> list[torch.Tensor]:
        m_enc, m_dec, m_ed = self.masks
        return list(model(self.enc, None, m_enc, self.dec, None, m_dec, m_ed))

    def loss(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Backward of a weighted sum of (decoder, encoder, pooled) outputs."""
        outs = self.outputs(self.model)
        total = sum((o * u).sum() for o, u in zip(outs, self.up, strict=True))
        total.backward()
        return total.detach().reshape(1), [o.detach() for o in outs]


def _matrix(family, eval_checks: bool) -> dict:
    """Per plan: errors of outputs / loss / gradients vs sync and (``eval_checks``) of the
    eval-mode and no-grad forwards vs the sync training forward."""
    model, dropped = family.model, family.dropped
    family.set_plan(SYNC)
    model.zero_grad(set_to_none=True)
    ref_loss, ref_outs = family.loss()
    ref_grads = snapshot_grads(model)
    if eval_checks:  # the model's outputs (GPT: logits) in training mode, with a graph
        ref_logits = ref_outs if family.loss_gives_outputs else \
            [o.detach() for o in family.outputs(model)]
    res = {}
    for plan in PLANS:
        family.set_plan(plan)
        model.zero_grad(set_to_none=True)
        loss, outs = family.loss()
        errs = {"loss": rel_err(loss, ref_loss)}
        errs.update({f"out{i}": rel_err(o, r) for i, (o, r) in enumerate(zip(outs, ref_outs))})
        res[plan] = {"scalars": errs, "grads": grads_vs(model, ref_grads), "modes": {}}
        if not eval_checks:
            continue
        # (The encoder-decoder's loss pass ran exactly this forward: its outputs are reused.)
        modes = {"train_grad": outs if family.loss_gives_outputs else family.outputs(model)}
        with torch.no_grad():
            modes["train_no_grad"] = family.outputs(model)
            dropped.eval()
            modes["eval_no_grad"] = family.outputs(dropped)
        modes["eval_grad"] = family.outputs(dropped)
        dropped.train()
        for mode, got in modes.items():
            res[plan]["modes"].update(
                {f"{mode}{i}": rel_err(o, r) for i, (o, r) in enumerate(zip(got, ref_logits))})
    return res


# ---- TP=2 extras --------------------------------------------------------------------------------

def _too_many_micro_batches(state: ParallelState) -> dict:
    fam = _GPT(state)
    fam.set_plan(Plan(4, "cross_layer", 1))
    ids = fam.ids[:3]
    try:
        fam.model(ids, None, None)
        return {"raised": False, "message": ""}
    except ValueError as exc:
        return {"raised": True, "message": str(exc)}


def _dropout_masks(state: ParallelState) -> dict:
    """Record every dropout mask the model draws (by wrapping the modules' mask helpers)."""
    recorded: dict[str, list[torch.Tensor]] = {"attention": [], "hidden": []}
    cfg_over = dict(_GPT.over, hidden_dropout=0.2, attention_dropout=0.2)

    def recorder(kind, original):
        def wrapped(*args):
            keep = original(*args)
            if keep is not None:
                recorded[kind].append((keep != 0).detach().clone())
            return keep
        return wrapped

    orig_attn, orig_layer = attention_module.attention_keep, layer_module.dropout_mask
    attention_module.attention_keep = recorder("attention", orig_attn)
    layer_module.dropout_mask = recorder("hidden", orig_layer)
    res = {}
    try:
        torch.manual_seed(0)
        model = GPTModel(config(**cfg_over), parallel_state=state, parallel_output=False)
        ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(4))
        cpu = torch.device("cpu")
        for plan in (SYNC, Plan(2, "cross_layer", 2)):
            model.language_model.encoder.set_plan(plan)
            for kind in recorded:
                recorded[kind].clear()
            rep0 = state.rng.replicated(cpu).get_state().clone()
            mp0 = state.rng.model_parallel(cpu).get_state().clone()
            hidden = model.language_model(ids, None, None)
            logits = model(ids, None, None)
            logits.sum().backward()
            name = f"m{plan.micro_batches}"
            res[name] = {
                "attention_masks": [m.clone() for m in recorded["attention"]],
                "hidden_masks": [m.clone() for m in recorded["hidden"]],
                "hidden": hidden.detach(), "logits": logits.detach(),
                "replicated_advanced": not torch.equal(rep0, state.rng.replicated(cpu).get_state()),
                "mp_advanced": not torch.equal(mp0, state.rng.model_parallel(cpu).get_state()),
                "replicated_state": state.rng.replicated(cpu).get_state().clone(),
            }
            with torch.no_grad():
                model.eval()
                res[name]["eval_logits"] = model(ids, None, None)
                model.train()
    finally:
        attention_module.attention_keep, layer_module.dropout_mask = orig_attn, orig_layer
    return res


def _decode_micro_batches(state: ParallelState) -> dict:
    res = {}
    fam = _GPT(state)
    model = fam.model
    for batch, plan in ((4, Plan(2, "cross_layer", 2)), (3, Plan(4, "intra_layer", 1)),
                        (4, Plan(3, "none", 1))):
        ids = fam.ids[:batch]
        fam.set_plan(SYNC)
        with torch.no_grad():
            full = model(ids, None, None)
        fam.set_plan(plan)
        params = InferenceParams(max_batch_size=batch, max_sequence_length=S)
        outs = []
        with torch.no_grad():
            outs.append(model(ids[:, :2], None, None, inference_params=params))
            params.sequence_len_offset = 2
            for t in range(2, S):
                outs.append(model(ids[:, t:t + 1], None, None, inference_params=params))
                params.sequence_len_offset += 1
        res[f"b{batch}-m{plan.micro_batches}"] = rel_err(torch.cat(outs, dim=1), full)
    return res


def _schedules_checks(state: ParallelState) -> dict:
    world = state.tp.size
    # eval / no-grad forwards of every plan at TP=2 only: they share code with TP=4 and the
    # TP=4 spawn is the slow one (4 processes on 2 cores)
    res = {"gpt": _matrix(_GPT(state), world == 2), "encdec": _matrix(_EncDec(state), world == 2)}
    if world == 2:
        res["too_many"] = _too_many_micro_batches(state)
        res["dropout"] = _dropout_masks(state)
        res["decode"] = _decode_micro_batches(state)
    return res


register(2, _schedules_checks)
register(4, _schedules_checks)


def _results(tp: int) -> list:
    return tp_results(tp, _schedules_checks)


# ---- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gpt", "encdec"])
@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
@pytest.mark.parametrize("tp", [2, 4])
def test_domino_schedule_matches_sync(tp, plan, family) -> None:
    for rank, res in enumerate(_results(tp)):
        errs = res[family][plan]
        assert not failures(errs["scalars"]), f"TP={tp} rank {rank}: {failures(errs['scalars'])}"
        bad = failures(errs["grads"])
        assert not bad, f"TP={tp} rank {rank} gradients: {bad}"


@pytest.mark.parametrize("family", ["gpt", "encdec"])
def test_eval_and_no_grad_match_training_forward_tp2(family) -> None:
    for rank, res in enumerate(_results(2)):
        for plan in PLANS:
            modes = res[family][plan]["modes"]
            assert len(modes) >= 4 and not failures(modes), \
                f"rank {rank} {plan}: {failures(modes)}"


def test_too_many_micro_batches_raises_tp2() -> None:
    for res in _results(2):
        info = res["too_many"]
        assert info["raised"], info
        assert "domino_micro_batches=4" in info["message"] and "3" in info["message"], info


def test_split_batch_errors_and_sizes() -> None:
    with pytest.raises(ValueError) as exc:
        split_batch(3, 4)
    assert "4" in str(exc.value) and "3" in str(exc.value)
    assert split_batch(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert split_batch(5, 1) == [(0, 5)]
    assert split_batch(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_dropout_masks_replicated_vs_model_parallel_tp2() -> None:
    r0, r1 = (res["dropout"] for res in _results(2))
    for name in r0:
        a, b = r0[name], r1[name]
        assert a["hidden_masks"] and a["attention_masks"], name
        # hidden dropout (embedding + after each reduced branch): identical masks on TP ranks
        assert len(a["hidden_masks"]) == len(b["hidden_masks"])
        assert all(torch.equal(x, y) for x, y in zip(a["hidden_masks"], b["hidden_masks"]))
        # attention dropout runs on each rank's own heads: masks must differ
        assert len(a["attention_masks"]) == len(b["attention_masks"])
        assert not any(torch.equal(x, y) for x, y in zip(a["attention_masks"],
                                                         b["attention_masks"]))
        assert a["replicated_advanced"] and a["mp_advanced"]
        assert torch.equal(a["replicated_state"], b["replicated_state"])
        # so the replicated activations (and the gathered logits) agree across TP ranks
        assert torch.equal(a["hidden"], b["hidden"]) and torch.equal(a["logits"], b["logits"])
        assert rel_err(a["logits"], a["eval_logits"]) > 1e-3  # dropout was really on


def test_kv_cache_decoding_with_micro_batches_tp2() -> None:
    for rank, res in enumerate(_results(2)):
        assert not failures(res["decode"]), (rank, res["decode"])


def test_no_grad_forward_caps_micro_batches_to_the_batch() -> None:
    """Inference on fewer samples than micro-batches works (the split only changes speed)."""
    from domino import TransformerConfig
    from domino.gpt_model import GPTModel

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                            seq_length=8, max_position_embeddings=8, hidden_dropout=0.0,
                            attention_dropout=0.0, domino_micro_batches=4)
    # Half of a TP=2 model with its collectives off: the schedule splits (at TP=1 it would not).
    state = ParallelState(tp=CommGroup(size=2, rank=0, enabled=False))
    model = GPTModel(cfg, parallel_state=state)
    assert model.language_model.encoder.effective_plan().micro_batches == 4
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        split = model(ids, None, None)
        model.language_model.encoder.set_plan(Plan(1, "none", 1))
        whole = model(ids, None, None)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)
    model.language_model.encoder.set_plan(Plan(4, "cross_layer", 1))
    with pytest.raises(ValueError, match="domino_micro_batches=4"):
        model(ids, None, None, labels=ids)


def test_single_tp_rank_runs_unsplit() -> None:
    """With one TP rank there is nothing to hide: the stack runs unsplit, whatever the plan, but
    a plan that does not fit the batch is still rejected (as it would be at TP=2)."""
    from domino import TransformerConfig
    from domino.transformer import DominoTransformer

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            domino_micro_batches=3, domino_column_chunks=2)
    stack = DominoTransformer(cfg, ParallelState.single())
    assert stack.plan == Plan(3, "cross_layer", 2)
    assert stack.effective_plan() == Plan(1, "none", 1)
    with pytest.raises(ValueError, match="domino_micro_batches=3"):
        stack(torch.randn(4, 2, 32), None)
    assert stack(torch.randn(4, 3, 32), None).shape == (4, 3, 32)


@pytest.mark.parametrize(("comm", "splits"), [("p2p", True), ("all_gather", False)])
def test_single_tp_rank_splits_for_the_cp_ring(comm, splits) -> None:
    """At one TP rank, ring context parallelism has transfers to hide under the other
    micro-batches (each one's first K/V exchange goes out at its Q/K/V GEMM): the plan runs as
    given. All-gather CP hides nothing by splitting: unsplit."""
    from domino import TransformerConfig
    from domino.runtime import RuntimeConfig
    from domino.transformer import DominoTransformer

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            attention_dropout=0.0)
    cp = CommGroup(size=2, rank=0, enabled=False)
    state = ParallelState(cp=cp, dp_cp=cp)
    plan = Plan(2, "cross_layer", 1)
    stack = DominoTransformer(cfg, state, runtime=RuntimeConfig(plan=plan, cp_comm_type=comm))
    assert stack.effective_plan() == (plan if splits else Plan(1, "none", 1))


@pytest.mark.parametrize(("args", "field"), [((0, "cross_layer", 1), "micro_batches"),
                                              ((2, "cross", 1), "overlap"),
                                              ((2, "none", 0), "column_chunks")])
def test_plan_rejects_bad_values(args, field) -> None:
    with pytest.raises(ValueError, match=f"Plan.{field}"):
        Plan(*args)


def test_config_rejects_more_column_chunks_than_columns() -> None:
    from domino import TransformerConfig

    with pytest.raises(ValueError, match="domino_column_chunks=9"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                          domino_column_chunks=9)


@pytest.mark.parametrize(("plan", "tail_chunks"), [(Plan(2, "cross_layer", 1), 2),
                                                    (Plan(3, "intra_layer", 1), 2),
                                                    (Plan(2, "cross_layer", 3), 3),
                                                    (Plan(1, "none", 1), 1),
                                                    (Plan(2, "none", 1), 1)])
def test_forward_tail_piece_is_column_chunked(plan: Plan, tail_chunks: int) -> None:
    """The forward's last piece has nothing left to hide its all-reduce under: it is split in at
    least two column chunks so the first chunk's all-reduce runs under the second's GEMM."""
    from domino import TransformerConfig
    from domino.bench.hooks import BenchHook, SimulatedLink
    from domino.bench.timeline import Timeline
    from domino.transformer import DominoTransformer

    # Half of a TP=2 stack whose all-reduces go to an instant simulated link (no process group).
    tl = Timeline(0)
    state = ParallelState(tp=CommGroup(size=2, rank=0,
                                       hook=BenchHook(timeline=tl, link=SimulatedLink(1e15))))
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            hidden_dropout=0.0, attention_dropout=0.0)
    stack = DominoTransformer(cfg, state)
    stack.set_plan(plan)
    with torch.no_grad():
        stack(torch.randn(4, 6, 32), None)
    chunks: dict[tuple[int, int], int] = {}
    for span in tl.by_category("comm"):
        key = (span.args["block"], span.args["mb"])
        chunks[key] = max(chunks.get(key, 0), span.args["chunk"] + 1)
    last = (3, plan.micro_batches - 1)  # 2 layers = 4 blocks
    assert chunks.pop(last) == tail_chunks
    assert set(chunks.values()) == {plan.column_chunks}


@pytest.mark.parametrize("family", [_GPT, _EncDec], ids=["gpt", "encdec"])
@pytest.mark.parametrize("plan", [Plan(1, "none", 1), Plan(2, "cross_layer", 1),
                                  Plan(3, "intra_layer", 2)], ids=["m1", "m2-cross", "m3-intra-c2"])
def test_backward_leaves_plain_gradients(family, plan: Plan) -> None:
    """Parameter gradients are plain tensors with no autograd history, step after step.

    The schedule runs deferred weight-gradient GEMMs between its explicit backward calls, on
    inputs that require grad; were that recorded (its backward under grad mode), ``param.grad``
    would chain every micro-batch's activations into its graph and keep them alive until the
    grads are reset."""
    # Half of a TP=2 model with its collectives off: the schedule splits as it would at TP=2.
    fam = family(ParallelState(tp=CommGroup(size=2, rank=0, enabled=False)))
    fam.set_plan(plan)
    # Watch the inputs of the first column-parallel entry: its weight-gradient GEMM uses them.
    entry = next(m for m in fam.model.modules() if isinstance(m, ColumnParallelLinear))
    inputs: list = []
    hook = entry.register_forward_pre_hook(lambda _m, args: inputs.append(weakref.ref(args[0])))
    fam.loss()
    hook.remove()
    first = {name: p.grad.clone() for name, p in fam.model.named_parameters()}
    fam.loss()  # second step accumulates into the same .grad tensors
    gc.collect()
    for name, p in fam.model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.grad_fn is None and not p.grad.requires_grad, (name, p.grad.grad_fn)
        scale = first[name].abs().max().item()
        torch.testing.assert_close(p.grad, 2 * first[name], rtol=1e-5, atol=1e-6 * scale,
                                   msg=name)
    assert inputs and all(ref() is None for ref in inputs), "step 1's activations are still alive"
