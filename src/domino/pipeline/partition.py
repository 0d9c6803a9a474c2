"""Which layers each pipeline stage (and each virtual stage of an interleaved pipeline) holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """``bounds[k]`` = (first layer, end) of virtual stage k, which runs on rank ``k % stages``
    as its model chunk ``k // stages``."""

    stages: int
    chunks: int
    bounds: tuple[tuple[int, int], ...]

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def layers(self, rank: int, chunk: int = 0) -> tuple[int, int]:
        return self.bounds[chunk * self.stages + rank]

    def is_first(self, rank: int, chunk: int) -> bool:
        return chunk * self.stages + rank == 0

    def is_last(self, rank: int, chunk: int) -> bool:
        return chunk * self.stages + rank == self.virtual_stages - 1

    def describe(self) -> str:
        if self.stages == 1:
            return "1 stage"
        per_rank = [[self.layers(r, c) for c in range(self.chunks)] for r in range(self.stages)]
        text = "; ".join(f"stage {r}: " + ", ".join(f"layers {a}-{b - 1}" for a, b in chunks)
                         for r, chunks in enumerate(per_rank))
        return f"{self.stages} stages x {self.chunks} chunk(s) ({text})"


def partition(num_layers: int, stages: int, layers_per_virtual_stage: int | None = None,
              stage_layers: tuple[int, ...] | None = None) -> Layout:
    """Cut ``num_layers`` into ``stages`` pipeline stages: evenly, by ``stage_layers`` (one count
    per stage), or into virtual stages of ``layers_per_virtual_stage`` layers each (interleaved
    1F1B). ValueError naming the
    fields (``TrainArgs``'s) when the numbers do not fit."""
    if stages < 1:
        raise ValueError(f"pipeline_model_parallel_size={stages} must be >= 1")
    if stage_layers is not None:
        if layers_per_virtual_stage is not None:
            raise ValueError("pipeline_stage_layers and num_layers_per_virtual_pipeline_stage"
                             " exclude each other: uneven stages or interleaved chunks, not both")
        if len(stage_layers) != stages:
            raise ValueError(f"pipeline_stage_layers has {len(stage_layers)} counts for "
                             f"{stages} pipeline stages; give one count per stage")
        if any(n < 1 for n in stage_layers) or sum(stage_layers) != num_layers:
            raise ValueError(f"pipeline_stage_layers {','.join(map(str, stage_layers))} must "
                             f"be counts >= 1 adding up to num_layers={num_layers}")
        counts = list(stage_layers)
        chunks = 1
    elif layers_per_virtual_stage is not None:
        per = layers_per_virtual_stage
        if per < 1 or num_layers % (per * stages):
            raise ValueError(
                f"num_layers_per_virtual_pipeline_stage={per}: {num_layers} layers do not "
                f"split into {stages} stages x chunks of {per} layers (the layers must be a "
                f"multiple of {per * stages}); change it or num_layers")
        chunks = num_layers // (per * stages)
        counts = [per] * (stages * chunks)
    else:
        if num_layers % stages:
            raise ValueError(
                f"num_layers={num_layers} does not divide into {stages} pipeline stages; "
                "change num_layers or pipeline_model_parallel_size, or give uneven stages "
                f"with pipeline_stage_layers (one count per stage, adding up to {num_layers})")
        counts = [num_layers // stages] * stages
        chunks = 1
    bounds, start = [], 0
    for n in counts:
        bounds.append((start, start + n))
        start += n
    return Layout(stages, chunks, tuple(bounds))
