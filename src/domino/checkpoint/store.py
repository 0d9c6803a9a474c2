"""Saving and loading a run's state: weights, AdamW state and dropout RNG, one file per rank.

Every (TP rank, PP stage) of DP rank 0 writes its own files (no rank gathers the model; a
sharded run's DP chunks are gathered and streamed to them one bucket at a time:
``checkpoint.rank_files``); global rank 0 then writes ``checkpoint.json`` and renames the
folder into place, so a checkpoint exists only once it is complete. Loading reads each rank's
part for *its* TP size one tensor at a time (a sharded run keeps its DP chunks of each), so a
checkpoint saved at TP=a x DP=x loads at TP=b x DP=y (optimizer state included).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from domino.checkpoint import layout, lora
from domino.checkpoint.layout import CheckpointError, Meta
from domino.checkpoint.rank_files import (  # saved_tensors: importable from here as before
    named_model_tensors,
    saved_tensors,  # noqa: F401
    write_rank_files,
)
from domino.checkpoint.shards import ShardReader, TensorSpec
from domino.models.lora import is_adapter_name
from domino.parallel_state import ParallelState
from domino.tensor_parallel.layers import shard_of_full
from domino.tensor_parallel.placement import placement_of


def save(run_dir: Path, step: int, state: ParallelState, model: nn.Module,
         optimizer: Any, meta: Meta, keep: int = 0,
         tokenizer: Any = None) -> Path:
    """Write checkpoint ``step`` of this run (every rank calls this); returns its folder.

    ``meta`` carries what is not a tensor (its ``tensors`` / ``files`` / ``layout`` are filled in
    here). ``keep`` > 0 deletes all but the newest ``keep`` checkpoints once this one is in place.
    A write that fails on any rank (a full disk) fails the save on every rank with that rank's
    error, once all of them are done with the folder (:class:`_Attempt`).
    """
    root = Path(run_dir) / layout.CHECKPOINTS
    final = root / layout.step_dir_name(step)
    tmp = root / (final.name + layout.TMP_SUFFIX)
    world = state.world
    attempt = _Attempt(step, tmp, world.rank, world.size)
    if world.rank == 0:
        with attempt.recording():
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / layout.TOKENIZER_DIR).mkdir(parents=True)
    attempt.settle(world, [world.broadcast_json(attempt.error)])
    records: dict[str, Any] = {}
    if world.rank == 0 and tokenizer is not None:
        with attempt.recording():
            meta.tokenizer = save_tokenizer(tokenizer, tmp / layout.TOKENIZER_DIR)
            for f in sorted((tmp / layout.TOKENIZER_DIR).iterdir()):
                records[f"{layout.TOKENIZER_DIR}/{f.name}"] = layout.file_record(f)
    specs = write_rank_files(tmp, state, model, optimizer, records, attempt)
    _test_pause(step)
    gathered = world.all_gather_json({"files": records, "tensors": specs,
                                      "error": attempt.error})
    attempt.settle(world, [part["error"] for part in gathered])
    if world.rank == 0:
        meta.files, meta.tensors = {}, {}
        for part in gathered:
            meta.files.update(part["files"])
            meta.tensors.update(part["tensors"])
        meta.step = step
        meta.has_optimizer = optimizer is not None
        meta.layout = {"tp": state.tp.size, "pp": state.pp.size, "dp": state.dp.size}
        meta.rng_seed = state.rng.state_dict()["seed"]
        with attempt.recording():
            layout.write_json_atomic(tmp / layout.META, meta.to_json())
            _publish(root, tmp, final)
            layout.write_json_atomic(root / layout.LATEST, {"step": step, "dir": final.name})
        if keep > 0 and attempt.error is None:
            for _s, old in layout.list_steps(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    # Nobody moves on (or exits) before the checkpoint is in place, or all fail with rank 0.
    attempt.settle(world, [world.broadcast_json(attempt.error)])
    return final


class _Attempt:
    """One rank's part of a save. A write that fails (a full disk, a read-only or vanished
    --save) is recorded, not raised, until the ranks compare their outcomes at a collective
    (:meth:`settle`): removing the unpublished ``tmp`` folder while another rank still writes
    into it would make that rank fail on a missing file and report that instead of the cause."""

    def __init__(self, step: int, tmp: Path, rank: int, world_size: int) -> None:
        self.step, self.tmp, self.rank, self.world_size = step, tmp, rank, world_size
        self.error: str | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record this rank's first failed write (raise nothing)."""
        try:
            yield
        except (OSError, SafetensorError) as err:  # SafetensorError is not an OSError
            if self.error is None:
                where = f" on rank {self.rank}" if self.world_size > 1 else ""
                self.error = f"{where}: {err}"

    def settle(self, world: Any, errors: list[str | None]) -> None:
        """After a collective that brought every rank's ``errors`` (or rank 0's): when one
        failed, rank 0 removes ``tmp`` (no rank writes into it any more; the next start would
        remove it too) and every rank raises the same CheckpointError, the first failure's."""
        failed = next((e for e in errors if e is not None), None)
        if failed is None:
            return
        if world.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)
        raise CheckpointError(
            f"saving checkpoint {self.step} to {self.tmp} failed{failed}; the previous "
            "checkpoint is intact (free space on the --save filesystem, or pass another --save)")


PAUSE_ENV = "DOMINO_TEST_SAVE_PAUSE"  # test hook: "STEP:SECONDS" sleeps mid-save at STEP


def _test_pause(step: int) -> None:
    """Test hook: hold a save half-written (its shards on disk, nothing published) so a test
    can kill the run in the middle of it."""
    spec = os.environ.get(PAUSE_ENV)
    if spec:
        at, seconds = spec.split(":")
        if int(at) == step:
            time.sleep(float(seconds))


def _publish(root: Path, tmp: Path, final: Path) -> None:
    """Rename the finished folder into place (replacing an older save of the same step)."""
    old = None
    if final.exists():
        old = root / (final.name + ".old" + layout.TMP_SUFFIX)
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    layout.fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_tokenizer(tokenizer: Any, folder: Path) -> dict[str, Any]:
    """Copy the tokenizer's files into ``folder``; returns its JSON identity record."""
    record = tokenizer.describe()
    if hasattr(tokenizer, "save"):
        tokenizer.save(folder)
    record["files"] = sorted(f.name for f in folder.iterdir())
    return record


# ---- loading ----------------------------------------------------------------------------------


def _spec(meta: Meta, name: str, step_dir: Path) -> TensorSpec:
    raw = meta.tensors.get(name)
    if raw is None:
        raise CheckpointError(f"{step_dir / layout.META}: no tensor {name!r}; the checkpoint "
                              "holds a different model")
    return TensorSpec.from_json(name, raw)


def read_part(reader: ShardReader, meta: Meta, name: str, like: torch.Tensor,
              state: ParallelState, param: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's part of tensor ``name`` shaped like the local tensor ``like`` (of parameter
    ``param``, default ``like``: an expert's is cut from the whole tensor over EP)."""
    spec = _spec(meta, name, reader.folder)
    placement = placement_of(param if param is not None else like)
    if spec.dim is None and placement.shard == "ep" and like.dim() > 0:
        out = shard_of_full(reader.full(name, spec), placement.dim, state.ep, placement.stride)
    elif spec.dim is None:
        out = reader.full(name, spec)
    else:
        full_len = like.shape[spec.dim] * state.tp.size if like.dim() > spec.dim else None
        out = reader.part(name, spec, state.tp.rank, state.tp.size, full_len)
    if tuple(out.shape) != tuple(like.shape):
        raise CheckpointError(
            f"{reader.folder}: tensor {name} has shape {tuple(out.shape)} for TP rank "
            f"{state.tp.rank} of {state.tp.size}, but the model's is {tuple(like.shape)}; the "
            "checkpoint holds a different model")
    return out


def load_model(step_dir: Path, meta: Meta, model: nn.Module, state: ParallelState,
               optimizer: Any = None) -> None:
    """Fill ``model``'s weights with this rank's part of the checkpoint's; an ``optimizer``
    holding the fp32 masters apart (``load_master``: a distributed optimizer under ``--bf16``)
    takes them at the checkpoint's precision.

    A LoRA checkpoint (``checkpoint.lora``) fills the base weights from its base checkpoint and
    the adapters from itself; LoRA adapters a plain checkpoint lacks (a LoRA run starting from
    a base) keep their start."""
    if lora.spec_of(meta) is not None:
        base_dir, base_meta = lora.base_of(step_dir, meta)
        _load_tensors(base_dir, base_meta, model, state, optimizer, adapters=False)
        _load_tensors(step_dir, meta, model, state, optimizer, adapters=True)
    else:
        _load_tensors(step_dir, meta, model, state, optimizer, adapters=False)


def _load_tensors(step_dir: Path, meta: Meta, model: nn.Module, state: ParallelState,
                  optimizer: Any, adapters: bool) -> None:
    """The model's base weights (``adapters`` False) or its LoRA adapters from ``step_dir``."""
    reader = ShardReader(step_dir)
    names = set()
    load_master = getattr(optimizer, "load_master", None)
    with torch.no_grad():
        for name, p in named_model_tensors(model):
            if is_adapter_name(name) != adapters:
                continue
            value = read_part(reader, meta, name, p, state)
            if load_master is not None:
                load_master(p, value)
            else:
                p.copy_(value.to(p.dtype))
            names.add(name)
    extra = sorted(k for k in meta.tensors if not k.startswith("optimizer.") and k not in names)
    if extra and state.pp.size == 1:  # (a pipeline stage holds only its share)
        raise CheckpointError(f"{step_dir}: tensors {extra[:5]} have no place in this model; the "
                              "checkpoint holds a different model")


def load_optimizer(step_dir: Path, meta: Meta, optimizer: Any,
                   model: nn.Module, state: ParallelState) -> None:
    """Fill ``optimizer``'s state (AdamW moments and steps) with this rank's part (a
    distributed optimizer keeps its DP chunks of it)."""
    reader = ShardReader(step_dir)
    slots: dict[str, list[str]] = {}
    for key in meta.tensors:
        if key.startswith("optimizer."):
            slot, name = key[len("optimizer."):].split("/", 1)
            slots.setdefault(name, []).append(slot)
    # One parameter at a time: a distributed optimizer keeps its chunks of each and drops the
    # rest before the next is read (never the model's full state at once).
    keep = getattr(optimizer, "load_param_state", None)
    for name, p in named_model_tensors(model):
        entry = {}
        for slot in slots.get(name, []):
            key = f"optimizer.{slot}/{name}"
            like = p if _spec(meta, key, step_dir).shape else torch.empty(())  # scalar: step
            value = read_part(reader, meta, key, like, state, p)
            entry[slot] = value.to(p.device) if value.dim() else value
        if entry and keep is not None:
            keep(p, entry)
        elif entry:
            optimizer.state[p] = entry
        del entry


def load_rng(step_dir: Path, meta: Meta, state: ParallelState) -> None:
    """Restore the dropout streams. Same layout: each rank's own. Another TP size: the
    replicated streams (equal on every TP rank); the TP-distinct ones of the saved ranks do not
    map onto the new ranks, so they restart from the seed and the step. Another PP size: a
    stage's streams drew for other layers, so all restart."""
    if meta.layout.get("pp", 1) != state.pp.size:
        state.rng.load_state_dict({"seed": meta.rng_seed, "states": {}},
                                  reseed_model_parallel=meta.step, device=state.device)
        return
    same = meta.layout["tp"] == state.tp.size and not meta.extra.get(
        "rng_model_parallel_restart")
    rel = layout.rng_file(state.tp.rank if meta.layout["tp"] == state.tp.size else 0,
                          state.pp.rank)
    if rel not in meta.files:
        return
    states = ShardReader(step_dir).all_tensors(rel)
    if not same:
        states = {k: v for k, v in states.items() if k.startswith("replicated|")}
    state.rng.load_state_dict({"seed": meta.rng_seed, "states": states},
                              reseed_model_parallel=None if same else meta.step,
                              device=state.device)


def load_tokenizer(step_dir: Path, meta: Meta) -> Any:
    """The tokenizer a checkpoint was made with (its own copy of the files)."""
    from domino.data import tokenizer as tk
    from domino.data.tokenizer import BPETokenizer, ByteTokenizer, HFTokenizer

    record = meta.tokenizer or {}
    kind = record.get("kind")
    folder = step_dir / layout.TOKENIZER_DIR
    fixed = {"bpe": (tk.VOCAB_FILE, tk.MERGES_FILE), "hf": (tk.HF_TOKENIZER_FILE, tk.HF_SIDECAR)}
    for name in fixed.get(kind, ()):  # read by these names, listed or not: no link out
        layout.inside(step_dir, f"{layout.TOKENIZER_DIR}/{name}", "tokenizer file")
    try:
        if kind == "byte":
            tok: Any = ByteTokenizer()
        elif kind == "bpe":
            tok = BPETokenizer.load(folder)
        elif kind == "hf":
            tok = HFTokenizer.load(folder)
        else:
            raise CheckpointError(f"{step_dir / layout.META}: no usable tokenizer record "
                                  f"({record!r})")
    except CheckpointError:
        raise
    except Exception as err:  # the tokenizers library raises its own types
        names = ", ".join(record.get("files") or [])
        raise CheckpointError(f"{folder}: the tokenizer files ({names}) cannot be read: "
                              f"{err}") from None
    if tok.vocab_hash() != record.get("vocab_hash"):
        raise CheckpointError(f"{folder}: the tokenizer files differ from the ones the "
                              "checkpoint was saved with (vocabulary hash mismatch)")
    return tok
