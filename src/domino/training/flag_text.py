"""Library errors in a command's words: the library names config fields and keywords
(``context_parallel_size=4``, ``seq_length``); ``domino train`` and ``domino bench`` print the
flags that set them (``--context-parallel-size 4``, ``--seq-length``).

One mapping, :func:`train_flags`, read from the three tables the flags come from: the model
flags (:mod:`~domino.training.model_flags`), the parallel sizes (:mod:`domino.parallel_dims`)
and the run-time flags (:mod:`~domino.training.runtime_flags`). ``domino bench`` maps those
names among its settings (:func:`command_flags`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import cache

from domino.parallel_dims import SIZED
from domino.training import model_flags, runtime_flags

# ``name=value``: the value a quoted string, or a word (a number, True, None) not ending in the
# sentence's full stop. A name inside a path, a dotted name or a flag is left alone.
_ASSIGNED = re.compile(r"(?<![\w.\-/'\"])([a-z][a-z0-9_]*)=('[^']*'|\"[^\"]*\"|-?[\w.+-]*\w)")
# A bare snake_case name (one underscore or more: plain words stay words).
_BARE = re.compile(r"(?<![\w.\-/'\"])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w/(=-]|\.\w)")


def as_flags(text: str, flags: Mapping[str, str]) -> str:
    """``text`` with each name of ``flags`` (field -> ``--flag``) spelled as its flag:
    ``name=value`` as ``--flag value`` (a switch: ``--flag`` / ``--no-flag``), a bare name as
    ``--flag``."""

    def assigned(m: re.Match[str]) -> str:
        name, value = m.group(1), m.group(2)
        flag = flags.get(name)
        if flag is None:
            return m.group(0)
        if value in ("True", "False"):
            return flag if value == "True" else "--no-" + flag[2:]
        if value[0] in "'\"":
            value = value[1:-1]
        return f"{flag} {value}"

    def bare(m: re.Match[str]) -> str:
        return flags.get(m.group(1), m.group(0))

    return _BARE.sub(bare, _ASSIGNED.sub(assigned, text))


def command_flags(settings: Iterable[str]) -> dict[str, str]:
    """The mapping of a command whose ``settings`` are flags of their own names: the library
    names among them (those :func:`train_flags` maps), each to its flag."""
    library = train_flags()
    return {name: _dashed(name) for name in settings if name in library}


def _dashed(name: str) -> str:
    return "--" + name.replace("_", "-")


@cache
def train_flags() -> dict[str, str]:
    """`domino train`'s mapping of the library's names: the model config's fields (a renamed one
    when one flag sets the same value: ``layernorm_epsilon`` -> ``--norm-epsilon``), the
    parallel sizes, the run-time config's fields and seed keywords, and the run's own settings
    (``pipeline_stage_layers``, ``global_batch_size``: every one a flag of its name)."""
    from domino.training.arguments import TrainArgs  # (it reads this module's tables' flags)

    names = [*model_flags.same_named(), *(str(d.size_field) for d in SIZED),
             *runtime_flags.SAME_NAMED, *(f.name for f in dataclasses.fields(TrainArgs)),
             *(x.name for f in runtime_flags.FROM_FLAGS.values() for x in f.flags)]
    out = {name: _dashed(name) for name in names}
    for name, renamed in model_flags.RENAMED.items():
        if len(renamed.flags) == 1 and renamed.flags[0].kind is not bool:
            out[name] = _dashed(renamed.flags[0].name)
    out["merges_file"] = "--merge-file"  # the BPE tokenizer's keyword for that file
    return out


@contextmanager
def flags_in_errors(flags: Mapping[str, str]) -> Iterator[None]:
    """Re-raise a ValueError from the block with its names spelled as ``flags``."""
    try:
        yield
    except ValueError as err:
        if type(err) is ValueError and err.args and isinstance(err.args[0], str):
            err.args = (as_flags(err.args[0], flags), *err.args[1:])
        raise
