"""What a run is made of, built once: :class:`Run` (settings, model config, run-time config,
tokenizer, datasets), and :func:`prepare_run`, which checks everything that can be checked
before any process starts and fills in the derived settings.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from domino.config import TransformerConfig
from domino.context_parallel import check_context_parallel
from domino.data.checks import check_tokenizer, eod_of, open_dataset
from domino.data.tokenizer import Tokenizer
from domino.flops import check_peak_tflops
from domino.parallel_dims import model_dims
from domino.parallel_state import ParallelSizes
from domino.pipeline.schedules import check_schedule, theoretical_bubble
from domino.plan import Plan
from domino.runtime import CP_COMM_TYPES, RuntimeConfig, check_compile
from domino.training import fsdp_flags, model_flags
from domino.training.arguments import TrainArgs, field_types
from domino.training.data import (
    build_datasets,
    cache_folder,
    data_sources,
    make_tokenizer,
    normalized_blend,
    prepare_default_corpus,
)
from domino.training.flag_text import flags_in_errors, train_flags
from domino.training.lora_flags import check_lora
from domino.training.resume import (
    Resume,
    check_compatible,
    check_free_space,
    check_save_dir,
    open_resume,
)
from domino.training.validation import check_features
from domino.utils import removed_on_error


@dataclass(eq=False)
class Run:
    """One run's inputs: resolved settings (``args``), the model config, how the model runs
    (``runtime``: Domino plan, sequence parallelism, recomputation), the tokenizer and the
    train / validation datasets, and the run folder (None until known)."""

    args: TrainArgs
    config: TransformerConfig
    runtime: RuntimeConfig
    tokenizer: Tokenizer
    train_ds: Any
    valid_ds: Any
    run_dir: Path | None = None
    resume: Resume | None = None  # the checkpoint this run continues from

    @property
    def plan(self) -> Plan:
        """The Domino plan asked for (before any autotuning)."""
        return self.runtime.plan


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def model_config(args: TrainArgs, vocab_size: int) -> TransformerConfig:
    """The TransformerConfig of a run (raises ValueError with the field's message); how it
    runs is ``args.runtime()``."""
    return model_flags.model_config(args, vocab_size)


def default_run_dir() -> Path:
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        path, n = Path(f"{base}-{n}"), n + 1
    return path


def _positive(args: TrainArgs, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(args, name)
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ValueError(f"--{name.replace('_', '-')}={value} must be {bound}.")


def _check_scalars(args: TrainArgs) -> None:
    for name, kind in field_types().items():
        value = getattr(args, name)
        if kind is float and value is not None and not math.isfinite(value):
            raise ValueError(f"--{name.replace('_', '-')}={value} must be a finite number.")
    # The model's sizes first: a zero width would otherwise be blamed on the Domino plan.
    _positive(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length",
              "make_vocab_size_divisible_by", *(
                  name for name in ("ffn_hidden_size", "num_query_groups", "kv_channels",
                                    "max_position_embeddings",
                                    "num_layers_per_virtual_pipeline_stage", "nproc")
                  if getattr(args, name) is not None))
    _positive(args, *args.parallel_sizes(), "micro_batch_size", "train_iters", "log_interval",
              "lr", "distributed_timeout_minutes")
    _positive(args, "eval_interval", "eval_iters", "min_lr", "lr_warmup_iters", "weight_decay",
              "clip_grad", "save_interval", "exit_interval", "sample_tokens",
              "save_interval_minutes", "keep_checkpoints", "max_nonfinite_steps",
              allow_zero=True)
    if args.min_lr > args.lr:
        raise ValueError(f"--min-lr={args.min_lr} is larger than --lr={args.lr}.")
    if args.top_k < 1:
        raise ValueError(f"--top-k={args.top_k} must be >= 1 (1 = greedy).")
    if args.temperature <= 0:
        raise ValueError(f"--temperature={args.temperature} must be > 0.")
    if args.lr_decay_iters is not None and args.lr_decay_iters < 1:
        raise ValueError(f"--lr-decay-iters={args.lr_decay_iters} must be >= 1.")


def _check_device(args: TrainArgs, local_procs: int) -> None:
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 are exclusive; pick one.")
    check_peak_tflops(args.peak_tflops)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available; use --device cpu.")
        if local_procs > torch.cuda.device_count():
            raise ValueError(f"{local_procs} local processes but only "
                             f"{torch.cuda.device_count()} CUDA devices; lower --nproc.")
    check_compile(args.compile, args.compile_backend, args.device, "--compile")
    if args.device != "cuda" and args.fp16:
        raise ValueError("--fp16 needs a CUDA device (fp16 compute with dynamic loss scaling is "
                         "GPU only); use --bf16 on CPU.")


def _check_batches(args: TrainArgs, dp: int) -> None:
    if args.global_batch_size is None:
        # A pipeline gets one pipeline micro-batch per stage: fewer would leave stages idle.
        args.global_batch_size = args.micro_batch_size * dp * args.pipeline_model_parallel_size
    per_step = args.micro_batch_size * dp
    if args.global_batch_size < 1 or args.global_batch_size % per_step:
        raise ValueError(
            f"--global-batch-size={args.global_batch_size} is not a positive multiple of "
            f"--micro-batch-size={args.micro_batch_size} x data-parallel size {dp} = {per_step}; "
            "gradient accumulation needs a whole number of micro-batches per rank.")
    plan = args.plan()
    plan.check_fits(args.micro_batch_size, what="--domino-micro-batches",
                    batch_name="--micro-batch-size")
    plan.check_width(args.hidden_size, what="--domino-column-chunks",
                     width_name="--hidden-size")


def _check_pipeline(args: TrainArgs, dp: int, progress: bool) -> None:
    """The layers cut into stages, and a schedule that can run them."""
    layout = args.pipeline_layout()
    if args.pipeline_model_parallel_size == 1:
        if args.pipeline_schedule not in (None, "1f1b"):
            raise ValueError(f"--pipeline-schedule {args.pipeline_schedule} needs "
                             "--pipeline-model-parallel-size > 1")
        return
    if args.domino_autotune:
        raise ValueError("--domino-autotune times one stage's forward and backward alone, which "
                         "a pipeline stage cannot run; with --pipeline-model-parallel-size > 1 "
                         "pick the Domino plan with the --domino-* flags")
    micro_batches = args.global_batch_size // (args.micro_batch_size * dp)
    schedule = args.schedule()
    check_schedule(schedule, layout.stages, micro_batches, layout.chunks)
    if micro_batches < layout.stages and progress:
        bubble = theoretical_bubble(schedule, layout.stages, micro_batches, layout.chunks)
        print(f"domino train: {micro_batches} pipeline micro-batch(es) per step for "
              f"{layout.stages} stages: {schedule}'s bubble will be about {bubble:.0%} of the "
              "stages' time; raise --global-batch-size (pipeline micro-batches = global batch / "
              "(micro-batch size x DP)) for a smaller one")


def _check_context_parallel(args: TrainArgs) -> None:
    """``--context-parallel-size``: what CP attention needs, and what does not run with it yet."""
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    check_context_parallel(seq_length=args.seq_length, context_parallel_size=cp,
                           num_attention_heads=args.num_attention_heads,
                           num_query_groups=args.num_query_groups,
                           attention_dropout=args.attention_dropout,
                           kind=CP_COMM_TYPES[args.cp_comm_type], tensor_model_parallel_size=tp,
                           attention_softcap=args.attention_softcap,
                           attention_sinks=args.attention_sinks)
    if cp == 1:
        return
    if args.sequence_parallel and tp > 1 and (args.seq_length // cp) % tp:
        raise ValueError(
            f"--sequence-parallel splits each CP rank's {args.seq_length // cp} tokens "
            f"(--seq-length {args.seq_length} / --context-parallel-size {cp}) over the "
            f"--tensor-model-parallel-size {tp} ranks: use a --seq-length that is a multiple "
            f"of {2 * cp * tp // math.gcd(2, tp)}.")
    if args.domino_autotune:
        raise ValueError(f"--domino-autotune does not run with --context-parallel-size {cp} "
                         "yet: drop it (pick --domino-micro-batches / --domino-overlap), or use "
                         "--context-parallel-size 1.")


def _check_link(args: TrainArgs, world_size: int) -> None:
    """``--emulate-link``: one emulated host per local rank."""
    if args.emulate_link is None:
        if args.emulate_hosts is not None:
            raise ValueError("--emulate-hosts sets how many hosts --emulate-link emulates: add "
                             "--emulate-link RATE")
        return
    from domino.netem import check_can_emulate, parse_rate

    args.emulate_link = parse_rate(args.emulate_link)
    if under_torchrun():
        raise ValueError("--emulate-link starts the ranks itself in network namespaces; run "
                         "`domino train` without torchrun")
    if world_size < 2:
        raise ValueError(f"--emulate-link needs two or more ranks (one emulated host each); "
                         f"the world size is {world_size}: raise --nproc or "
                         "--tensor-model-parallel-size")
    hosts = args.emulate_hosts if args.emulate_hosts is not None else world_size
    if hosts < 2 or world_size % hosts:
        raise ValueError(f"--emulate-hosts={hosts} must be >= 2 and divide the world size "
                         f"{world_size} (each host runs world / hosts consecutive ranks)")
    if args.device not in (None, "cpu"):
        raise ValueError("--emulate-link shapes gloo's TCP traffic; use it with --device cpu")
    try:
        check_can_emulate()
    except RuntimeError as err:
        raise ValueError(f"--emulate-link: {err}") from err


def prepare_run(args: TrainArgs, world_size: int | None = None, progress: bool = True,
                run_dir: Path | None = None) -> Run:
    """Check everything that can be checked without starting processes and build the run; fills
    in nproc, device, save, data_path, tokenizer, global_batch_size and max_position_embeddings.
    Raises ValueError naming the flags to change (a library error's config fields spelled as
    flags), leaving no folder behind that it created."""
    with removed_on_error(args.save if args.save is not None else run_dir), \
            flags_in_errors(train_flags()):
        return _prepare(args, world_size, progress, run_dir)


def _prepare(args: TrainArgs, world_size: int | None, progress: bool,
             run_dir: Path | None) -> Run:
    _check_scalars(args)
    check_features(args)  # MoE / CP / fp16 flags: values, and none whose feature is off
    world_size = _world_size(args, world_size)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    _check_device(args, local if under_torchrun() else world_size)
    _check_link(args, world_size)
    dp = _check_parallel(args, world_size)
    fsdp_flags.check(args, dp)  # the sharding strategy's flags
    if args.save is None and run_dir is not None:
        args.save = str(run_dir)
    if args.max_position_embeddings is None and args.position_embedding_type == "learned_absolute":
        args.max_position_embeddings = args.seq_length
    _check_batches(args, dp)
    _check_pipeline(args, dp, progress)
    if args.num_experts is not None and args.tensor_model_parallel_size > 1 \
            and not args.sequence_parallel:
        raise ValueError(
            f"--num-experts {args.num_experts} at --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size} needs --sequence-parallel (as in Megatron): each "
            "TP rank then routes its own shard of the tokens to whole experts; add "
            "--sequence-parallel or use TP=1")
    _prepare_data(args, progress)  # data first: the vocabulary size comes from the tokenizer
    resume = None
    if args.load is not None:
        # Rank 0 of each host hashes every file; the other local ranks check sizes only.
        hashes = int(os.environ.get("LOCAL_RANK", "0")) == 0
        resume = open_resume(args, hashes=hashes, progress=progress)
    check_lora(args, resume)
    if args.save is not None:
        check_save_dir(args, resume)
    run = build_run(args, run_dir, resume)
    if resume is not None:
        check_compatible(args, run, resume)
    if args.save is not None:
        check_free_space(args, run.config)
    return run


def _world_size(args: TrainArgs, world_size: int | None) -> int:
    """The run's world size: torchrun's, ``world_size``, ``--nproc``, or one model replica's
    ranks (filled into ``--nproc`` when this command starts the ranks)."""
    if world_size is None:
        world_size = int(os.environ["WORLD_SIZE"]) if under_torchrun() else (
            args.nproc or math.prod(getattr(args, str(d.size_field)) for d in model_dims()))
    if not under_torchrun():
        args.nproc = world_size
    return world_size


def _check_parallel(args: TrainArgs, world_size: int) -> int:
    """The parallel sizes fit the world and the model; the data-parallel size."""
    dp = ParallelSizes.from_fields(world_size, **args.parallel_sizes()).dp
    _check_context_parallel(args)
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    if ep > 1 and (args.num_experts is None or args.num_experts % ep):
        raise ValueError(
            f"--expert-model-parallel-size {ep} splits each MoE layer's experts over {ep} "
            f"ranks: it needs --num-experts divisible by {ep} (got {args.num_experts})")
    if args.sequence_parallel and tp > 1 and args.seq_length % tp:
        raise ValueError(
            f"--sequence-parallel splits each sequence over the TP ranks: --seq-length="
            f"{args.seq_length} is not divisible by --tensor-model-parallel-size={tp}; use a "
            f"multiple of {tp} (e.g. {args.seq_length - args.seq_length % tp or tp}).")
    return dp


def _prepare_data(args: TrainArgs, progress: bool) -> None:
    """The tokenizer's default, the datasets (the built-in corpus when none is given, written
    to the run folder) and their blends normalised; a cache folder that cannot be written fails
    here."""
    if args.tokenizer_type is None:
        # The built-in corpus learns clearly faster per byte with a small BPE than with bytes
        # (same steps: ~1.6 vs ~2.4 nats/byte on validation); user data defaults to bytes.
        user_bpe = bool(args.vocab_file or args.merge_file or args.tokenizer_dir)
        own_data = args.data_path is not None or args.train_data_path is not None
        args.tokenizer_type = "byte" if own_data and not user_bpe else "bpe"
    eod_flags = [f"--{n.replace('_', '-')}" for n in
                 ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
                 if getattr(args, n)]
    if args.pack_documents and eod_flags:
        raise ValueError(f"--pack-documents already keeps each document apart (positions, "
                         f"attention and labels, by the dataset's document boundaries); "
                         f"{', '.join(eod_flags)} would cut samples again at EOD tokens: drop "
                         f"{'it' if len(eod_flags) == 1 else 'them'}")
    sources = data_sources(args)  # the blend flags' syntax, before anything is built
    if sources is None:
        scratch = Path(args.save) if args.save else default_run_dir()
        args.data_path = [prepare_default_corpus(args, scratch, progress)]
        sources = data_sources(args)
        assert sources is not None
    for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if getattr(args, name) is not None:
            setattr(args, name, normalized_blend(getattr(args, name)))
    _, note = cache_folder(args, sources)
    if note and progress:
        print(f"domino train: {note}")


def build_run(args: TrainArgs, run_dir: Path | None = None,
              resume: Resume | None = None) -> Run:
    """The run of already resolved settings (what :func:`prepare_run` returns; a locally
    launched rank builds its own from the saved settings)."""
    if resume is None and args.load is not None:
        resume = open_resume(args, hashes=False, progress=False)
    tokenizer = make_tokenizer(args)
    sources = data_sources(args)
    assert sources is not None, "prepare_run() fills in --data-path"
    datasets = {prefix: open_dataset(prefix, name) for prefix, name in sources.prefixes()}
    for prefix, name in sources.prefixes():
        check_tokenizer(datasets[prefix], tokenizer, name)
    ds = next(iter(datasets.values()))
    config = model_config(args, tokenizer.vocab_size)
    runtime = args.runtime()
    config.validate_parallel(args.tensor_model_parallel_size)
    runtime.check(config, args.tensor_model_parallel_size)
    start, consumed = (0, 0) if resume is None else (resume.start_step, resume.consumed)
    train_ds, valid_ds = build_datasets(args, datasets, eod_of(ds, tokenizer),  # split/size checks
                                        start_step=start, consumed_samples=consumed)
    return Run(args, config, runtime, tokenizer, train_ds, valid_ds, run_dir, resume)
