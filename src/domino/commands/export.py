"""``domino export --format hf RUN_DIR OUT``: a checkpoint as a ``transformers`` model folder of
the first family that expresses the model (:data:`domino.checkpoint.families.FAMILIES`), in the
model's own dtype unless ``--dtype`` says otherwise; a LoRA run's model merged (its base with
the adapters' update added). ``--format peft``: a LoRA run's adapters as a PEFT adapter folder
for the base model's HF export."""

from __future__ import annotations

import argparse
from pathlib import Path

from domino.checkpoint import lora
from domino.checkpoint.hf_export import DTYPES, export_hf, model_dtype
from domino.checkpoint.layout import open_checkpoint
from domino.checkpoint.peft_export import export_peft
from domino.models.lora import is_adapter_name
from domino.utils import check_output_dir, removed_on_error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("hf", "peft"), required=True,
                        help="hf: a Hugging Face transformers model folder (a LoRA run's "
                        "merged); peft: a LoRA run's adapters as a PEFT adapter folder")
    parser.add_argument("source", metavar="RUN_DIR",
                        help="run, checkpoints or step folder (default: its latest checkpoint)")
    parser.add_argument("output", metavar="OUT", help="folder to write (created; must be empty)")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                        help="dtype of the written weights; auto: the model's own (an imported "
                        "model's as it came, e.g. bfloat16, also for a LoRA run on it; a "
                        "trained run's float32 master weights, --bf16 or not; peft: the "
                        "adapters' float32) [default: auto]")
    parser.add_argument("--base-model-path", default=None, metavar="PATH",
                        help="peft: the base model's HF folder or Hub name, written as the "
                        "adapter's base_model_name_or_path [default: none]")


def run(ns: argparse.Namespace) -> int:
    out = Path(ns.output)
    check_output_dir(out, "OUT")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"OUT {out} is not empty; pass a new or empty folder")
    if ns.base_model_path is not None and ns.format != "peft":
        raise ValueError(f"--base-model-path {ns.base_model_path}: it names a PEFT adapter's "
                         "base model, for --format peft only; leave it out with --format hf")
    step_dir, meta, _ = open_checkpoint(ns.source, hashes=True)
    spec = lora.spec_of(meta)
    if ns.format == "peft":
        dtype = "float32" if ns.dtype == "auto" else ns.dtype
        with removed_on_error(out):
            arch, targets = export_peft(step_dir, meta, out, dtype, ns.base_model_path)
        print(f"domino export: {step_dir} -> {out} (LoRA r={spec.rank}, alpha="
              f"{spec.alpha:g} on {arch} modules {targets}, {dtype}); load it with "
              "peft.PeftModel.from_pretrained onto the base model's --format hf export")
        return 0
    dtype = model_dtype(meta, step_dir) if ns.dtype == "auto" else ns.dtype
    with removed_on_error(out):
        arch = export_hf(step_dir, meta, out, dtype)
    adapted = sum(is_adapter_name(n) and n.endswith("a") and not n.startswith("optimizer.")
                  for n in meta.tensors)  # (each adapter's A: ".lora.a", experts' ".fc1_a")
    what = (f"its base with {adapted} LoRA adapters merged" if spec is not None
            else f"{len(meta.tensors)} tensors")
    print(f"domino export: {step_dir} -> {out} ({arch}, {dtype}, {what}); load it with "
          "transformers.AutoModelForCausalLM.from_pretrained")
    return 0
