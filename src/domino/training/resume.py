"""What a run folder and a checkpoint to resume from must satisfy, checked before any process
starts: ``--save`` is writable, has room for a checkpoint and holds no other run (unless
``--overwrite`` or ``--load`` says what to do with it); ``--load`` names an intact checkpoint
whose model is the one this run builds."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from domino.checkpoint import layout
from domino.checkpoint.layout import CheckpointError, Meta, open_checkpoint
from domino.config import TransformerConfig
from domino.training.arguments import TrainArgs
from domino.training.model_flags import flag_label
from domino.utils import check_output_dir, format_bytes

# What makes a folder hold a run (a folder with only config.* is a launch that never trained).
RUN_MARKERS = ("metrics.jsonl", layout.CHECKPOINTS)
# What --overwrite deletes: everything a run writes into its folder, nothing else.
RUN_OUTPUTS = (layout.CHECKPOINTS, "metrics.jsonl", "loss_curve.png", "sample.txt",
               "autotune.json", "tensorboard", "config.json", "config.toml")
BYTES_PER_PARAM_SAVED = 3  # x the parameter size: weights + AdamW's two moments

@dataclass
class Resume:
    """The checkpoint a run continues from (or, without optimizer state, starts from)."""

    step_dir: Path
    meta: Meta
    notes: list[str] = field(default_factory=list)
    finetune: bool = False  # --finetune: its weights only, whatever else it holds

    @property
    def weights_only(self) -> bool:
        """No optimizer state (an imported or converted model), or --finetune: a new run from
        its weights."""
        return self.finetune or not self.meta.has_optimizer

    @property
    def start_step(self) -> int:
        return 0 if self.weights_only else self.meta.step

    @property
    def consumed(self) -> int:
        return 0 if self.weights_only else self.meta.consumed_samples


def open_resume(args: TrainArgs, hashes: bool, progress: bool) -> Resume:
    """Find and check the ``--load`` checkpoint; ``args.load`` becomes its step folder, so every
    rank loads exactly that one."""
    assert args.load is not None
    try:
        step_dir, meta, notes = open_checkpoint(args.load, hashes=hashes,
                                                fallback=args.load_fallback)
    except CheckpointError as err:
        raise ValueError(f"--load {args.load}: {err}") from None
    if progress:
        for note in notes:
            print(f"domino train: {note}")
    args.load = str(step_dir.resolve())
    return Resume(step_dir.resolve(), meta, notes, finetune=args.finetune)


def check_save_dir(args: TrainArgs, resume: Resume | None) -> None:
    """``--save`` is a folder this process can write, and holds no run it would mix with."""
    assert args.save is not None
    save = Path(args.save)
    check_output_dir(save, "--save")
    check_not_in_checkpoint(save)
    try:
        save.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--save {save}: cannot create it ({err.strerror or err}); pass a "
                         "folder you can write to") from None
    linked = [n for n in RUN_OUTPUTS if (save / n).is_symlink()]
    if linked:  # reading or writing through it would reach wherever it leads
        raise ValueError(f"--save {save}: {', '.join(linked)} is a symbolic link, which domino "
                         "never makes in a run folder; remove it (or pass another --save)")
    root = save / layout.CHECKPOINTS
    held = [n for n in RUN_MARKERS if (save / n).exists()
            and not (n == layout.CHECKPOINTS and not any(root.iterdir()))]
    continuing = resume is not None and save.resolve() in resume.step_dir.parents
    _check_not_the_base(save, resume if continuing else None)
    if held and args.overwrite:
        if continuing:
            raise ValueError(f"--overwrite would delete {resume.step_dir}, the checkpoint --load "
                             "resumes from; drop --overwrite to continue the run, or pass "
                             "another --save")
        for name in RUN_OUTPUTS:
            target = save / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    elif held and not continuing:
        raise ValueError(
            f"--save {save} already holds a run ({', '.join(held)}): pass --load {save} to "
            "continue it, --overwrite to start over in it (deletes its checkpoints and "
            "metrics), or another --save")
    elif held and not resume.weights_only:
        newer = [d.name for s, d in layout.list_steps(root) if s > resume.meta.step]
        if newer:
            raise ValueError(
                f"--load {resume.step_dir} continues at step {resume.meta.step} in --save "
                f"{save}, which holds newer checkpoints ({', '.join(newer)}); pass another "
                "--save (or --load the newest)")
    removed = layout.remove_partial_saves(root)
    if removed:
        print(f"domino train: removed {len(removed)} interrupted save(s) in {root}: "
              + ", ".join(p.name for p in removed))


def _check_not_the_base(save: Path, resume: Resume | None) -> None:
    """A fine-tune never writes into the run it starts from (``resume``: one ``save`` holds)."""
    if resume is not None and resume.finetune:
        raise ValueError(f"--save {save} is the run --finetune starts from ({resume.step_dir}); "
                         "a fine-tune writes a new run and never touches the base: pass "
                         "another --save")


def check_compatible(args: TrainArgs, run, resume: Resume) -> None:
    """The checkpoint's model is the one this run builds, with the same tokenizer."""
    try:
        saved = TransformerConfig.from_dict(resume.meta.config)
    except (TypeError, ValueError) as err:
        raise ValueError(f"--load {resume.step_dir}: its model config is unusable ({err})"
                         ) from None
    mine, theirs = run.config.architecture(), saved.architecture()
    diffs = model_differences(mine, theirs)
    if diffs:
        parts = [f"{flag_label(n)} is {_shown(n, theirs.get(n))} in the "
                 f"checkpoint but {_shown(n, mine.get(n))} here" for n in diffs]
        raise ValueError(
            f"--load {resume.step_dir}: the checkpoint holds another model: {'; '.join(parts)}. "
            f"Pass the checkpoint's settings (its config.toml, or {layout.META}) or drop --load")
    record = resume.meta.tokenizer
    if record and record.get("vocab_hash") != run.tokenizer.vocab_hash():
        raise ValueError(
            f"--load {resume.step_dir}: the checkpoint was trained with a {record.get('kind')} "
            f"tokenizer of {record.get('vocab_size')} tokens (hash {record.get('vocab_hash')}), "
            f"this run uses a {run.tokenizer.name} tokenizer of {run.tokenizer.vocab_size} "
            f"(hash {run.tokenizer.vocab_hash()}); pass the checkpoint's tokenizer (its files "
            f"are in {resume.step_dir / layout.TOKENIZER_DIR})")


# Settings that decide whether others apply (TransformerConfig.architecture() leaves out the
# moe_* settings without experts, the RoPE ones without RoPE, ...): named first when they differ.
GOVERNING = ("num_experts", "position_embedding_type", "rope_scaling_type")


def model_differences(mine: dict, theirs: dict) -> list[str]:
    """The architecture settings that differ between two models, governing ones first. A
    setting only one side has applies only because a governing setting differs (``moe_*``
    when one model has experts and the other none): it is not a difference of its own, and is
    named only if nothing else differs."""
    both = [n for n in set(mine) & set(theirs) if mine[n] != theirs[n]]
    names = both or list(set(mine) ^ set(theirs))
    return sorted(names, key=lambda n: (n not in GOVERNING, n))


def _shown(name: str, value) -> str:
    if value is None:
        return "unset (a dense model: no experts)" if name == "num_experts" else "unset"
    return repr(value)


def parameter_bytes(config: TransformerConfig) -> int:
    """Bytes of the full model's parameters (built on the meta device: nothing is allocated)."""
    from domino.models.gpt import GPTModel
    from domino.parallel_state import ParallelState

    model = GPTModel(config, parallel_state=ParallelState.single("meta"))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def check_free_space(args: TrainArgs, config: TransformerConfig) -> None:
    """Room on ``--save``'s filesystem for one more checkpoint (old ones go once it is in)."""
    need = parameter_bytes(config) * BYTES_PER_PARAM_SAVED
    free = shutil.disk_usage(args.save).free
    if free < need * 1.1:
        raise ValueError(
            f"--save {args.save}: {format_bytes(free)} free on its filesystem, but a "
            f"checkpoint of this model takes about {format_bytes(need)}; free space or pass "
            "another --save")


def check_not_in_checkpoint(save: Path) -> None:
    """``--save`` is not inside a checkpoints folder or a step folder (its own or another
    run's): a run written there would mix with the checkpoints and be deleted by their
    rotation."""
    for folder in (save.resolve(), *save.resolve().parents):
        is_step = (folder / layout.META).is_file() or (
            layout.is_step_dir_name(folder.name) and folder.parent.name == layout.CHECKPOINTS)
        is_root = (folder / layout.LATEST).is_file() or (
            folder.name == layout.CHECKPOINTS and bool(layout.list_steps(folder)))
        if is_step or is_root:
            run = folder.parent if is_root else folder.parent.parent
            raise ValueError(
                f"--save {save} is inside {folder}, a checkpoint folder of the run in {run}; "
                f"pass a run folder outside it (to continue that run: --load {run} --save {run})")
