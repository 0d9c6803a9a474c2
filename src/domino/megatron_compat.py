"""Megatron compatibility: the ``mpu``-style module functions (``initialize_model_parallel``,
``get_tensor_model_parallel_world_size``, ...) for code written against Megatron, over one
*current* :class:`~domino.parallel_state.ParallelState`.

That current state is the only module-level mutable value in the package, and only this
module reads or writes it. domino's own code takes a ``ParallelState`` explicitly; the seed's
language-model API (``get_language_model(config, ...)``, which takes no state) falls back to
the current one through :func:`resolve`.
"""

from __future__ import annotations

import torch

from domino.parallel_state import ParallelState

_CURRENT: ParallelState | None = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1,
                              device: torch.device | str | None = None,
                              shared_memory: bool = True, **sizes: int) -> ParallelState:
    """Build TP x DP (x PP, x CP, ...) groups over the current world and make them current:
    ``sizes`` are the other size keywords (``context_parallel_size``, ...; see
    :meth:`ParallelState.build`, also for ``shared_memory``)."""
    global _CURRENT
    if _CURRENT is not None:
        raise RuntimeError("model parallel is already initialised; call destroy_model_parallel().")
    _CURRENT = ParallelState.build(tensor_model_parallel_size, pipeline_model_parallel_size,
                                   device, shared_memory, **sizes)
    return _CURRENT


def model_parallel_is_initialized() -> bool:
    return _CURRENT is not None


def destroy_model_parallel() -> None:
    """Forget the current state, stopping its shared-memory transports."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.close()
    _CURRENT = None


def get_parallel_state() -> ParallelState:
    """The current state, or the single-process one when nothing was initialised."""
    return _CURRENT if _CURRENT is not None else ParallelState.single()


def resolve(state: ParallelState | None) -> ParallelState:
    """``state`` if given, else the current one (seed API functions take no state argument)."""
    return state if state is not None else get_parallel_state()


def _current() -> ParallelState:
    if _CURRENT is None:
        raise RuntimeError("model parallel is not initialised: call initialize_model_parallel().")
    return _CURRENT


def get_tensor_model_parallel_world_size() -> int:
    return _current().tp.size


def get_tensor_model_parallel_rank() -> int:
    return _current().tp.rank


def get_tensor_model_parallel_group():
    return _current().tp.group


def get_data_parallel_world_size() -> int:
    return _current().dp.size


def get_data_parallel_rank() -> int:
    return _current().dp.rank


def get_data_parallel_group():
    return _current().dp.group


def get_pipeline_model_parallel_world_size() -> int:
    return _current().pp.size


def get_pipeline_model_parallel_rank() -> int:
    return _current().pp.rank


def get_context_parallel_world_size() -> int:
    return _current().cp.size


def get_context_parallel_rank() -> int:
    return _current().cp.rank


def get_context_parallel_group():
    return _current().cp.group
