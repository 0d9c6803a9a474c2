"""How a tensor is cut across TP ranks, and reading any rank's part for any TP size.

A TP-sharded tensor is described (from its parameter's
:class:`~domino.tensor_parallel.placement.Placement`) by its partition ``dim``, its ``stride``
(the dimension is ``stride`` equal blocks and each rank holds its part of every block: SwiGLU's
[gate; up]) and,
for vocabulary tables, the number of ``vocab`` rows that are real (the rest is padding, whose
amount depends on the TP size). Reading rank r of b of a tensor saved by a ranks gathers exactly
the rows rank r needs from the saved files (safetensors slices: no rank loads the whole model)
and fills padding rows with zeros. Replicated tensors are stored once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from domino.checkpoint.layout import CheckpointError, inside
from domino.tensor_parallel.placement import placement_of

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.uint8, torch.bool)}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint: full shape and dtype as saved, how it is split, and which
    file holds which part (``files[r]`` = TP rank r's file; one file when replicated)."""

    shape: tuple[int, ...]
    dtype: str
    files: tuple[str, ...]
    dim: int | None = None
    stride: int = 1
    vocab: int | None = None  # real rows along dim (vocabulary tables); the rest is padding

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "files": list(self.files),
                "dim": self.dim, "stride": self.stride, "vocab": self.vocab}

    @classmethod
    def from_json(cls, name: str, raw: dict[str, Any]) -> TensorSpec:
        try:
            spec = cls(tuple(int(x) for x in raw["shape"]), str(raw["dtype"]),
                       tuple(str(f) for f in raw["files"]),
                       None if raw.get("dim") is None else int(raw["dim"]),
                       int(raw.get("stride", 1)),
                       None if raw.get("vocab") is None else int(raw["vocab"]))
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"tensor {name}: malformed record {raw!r} ({err!r})") from None
        if spec.dtype not in _DTYPES:
            raise CheckpointError(f"tensor {name}: unsupported dtype {spec.dtype!r}")
        if spec.dim is not None and not (0 <= spec.dim < len(spec.shape)):
            raise CheckpointError(f"tensor {name}: dim {spec.dim} outside shape {spec.shape}")
        return spec


def describe(local: torch.Tensor, like: torch.Tensor, tp_size: int, files: list[str],
             name: str = "a tensor") -> TensorSpec:
    """The spec of a tensor whose local part is ``local``, split as parameter ``like``'s
    placement says (``files[r]``: the file TP rank r writes; a replicated tensor lives in
    ``files[0]``). Only TP cuts have a layout: a tensor sharded over another group is refused
    (NotImplementedError); experts sharded over EP are gathered whole before they are described
    (``rank_files._Source``)."""
    dtype = str(local.dtype).removeprefix("torch.")
    placement = placement_of(like)
    sharded = (placement.shard is not None and local.dim() > 0
               and local.shape == like.shape)  # not e.g. a scalar optimizer step
    if not sharded:
        return TensorSpec(tuple(local.shape), dtype, (files[0],))
    if placement.shard != "tp":
        raise NotImplementedError(
            f"{name} is sharded over {placement.shard!r}: checkpoints store TP shards only "
            "(a layout for other sharded dimensions comes with them)")
    shape = list(local.shape)
    shape[placement.dim] *= tp_size
    return TensorSpec(tuple(shape), dtype, tuple(files), placement.dim, placement.stride,
                      placement.rows)


def _parts(full: int, stride: int, size: int) -> tuple[int, int]:
    """(block length, per-rank part of a block) along the split dimension."""
    block = full // stride
    return block, block // size


class ShardReader:
    """Reads tensors (or TP parts of them) from a checkpoint's safetensors files."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._open: dict[str, Any] = {}

    def _file(self, rel: str) -> Any:
        handle = self._open.get(rel)
        if handle is None:
            # Names come from checkpoint.json (checked there); this also refuses a link planted
            # since, or a caller's unchecked name. (No form: tests read files of any name.)
            path = inside(self.folder, rel, "shard file", form=False)
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as err:  # safetensors raises its own error types
                raise CheckpointError(f"{path}: cannot be read as safetensors ({err})") from None
            self._open[rel] = handle
        return handle

    def _slice(self, rel: str, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        try:
            view = self._file(rel).get_slice(name)
            index = (slice(None),) * dim + (slice(start, stop),)
            return view[index]
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"{self.folder / rel}: cannot read {name} ({err})") from None

    def all_tensors(self, rel: str) -> dict[str, torch.Tensor]:
        """Every tensor of one file, by name."""
        handle = self._file(rel)
        try:
            return {k: handle.get_tensor(k) for k in handle.keys()}
        except Exception as err:
            raise CheckpointError(f"{self.folder / rel}: cannot read it ({err})") from None

    def full(self, name: str, spec: TensorSpec) -> torch.Tensor:
        """The whole tensor as saved (padding included)."""
        if spec.dim is None:
            try:
                return self._file(spec.files[0]).get_tensor(name)
            except CheckpointError:
                raise
            except Exception as err:
                raise CheckpointError(f"{self.folder / spec.files[0]}: cannot read {name} "
                                      f"({err})") from None
        return self.part(name, spec, 0, 1, spec.shape[spec.dim])

    def part(self, name: str, spec: TensorSpec, rank: int, size: int,
             full_len: int | None = None) -> torch.Tensor:
        """Rank ``rank`` of ``size``'s part of the tensor, whose full length along the split
        dimension is ``full_len`` for that layout (vocabulary padding may differ from the saved
        one; default: the saved length)."""
        if spec.dim is None:
            return self.full(name, spec)
        dim, stride = spec.dim, spec.stride
        saved_len = spec.shape[dim]
        full_len = saved_len if full_len is None else full_len
        real = spec.vocab if spec.vocab is not None else saved_len
        if spec.vocab is None and full_len != saved_len:
            raise CheckpointError(f"tensor {name}: length {full_len} along dim {dim} asked, "
                                  f"{saved_len} saved (only vocabulary padding may differ)")
        if full_len % (stride * size) or saved_len % (stride * len(spec.files)):
            raise CheckpointError(f"tensor {name}: {full_len} rows do not split into {size} x "
                                  f"{stride} parts")
        block_b, part_b = _parts(full_len, stride, size)
        block_a, part_a = _parts(saved_len, stride, len(spec.files))
        pieces = []
        for k in range(stride):
            lo = k * block_b + rank * part_b
            hi = lo + part_b
            i = lo
            while i < hi:
                if i - k * block_b + k * block_a >= min(real, (k + 1) * block_a):
                    pieces.append(self._zeros(spec, dim, hi - i))  # padding rows
                    break
                j = i - k * block_b  # position inside block k (same in both layouts)
                src = j // part_a
                off = k * part_a + j % part_a
                run = min(hi - i, part_a - j % part_a, real - (k * block_a + j))
                pieces.append(self._slice(spec.files[src], name, dim, off, off + run))
                i += run
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    def _zeros(self, spec: TensorSpec, dim: int, rows: int) -> torch.Tensor:
        shape = list(spec.shape)
        shape[dim] = rows
        return torch.zeros(shape, dtype=_DTYPES[spec.dtype])
