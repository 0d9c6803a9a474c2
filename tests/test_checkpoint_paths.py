"""Names read from a checkpoint (``checkpoint.json``, ``latest.json``) or from a Hugging Face
folder's safetensors index cannot lead outside their folder: every form of escape is refused
with a message naming the listing file and the name, and no file outside is opened or stat'ed
on the way (issue 19)."""

from __future__ import annotations

import builtins
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_checkpoint_format import _checkpoint, _config, _load_everything

import domino.checkpoint.hf_import as hf_import
import domino.checkpoint.layout as layout
import domino.checkpoint.shards as shards
from domino.checkpoint.layout import CheckpointError, Meta, open_checkpoint
from domino.checkpoint.shards import ShardReader
from domino.checkpoint.store import load_model, load_tokenizer
from domino.cli import main
from domino.config import TransformerConfig
from domino.data import BPETokenizer
from domino.models.gpt import GPTModel
from domino.parallel_state import ParallelState

MODEL = "model-tp00-pp00.safetensors"
FIX = "use an intact one"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A real one-update checkpoint with a BPE tokenizer (written once, copied per test)."""
    bpe = BPETokenizer.train(["alpha beta gamma delta " * 40] * 10, vocab_size=300)
    run = tmp_path_factory.mktemp("pristine") / "run"
    _checkpoint(run, config=_config(vocab_size=bpe.vocab_size), tokenizer=bpe)
    return run


@pytest.fixture
def run(tmp_path: Path, pristine: Path) -> Path:
    shutil.copytree(pristine, tmp_path / "run", symlinks=True)
    (tmp_path / "outside").mkdir()
    return tmp_path / "run"


@pytest.fixture
def touched(monkeypatch) -> list[str]:
    """Every path opened, stat'ed, hashed or safetensors-opened from now on (absolute,
    normalised: ``a/../b`` counts as ``b``)."""
    seen: list[str] = []

    def spy(real: Callable) -> Callable:
        def wrapper(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)):
                seen.append(os.path.normpath(os.path.abspath(os.fspath(path))))
            return real(path, *args, **kwargs)
        return wrapper

    for owner, name in ((builtins, "open"), (os, "open"), (os, "stat"), (layout, "sha256_of"),
                        (shards, "safe_open"), (hf_import, "safe_open")):
        monkeypatch.setattr(owner, name, spy(getattr(owner, name)))
    return seen


def _outside_touched(seen: list[str], outside: Path) -> list[str]:
    seen = list(seen)  # (what this function itself looks up does not count)
    forbidden = (os.path.abspath(outside), "/etc/passwd")
    return [p for p in seen if any(p == f or p.startswith(f + os.sep) for f in forbidden)]


def _edit(step: Path, change: Callable[[dict], None]) -> None:
    raw = json.loads((step / "checkpoint.json").read_text())
    change(raw)
    (step / "checkpoint.json").write_text(json.dumps(raw))


def _rename_model(step: Path, new: str, *, move_to: Path | None = None) -> None:
    """List the model file as ``new`` (in ``files`` and every tensor record), optionally moving
    the real file to ``move_to`` first so that an unchecked reader would find valid weights."""
    if move_to is not None:
        shutil.copy(step / MODEL, move_to)

    def change(raw: dict) -> None:
        raw["files"][new] = raw["files"].pop(MODEL)
        for rec in raw["tensors"].values():
            rec["files"] = [new if f == MODEL else f for f in rec["files"]]
    _edit(step, change)


def _relative(step: Path, out: Path) -> str:
    _rename_model(step, "../../../outside/x.safetensors", move_to=out / "x.safetensors")
    return "'../../../outside/x.safetensors'"


def _absolute(step: Path, out: Path) -> str:
    _rename_model(step, str(out / "x.safetensors"), move_to=out / "x.safetensors")
    return repr(str(out / "x.safetensors"))


def _dot(step: Path, out: Path) -> str:
    _rename_model(step, f"./{MODEL}")
    return f"'./{MODEL}'"


def _symlink(step: Path, out: Path) -> str:
    shutil.move(step / MODEL, out / "x.safetensors")
    (step / MODEL).symlink_to(out / "x.safetensors")
    return "symbolic link"


def _nul(step: Path, out: Path) -> str:
    _rename_model(step, MODEL + "\x00.txt")
    return "control character"


def _backslash(step: Path, out: Path) -> str:
    _rename_model(step, "..\\..\\..\\outside\\x.safetensors")
    return "backslash"


def _empty(step: Path, out: Path) -> str:
    _rename_model(step, "")
    return "non-empty"


def _unexpected_form(step: Path, out: Path) -> str:
    shutil.copy(step / MODEL, step / "weights.safetensors")
    _rename_model(step, "weights.safetensors")
    return "'weights.safetensors'"


def _unlisted(step: Path, out: Path) -> str:
    shutil.copy(step / MODEL, step / "model-tp01-pp00.safetensors")

    def change(raw: dict) -> None:
        for rec in raw["tensors"].values():
            rec["files"] = ["model-tp01-pp00.safetensors" if f == MODEL else f
                            for f in rec["files"]]
    _edit(step, change)
    return "not among"


def _etc_passwd(step: Path, out: Path) -> str:
    _edit(step, lambda raw: raw["files"].update({"/etc/passwd": {"bytes": 1}}))
    return "'/etc/passwd'"


def _tokenizer_record(step: Path, out: Path) -> str:
    def change(raw: dict) -> None:
        raw["tokenizer"]["files"] = ["../../../outside/vocab.json"]
    _edit(step, change)
    return "outside/vocab.json"


def _tokenizer_symlink(step: Path, out: Path) -> str:
    shutil.move(step / "tokenizer" / "vocab.json", out / "vocab.json")
    (step / "tokenizer" / "vocab.json").symlink_to(out / "vocab.json")
    return "symbolic link"


def _tokenizer_dir_symlink(step: Path, out: Path) -> str:
    shutil.move(step / "tokenizer", out / "tokenizer")
    (step / "tokenizer").symlink_to(out / "tokenizer")
    return "symbolic link"


def _tokenizer_subfolder(step: Path, out: Path) -> str:
    """Unlisted, but convert would copy the folder whole, following the link."""
    shutil.copy(step / "tokenizer" / "vocab.json", out / "vocab.json")
    (step / "tokenizer" / "sub").mkdir()
    (step / "tokenizer" / "sub" / "x").symlink_to(out / "vocab.json")
    return "'tokenizer/sub' is refused"


def _latest_symlink(step: Path, out: Path) -> str:
    shutil.move(step, out / step.name)
    step.symlink_to(out / step.name)
    return "symbolic link"


def _meta_json_symlink(step: Path, out: Path) -> str:
    """checkpoint.json itself a link (to another run's record: a valid one)."""
    shutil.move(step / "checkpoint.json", out / "checkpoint.json")
    (step / "checkpoint.json").symlink_to(out / "checkpoint.json")
    return "the checkpoint record is a symbolic link"


def _meta_json_to_passwd(step: Path, out: Path) -> str:
    (step / "checkpoint.json").unlink()
    (step / "checkpoint.json").symlink_to("/etc/passwd")
    return "the checkpoint record is a symbolic link"


def _latest_json_symlink(step: Path, out: Path) -> str:
    """latest.json itself a link (to another run's tracker naming a valid step)."""
    latest = step.parent / "latest.json"
    shutil.move(latest, out / "latest.json")
    latest.symlink_to(out / "latest.json")
    return "the latest-checkpoint tracker is a symbolic link"


PLANTS = [_relative, _absolute, _dot, _symlink, _nul, _backslash, _empty, _unexpected_form,
          _unlisted, _etc_passwd, _tokenizer_record, _tokenizer_symlink, _tokenizer_dir_symlink,
          _tokenizer_subfolder, _latest_symlink, _meta_json_symlink, _meta_json_to_passwd,
          _latest_json_symlink]
_IN_LATEST = (_latest_symlink, _latest_json_symlink)


@pytest.mark.parametrize("hashes", [True, False], ids=["hashed", "unhashed"])
@pytest.mark.parametrize("plant", PLANTS, ids=lambda f: f.__name__.strip("_"))
def test_a_name_leading_out_is_refused_before_anything_outside_is_read(
        run: Path, plant: Callable, hashes: bool, touched: list[str]) -> None:
    step = run / "checkpoints" / "step_0000003"
    out = run.parent / "outside"
    expected = plant(step, out)
    touched.clear()
    with pytest.raises(CheckpointError) as err:
        _load_everything(run, hashes=hashes)
    msg = str(err.value)
    assert FIX in msg and expected in msg, msg
    assert ("latest.json" if plant in _IN_LATEST else "checkpoint.json") in msg, msg
    assert not _outside_touched(touched, out), _outside_touched(touched, out)
    if plant is _etc_passwd:  # nothing about the file: not its size, not whether it exists
        assert str(os.stat("/etc/passwd").st_size) not in msg.split("is refused")[1]
        assert "missing" not in msg and "bytes" not in msg.split("is refused")[1]


def test_the_open_points_refuse_a_planted_link_on_their_own(run: Path,
                                                             touched: list[str]) -> None:
    """A link planted after the checkpoint was checked (or by a caller that skipped the
    check) is refused where the file is opened."""
    step_dir, meta, _ = open_checkpoint(run)
    out = run.parent / "outside"
    _symlink(step_dir, out)
    _tokenizer_symlink(step_dir, out)
    touched.clear()
    state = ParallelState.single()
    model = GPTModel(TransformerConfig.from_dict(meta.config), parallel_state=state)
    with pytest.raises(CheckpointError, match=f"'{MODEL}' is refused: it is a symbolic link"):
        load_model(step_dir, meta, model, state)
    with pytest.raises(CheckpointError, match="'tokenizer/vocab.json' is refused: it is a sym"):
        load_tokenizer(step_dir, meta)
    with pytest.raises(CheckpointError, match=r"is refused: '\.\.'"):
        ShardReader(step_dir)._file("../../../outside/x.safetensors")
    assert not _outside_touched(touched, out)


@pytest.mark.parametrize("command", ["convert", "export"])
def test_the_cli_refuses_in_one_line(run: Path, tmp_path: Path, command: str, capsys,
                                     touched: list[str]) -> None:
    step = run / "checkpoints" / "step_0000003"
    _relative(step, tmp_path / "outside")
    copy = tmp_path / "copy"
    argv = ([command, str(run), str(copy), "--tensor-model-parallel-size", "1"]
            if command == "convert" else [command, "--format", "hf", str(run), str(copy)])
    capsys.readouterr()
    touched.clear()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"domino {command}: error: ") and err.count("\n") == 1, err
    assert "'../../../outside/x.safetensors' is refused" in err and FIX in err
    assert "Traceback" not in err and not copy.exists()
    assert not _outside_touched(touched, tmp_path / "outside")


LINK_TARGETS = {"another run's": None, "/etc/passwd": "/etc/passwd",
                "a missing file": "/nonexistent/domino-link-target"}


@pytest.mark.parametrize("record", ["checkpoint.json", "latest.json"])
def test_every_command_refuses_a_linked_record_alike_wherever_it_points(
        run: Path, tmp_path: Path, record: str, capsys, touched: list[str],
        byte_dataset) -> None:
    """train, convert, export, generate and eval refuse a linked checkpoint.json or
    latest.json in one line that is the same whatever the link leads to (so it cannot tell
    whether a path exists), and open nothing outside."""
    step = run / "checkpoints" / "step_0000003"
    path = step / record if record == "checkpoint.json" else run / "checkpoints" / record
    other = tmp_path / "other"
    shutil.copytree(run, other)
    LINK_TARGETS["another run's"] = str(other / path.relative_to(run))
    data = byte_dataset(20_000)
    argvs = {"train": ["train", "--load", str(run), "--data-path", data, "--train-iters", "4",
                       "--save",
                       str(tmp_path / "new"), "--no-tensorboard"],
             "convert": ["convert", str(run), str(tmp_path / "copy"),
                         "--tensor-model-parallel-size", "1"],
             "export": ["export", "--format", "hf", str(run), str(tmp_path / "copy")],
             "generate": ["generate", str(run), "--prompt", "a", "--max-new-tokens", "1"],
             "eval": ["eval", str(run), "--data-path", data]}
    lines = {}
    for target in LINK_TARGETS.values():
        path.unlink()
        path.symlink_to(target)
        for command, argv in argvs.items():
            capsys.readouterr()
            touched.clear()
            assert main(argv) == 2, (command, target)
            err = capsys.readouterr().err
            assert err.startswith(f"domino {command}: error: ") and err.count("\n") == 1, err
            assert str(path) in err and "is a symbolic link" in err, err
            assert "Traceback" not in err and not (tmp_path / "copy").exists()
            assert not (tmp_path / "new").exists()
            assert not _outside_touched(touched, other), (command, target)
            lines.setdefault(command, set()).add(err)
    assert all(len(seen) == 1 for seen in lines.values()), lines  # the same words each time


def test_meta_from_json_checks_every_name(run: Path) -> None:
    path = run / "checkpoints" / "step_0000003" / "checkpoint.json"
    raw = json.loads(path.read_text())
    Meta.from_json(raw, path)
    raw["tensors"]["language_model.embedding.word_embeddings.weight"]["files"] = ["../m"]
    with pytest.raises(CheckpointError, match=r"checkpoint.json: .*'\.\./m' is refused"):
        Meta.from_json(raw, path)


# ---- Hugging Face folders -----------------------------------------------------------------------


def _hf(tmp_path: Path, weight_map: dict[str, str] | None) -> tuple[Path, Path]:
    """An HF-style folder (one real shard) and a valid shard outside it, at outside/x."""
    folder, out = tmp_path / "hf", tmp_path / "outside"
    (folder / "sub").mkdir(parents=True)
    out.mkdir()
    save_file({"a": torch.ones(2)}, str(folder / "model.safetensors"))
    for target in (out / "x.safetensors", folder / "sub" / "x.safetensors"):
        save_file({"b": torch.zeros(2)}, str(target))
    if weight_map is not None:
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": weight_map}))
    return folder, out


@pytest.mark.parametrize("name,rule", [
    ("../outside/x.safetensors", "'..'"), ("ABS", "absolute"),
    ("sub/x.safetensors", "subfolder"), ("..\\outside\\x.safetensors", "backslash"),
    ("x.bin", ".safetensors"), ("link.safetensors", "symbolic link leading out")])
def test_hf_index_names_stay_in_the_folder(tmp_path: Path, name: str, rule: str,
                                           touched: list[str]) -> None:
    if name == "ABS":
        name = str(tmp_path / "outside" / "x.safetensors")
    folder, out = _hf(tmp_path, {"a": "model.safetensors", "b": name})
    if name == "link.safetensors":
        (folder / name).symlink_to(out / "x.safetensors")
    touched.clear()
    with pytest.raises(ValueError) as err:
        hf_import.read_hf_weights(folder)
    msg = str(err.value)
    assert "model.safetensors.index.json" in msg and repr(name) in msg and rule in msg, msg
    assert "re-download" in msg
    assert not _outside_touched(touched, out)


def test_hf_files_found_by_glob_or_name_must_not_link_out(tmp_path: Path) -> None:
    folder, out = _hf(tmp_path, None)
    (folder / "y.safetensors").symlink_to(out / "x.safetensors")
    with pytest.raises(ValueError, match="y.safetensors.*symbolic link leading out"):
        hf_import.read_hf_weights(folder)
    (folder / "y.safetensors").unlink()
    assert set(hf_import.read_hf_weights(folder)) == {"a"}
    (out / "config.json").write_text("{}")
    (folder / "config.json").symlink_to(out / "config.json")
    with pytest.raises(ValueError, match="config.json.*symbolic link leading out"):
        hf_import.import_hf(folder, tmp_path / "imported", 1)
    bpe = BPETokenizer.train(["alpha beta " * 20] * 4, vocab_size=270)
    bpe._tok.save(str(out / "tokenizer.json"))
    (folder / "tokenizer.json").symlink_to(out / "tokenizer.json")
    with pytest.raises(ValueError, match="tokenizer.json.*symbolic link leading out"):
        hf_import.read_hf_tokenizer(folder, _config(vocab_size=300), None)


def test_a_hub_cache_snapshot_of_links_into_its_blobs_is_read(tmp_path: Path) -> None:
    """How ``huggingface_hub`` stores a model: snapshots/<rev>/<file> -> ../../blobs/<hash>."""
    repo = tmp_path / "models--x--y"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    save_file({"a": torch.ones(2)}, str(repo / "blobs" / "f00d"))
    (repo / "blobs" / "beef").write_text(json.dumps({"weight_map": {"a": "model.safetensors"}}))
    (snap / "model.safetensors").symlink_to("../../blobs/f00d")
    (snap / "model.safetensors.index.json").symlink_to("../../blobs/beef")
    assert set(hf_import.read_hf_weights(snap)) == {"a"}
