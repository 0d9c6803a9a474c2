"""Where a checkpoint's files are, what its JSON says, and how to tell an intact one.

::

    RUN/checkpoints/
      latest.json                       {"step": 300, "dir": "step_0000300"}, replaced last
      step_0000300/
        checkpoint.json                 everything but tensors: format, library version, step,
                                        consumed samples, model config, plan, settings, tokenizer,
                                        TP x PP x DP layout, every tensor's name, full shape, dtype,
                                        how it is split (dim, stride, vocabulary padding) and which
                                        file holds which part, every file's size and SHA-256
        model-tp00-pp00.safetensors     one per (TP rank, PP stage): that rank's weights
        optim-tp00-pp00.safetensors     its AdamW state (exp_avg / exp_avg_sq / step per weight)
        rng-tp00-pp00.safetensors       its dropout generators' states
        tokenizer/                      vocab.json + merges.txt (BPE), tokenizer.json (HF), or none
      step_0000400.tmp/                 a save in progress (or interrupted: removed at next start)

Tensors are only ever read from safetensors files and everything else from JSON: nothing on the
load path unpickles. A checkpoint directory gets its final name only once every rank's files
and ``checkpoint.json`` are complete, so a crash mid-save leaves the previous one intact. Every
file name read from the JSON must be of a form above and stay in its folder through no
symbolic link (domino writes none), checked before anything is opened (``inside``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from domino.checkpoint.files import (  # noqa: F401  (re-exported: the format's one namespace)
    TMP_SUFFIX,
    file_record,
    safetensors_header_problem,
    sha256_of,
    write_json_atomic,
)
from domino.safe_files import NotAFileError, fsync_dir, read_regular  # noqa: F401

FORMAT = "domino-checkpoint"
FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
LATEST = "latest.json"
META = "checkpoint.json"
TOKENIZER_DIR = "tokenizer"
_STEP_RE = re.compile(r"^step_(\d{7,})$")
_MAX_JSON_BYTES = 256 << 20  # a checkpoint.json of a huge model is a few MiB
# The names domino writes in a step folder (model_file, optim_file, rng_file below) and the
# tokenizer's own files one level down (vocab.json, merges.txt, tokenizer.json, domino.json).
_SHARD_NAME = re.compile(r"(model|optim|rng)-tp\d{2,}-pp\d{2,}\.safetensors")
_PLAIN_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
REFUSED_FIX = "the checkpoint was edited or is not from domino; use an intact one"
ESCAPE_LINK = "it is a symbolic link (domino never writes one)"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def model_file(tp_rank: int, pp_rank: int = 0) -> str:
    return f"model-tp{tp_rank:02d}-pp{pp_rank:02d}.safetensors"


def optim_file(tp_rank: int, pp_rank: int = 0) -> str:
    return f"optim-tp{tp_rank:02d}-pp{pp_rank:02d}.safetensors"


def rng_file(tp_rank: int, pp_rank: int = 0) -> str:
    return f"rng-tp{tp_rank:02d}-pp{pp_rank:02d}.safetensors"


# ---- names read from a checkpoint --------------------------------------------------------------


def name_problem(rel: object) -> str | None:
    """Why ``rel`` is not a plain relative path (None when it is); nothing is looked up."""
    if not isinstance(rel, str) or not rel:
        return "a file name must be a non-empty string"
    if _CONTROL.search(rel):
        return "control characters (NUL, newline, ...) are not allowed in a file name"
    if "\\" in rel:
        return "backslashes are not allowed in a file name"
    if rel.startswith("/"):
        return "absolute paths are not allowed"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "'..', '.' and empty path components are not allowed"
    return None


def checkpoint_name_problem(rel: object) -> str | None:
    """Why ``rel`` is not a name domino writes into a step folder (None when it is)."""
    bad = name_problem(rel)
    if bad:
        return bad
    folder, _, file = str(rel).rpartition("/")
    if _SHARD_NAME.fullmatch(str(rel)) or (folder == TOKENIZER_DIR
                                           and _PLAIN_FILE.fullmatch(file)):
        return None
    return ("domino writes only model-/optim-/rng-tpNN-ppNN.safetensors and "
            f"{TOKENIZER_DIR}/<file name>")


def escape_problem(folder: Path, rel: str) -> str | None:
    """Why ``folder / rel`` (``rel`` a plain name) may lead out of ``folder`` (None when it
    cannot). Each component is tested for being a link before anything resolves it, so a
    link's target is never looked at; domino never writes links, so any is refused."""
    path = folder
    for part in rel.split("/"):
        path = path / part
        if path.is_symlink():
            return ESCAPE_LINK
    if not path.resolve().is_relative_to(folder.resolve()):
        return "it resolves outside the checkpoint folder"
    return None


def refusal(what: str, rel: object, rule: str) -> str:
    """Why a name is refused: the name and the rule, and never anything about where it leads
    (whether a file is there, its size)."""
    return f"{what} {rel!r} is refused: {rule}; {REFUSED_FIX}"


def refused(listed_in: Path, what: str, rel: object, rule: str) -> CheckpointError:
    return CheckpointError(f"{listed_in}: {refusal(what, rel, rule)}")


def inside(folder: Path, rel: str, what: str = "file", form: bool = True) -> Path:
    """``folder / rel`` once ``rel`` is a plain name (of a checkpoint's forms, unless not
    ``form``) reaching a path inside ``folder`` through no symbolic link; otherwise
    CheckpointError naming ``folder``'s checkpoint.json as the listing file."""
    bad = (checkpoint_name_problem(rel) if form else name_problem(rel)) or escape_problem(
        folder, rel)
    if bad:
        raise refused(folder / META, what, rel, bad)
    return folder / rel


def _check_names(meta: Meta, path: Path) -> None:
    """Every name ``checkpoint.json`` lists is of a checkpoint's forms, and every tensor's and
    the tokenizer's files are among its ``files``."""
    for rel, rec in meta.files.items():
        bad = checkpoint_name_problem(rel) or (
            None if isinstance(rec, dict) else "its record is not a JSON object")
        if bad:
            raise refused(path, "file", rel, bad)
    tokenizer = meta.tokenizer if meta.tokenizer is not None else {}
    names = tokenizer.get("files", []) if isinstance(tokenizer, dict) else None
    if not isinstance(names, list):
        raise CheckpointError(f"{path}: the tokenizer record {tokenizer!r} is malformed")
    uses = [("tokenizer file", n, f"{TOKENIZER_DIR}/{n}") for n in names]  # (listed bare)
    for name, rec in meta.tensors.items():
        files = rec.get("files") if isinstance(rec, dict) else None
        if not isinstance(files, list) or not files:
            raise CheckpointError(f"{path}: tensor {name!r} lists no files")
        uses += [(f"tensor {name}'s file", rel, rel) for rel in files]
    for what, rel, full in uses:
        bad = name_problem(rel) or checkpoint_name_problem(full)
        if not bad and full not in meta.files:
            bad = "it is not among the checkpoint's files"
        if bad:
            raise refused(path, what, rel, bad)


# ---- JSON -----------------------------------------------------------------------------------


def read_json(path: Path, what: str, follow: bool = False) -> dict[str, Any]:
    """A JSON object from ``path``; CheckpointError naming the file when it is not one. A link
    is refused without being followed (the message is the same wherever it points) unless
    ``follow``: a Hugging Face folder's files, whose links ``hf_file`` has judged."""
    try:
        raw = read_regular(path, _MAX_JSON_BYTES, follow=follow)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (the {what})") from None
    except NotAFileError:
        kind = "a symbolic link" if path.is_symlink() else "not a regular file"
        raise CheckpointError(f"{path} is refused: the {what} is {kind} (domino writes only "
                              f"regular files there); {REFUSED_FIX}") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read the {what}: {err.strerror or err}") from None
    if not raw.strip():
        raise CheckpointError(f"{path}: the {what} is empty; the file is damaged (cut short "
                              "by a crash or a full disk?): use another checkpoint")
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: the {what} is not UTF-8 text; the file is damaged or "
                              "was replaced: use another checkpoint") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: the {what} is not valid JSON ({err.msg} at line "
                              f"{err.lineno}, column {err.colno}); the file is damaged or was "
                              "replaced: use another checkpoint") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: the {what} must be a JSON object, not "
                              f"{type(value).__name__}")
    return value


# ---- the meta record ------------------------------------------------------------------------


@dataclass
class Meta:
    """What ``checkpoint.json`` holds (see the module docstring)."""

    step: int
    consumed_samples: int
    config: dict[str, Any]
    layout: dict[str, int]  # {"tp": .., "pp": .., "dp": ..} of the run that saved it
    tensors: dict[str, dict[str, Any]]
    files: dict[str, dict[str, Any]]
    plan: str | None = None
    args: dict[str, Any] | None = None
    tokenizer: dict[str, Any] | None = None
    has_optimizer: bool = True
    scaler: dict[str, Any] | None = None
    rng_seed: int | None = None
    library_version: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "format_version": FORMAT_VERSION,
                "library_version": self.library_version, "step": self.step,
                "consumed_samples": self.consumed_samples, "has_optimizer": self.has_optimizer,
                "layout": self.layout, "config": self.config, "plan": self.plan,
                "args": self.args, "tokenizer": self.tokenizer, "scaler": self.scaler,
                "rng_seed": self.rng_seed, "extra": self.extra, "tensors": self.tensors,
                "files": self.files}

    @classmethod
    def from_json(cls, raw: dict[str, Any], path: Path) -> Meta:
        if raw.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a domino checkpoint record (format "
                                  f"{raw.get('format')!r}, expected {FORMAT!r})")
        if raw.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{path}: format version {raw.get('format_version')!r}; this "
                                  f"library reads version {FORMAT_VERSION}")
        try:
            meta = cls(step=int(raw["step"]), consumed_samples=int(raw["consumed_samples"]),
                       config=dict(raw["config"]), layout={k: int(v) for k, v in
                                                          raw["layout"].items()},
                       tensors=dict(raw["tensors"]), files=dict(raw["files"]),
                       plan=raw.get("plan"), args=raw.get("args"),
                       tokenizer=raw.get("tokenizer"),
                       has_optimizer=bool(raw.get("has_optimizer", True)),
                       scaler=raw.get("scaler"), rng_seed=raw.get("rng_seed"),
                       library_version=str(raw.get("library_version", "")),
                       extra=dict(raw.get("extra") or {}))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CheckpointError(f"{path}: malformed checkpoint record ({err!r})") from None
        for key in ("tp", "pp", "dp"):
            if meta.layout.get(key, 0) < 1:
                raise CheckpointError(f"{path}: layout {meta.layout} lacks a positive {key!r}")
        _check_names(meta, path)
        return meta


# ---- finding and checking checkpoints ------------------------------------------------------


def checkpoints_root(path: str | os.PathLike) -> Path:
    """The ``checkpoints`` folder for a run folder, a checkpoints folder or a step folder."""
    p = Path(path)
    if (p / META).is_file() or _STEP_RE.match(p.name):
        return p.parent
    if (p / CHECKPOINTS).is_dir():
        return p / CHECKPOINTS
    return p


def list_steps(root: Path) -> list[tuple[int, Path]]:
    """Complete (renamed) step folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and not child.is_symlink():  # domino writes no links
            out.append((int(m.group(1)), child))
    return sorted(out)


def partial_saves(root: Path) -> list[Path]:
    """Leftovers of interrupted saves (folders and files with the temporary suffix)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.endswith(TMP_SUFFIX))


def remove_partial_saves(root: Path) -> list[Path]:
    """Delete what interrupted saves left; returns what was removed."""
    removed = partial_saves(root)
    for p in removed:
        if p.is_dir() and not p.is_symlink():  # a link is removed, not what it leads to
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return removed


def latest_step_dir(root: Path) -> Path:
    """The step folder ``latest.json`` names (CheckpointError when there is none)."""
    tracker = root / LATEST
    if not os.path.lexists(tracker):  # a link, dangling or not, is refused by read_json
        steps = list_steps(root)
        hint = (f" ({len(steps)} step folder(s) exist, e.g. {steps[-1][1]}: pass one of them)"
                if steps else "")
        raise CheckpointError(f"no checkpoint found in {root} (missing {tracker}){hint}")
    raw = read_json(tracker, "latest-checkpoint tracker")
    name = raw.get("dir")
    if not isinstance(name, str) or not _STEP_RE.match(name):
        raise CheckpointError(f"{tracker}: 'dir' must name a step folder, got {name!r}")
    step_dir = root / name
    if step_dir.is_symlink() or not step_dir.resolve().is_relative_to(root.resolve()):
        raise refused(tracker, "'dir'", name, "the step folder is a symbolic link or lies "
                      f"outside {root} (domino writes neither)")
    return step_dir


@dataclass
class Problem:
    path: Path
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def check(step_dir: Path, hashes: bool = True) -> tuple[Meta | None, list[Problem]]:
    """Read ``checkpoint.json`` and check every file it lists: present, of the recorded size,
    a parseable safetensors header, and (``hashes``) the recorded SHA-256. Returns the meta
    (None when the record itself is unusable) and what is wrong."""
    try:
        meta = Meta.from_json(read_json(step_dir / META, "checkpoint record"), step_dir / META)
    except CheckpointError as err:
        return None, [Problem(step_dir / META, str(err).split(": ", 1)[-1])]
    problems = []
    # Convert copies the tokenizer folder whole (following links), listed files or not: it
    # may hold plain files only.
    tok = step_dir / TOKENIZER_DIR
    for entry in [tok] if tok.is_symlink() else sorted(tok.iterdir()) if tok.is_dir() else []:
        rel = entry.relative_to(step_dir).as_posix()
        if rel not in meta.files and (entry.is_symlink() or not entry.is_file()):
            problems.append(Problem(step_dir / META, refusal("entry", rel, "it is a symbolic "
                                                             "link or a folder (domino writes "
                                                             "neither)")))
    for rel, rec in meta.files.items():
        bad = escape_problem(step_dir, rel)  # (the names themselves: Meta.from_json)
        if bad:
            problems.append(Problem(step_dir / META, refusal("file", rel, bad)))
            continue
        path = step_dir / rel
        if not path.is_file():
            problems.append(Problem(path, "missing"))
            continue
        size = path.stat().st_size
        if size != rec.get("bytes"):
            problems.append(Problem(path, f"{size} bytes, but {rec.get('bytes')} were written "
                                          "(truncated or replaced)"))
            continue
        if rel.endswith(".safetensors"):
            bad = safetensors_header_problem(path)
            if bad:
                problems.append(Problem(path, bad))
                continue
        if hashes and sha256_of(path) != rec.get("sha256"):
            problems.append(Problem(path, "content differs from what was written (SHA-256 "
                                          "mismatch): the file is corrupt"))
    return meta, problems


def open_checkpoint(path: str | os.PathLike, hashes: bool = True,
                    fallback: bool = False) -> tuple[Path, Meta, list[str]]:
    """The step folder ``path`` means (a run, a checkpoints folder or a step folder), checked.

    Returns (step folder, meta, notes). A damaged checkpoint raises CheckpointError naming
    every problem and the newest intact checkpoint; with ``fallback`` that one is used instead
    (``notes`` then says so).
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist")
    root = checkpoints_root(p)
    explicit = (p / META).is_file() or _STEP_RE.match(p.name) is not None
    step_dir = p if explicit else latest_step_dir(root)
    meta, problems = check(step_dir, hashes)
    if not problems:
        assert meta is not None
        return step_dir, meta, []
    listing = "; ".join(map(str, problems))
    intact = None
    for _step, other in reversed(list_steps(root)):
        if other != step_dir:
            m, probs = check(other, hashes)
            if not probs and m is not None:
                intact = (other, m)
                break
    if fallback and intact is not None:
        return intact[0], intact[1], [f"checkpoint {step_dir.name} is damaged ({listing}); "
                                      f"using {intact[0].name}, the newest intact one"]
    hint = (f"; the newest intact checkpoint is {intact[0]} (pass it, or add --load-fallback)"
            if intact is not None else "; no intact checkpoint remains in " + str(root))
    raise CheckpointError(f"checkpoint {step_dir} is damaged: {listing}{hint}")


def is_step_dir_name(name: str) -> bool:
    """``name`` is a step folder's (``step_0000300``), finished or in progress (``.tmp``)."""
    return _STEP_RE.match(name.removesuffix(TMP_SUFFIX)) is not None
