"""`domino train` settings: one flat dataclass, its command-line flags and TOML layering.

Precedence: built-in defaults < ``--config FILE.toml`` < command-line flags. Flags follow
Megatron's names. Three tables make most of them: the model flags are TransformerConfig's
fields (``model_flags``: their names, types and help), the parallel sizes are
:data:`domino.parallel_dims.DIMS`, and the run-time flags (``--domino-*``,
``--sequence-parallel``, ``--recompute-granularity``, ``--compile``, ``--cp-comm-type``) are
RuntimeConfig's fields (``runtime_flags``); the rest are declared here.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import torch

from domino.parallel_dims import SIZED
from domino.pipeline.partition import Layout, partition
from domino.pipeline.schedules import SCHEDULES
from domino.plan import Plan, check_fields
from domino.precision import PRECISIONS, precision_of
from domino.runtime import RuntimeConfig
from domino.training import fsdp_flags, lora_flags, model_flags, runtime_flags

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def _f(default: Any, help: str, group: str = "training",
       choices: tuple[str, ...] | None = None) -> Any:
    """A field: its default, the flag's help, its help group and choices."""
    return field(default=default, metadata={"help": help, "group": group, "choices": choices})


# The model flags (group "model"), one per TransformerConfig field: see model_flags.
ModelArgs = dataclasses.make_dataclass("ModelArgs", model_flags.model_fields(), kw_only=True)
ModelArgs.__module__ = __name__
ModelArgs.__doc__ = "`domino train`'s model flags, derived from TransformerConfig's fields."


def _size_fields() -> list[tuple[str, type, Any]]:
    """One flag per chosen parallel size (parallel_dims.DIMS), group "parallel"."""
    return [(str(d.size_field), int, _f(d.cli_default, d.help, "parallel")) for d in SIZED]


# The parallel sizes (from the dimensions' table), then the run-time flags (RuntimeConfig's
# fields: see runtime_flags).
SizeArgs = dataclasses.make_dataclass("SizeArgs", _size_fields(), bases=(ModelArgs,),
                                      kw_only=True)
RuntimeArgs = dataclasses.make_dataclass("RuntimeArgs", runtime_flags.runtime_fields(),
                                         bases=(SizeArgs,), kw_only=True)
LoraArgs = dataclasses.make_dataclass("LoraArgs", lora_flags.lora_fields()
                                      + fsdp_flags.fsdp_fields(), bases=(RuntimeArgs,),
                                      kw_only=True)
for _cls in (SizeArgs, RuntimeArgs, LoraArgs):
    _cls.__module__ = __name__
SizeArgs.__doc__ = "`domino train`'s parallel-size flags, from domino.parallel_dims."
RuntimeArgs.__doc__ = "`domino train`'s run-time flags, derived from RuntimeConfig's fields."
LoraArgs.__doc__ = "`domino train`'s LoRA and sharded data-parallel flags (lora_flags, fsdp_flags)."


@dataclass(kw_only=True)
class TrainArgs(LoraArgs):
    """Everything a `domino train` run needs (model, parallelism, optimisation, data, output)."""

    domino_autotune: bool = _f(
        False, "Before training, time sync TP and cross-layer Domino with 2-4 micro-batches x 1-2 "
        "column chunks on the first batch and train with the fastest (all ranks agree; replaces "
        "the three --domino-* settings above).", "model")
    # parallelism and launch
    pipeline_schedule: str | None = _f(
        None, "Pipeline schedule: gpipe, 1f1b, interleaved (needs virtual stages) or zero_bubble "
        "(weight gradients fill the bubble); default 1f1b, or interleaved with "
        "--num-layers-per-virtual-pipeline-stage.", "parallel", SCHEDULES)
    num_layers_per_virtual_pipeline_stage: int | None = _f(
        None, "Interleaved 1F1B: layers per model chunk; each stage holds several chunks.",
        "parallel")
    pipeline_stage_layers: str | None = _f(
        None, "Uneven stages: layers per stage, comma-separated (e.g. 3,5); default an even "
        "split.", "parallel")
    nproc: int | None = _f(None, "Local processes to start when not under torchrun; default = "
                           "TP x PP x CP.", "parallel")
    device: str | None = _f(None, "cpu or cuda; default cuda when available.", "parallel",
                            ("cpu", "cuda"))
    overlap_grad_reduce: bool = _f(
        True, "With DP > 1: sum gradients over DP in buckets launched during the backward, as "
        "soon as their layers' gradients are final (off: one blocking reduction after it).",
        "parallel")
    grad_reduce_in_bf16: bool = _f(
        False, "With DP > 1: sum the gradient buckets over DP in bf16 (half the bytes, bf16 "
        "rounding of every rank's part); off (Megatron's default): in fp32, the dtype the "
        "gradients accumulate in.", "parallel")
    overlap_param_gather: bool = _f(
        True, "With --use-distributed-optimizer: the updated parameters' all-gathers run under "
        "the next forward, each bucket waited for just before its first layer (off: waited at "
        "the end of the step; pipeline runs always wait there).", "parallel")
    shared_memory_comm: bool = _f(
        True, "On CPU: TP, DP, EP and tied-embedding groups whose ranks share a host move their "
        "bulk collectives (all-reduces, reduce-scatters, all-gathers, EP's all-to-alls) through "
        "shared memory instead of gloo's loopback TCP (far less host CPU per byte; see "
        "docs/parallelism.md). Off: gloo for everything. Groups across hosts (or emulated "
        "hosts) always use gloo.", "parallel")
    use_distributed_optimizer: bool = _f(
        False, "With DP > 1: ZeRO-1 - AdamW state (and under --bf16 the fp32 master weights) "
        "sharded over DP (memory per rank / DP), gradients reduce-scattered during the "
        "backward, parameters all-gathered after the update.", "parallel")
    emulate_link: str | None = _f(
        None, "Measure overlap on a slow network: run each local rank in its own network "
        "namespace over a veth shaped to RATE (e.g. 1gbit, 100mbit); CPU, local processes, root "
        "only.", "parallel")
    emulate_hosts: int | None = _f(
        None, "With --emulate-link: this many emulated hosts, consecutive ranks sharing one (they "
        "talk over its loopback); e.g. 2 hosts x 2 ranks puts TP=2 inside a host and DP=2 "
        "across the link. Default: one host per rank.", "parallel")
    distributed_timeout_minutes: float = _f(
        5.0, "Process-group timeout: a rank blocked this long on a dead peer fails.", "parallel")
    # optimisation
    micro_batch_size: int = _f(8, "Samples per forward/backward on each DP rank.")
    global_batch_size: int | None = _f(
        None, "Samples per optimizer step (micro-batch x DP x accumulation, or x pipeline "
        "micro-batches); default micro-batch x DP (x PP with a pipeline).")
    train_iters: int = _f(300, "Optimizer steps.")
    lr: float = _f(2e-3, "Peak learning rate.")
    min_lr: float = _f(2e-4, "Learning rate at the end of the decay.")
    lr_warmup_iters: int = _f(30, "Linear warm-up steps from 0 to --lr.")
    lr_decay_style: str = _f("cosine", "Decay after warm-up.", choices=("cosine", "linear",
                                                                        "constant"))
    lr_decay_iters: int | None = _f(None, "Steps until --min-lr; default --train-iters.")
    weight_decay: float = _f(0.1, "AdamW weight decay (not on biases and norm weights).")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.95, "AdamW beta2.")
    adam_eps: float = _f(1e-8, "AdamW epsilon.")
    clip_grad: float = _f(1.0, "Clip gradients to this global L2 norm (0 = off).")
    seed: int = _f(1234, "Seed for weights, data order, dropout and sampling.")
    bf16: bool = _f(False, "Mixed precision: compute in bf16 from fp32 master weights, each "
                           "cast once per step; fp32 gradients and optimizer (CPU or GPU).")
    fp16: bool = _f(False, "Mixed precision in fp16 with dynamic loss scaling (GPU only).")
    peak_tflops: float | None = _f(
        None, "MFU's denominator, TFLOP/s per rank [default: on CUDA the device's dense peak "
              "for the dtype (A100, H100, H200, B200), on CPU the rate this machine measures on "
              "the model's GEMM shapes (cached)].")
    initial_loss_scale: float = _f(2.0 ** 16, "fp16: initial dynamic loss scale.")
    loss_scale_window: int = _f(1000, "fp16: overflow-free steps before the scale doubles.")
    # data
    data_path: list[str] | None = _f(
        None, "Dataset prefix (PREFIX.bin/.idx from `domino preprocess`), or a blend of weight/"
        "prefix pairs (0.7 data/a 0.3 data/b: weights are normalised, --split cuts each dataset, "
        "see docs/train.md); default: the Python standard library's .py files.", "data")
    split: str = _f("98,2,0", "Train/valid/test document weights (of each --data-path dataset).",
                    "data")
    train_data_path: list[str] | None = _f(
        None, "Instead of --data-path and --split: the training data, a prefix or a blend, each "
        "dataset used whole.", "data")
    valid_data_path: list[str] | None = _f(
        None, "With --train-data-path: the validation data (a prefix or a blend, used whole).",
        "data")
    test_data_path: list[str] | None = _f(
        None, "With --train-data-path: the test data (checked; `domino eval` reads it).", "data")
    data_cache_path: str | None = _f(
        None, "Folder for the cached blend index; default domino_cache/ in the first dataset's "
        "folder (not cached when that is not writable).", "data")
    tokenizer_type: str | None = _f(
        None, "Tokenizer the data was made with; default byte with --data-path, and a BPE "
        "trained on the built-in corpus without it; hf: an imported model's tokenizer "
        "(--tokenizer-dir).", "data", ("byte", "bpe", "hf"))
    vocab_file: str | None = _f(None, "BPE vocab.json (GPT-2 style).", "data")
    merge_file: str | None = _f(None, "BPE merges.txt (GPT-2 style).", "data")
    tokenizer_dir: str | None = _f(
        None, "Where the tokenizer is: bpe: a folder with vocab.json + merges.txt; hf: one with "
        "tokenizer.json + domino.json (a checkpoint's tokenizer/), or the transformers model "
        "folder itself; either: a run or checkpoint folder (its latest checkpoint's tokenizer/, "
        "e.g. `domino import`'s OUT).", "data")
    reset_position_ids: bool = _f(False, "Restart position ids after each EOD.", "data")
    reset_attention_mask: bool = _f(False, "Do not attend across EOD boundaries.", "data")
    eod_mask_loss: bool = _f(False, "No loss on EOD input tokens.", "data")
    pack_documents: bool = _f(
        False, "Pack whole documents (e.g. conversations) into samples, greedy in order, "
        "padding the rest; each attends only to itself, positions restart at 0.", "data")
    # evaluation, output, sampling
    log_interval: int = _f(10, "Steps per log line / metrics.jsonl record.", "output")
    eval_interval: int = _f(100, "Steps between validation runs (0 = only at the end).", "output")
    eval_iters: int = _f(5, "Global batches per validation run (0 = no validation).", "output")
    save: str | None = _f(None, "Run folder (config, metrics, plots, checkpoints); default "
                          "runs/<timestamp>.", "output")
    load: str | None = _f(None, "Run, checkpoints or step folder to resume from (a checkpoint "
                          "without optimizer state, e.g. from `domino import`, starts a fresh "
                          "run from its weights).", "output")
    finetune: bool = _f(False, "With --load: a new run from its weights only (not its optimizer, "
                        "step, data position or RNG), its model and tokenizer, and fine-tuning "
                        "defaults (docs/finetune.md).", "output")
    load_fallback: bool = _f(False, "When the --load checkpoint is damaged, resume from the "
                             "newest intact one instead of stopping.", "output")
    overwrite: bool = _f(False, "--save may hold an earlier run: delete its checkpoints and "
                         "metrics and start over.", "output")
    save_interval: int = _f(1000, "Checkpoint every this many steps (0 = off; the end of "
                            "training and a SIGTERM / Ctrl-C always checkpoint).", "output")
    save_interval_minutes: float = _f(30.0, "Also checkpoint when this many minutes passed "
                                      "since the last one (0 = off).", "output")
    keep_checkpoints: int = _f(3, "Keep only the newest this many checkpoints (0 = all).",
                               "output")
    max_nonfinite_steps: int = _f(10, "Stop (exit 1, without saving) after this many "
                                  "consecutive steps whose loss or gradients are NaN/inf "
                                  "(0 = never).", "output")
    exit_interval: int = _f(0, "Checkpoint and stop once the step is a multiple of this (0 = "
                            "off); resume later with --load.", "output")
    tensorboard: bool = _f(True, "Write TensorBoard events when tensorboard is installed.",
                           "output")
    sample_tokens: int = _f(200, "Tokens to generate at the end (0 = no sample).", "output")
    sample_prompt: str = _f("def", "Prompt of the final sample.", "output")
    top_k: int = _f(5, "Sample from the k most likely tokens (1 = greedy).", "output")
    temperature: float = _f(0.8, "Sampling temperature.", "output")

    def __post_init__(self) -> None:
        for name, kind in field_types().items():
            value = getattr(self, name)
            if value is None:
                if not _optional(name):
                    raise ValueError(f"--{flag(name)} needs a value.")
                continue
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                setattr(self, name, value)
            if kind is list:  # a blend: a TOML/JSON list, or one string
                value = _string_list(name, value)
                setattr(self, name, value)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ValueError(f"--{flag(name)}={value!r} must be a {kind.__name__}.")
            choices = _meta(name).get("choices")
            if choices and value not in choices:
                raise ValueError(f"--{flag(name)}={value!r} is not one of {', '.join(choices)}.")
        check_fields(self.domino_micro_batches, self.domino_overlap, self.domino_column_chunks,
                     lambda f: f"--domino-{flag(f)}")

    def pipeline_layout(self) -> Layout:
        """How the layers are cut into pipeline stages (ValueError naming the flag)."""
        counts = None
        if self.pipeline_stage_layers is not None:
            try:
                counts = tuple(int(x) for x in self.pipeline_stage_layers.split(","))
            except ValueError:
                raise ValueError(f"--pipeline-stage-layers={self.pipeline_stage_layers!r} must "
                                 "be comma-separated layer counts, e.g. 3,5") from None
        if self.pipeline_model_parallel_size == 1 and (
                counts is not None or self.num_layers_per_virtual_pipeline_stage is not None):
            raise ValueError("--pipeline-stage-layers and --num-layers-per-virtual-pipeline-stage"
                             " cut pipeline stages: add --pipeline-model-parallel-size > 1")
        return partition(self.num_layers, self.pipeline_model_parallel_size,
                         self.num_layers_per_virtual_pipeline_stage, counts)

    def schedule(self) -> str:
        """The pipeline schedule (the default resolved)."""
        if self.pipeline_schedule is not None:
            return self.pipeline_schedule
        return "interleaved" if self.num_layers_per_virtual_pipeline_stage else "1f1b"

    def plan(self) -> Plan:
        """The Domino schedule these settings ask for (before any autotuning)."""
        return Plan(self.domino_micro_batches, self.domino_overlap, self.domino_column_chunks)

    def runtime(self) -> RuntimeConfig:
        """How the model runs: the plan (before any autotuning), sequence parallelism,
        recomputation, the compute dtype (``--bf16`` / ``--fp16``) and ``--compile``
        (:mod:`~domino.training.runtime_flags`)."""
        return runtime_flags.runtime_config(self)

    def parallel_sizes(self) -> dict[str, int]:
        """The chosen parallel sizes, by keyword (``tensor_model_parallel_size``, ...)."""
        return {str(d.size_field): getattr(self, str(d.size_field)) for d in SIZED}

    def grad_reduce_dtype(self) -> torch.dtype | None:
        """The dtype DP gradient sums run in (None: the gradients' own, fp32)."""
        return torch.bfloat16 if self.grad_reduce_in_bf16 else None

    def compute_dtype(self) -> torch.dtype | None:
        """The mixed-precision compute dtype (None: fp32 throughout)."""
        return PRECISIONS[precision_of(self.bf16, self.fp16)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def flag(name: str) -> str:
    return name.replace("_", "-")


def _meta(name: str) -> dict:
    return _FIELDS[name].metadata


def field_types() -> dict[str, type]:
    """Each setting's type (its optional-ness removed)."""
    return {name: _base_type(hint) for name, hint in _HINTS.items()}


def _base_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    return list if typing.get_origin(base) is list else base


def _string_list(name: str, value: Any) -> list[str]:
    """A list setting (``--data-path 0.7 A 0.3 B``): a list of strings (bare numbers allowed:
    TOML users may write weights unquoted) or one string, split on whitespace only when it
    starts with a weight (:func:`~domino.data.blend.blend_tokens`)."""
    from domino.data.blend import blend_tokens

    if isinstance(value, str):
        return blend_tokens(value)
    if isinstance(value, (list, tuple)) and all(
            isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value):
        return [v if isinstance(v, str) else repr(v) for v in value]
    raise ValueError(f"--{flag(name)}={value!r} must be a list of strings (or one string), e.g. "
                     '["0.7", "data/a", "0.3", "data/b"].')


def _optional(name: str) -> bool:
    hint = _HINTS[name]
    return (typing.get_origin(hint) in (typing.Union, types.UnionType)
            and type(None) in typing.get_args(hint))


_FIELDS = {f.name: f for f in dataclasses.fields(TrainArgs)}
_HINTS = typing.get_type_hints(TrainArgs)
_GROUPS = {"model": "model (TransformerConfig)", "parallel": "parallelism and launch",
           "training": "optimisation", "lora": "LoRA fine-tuning", "data": "data",
           "output": "evaluation, output, sampling"}


def help_text(name: str) -> str:
    """The help of setting ``name``'s flag."""
    return _meta(name)["help"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per TrainArgs field (plus --config). Flags left out stay unset, so that
    the layering defaults < TOML < command line can tell what was given."""
    parser.add_argument("--config", metavar="FILE.toml", default=argparse.SUPPRESS,
                        help="TOML file of settings (keys = flag names, '-' or '_'); flags win.")
    groups = {key: parser.add_argument_group(title) for key, title in _GROUPS.items()}
    for name, kind in field_types().items():
        default = _FIELDS[name].default
        shown = ("on" if default else "off") if kind is bool else default
        text = help_text(name) + ("" if default is None else f" [default: {shown}]")
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": text}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif kind is list:
            kw.update(nargs="+", metavar="PATH")
        else:
            kw["type"] = kind
            kw["metavar"] = "|".join(_meta(name)["choices"] or ()) or name.split("_")[-1].upper()
        groups[_meta(name)["group"]].add_argument(f"--{flag(name)}", **kw)


def load_toml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a settings file: flat keys, or keys inside tables (tables are only for grouping)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"--config {os.fspath(path)}: file not found") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"--config {os.fspath(path)}: invalid TOML ({err})") from None
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for k, v in items:
            name = k.replace("-", "_")
            if name in RETIRED:
                _check_retired(path, k, v)
                continue
            if name not in _FIELDS:
                close = difflib.get_close_matches(name, list(_FIELDS), n=1)
                hint = f" (did you mean {flag(close[0])}?)" if close else ""
                raise ValueError(f"--config {os.fspath(path)}: unknown setting {k!r}{hint}")
            flat[name] = v
    return flat


# Settings an earlier `domino train` wrote into config.toml that are no flags now: read back at
# that value, refused at another (what they set is a benchmark's, model_flags.SET_BY_RUN).
RETIRED: dict[str, Any] = {"moe_router_force_load_balancing": False}


def _check_retired(path: str | os.PathLike, key: str, value: Any) -> None:
    name = key.replace("-", "_")
    if value != RETIRED[name]:
        raise ValueError(f"--config {os.fspath(path)}: {key} = {_toml_value(value)} is not a "
                         f"`domino train` setting: it sets "
                         f"{model_flags.flag_label(name)}; remove it")


def resolve_args(ns: argparse.Namespace | dict[str, Any],
                 base: dict[str, Any] | None = None) -> TrainArgs:
    """Layer built-in defaults < ``base`` (``--finetune``: the checkpoint's model) < TOML
    (``config`` key) < explicitly given flags."""
    given = dict(vars(ns)) if isinstance(ns, argparse.Namespace) else dict(ns)
    values: dict[str, Any] = dict(base or {})
    config = given.pop("config", None)
    if config:
        values.update(load_toml(config))
    values.update({k: v for k, v in given.items() if k in _FIELDS})
    return TrainArgs(**values)


def to_toml(args: TrainArgs) -> str:
    """The settings as a TOML file that ``--config`` reads back (unset values commented out)."""
    lines = ["# domino train: effective configuration"]
    for key, title in _GROUPS.items():
        lines.append(f"\n# -- {title}")
        for name in _FIELDS:
            if _meta(name)["group"] != key:
                continue
            value = getattr(args, name)
            if value is None:
                lines.append(f"# {name} =  # unset")
            else:
                lines.append(f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # repr keeps the float round-trippable (1e-08, 65536.0, inf)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(json.dumps(str(v)) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string
