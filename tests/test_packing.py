"""--pack-documents: whole documents packed into samples, each attending only to itself.

The packer (no model): every document of an epoch lands whole in exactly one sample, greedy in
order; the efficiency is real tokens / slots; padding and each document's last token count
nothing; a document longer than a sample and the EOD flags beside packing are refused. The
model: each packed document's per-token losses and the summed gradients of the masked loss
equal running every document alone, unpadded, in a single-process model (learned positions +
GELU, and RoPE + SwiGLU + GQA), at TP=1 in-process and, in the session's shared 2-rank spawn,
at TP=2 with sequence parallelism and a Domino plan and at CP=2 (document ids in a
SequenceMask), with the batches made by the trainer's own ``state_batches``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tp_helpers import (
    config,
    copy_weights,
    expected_local,
    one_thread,
    perturb,
    rel_err,
    tp_results,
)

from domino import ParallelState
from domino.data import ByteTokenizer
from domino.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from domino.data.loss_mask import loss_mask_prefix
from domino.data.packed import PackedDataset, build_packed_sample, packing_text
from domino.gpt_model import GPTModel
from domino.parallel_state import ParallelSizes
from domino.runtime import RuntimeConfig
from domino.training.arguments import TrainArgs
from domino.training.data import state_batches
from domino.training.prepare import prepare_run
from domino.transformer import Plan

SEQ, VOCAB, BATCH = 24, 64, 2
MODELS = {"learned_gelu": {},
          "rope_swiglu_gqa": dict(position_embedding_type="rope", activation="swiglu",
                                  normalization="RMSNorm", num_query_groups=2,
                                  add_bias_linear=False)}
TOL = 2e-5


def write_chats(prefix: Path, n: int = 40, seed: int = 0, longest: int = 14) -> None:
    """``n`` conversations of 3..``longest`` tokens with a loss mask beside them (a prompt
    of 0s, then 1s), as ``domino preprocess --format chat`` lays them out."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetBuilder(prefix, np.uint16) as tokens, \
            IndexedDatasetBuilder(loss_mask_prefix(prefix), np.uint8) as masks:
        for i in range(n):
            size = int(rng.integers(3, longest + 1))
            tokens.add_document(rng.integers(1, VOCAB, size=size))
            # Every third counts every token (--train-on-prompt): a label crossing into it
            # would count.
            prompt = 0 if i % 3 == 0 else int(rng.integers(1, size))
            masks.add_document(np.r_[np.zeros(prompt), np.ones(size - prompt)].astype(np.uint8))
        tokens.finalize({"tokenizer": ByteTokenizer().describe()})
        masks.finalize()


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("chats") / "chats"
    write_chats(prefix)
    return prefix


def test_packer_keeps_documents_whole_greedy_in_order(chats: Path) -> None:
    ds = IndexedDataset(chats)
    mask_ds = IndexedDataset(loss_mask_prefix(chats))
    packed = PackedDataset(ds, SEQ, epochs=1, seed=3)
    slots = SEQ + 1
    seen, counted, bins = [], 0.0, []
    for i in range(len(packed)):
        docs = packed.sample_documents(i)
        seen.extend(docs.tolist())
        sample = packed[i]
        raw = np.concatenate([ds[d] for d in docs])
        n = len(raw)
        assert n <= slots
        # Inputs then labels are the documents laid end to end: nothing split, nothing cut.
        whole = np.r_[sample["tokens"].numpy(), sample["labels"].numpy()[-1:]]
        assert np.array_equal(whole[:n], raw)
        starts = np.cumsum([0] + [len(ds[d]) for d in docs])
        positions = np.concatenate([np.arange(b - a) for a, b in zip(starts, starts[1:])])
        assert np.array_equal(sample["position_ids"].numpy()[:min(n, SEQ)], positions[:SEQ])
        # Counted: the mask of the next token, inside one document; padding counts nothing.
        expected = np.zeros(SEQ, np.float32)
        for d, a in zip(docs, starts[:-1]):
            m = mask_ds[d][1:]
            expected[a:a + len(m)] = m
        assert np.array_equal(sample["loss_mask"].numpy(), expected)
        counted += expected.sum()
        att = sample["attention_mask"][0].numpy()
        for a, b in zip(starts, starts[1:]):  # a row sees its document's start .. itself
            for q in range(a, min(b, SEQ)):
                assert not att[q, a:q + 1].any() and att[q, :a].all()
        bins.append(docs)
    assert sorted(seen) == list(range(ds.num_documents))  # each document exactly once
    assert counted == sum(mask_ds[d][1:].sum() for d in range(ds.num_documents))
    # Greedy in order: the next sample's first document did not fit what this one left.
    by_order = [packed.document_order[a:b] for a, b in zip(packed._bounds, packed._bounds[1:])]
    sizes = ds.sizes
    for cur, nxt in zip(by_order, by_order[1:]):
        assert sizes[cur].sum() + sizes[nxt[0]] > slots
    assert packed.samples_per_epoch == len(by_order) == len(packed)
    assert packed.efficiency == pytest.approx(ds.num_tokens / (len(packed) * slots))
    assert f"{100 * packed.efficiency:.1f}%" in packing_text(packed)
    assert f"{ds.num_documents:,} documents packed into {len(packed)} samples" in packing_text(
        packed)
    blend = SimpleNamespace(datasets=[packed, packed])  # a blend's line: its parts summed
    assert f"efficiency {100 * packed.efficiency:.1f}%" in packing_text(blend)
    assert packing_text(SimpleNamespace(datasets=[])) is None
    # More samples than one epoch: later epochs pack a fresh order.
    longer = PackedDataset(ds, SEQ, num_samples=3 * len(packed), seed=3)
    assert longer.epochs >= 3 and len(longer) == 3 * len(packed)


def test_packing_refusals(chats: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"longer than --seq-length \+ 1 = 9 tokens.*"
                                         r"--max-tokens 9"):
        PackedDataset(IndexedDataset(chats), 8, epochs=1)
    with pytest.raises(ValueError, match="do not fit"):
        build_packed_sample([np.arange(5), np.arange(5)], 8)
    base = dict(data_path=[str(chats)], tokenizer_type="byte", num_layers=1, hidden_size=32,
                num_attention_heads=4, seq_length=SEQ, micro_batch_size=2, global_batch_size=2,
                train_iters=2, eval_iters=0, device="cpu", save=str(tmp_path / "run"),
                tensor_model_parallel_size=1, pack_documents=True)
    with pytest.raises(ValueError, match="--reset-attention-mask would cut samples again"):
        prepare_run(TrainArgs(**base, reset_attention_mask=True), world_size=1, progress=False)
    run = prepare_run(TrainArgs(**{**base, "save": str(tmp_path / "ok")}), world_size=1,
                      progress=False)
    assert isinstance(run.train_ds, PackedDataset)
    assert run.train_ds[0]["attention_mask"].shape == (1, SEQ, SEQ)


def _per_document(ref: GPTModel, batch: dict, docs: list[list[tuple]]) -> tuple:
    """Each document of each sample run alone in ``ref`` (unpadded, positions from 0): the
    per-token losses at the packed positions, where they are defined, and the summed gradients
    of the loss masked as packing masks it."""
    expected = torch.zeros(BATCH, SEQ)
    covered = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    total = 0.0
    for b, sample in enumerate(docs):
        at = 0
        for tokens, counts in sample:
            t = torch.tensor(np.asarray(tokens, dtype=np.int64))[None]
            loss = ref(t[:, :-1], None, None, labels=t[:, 1:])[0]  # [n - 1]
            n = min(len(tokens) - 1, SEQ - at)
            expected[b, at:at + n], covered[b, at:at + n] = loss[:n].detach(), True
            weights = torch.tensor(np.asarray(counts[1:n + 1], dtype=np.float32))
            total = total + (loss[:n] * weights).sum()
            at += len(tokens)
    total.backward()
    return expected, covered


def _gathered(loss: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """A CP rank's [b, s/cp] losses (chunks r and 2cp-1-r) put back in true order."""
    cp = state.cp.size
    if cp == 1:
        return loss
    parts = [torch.empty_like(loss) for _ in range(cp)]
    dist.all_gather(parts, loss.contiguous(), group=state.cp.group)
    chunks: list = [None] * (2 * cp)
    for r, x in enumerate(parts):
        chunks[r], chunks[2 * cp - 1 - r] = x.chunk(2, dim=1)
    return torch.cat(chunks, dim=1)


def _case(state: ParallelState, packed: PackedDataset, model: str, plan: Plan,
          sp: bool) -> dict:
    """(loss error, worst gradient error, loss mask zero on uncovered positions)."""
    cfg = config(**MODELS[model], vocab_size=VOCAB, seq_length=SEQ, max_position_embeddings=32)
    torch.manual_seed(0)
    ref = GPTModel(cfg, parallel_state=ParallelState.single())
    perturb(ref, seed=1, vocab=VOCAB)
    net = GPTModel(cfg, parallel_state=state, runtime=RuntimeConfig(plan=plan,
                                                                    sequence_parallel=sp))
    copy_weights(net, ref, state.tp, VOCAB)
    net.language_model.encoder.set_plan(plan, force=True)
    batch = state_batches(packed, 0, BATCH, BATCH, state)[0]
    docs = [[(packed.indexed_dataset[d], packed.loss_mask[d]) for d in packed.sample_documents(i)]
            for i in range(BATCH)]
    assert all(len(sample) >= 2 for sample in docs)  # packed: several documents a sample
    assert any(counts[0] for sample in docs for _, counts in sample[1:])  # see write_chats
    expected, covered = _per_document(ref, batch, docs)
    loss = net(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
               labels=batch["labels"])
    (loss * batch["loss_mask"]).sum().backward()
    for p in net.parameters():  # what the trainer's DP x CP reduction does (DP = 1 here)
        if state.cp.size > 1:
            dist.all_reduce(p.grad, group=state.cp.group)
    whole = _gathered(loss.detach(), state)
    whole_mask = _gathered(batch["loss_mask"], state)
    refs = dict(ref.named_parameters())
    grads = max(rel_err(p.grad, expected_local(n, refs[n].grad, p, state.tp, VOCAB))
                for n, p in net.named_parameters())
    return {"loss": rel_err(whole[covered], expected[covered]), "grads": grads,
            "pad_counts": float(whole_mask[~covered].abs().sum())}


def _cases(state: ParallelState, plans: dict) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        write_chats(Path(folder) / "chats")
        packed = PackedDataset(IndexedDataset(Path(folder) / "chats"), SEQ, num_samples=BATCH,
                               seed=10)  # padding and an exactly full sample
        return {(m, p): _case(state, packed, m, *plans[p]) for m in MODELS for p in plans}


def _spawned(state: ParallelState) -> dict:
    """TP=2 (the session's state) with SP and a Domino plan; then CP=2 on the same ranks."""
    out = {("tp2", *k): v for k, v in
           _cases(state, {"m2_cross_sp": (Plan(2, "cross_layer", 1), True)}).items()}
    cp = ParallelState.from_sizes(ParallelSizes.for_world(2, cp=2))
    try:
        out.update({("cp2", *k): v for k, v in
                    _cases(cp, {"m2_cross": (Plan(2, "cross_layer", 1), False),
                                "sync": (Plan(1, "none", 1), False)}).items()})
    finally:
        cp.close()
    out["pipeline"] = _pipeline(state)
    return out


def _trained(folder: str, **sizes) -> list[float]:
    """Losses and validation losses of 2 steps of `domino train --pack-documents` here."""
    from dist import fit

    args = TrainArgs(data_path=[f"{folder}/chats"], tokenizer_type="byte", split="80,20,0",
                     num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
                     micro_batch_size=2, global_batch_size=4, train_iters=2, lr=1e-3,
                     eval_interval=2, eval_iters=1, log_interval=1, sample_tokens=0,
                     tensorboard=False, device="cpu", hidden_dropout=0.0,
                     attention_dropout=0.0, position_embedding_type="rope",
                     domino_micro_batches=1, pack_documents=True, adam_eps=1e-4,
                     save=f"{folder}/{'_'.join(sizes) or 'dp'}", **sizes)
    res = fit(args, args.save)
    return [*res.losses, *(v for _, v in res.val_losses)]


def _pipeline(state: ParallelState) -> dict:
    """The trainer at PP=2 against DP=2 on the same 2 ranks (DP is TP=1's math)."""
    # One folder for both ranks (a run folder is shared): named by the spawn's port.
    folder = Path(tempfile.gettempdir()) / f"domino_packing_{os.environ['MASTER_PORT']}"
    if state.world.rank == 0:
        write_chats(folder / "chats", n=120)
    dist.barrier()
    try:
        dp = _trained(str(folder), tensor_model_parallel_size=1)
        pp = _trained(str(folder), tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    finally:
        dist.barrier()  # rank 0 removes the folder only when both are done
        if state.world.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return {"dp": dp, "pp": pp}


def _check(results: dict) -> None:
    for key, res in results.items():
        assert res["loss"] < TOL and res["grads"] < TOL and res["pad_counts"] == 0, (key, res)


def test_packed_equals_each_document_alone_tp1() -> None:
    with one_thread():
        _check(_cases(ParallelState.single(), {"sync": (Plan(1, "none", 1), False),
                                               "m2": (Plan(2, "none", 1), False)}))


def test_packed_equals_each_document_alone_tp2_sp_domino_and_cp2() -> None:
    results = tp_results(2, _spawned)
    assert len(results[0]) == 3 * len(MODELS) + 1  # TP=2: one plan; CP=2: two; PP
    for res in results:
        trained = res.pop("pipeline")
        assert len(trained["dp"]) == 3
        assert rel_err(torch.tensor(trained["pp"]), torch.tensor(trained["dp"])) < TOL, trained
        _check(res)
