"""A LoRA run's adapters (:mod:`domino.checkpoint.lora`) outside domino: merged into the base
weights (:func:`merged`, for ``domino export --format hf``), or as a PEFT adapter folder
(:func:`export_peft`, ``--format peft``: ``adapter_config.json`` + ``adapter_model.safetensors``
under the Hugging Face family's module names, which ``peft.PeftModel.from_pretrained`` loads
onto the base model's HF export).

One of our weights can be several HF modules (the fused QKV is ``q_proj``, ``k_proj`` and
``v_proj``; SwiGLU's ``fc1`` is ``gate_proj`` and ``up_proj``; an MoE layer's stacked experts
are each expert's ``gate_proj``, ``up_proj`` and ``down_proj``). Where the family's weight link
only picks rows of the weight (seen as ``[out, in]``, one such matrix per expert), each HF
module's weight is ``W[rows]``, so its update is ``(B A)[rows] = B[rows] A``: its ``lora_B`` is
B's same rows and its ``lora_A`` all of A. That is checked for each link on a probe (every
element a distinct number: its expert, row and column) rather than assumed; a link that does
anything else to the weight (GPT-2's Conv1D stores it transposed) is refused, and the merged
export is the way out. The probe has a few columns, not the weight's: links move rows, and one
that moved columns would show it as a transposition or fail.

PEFT reads the experts as transformers 4.x stores them, one module each, and converts them to
transformers 5's fused expert tensors itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from domino.checkpoint import lora
from domino.checkpoint.families import family_for
from domino.checkpoint.families.weights import Link
from domino.checkpoint.hf import family_of
from domino.checkpoint.layout import Meta
from domino.checkpoint.shards import ShardReader, TensorSpec
from domino.config import TransformerConfig
from domino.models.lora import LoraSpec, is_adapter_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's: the PeftModel's base_model (LoraModel), its model
_COLUMNS = 3  # the probe's (see the module docstring)


@dataclass(frozen=True)
class Factors:
    """One adapted weight's LoRA factors, for ``y = W x + scale * B A x`` with W seen as
    ``[out, in]``: A [r, in], B [out, r], stacked [E, ...] for an MoE layer's experts."""

    weight: str  # our tensor it adapts: [out, in], or the experts' [E, in, out]
    a: torch.Tensor
    b: torch.Tensor

    @property
    def experts(self) -> bool:
        return self.a.dim() == 3

    def delta(self) -> torch.Tensor:
        """``B A`` in our tensor's layout."""
        return (self.b @ self.a).transpose(1, 2) if self.experts else self.b @ self.a


def read_adapters(step_dir: Path, meta: Meta) -> list[Factors]:
    """A LoRA checkpoint's adapters, whole and in fp32: a linear's ``<linear>.lora.a`` [r, in]
    and ``.lora.b`` [out, r]; an MoE layer's ``<experts>.lora.fc1_a`` [E, in, r] and
    ``fc1_b`` [E, r, out] (the grouped GEMM's ``x A B``), as :class:`Factors`."""
    reader = ShardReader(step_dir)
    full = {name: reader.full(name, TensorSpec.from_json(name, raw)).float()
            for name, raw in meta.tensors.items()
            if not name.startswith("optimizer.") and is_adapter_name(name)}
    out = []
    for name in sorted(n for n in full if n.endswith("a")):
        owner, factor = name.rsplit(f".{lora.KEY}.", 1)
        a, b = full[name], full.get(name[:-1] + "b")
        weight = f"{owner}.weight" if factor == "a" else f"{owner}.{factor[:-2]}"
        if b is not None and a.dim() == 3 and factor.endswith("_a"):
            a, b = a.transpose(1, 2), b.transpose(1, 2)
        if (b is None or a.dim() != b.dim() or a.dim() != (2 if factor == "a" else 3)
                or a.shape[-2] != b.shape[-1] or a.shape[:-2] != b.shape[:-2]):
            raise ValueError(f"{step_dir}: the LoRA adapter of {weight} is incomplete or "
                             f"malformed (A {tuple(a.shape)}, B "
                             f"{None if b is None else tuple(b.shape)}); use a checkpoint "
                             "that domino train wrote")
        out.append(Factors(weight, a.contiguous(), b.contiguous()))
    return out


def merged(ours: dict[str, torch.Tensor], adapters: list[Factors], scale: float
           ) -> dict[str, torch.Tensor]:
    """The base weights ``ours`` with each adapter's update ``scale * B A`` added, in fp32
    (the other tensors as they are)."""
    out = dict(ours)
    for f in adapters:
        w, delta = ours.get(f.weight), f.delta()
        if w is None or w.shape != delta.shape:
            raise ValueError(f"the LoRA adapter of {f.weight} (A {tuple(f.a.shape)}, B "
                             f"{tuple(f.b.shape)}) does not fit the base's "
                             f"({None if w is None else tuple(w.shape)}); the adapters were "
                             "trained on another base")
        out[f.weight] = w.float() + scale * delta
    return out


class _Probes(Mapping):
    """What a link reads: each adapted weight's probe, in our layout (few columns), whose
    elements are their own indices in [E, out, columns] after the weight's offset; any other
    tensor a stand-in of -1s (``shapes``: our tensors'; expanded, so it costs no memory)."""

    def __init__(self, adapters: dict[str, Factors], shapes: dict[str, tuple[int, ...]]):
        self.adapters, self.shapes = adapters, shapes
        self.offsets: dict[str, int] = {}
        self.virtual: dict[str, torch.Tensor] = {}
        self.end = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        f = self.adapters.get(name)
        if f is None:
            return torch.tensor(-1).expand(self.shapes[name])
        if name not in self.virtual:
            experts = f.b.shape[0] if f.experts else 1
            size = experts * f.b.shape[-2] * _COLUMNS
            self.offsets[name] = self.end
            self.virtual[name] = torch.arange(self.end, self.end + size).reshape(
                experts, f.b.shape[-2], _COLUMNS)  # [E, out, columns]
            self.end += size
        v = self.virtual[name]
        return v.transpose(1, 2) if f.experts else v[0]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def _owner(self, value: int) -> tuple[str, int] | None:
        """(our weight, expert) whose probe holds ``value``."""
        for name, v in self.virtual.items():
            e = (value - self.offsets[name]) // (v.shape[1] * _COLUMNS)
            if value >= self.offsets[name] and e < v.shape[0]:
                return name, e
        return None

    def _rows_of(self, t: torch.Tensor, name: str, e: int) -> torch.Tensor | None:
        """The rows of ``name``'s expert ``e`` that ``t`` is, all columns in order, or None."""
        v = self.virtual[name][e]
        if t.dim() != 2 or t.shape[1] != _COLUMNS or not t.shape[0]:
            return None
        rows = (t[:, 0] - int(v[0, 0])) // _COLUMNS
        if not bool(((rows >= 0) & (rows < v.shape[0])).all()):
            return None
        return rows if torch.equal(t, v[rows]) else None

    def locate(self, t: torch.Tensor) -> tuple[str, int, torch.Tensor] | None:
        """(our weight, expert, rows) of which HF tensor ``t`` is the rows; None: it holds no
        probe; ValueError saying what else it is."""
        if t.numel() > 1 and not any(t.stride()):
            return None  # a stand-in, still expanded
        held = t[t >= 0]
        if not held.numel():
            return None
        owner = self._owner(int(held[0]))
        if owner is None:
            raise ValueError("made of our adapted weights by more than picking rows")
        rows = self._rows_of(t, *owner)
        if rows is not None:
            return (*owner, rows)
        if t.dim() == 2 and self._rows_of(t.t(), *owner) is not None:
            raise ValueError(f"our {owner[0]} stored transposed ([in, out], as GPT-2's "
                             "Conv1D)")
        raise ValueError(f"not whole rows of our {owner[0]} (or not it alone)")


def _modules(link: Link, probes: _Probes, arch: str
             ) -> Iterator[tuple[str, str, int, torch.Tensor]]:
    """(HF module, our weight, expert, rows) for each HF weight ``link`` makes of an adapted
    weight; ValueError if one is not rows of it (module docstring)."""
    for name, t in link.to_hf(probes).items():
        try:
            where = probes.locate(t)
        except ValueError as err:
            raise ValueError(
                f"--format peft: {arch}'s {name} is {err}, so a LoRA update of ours is no "
                "PEFT LoRA of that module (PEFT export writes adapters of [out, in] linears "
                "whose weights are rows of ours); export the merged model with --format hf "
                "instead") from None
        if where is not None:
            if not name.endswith(".weight"):
                raise ValueError(f"--format peft: {arch}'s {name} holds our adapted "
                                 f"{where[0]} but is no module's weight; export the merged "
                                 "model with --format hf instead")
            yield (name.removesuffix(".weight"), *where)


def hf_adapters(config: TransformerConfig, arch: str, adapters: list[Factors]
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Our adapters as the HF family's, in its weight map's order: HF module name (e.g.
    ``model.layers.0.self_attn.q_proj``) -> (lora_A [r, in], lora_B [out, r])."""
    from domino.models.gpt import GPTModel
    from domino.parallel_state import ParallelState

    model = GPTModel(config, parallel_state=ParallelState.single("meta"))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    left = {f.weight: f for f in adapters}
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    experts: set[str] = set()  # the modules of MoE experts
    for link in family_of(arch).weights(config):
        ours = getattr(link, "ours", None)  # its tensor, or their prefix (an MoE layer's)
        if isinstance(ours, str) and not any(w.startswith(ours) for w in left):
            continue  # it reads no adapted weight
        found = list(_modules(link, _Probes(left, shapes), arch))
        for module, weight, e, rows in found:
            f = left[weight]
            a, b = (f.a[e], f.b[e]) if f.experts else (f.a, f.b)
            out[module] = (a.clone(), b[rows].contiguous())
            if f.experts:
                experts.add(module)
        for weight in {w for _, w, _, _ in found}:
            del left[weight]
    if left:
        raise ValueError(f"--format peft: no {arch} weight is our {next(iter(left))}, so its "
                         "LoRA adapter has no HF module to go on; export the merged model with "
                         "--format hf instead")
    _check_shared_names(out, experts, arch)
    return out


def _check_shared_names(modules: dict, experts: set[str], arch: str) -> None:
    """Refuse adapters on dense MLPs named like the experts' projections (Qwen3-MoE's dense
    layers): peft 0.21 on transformers 5 maps every target of such a name to the fused expert
    tensors, so the dense layers' adapters would be dropped without a word."""
    dense = {m.rsplit(".", 1)[-1]: m for m in modules if m not in experts}
    shared = [dense[m.rsplit(".", 1)[-1]] for m in modules
              if m in experts and m.rsplit(".", 1)[-1] in dense]
    if shared:
        raise ValueError(
            f"--format peft: the adapted {shared[0]} of a dense layer is named like the "
            f"{arch} experts' projections, which peft (on transformers 5) maps to the fused "
            "expert tensors: its adapter would be dropped; export the merged model with "
            "--format hf, or train with --lora-target-modules qkv,proj for a PEFT adapter")


def adapter_config(spec: LoraSpec, targets: list[str], base_model_path: str | None) -> dict:
    """``adapter_config.json``: a plain LoRA (no rsLoRA, DoRA or biases) of ``spec`` on the
    modules named ``targets`` (PEFT matches a module whose name ends with one)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_path, "revision": None,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}


def export_peft(step_dir: Path, meta: Meta, out: Path, dtype: str = "float32",
                base_model_path: str | None = None) -> tuple[str, list[str]]:
    """Write the PEFT adapter folder of LoRA checkpoint ``step_dir`` (factors in ``dtype``);
    returns (the architecture, ``target_modules``). ValueError for a checkpoint without LoRA
    or a family whose modules a LoRA of ours does not map onto."""
    spec = lora.spec_of(meta)
    if spec is None:
        raise ValueError(f"{step_dir} is not a LoRA checkpoint (its checkpoint.json has no "
                         "LoRA record): --format peft writes LoRA adapters; train them with "
                         "`domino train --load RUN --finetune --lora-rank R` "
                         "(docs/finetune.md), or export the whole model with --format hf")
    config = TransformerConfig.from_dict(meta.config)
    arch = family_for(config).model_type
    adapters = hf_adapters(config, arch, read_adapters(step_dir, meta))
    # PEFT adapts every module whose name ends with one of these; where a module of that name
    # is not ours it starts with B = 0 and changes nothing.
    targets = list(dict.fromkeys(m.rsplit(".", 1)[-1] for m in adapters))
    want = getattr(torch, dtype)
    tensors = {}
    for module, (a, b) in adapters.items():
        tensors[f"{PREFIX}{module}.lora_A.weight"] = a.to(want)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = b.to(want)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(
        json.dumps(adapter_config(spec, targets, base_model_path), indent=2) + "\n")
    return arch, targets
