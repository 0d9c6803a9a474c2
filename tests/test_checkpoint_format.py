"""The checkpoint format, in one process: resharding reads (against slicing written from the
definition), nothing on the load path unpickles (a planted pickle in place of every file is
refused and never runs), damage is named and the newest intact checkpoint found, saves are
atomic with keep-K, and every bad --save / --load input gets its message before any spawn."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from domino.checkpoint import layout
from domino.checkpoint.layout import CheckpointError, Meta, open_checkpoint
from domino.checkpoint.shards import ShardReader, TensorSpec
from domino.checkpoint.store import load_model, load_optimizer, load_rng, load_tokenizer, save
from domino.config import TransformerConfig
from domino.data import BPETokenizer, ByteTokenizer, preprocess
from domino.data.preprocess import stdlib_corpus_files
from domino.models.gpt import GPTModel
from domino.parallel_state import ParallelState
from domino.training.arguments import TrainArgs
from domino.training.prepare import model_config, prepare_run

SRC = Path(__file__).resolve().parents[1] / "src" / "domino"


# ---- resharding reads ---------------------------------------------------------------------------


def _shard(full: torch.Tensor, dim: int, stride: int, size: int, rank: int) -> torch.Tensor:
    """Rank ``rank`` of ``size``'s part: ``stride`` blocks along ``dim``, each cut in ``size``."""
    block = full.shape[dim] // stride
    part = block // size
    return torch.cat([full.narrow(dim, k * block + rank * part, part) for k in range(stride)],
                     dim=dim)


def _padded(real: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([real, real.new_zeros(rows - real.shape[0], *real.shape[1:])])


@pytest.mark.parametrize("saved,loaded", [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 2)])
def test_reshard_reads_match_the_definition(tmp_path: Path, saved: int, loaded: int) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {  # name: (full tensor, dim, stride)
        "col": (torch.randn(24, 5, generator=gen), 0, 1),
        "row": (torch.randn(5, 24, generator=gen), 1, 1),
        "swiglu": (torch.randn(32, 3, generator=gen), 0, 2),
        "bias": (torch.randn(16, generator=gen), 0, 2),
    }
    vocab = torch.randn(13, 4, generator=gen)  # 13 real rows, padded to a multiple of 4 x TP
    pad = {n: -(-13 // (4 * n)) * 4 * n for n in (1, 2, 4)}
    specs = {}
    for r in range(saved):
        out = {name: _shard(t, d, s, saved, r) for name, (t, d, s) in tensors.items()}
        out["vocab"] = _shard(_padded(vocab, pad[saved]), 0, 1, saved, r)
        save_file({k: v.contiguous() for k, v in out.items()}, str(tmp_path / f"r{r}.st"))
    files = tuple(f"r{r}.st" for r in range(saved))
    for name, (t, d, s) in tensors.items():
        specs[name] = TensorSpec(tuple(t.shape), "float32", files, d, s)
    specs["vocab"] = TensorSpec((pad[saved], 4), "float32", files, 0, 1, vocab=13)
    reader = ShardReader(tmp_path)
    for r in range(loaded):
        for name, (t, d, s) in tensors.items():
            torch.testing.assert_close(reader.part(name, specs[name], r, loaded),
                                       _shard(t, d, s, loaded, r), rtol=0, atol=0)
        got = reader.part("vocab", specs["vocab"], r, loaded, pad[loaded])
        torch.testing.assert_close(got, _shard(_padded(vocab, pad[loaded]), 0, 1, loaded, r),
                                   rtol=0, atol=0)
    torch.testing.assert_close(reader.full("swiglu", specs["swiglu"]), tensors["swiglu"][0])


# ---- a real checkpoint, written in this process -------------------------------------------------


def _config(**kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=257,
                seq_length=16, max_position_embeddings=16, hidden_dropout=0.1,
                attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def _checkpoint(run_dir: Path, step: int = 3, config: TransformerConfig | None = None,
                tokenizer=None, keep: int = 0, args: TrainArgs | None = None):
    """A one-update model + AdamW state saved as checkpoint ``step`` (world of one)."""
    config = config or _config()
    state = ParallelState.single()
    state.rng.seed(7)
    torch.manual_seed(step)
    model = GPTModel(config, parallel_state=state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    model(ids, None, None, labels=ids).mean().backward()  # draws dropout masks too
    opt.step()
    meta = Meta(step=step, consumed_samples=4 * step, config=config.to_dict(), layout={},
                tensors={}, files={}, plan="m2:cross",
                args=(args or TrainArgs()).to_dict(), library_version="test")
    folder = save(run_dir, step, state, model, opt, meta, keep=keep,
                  tokenizer=tokenizer or ByteTokenizer())
    return folder, model, opt, state


def _load_everything(path: Path, hashes: bool):
    """Every load path a run takes: find, check, weights, optimizer, RNG, tokenizer."""
    step_dir, meta, _ = open_checkpoint(path, hashes=hashes)
    state = ParallelState.single()
    config = TransformerConfig.from_dict(meta.config)
    model = GPTModel(config, parallel_state=state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_model(step_dir, meta, model, state)
    load_optimizer(step_dir, meta, opt, model, state)
    load_rng(step_dir, meta, state)
    load_tokenizer(step_dir, meta)
    return model, opt, state


def test_round_trip_is_exact(tmp_path: Path) -> None:
    folder, model, opt, state = _checkpoint(tmp_path / "run")
    assert folder == tmp_path / "run" / "checkpoints" / "step_0000003"
    assert json.loads((folder.parent / "latest.json").read_text()) == {"step": 3,
                                                                       "dir": folder.name}
    raw = json.loads((folder / "checkpoint.json").read_text())
    assert raw["format"] == "domino-checkpoint" and raw["layout"] == {"tp": 1, "pp": 1, "dp": 1}
    assert raw["consumed_samples"] == 12 and raw["plan"] == "m2:cross"
    emb = raw["tensors"]["language_model.embedding.word_embeddings.weight"]
    assert emb["dim"] == 0 and emb["vocab"] == 257 and emb["shape"] == [384, 32]
    assert raw["tensors"]["language_model.encoder.layers.0.mlp.dense_4h_to_h.weight"]["dim"] == 1
    loaded, lopt, lstate = _load_everything(tmp_path / "run", hashes=True)
    for (name, a), b in zip(model.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a, b), name
        for key, value in opt.state[a].items():
            assert torch.equal(value, lopt.state[b][key]), (name, key)
    assert torch.equal(state.rng.replicated(torch.device("cpu")).get_state(),
                       lstate.rng.replicated(torch.device("cpu")).get_state())


def test_source_never_unpickles() -> None:
    text = "\n".join(p.read_text() for p in SRC.rglob("*.py"))
    for banned in ("torch.load(", "weights_only=False", "import pickle", "pickle.load",
                   "broadcast_object_list", "all_gather_object"):
        assert banned not in text, banned


class _Boom:
    """Unpickling this creates a marker file: proof that code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("hashes", [True, False], ids=["checked", "unchecked"])
def test_a_planted_pickle_in_place_of_any_file_is_refused(tmp_path: Path, hashes: bool) -> None:
    bpe = BPETokenizer.train(["alpha beta gamma delta " * 40] * 10, vocab_size=300)
    run = tmp_path / "run"
    folder, *_ = _checkpoint(run, config=_config(vocab_size=bpe.vocab_size), tokenizer=bpe)
    victims = sorted(p for p in [*folder.rglob("*"), folder.parent / "latest.json"]
                     if p.is_file())
    assert {p.name for p in victims} >= {"checkpoint.json", "latest.json", "vocab.json",
                                         "merges.txt", "model-tp00-pp00.safetensors",
                                         "optim-tp00-pp00.safetensors",
                                         "rng-tp00-pp00.safetensors"}
    pristine = tmp_path / "pristine"
    shutil.copytree(run, pristine)
    for victim in victims:
        marker = tmp_path / f"ran-{victim.name}"
        victim.write_bytes(pickle.dumps(_Boom(str(marker))))
        # torch.save-style archives too: a zip holding a pickle.
        with pytest.raises((CheckpointError, ValueError)) as err:
            _load_everything(run, hashes=hashes)
        assert not marker.exists(), f"code ran when {victim.name} was a pickle"
        assert victim.name in str(err.value) or "tokenizer" in str(err.value), str(err.value)
        shutil.rmtree(run)
        shutil.copytree(pristine, run)
    torch.save({"x": _Boom(str(tmp_path / "ran-torch"))},
               folder / "model-tp00-pp00.safetensors")
    with pytest.raises(CheckpointError, match="model-tp00-pp00.safetensors"):
        _load_everything(run, hashes=False)
    assert not (tmp_path / "ran-torch").exists()


def test_damage_is_named_and_the_newest_intact_checkpoint_found(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _checkpoint(run, step=2)
    newest, *_ = _checkpoint(run, step=4)
    shard = newest / "model-tp00-pp00.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(run)
    msg = str(err.value)
    assert str(shard) in msg and "truncated" in msg and "step_0000002" in msg
    assert "--load-fallback" in msg
    step_dir, meta, notes = open_checkpoint(run, fallback=True)
    assert step_dir.name == "step_0000002" and meta.step == 2 and "damaged" in notes[0]
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF  # same size, other content
    shard.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="SHA-256 mismatch"):
        open_checkpoint(run)
    (run / "checkpoints" / "latest.json").write_text("step 4, I think")
    with pytest.raises(CheckpointError, match=r"latest.json: the latest-checkpoint tracker is "
                       r"not valid JSON \(Expecting value at line 1, column 1\); the file is "
                       "damaged or was replaced: use another checkpoint$"):
        open_checkpoint(run)
    (run / "checkpoints" / "latest.json").write_text("")
    with pytest.raises(CheckpointError, match=r"latest.json: the latest-checkpoint tracker is "
                       "empty; the file is damaged"):
        open_checkpoint(run)
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        open_checkpoint(tmp_path)


def test_keep_last_k_and_partial_saves(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (1, 2, 3, 4):
        _checkpoint(run, step=step, keep=2)
    root = run / "checkpoints"
    assert [s for s, _ in layout.list_steps(root)] == [3, 4]
    (root / "step_0000005.tmp").mkdir()
    (root / "step_0000005.tmp" / "model-tp00-pp00.safetensors").write_bytes(b"half")
    assert [p.name for p in layout.remove_partial_saves(root)] == ["step_0000005.tmp"]
    assert not (root / "step_0000005.tmp").exists()
    # Saving the same step again replaces it (a resumed run re-reaching a saved step).
    folder, model, *_ = _checkpoint(run, step=4, keep=2)
    loaded, *_ = _load_everything(folder, hashes=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters(),
                                                  strict=True))


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    run = tmp_path / "run"
    _checkpoint(run, step=2)
    import domino.checkpoint.rank_files as rank_files

    def full_disk(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rank_files, "StreamWriter", full_disk)  # (the tensor files' writer)
    with pytest.raises(CheckpointError, match="No space left.*previous checkpoint is intact"):
        _checkpoint(run, step=4)
    monkeypatch.undo()
    step_dir, meta, _ = open_checkpoint(run)
    assert meta.step == 2 and not (run / "checkpoints" / "step_0000004").exists()


# ---- what prepare_run checks before any process starts ------------------------------------------


@pytest.fixture(scope="module")
def data(byte_dataset) -> str:
    return byte_dataset(200_000)


def _args(data: str, **kw) -> TrainArgs:
    base = dict(data_path=data, tokenizer_type="byte", split="90,10,0", num_layers=2,
                hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=2,
                train_iters=6, eval_iters=1, sample_tokens=0, tensorboard=False,
                tensor_model_parallel_size=1, hidden_dropout=0.1, attention_dropout=0.0)
    base.update(kw)
    return TrainArgs(**base)


def _saved_run(tmp_path: Path, data: str, **kw) -> Path:
    args = _args(data, **kw)
    run = tmp_path / "saved"
    _checkpoint(run, step=3, config=model_config(args, 257), args=args)
    return run


def test_resume_checks_name_the_flag_and_both_values(tmp_path: Path, data: str) -> None:
    run = _saved_run(tmp_path, data)
    with pytest.raises(ValueError) as err:
        prepare_run(_args(data, num_attention_heads=8, load=str(run), save=str(tmp_path / "b")),
                    world_size=1, progress=False)
    msg = str(err.value)
    assert "--num-attention-heads is 4 in the checkpoint but 8 here" in msg
    assert str(run) in msg or "step_0000003" in msg
    flag = r"activation \(--swiglu, --openai-gelu, --geglu\)"
    with pytest.raises(ValueError, match=flag + r" is 'gelu'"):
        prepare_run(_args(data, swiglu=True, load=str(run), save=str(tmp_path / "c")),
                    world_size=1, progress=False)
    bpe = BPETokenizer.train(["alpha beta gamma " * 50] * 20, vocab_size=300)
    bpe_dir = tmp_path / "bpe"
    bpe.save(bpe_dir)
    preprocess(stdlib_corpus_files(limit_bytes=30_000), tmp_path / "bpe_data", bpe,
               progress=False)
    with pytest.raises(ValueError, match="vocabulary size"):
        prepare_run(_args(str(tmp_path / "bpe_data"), tokenizer_type="bpe",
                          tokenizer_dir=str(bpe_dir), load=str(run), save=str(tmp_path / "d")),
                    world_size=1, progress=False)
    # Another TP size is fine (resharding), and the resolved --load is the step folder.
    ok = prepare_run(_args(data, tensor_model_parallel_size=2, load=str(run),
                           save=str(tmp_path / "e")), world_size=2, progress=False)
    assert ok.resume.meta.step == 3 and ok.args.load.endswith("step_0000003")
    assert ok.resume.start_step == 3 and ok.resume.consumed == 12
    (run / "checkpoints" / "step_0000003" / "model-tp00-pp00.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match="--load .*model-tp00-pp00.safetensors.*truncated"):
        prepare_run(_args(data, load=str(run), save=str(tmp_path / "f")), world_size=1,
                    progress=False)


def test_save_folder_checks(tmp_path: Path, data: str, monkeypatch) -> None:
    def error(**kw) -> str:
        with pytest.raises(ValueError) as err:
            prepare_run(_args(data, **kw), world_size=1, progress=False)
        return str(err.value)

    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    assert "--save" in error(save=str(afile)) and "is a file" in error(save=str(afile))
    assert "cannot write there" in error(save=str(afile / "sub"))
    assert "cannot write there" in error(save="/proc/domino-test-run")
    assert "cannot write there" in error(save="/sys/domino-test-run")  # read-only for root too
    msg = error(lr=float("inf"), save=str(tmp_path / "x"))
    assert "--lr=inf must be a finite number" in msg
    # A folder holding a run: refused unless --load or --overwrite says what to do.
    held = tmp_path / "held"
    _checkpoint(held, step=2, config=model_config(_args(data), 257), args=_args(data))
    (held / "metrics.jsonl").write_text('{"step": 1}\n')
    msg = error(save=str(held))
    assert "already holds a run" in msg and "--load" in msg and "--overwrite" in msg
    prepare_run(_args(data, save=str(held), load=str(held)), world_size=1, progress=False)
    prepare_run(_args(data, save=str(held), overwrite=True), world_size=1, progress=False)
    assert not (held / "checkpoints").exists() and not (held / "metrics.jsonl").exists()
    # Continuing from an older checkpoint in a folder that holds newer ones is refused.
    again = tmp_path / "again"
    for step in (2, 4):
        _checkpoint(again, step=step, config=model_config(_args(data), 257), args=_args(data))
    msg = error(save=str(again), load=str(again / "checkpoints" / "step_0000002"))
    assert "holds newer checkpoints (step_0000004)" in msg
    # No room for a checkpoint.
    import domino.training.resume as resume

    monkeypatch.setattr(resume.shutil, "disk_usage",
                        lambda _p: shutil._ntuple_diskusage(10 << 20, 10 << 20, 1000))
    msg = error(save=str(tmp_path / "full"))
    # Sizes in a unit that shows them (was "0.00 GiB free ... about 0.00 GiB").
    assert "--save" in msg and "1000 B free" in msg and "free space" in msg
    assert "0.00 GiB" not in msg and re.search(r"takes about \d+(\.\d+)? [KM]iB", msg)
