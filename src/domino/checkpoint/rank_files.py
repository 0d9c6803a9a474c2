"""What one rank writes into a checkpoint, streamed tensor by tensor.

A writing rank (:func:`writes`) writes its (TP rank, PP stage)'s weights and AdamW state, each
parameter's whole over data parallelism. A distributed optimizer holds only its DP chunks of
the fp32 masters and moments: they are gathered bucket by bucket
(:meth:`~domino.training.dist_optim.DistributedAdamW.stream_full`, a collective every rank
joins) and each tensor goes to its file as it arrives (:class:`~domino.checkpoint.stream.
StreamWriter`, whose header is laid out beforehand from the shapes), so no rank holds more
than about one bucket of gathered state beyond its training state. The files and the specs are
what the whole-state writer made: same names, dtypes, bytes and records.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from domino.checkpoint import layout
from domino.checkpoint.shards import TensorSpec, describe
from domino.checkpoint.stream import StreamWriter
from domino.models.lora import is_adapter_name
from domino.parallel_state import ParallelState
from domino.tensor_parallel.layers import gather_full
from domino.tensor_parallel.placement import placement_of

MASTER = "master"  # a parameter's value (its fp32 master where the optimizer holds one apart)


def writes(state: ParallelState) -> bool:
    """DP and CP replicas hold identical weights and optimizer state (CP ranks' gradients
    are summed over DP x CP): DP rank 0 of CP rank 0 writes."""
    return state.dp.rank == 0 and state.cp.rank == 0


def named_model_tensors(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``model``'s parameters under the full model's names (``model.checkpoint_tensors()``
    where a model - a pipeline stage - renames them)."""
    if hasattr(model, "checkpoint_tensors"):
        yield from model.checkpoint_tensors()
    else:
        yield from model.named_parameters()


def saved_tensors(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The tensors a checkpoint of ``model`` holds: its parameters (:func:`named_model_tensors`)
    or, for a model carrying LoRA adapters, the adapters only (``checkpoint.lora``)."""
    named = list(named_model_tensors(model))
    if any(is_adapter_name(n) for n, _ in named):
        return [(n, p) for n, p in named if is_adapter_name(n)]
    return named


class _Source:
    """Each saved parameter's value and AdamW slots whole over DP, as a checkpoint holds them:
    what they will be (:meth:`like`, :meth:`slots`: meta tensors, for the files' headers) and
    then the tensors themselves (:meth:`items`). A distributed optimizer's are gathered bucket
    by bucket (the step count agreed first: collectives every rank joins); a plain optimizer
    holds them whole."""

    def __init__(self, optimizer: Any, state: ParallelState) -> None:
        self.opt, self.state = optimizer, state
        self.sharded = hasattr(optimizer, "stream_full")
        self.step = optimizer.step_count() if self.sharded else None
        self.held = {id(p) for p in optimizer.params} if self.sharded else set()

    def whole(self, p: nn.Parameter) -> bool:
        """Is ``p`` an expert sharded over EP (saved whole, gathered over EP)?"""
        return self.state.ep.size > 1 and placement_of(p).shard == "ep"

    def _shape(self, p: nn.Parameter, shape: tuple[int, ...]) -> tuple[int, ...]:
        if not (self.whole(p) and shape == tuple(p.shape)):
            return shape
        out = list(shape)
        out[placement_of(p).dim] *= self.state.ep.size
        return tuple(out)

    def like(self, p: nn.Parameter) -> torch.Tensor:
        """A meta tensor shaped and typed as ``p``'s saved value."""
        dtype = torch.float32 if id(p) in self.held else p.dtype
        return torch.empty(self._shape(p, tuple(p.shape)), dtype=dtype, device="meta")

    def slots(self, p: nn.Parameter) -> dict[str, torch.Tensor]:
        """Meta tensors shaped and typed as ``p``'s saved AdamW slots, in the saved order."""
        if self.sharded:
            if self.step is None or id(p) not in self.held:
                return {}
            shape = self._shape(p, tuple(p.shape))
            return {"step": torch.empty((), device="meta"),
                    **{k: torch.empty(shape, device="meta") for k in ("exp_avg", "exp_avg_sq")}}
        out = {}
        for key, value in self._plain_slots(p).items():
            out[key] = torch.empty(self._shape(p, tuple(value.shape)), dtype=value.dtype,
                                   device="meta")
        return out

    def _plain_slots(self, p: nn.Parameter) -> dict[str, torch.Tensor]:
        """A plain optimizer's slots of ``p`` (none for what a distributed one does not hold)."""
        mine = self.opt.state.get(p, {}) if self.opt is not None and not self.sharded else {}
        return {k: v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                for k, v in mine.items()}

    def items(self, saved: list[nn.Parameter]) -> Iterator[tuple[nn.Parameter, str,
                                                                  torch.Tensor]]:
        """``(parameter, key, tensor)`` for every parameter of ``saved`` (and, sharded, every
        parameter the optimizer holds), ``key`` :data:`MASTER` or a slot; experts whole (a
        collective over EP). The caller drops each before the next (one bucket alive)."""
        if self.sharded:
            stream = self.opt.stream_full(self.step)
            rest = [p for p in saved if id(p) not in self.held]
        else:
            stream, rest = iter(()), saved
        for p, key, value in stream:
            yield self._whole(p, key, value)
            del value
        for p in rest:
            yield self._whole(p, MASTER, p.detach())
            for key, value in self._plain_slots(p).items():
                yield self._whole(p, key, value)

    def _whole(self, p: nn.Parameter, key: str, value: torch.Tensor):
        if self.whole(p) and (key == MASTER or value.shape == p.shape):
            value = gather_full(value, p, self.state.ep)
        return p, key, value


def _plan(model: nn.Module, source: _Source, state: ParallelState, optimizer: bool):
    """What this rank writes: ``(targets, files, specs)``: (parameter id, key) -> the names
    it is written under; file -> name -> (shape, dtype) for its header; name -> spec (in the
    order the whole-state writer gave them). Sharded tensors always, replicated ones only on TP
    rank 0 (identical on every TP rank); the last stage's copy of a tied word table never (the
    first stage writes it)."""
    tp, pp = state.tp, state.pp.rank
    model_files = [layout.model_file(r, pp) for r in range(tp.size)]
    optim_files = [layout.optim_file(r, pp) for r in range(tp.size)]
    mine_model, mine_optim = model_files[tp.rank], optim_files[tp.rank]
    targets: dict[tuple[int, str], list[str]] = {}
    files: dict[str, dict[str, tuple]] = {mine_model: {}}
    if optimizer:
        files[mine_optim] = {}
    specs: dict[str, TensorSpec] = {}

    def add(p: nn.Parameter, key: str, name: str, like: torch.Tensor, spec: TensorSpec,
            file: str) -> None:
        targets.setdefault((id(p), key), []).append(name)
        files[file][name] = (tuple(like.shape), like.dtype)
        specs[name] = spec

    for name, p in saved_tensors(model):
        placement = placement_of(p)
        if placement.tied_copy:
            continue
        if placement.shard == "tp" or tp.rank == 0:  # (experts are whole on every TP rank)
            like = source.like(p)
            add(p, MASTER, name, like, describe(like, p, tp.size, model_files, name), mine_model)
        for key, like in source.slots(p).items():
            spec = describe(like, p, tp.size, optim_files, name)
            if spec.dim is not None or tp.rank == 0:
                add(p, key, f"optimizer.{key}/{name}", like, spec, mine_optim)
    return targets, files, specs


def write_rank_files(tmp: Path, state: ParallelState, model: nn.Module, optimizer: Any,
                     records: dict[str, Any], attempt: Any) -> dict[str, Any]:
    """Write this rank's tensor files into ``tmp`` (a writing rank's; the gathers of the
    distributed optimizer's state and of experts are collectives every rank joins to the end,
    writer or not, failed or not); adds their records to ``records`` and returns their
    tensors' specs. A failed write is recorded in ``attempt`` (``_Attempt``: the later writes
    are then not tried)."""
    source = _Source(optimizer, state)
    saved = list(dict.fromkeys(p for _, p in saved_tensors(model)))
    writing = writes(state) and attempt.error is None
    targets, files, specs = _plan(model, source, state, optimizer is not None)
    writers: dict[str, StreamWriter] = {}
    with attempt.recording():
        if writing:
            for rel, tensors in files.items():
                writers[rel] = StreamWriter(tmp / rel, tensors)
    file_of = {name: rel for rel, tensors in files.items() for name in tensors}
    for p, key, value in source.items(saved):
        for name in targets.get((id(p), key), ()) if writers and attempt.error is None else ():
            with attempt.recording():
                writers[file_of[name]].write(name, value)
        del value  # (its bucket is freed before the next is gathered)
    for writer in writers.values():
        with attempt.recording():  # (closing flushes: a full disk may fail there)
            if attempt.error is None:
                writer.close()
            else:
                writer.abort()
    if not writing or attempt.error is not None:
        return {}
    with attempt.recording():
        for rel in files:
            records[rel] = layout.file_record(tmp / rel)
        rng = dict(state.rng.state_dict()["states"])
        if rng:
            rel = layout.rng_file(state.tp.rank, state.pp.rank)
            save_file({k: v.to("cpu").contiguous() for k, v in rng.items()}, str(tmp / rel))
            records[rel] = layout.file_record(tmp / rel)
    return {k: v.to_json() for k, v in specs.items()}
