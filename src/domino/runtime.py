"""How a model runs, apart from what it is: :class:`RuntimeConfig`.

A :class:`~domino.config.TransformerConfig` is the architecture (what a checkpoint records). The
choices that change how the same weights are computed - the Domino schedule (a
:class:`~domino.plan.Plan`), sequence parallelism, activation recomputation, the compute dtype
of mixed precision (:mod:`domino.precision`) - live in one frozen value passed to the model
constructors (``GPTModel(config, runtime=...)``, ``TransformerLanguageModel``,
``DominoTransformer``, ``PipelineModel``) and read where they act.

The seed (the DeepSpeed-Domino language-model API that domino keeps compatible, see
docs/glossary.md) spells these choices as Megatron does - ``TransformerConfig(...,
domino_micro_batches=..., domino_overlap=..., domino_column_chunks=..., sequence_parallel=...,
recompute_granularity=...)`` - and that spelling still builds the default one:
:meth:`RuntimeConfig.from_seed`, read back by ``config.runtime()``, is what a model built
without ``runtime=`` runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from domino.plan import Plan, check_fields
from domino.precision import PRECISIONS
from domino.safe_files import read_cache, update_cache

RECOMPUTE_GRANULARITIES = ("full", "selective")
COMPUTE_DTYPES = (*PRECISIONS.values(), torch.float32)  # None: the parameters' own
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # eager: dynamo's tracing only
DEFAULT_PLAN = Plan(2, "cross_layer", 1)  # what the measurements found never worse (docs)
CXX_CACHE_FILE = "cxx_checks.json"  # the C++ compilers found to work (check_compile)
# Context-parallel attention: Megatron's --cp-comm-type values -> domino.context_parallel's kinds.
CP_COMM_TYPES = {"p2p": "ring", "all_gather": "allgather", "a2a": "alltoall"}
# The core attention's paths (kernels.attention; AttentionChoice says which runs when).
ATTENTION_PATHS = ("flash", "math", "explicit", "explicit_fp32")
ATTENTION_BACKENDS = ("auto", *ATTENTION_PATHS)  # auto: measured on the machine
MASK_KINDS = ("causal", "masked", "windowed")  # kernels.mask_kind

# The seed's constructor spelling of the run-time choices (TransformerConfig keywords and
# `domino train` flags): name -> (default, help).
SEED_SPELLING: dict[str, tuple[Any, str]] = {
    "domino_micro_batches": (
        DEFAULT_PLAN.micro_batches, "Domino: split each batch into this many micro-batches."),
    "domino_overlap": (
        DEFAULT_PLAN.overlap, "Domino overlap: none, intra_layer, cross_layer."),
    "domino_column_chunks": (
        DEFAULT_PLAN.column_chunks,
        "Domino: split row-parallel GEMM outputs into column chunks."),
    "recompute_granularity": (
        None, "Activation recomputation (Megatron's names): full (every piece of every layer is "
              "recomputed in backward from its inputs) or selective (the core attention only); "
              "None keeps every activation."),
    "sequence_parallel": (
        False, "Sequence parallelism (Megatron's name): norms, dropout and residuals run on this "
               "TP rank's 1/tp of the sequence; each TP all-reduce becomes an all-gather before "
               "the column-parallel GEMM and a reduce-scatter after the row-parallel one. "
               "Training and plain forwards only: a forward with a KV cache runs without it "
               "(same weights, same math)."),
}


@dataclass(frozen=True)
class AttentionChoice:
    """The path the core attention (``kernels.attention``) takes for each kind of mask: ``flash``
    (``scaled_dot_product_attention`` with PyTorch's own backend choice: its fused flash kernel
    on a CPU), ``math`` (SDPA's math backend), ``explicit`` (Q K^T, softmax, P V as batched
    matmuls in the compute dtype) or ``explicit_fp32`` (those matmuls in fp32). ``explicit``
    is the explicit variant run where only the explicit path can compute the attention: under
    attention dropout (its masks come from domino's TP-aware generators, which no fused kernel
    takes) and with a soft-cap or attention sinks (no fused kernel has them). The default is
    PyTorch's own choice, unmeasured; ``domino.transformer.attention_paths`` measures one."""

    causal: str = "flash"  # the causal rule alone (SDPA's is_causal)
    masked: str = "flash"  # an additive mask (padding, documents; or none)
    windowed: str = "flash"  # a sliding window (with the causal rule)
    explicit: str = "explicit"  # dropout, soft-cap, sinks: explicit or explicit_fp32
    source: str = field(default="not measured: PyTorch's own SDPA choice", compare=False)

    def __post_init__(self) -> None:
        for kind in MASK_KINDS:
            if getattr(self, kind) not in ATTENTION_PATHS:
                raise ValueError(f"AttentionChoice.{kind}={getattr(self, kind)!r} is not one of "
                                 f"{', '.join(ATTENTION_PATHS)}.")
        if self.explicit not in ATTENTION_PATHS[2:]:
            raise ValueError(f"AttentionChoice.explicit={self.explicit!r} is not one of "
                             f"{', '.join(ATTENTION_PATHS[2:])} (what dropout, a soft-cap or "
                             "sinks run).")

    @classmethod
    def fixed(cls, path: str) -> AttentionChoice:
        """Every mask kind on ``path`` (an explicit one also under dropout)."""
        if path not in ATTENTION_PATHS:
            raise ValueError(f"attention path {path!r} is not one of "
                             f"{', '.join(ATTENTION_PATHS)}.")
        explicit = path if path.startswith("explicit") else "explicit"
        return cls(path, path, path, explicit, source=f"fixed (attention_backend={path!r})")

    def path(self, kind: str) -> str:
        """The path of mask kind ``kind`` (one of :data:`MASK_KINDS`)."""
        return getattr(self, kind)

    def describe(self) -> str:
        """One line: the path of each mask kind, dropout's, and where the choice came from."""
        return (", ".join(f"{k} {self.path(k)}" for k in MASK_KINDS)
                + f"; dropout/soft-cap/sinks {self.explicit} ({self.source})")


class _Model(Protocol):  # what check() reads of a TransformerConfig (no import: config imports us)
    hidden_size: int
    seq_length: int


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """The run-time choices of a model: same weights, another way of computing them."""

    plan: Plan = field(
        default=DEFAULT_PLAN,
        metadata={"help": "The Domino schedule (micro-batches, overlap, column chunks)."})
    sequence_parallel: bool = field(
        default=False, metadata={"help": SEED_SPELLING["sequence_parallel"][1]})
    recompute_granularity: str | None = field(
        default=None, metadata={"help": SEED_SPELLING["recompute_granularity"][1],
                                "choices": RECOMPUTE_GRANULARITIES})
    compute_dtype: torch.dtype | None = field(
        default=None,
        metadata={"help": "Mixed precision: compute in this dtype (torch.bfloat16 or "
                          "torch.float16) from copies of the parameters, which stay the fp32 "
                          "master weights (domino.precision); None computes in the parameters' "
                          "own dtype."})
    compile: bool = field(
        default=False,
        metadata={"help": "Compile each piece's work between its GEMMs and collectives (norms, "
                          "dropout, residuals, RoPE, attention, activations) with torch.compile, "
                          "never across a collective (domino.transformer.kernels)."})
    compile_backend: str = field(
        default="inductor",
        metadata={"help": "The torch.compile backend of compile=True: inductor generates fused "
                          "code (a C++ compiler on CPU, Triton on CUDA); aot_eager traces and "
                          "differentiates the same graphs without generating code.",
                  "choices": COMPILE_BACKENDS})
    cp_comm_type: str = field(
        default="p2p",
        metadata={"help": "Context parallelism's attention (Megatron's --cp-comm-type; read only "
                          "when the state's CP group has more than one rank): p2p (K/V blocks "
                          "around a ring, each transfer under the previous block's compute), "
                          "all_gather (gather K/V once) or a2a (Ulysses: all-to-all by heads).",
                  "choices": tuple(CP_COMM_TYPES)})
    attention_backend: str = field(
        default="auto",
        metadata={"help": "The core attention's path: auto (the fastest measured on this "
                          "machine at the run's shapes, dtype and masks; domino.transformer."
                          "attention_paths, which domino train and bench call), or one for "
                          "every mask: flash (SDPA, PyTorch's own backend choice), math (SDPA's "
                          "math backend), explicit (batched matmuls in the compute dtype), "
                          "explicit_fp32 (in fp32). Dropout, a soft-cap and sinks always run an "
                          "explicit one.",
                  "choices": ATTENTION_BACKENDS})
    attention_measured: AttentionChoice | None = field(
        default=None,
        metadata={"help": "attention_backend='auto''s measured paths (set by domino.transformer."
                          "attention_paths.resolve_attention before the model is built); None: "
                          "not measured, PyTorch's own SDPA choice."})

    def __post_init__(self) -> None:
        if not isinstance(self.plan, Plan):
            raise TypeError(f"plan must be a domino.plan.Plan, got {type(self.plan).__name__}; "
                            "build one with Plan(...) or Plan.parse('m2:cross').")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel={self.sequence_parallel!r} must be True or "
                             "False.")
        if (self.recompute_granularity is not None
                and self.recompute_granularity not in RECOMPUTE_GRANULARITIES):
            raise ValueError(
                f"recompute_granularity={self.recompute_granularity!r} is not one of "
                f"{', '.join(RECOMPUTE_GRANULARITIES)} (or None: keep every activation).")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile={self.compile!r} must be True or False.")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile_backend={self.compile_backend!r} is not one of "
                             f"{', '.join(COMPILE_BACKENDS)}.")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type={self.cp_comm_type!r} is not one of "
                             f"{', '.join(CP_COMM_TYPES)}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is not one of "
                             f"{', '.join(ATTENTION_BACKENDS)}.")
        if self.attention_measured is not None and (
                not isinstance(self.attention_measured, AttentionChoice)
                or self.attention_backend != "auto"):
            raise ValueError(f"attention_measured={self.attention_measured!r} must be an "
                             "AttentionChoice, and only with attention_backend='auto' (it is "
                             "auto's measurement); drop it to run a fixed backend.")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r} is not one of "
                             "torch.bfloat16, torch.float16, torch.float32 (or None: the "
                             "parameters' own dtype).")

    @property
    def attention_paths(self) -> AttentionChoice:
        """The attention paths the model runs: the fixed backend's, else auto's measured
        ones, else PyTorch's own choice (auto not measured)."""
        if self.attention_backend != "auto":
            return AttentionChoice.fixed(self.attention_backend)
        return self.attention_measured or AttentionChoice()

    @property
    def cp_kind(self) -> str:
        """The ``domino.context_parallel`` kind of :attr:`cp_comm_type`."""
        return CP_COMM_TYPES[self.cp_comm_type]

    @classmethod
    def from_seed(cls, *, domino_micro_batches: int = DEFAULT_PLAN.micro_batches,
                  domino_overlap: str = DEFAULT_PLAN.overlap,
                  domino_column_chunks: int = DEFAULT_PLAN.column_chunks,
                  sequence_parallel: bool = False,
                  recompute_granularity: str | None = None) -> RuntimeConfig:
        """The run-time config the seed's spelling asks for (messages name those keywords)."""
        check_fields(domino_micro_batches, domino_overlap, domino_column_chunks,
                     "domino_{}".format)
        return cls(plan=Plan(domino_micro_batches, domino_overlap, domino_column_chunks),
                   sequence_parallel=sequence_parallel,
                   recompute_granularity=recompute_granularity)

    def seed_spelling(self) -> dict[str, Any]:
        """Inverse of :meth:`from_seed`: this config in the seed's keywords."""
        return {"domino_micro_batches": self.plan.micro_batches,
                "domino_overlap": self.plan.overlap,
                "domino_column_chunks": self.plan.column_chunks,
                "recompute_granularity": self.recompute_granularity,
                "sequence_parallel": self.sequence_parallel}

    def replace(self, **changes: Any) -> RuntimeConfig:
        """A copy with ``changes`` (validated like a new one)."""
        return dataclasses.replace(self, **changes)

    def check(self, config: _Model, tp_size: int) -> None:
        """Raise ValueError unless this runs ``config``'s model over ``tp_size`` TP ranks."""
        self.plan.check_width(config.hidden_size, what="the plan's column_chunks")
        if self.sequence_parallel and tp_size > 1 and config.seq_length % tp_size:
            raise ValueError(
                f"sequence_parallel needs seq_length divisible by tensor_model_parallel_size: "
                f"seq_length={config.seq_length} is not divisible by {tp_size}; choose a sequence "
                f"length that is a multiple of {tp_size} (or turn sequence_parallel off).")


def check_compile(compile: bool, backend: str, device_type: str, flag: str = "compile") -> None:
    """Raise ValueError unless ``torch.compile`` with ``backend`` can generate code for
    ``device_type`` here (inductor needs a working C++ compiler on CPU, :func:`cxx_problem`, and
    Triton on CUDA); ``flag`` names the setting in the message (``"compile"``: the library's
    keyword spelling, anything else a command's)."""
    if not compile or backend != "inductor":
        return
    backend_flag = "compile_backend='aot_eager'" if flag == "compile" else \
        "--compile-backend aot_eager"
    others = f"pass {backend_flag} (same graphs, no generated code), or drop {flag}"
    if device_type == "cpu":
        cxx, source = inductor_cxx()
        problem = cxx_problem(cxx)
        if problem is not None:
            raise ValueError(f"{flag} with the inductor backend: the C++ compiler {cxx!r} "
                             f"{problem} (from {source}); inductor compiles C++ on a CPU: install "
                             f"one (e.g. apt install g++) or set CXX to a working one, {others}")
    elif device_type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ValueError(f"{flag} with the inductor backend generates Triton kernels on CUDA, "
                         f"but triton is not installed: pip install triton, {others}.")


def inductor_cxx() -> tuple[str, str]:
    """(the C++ compiler inductor runs on a CPU, where that name comes from): ``$CXX`` (what a
    fresh rank's torch reads), else torch's ``torch._inductor.config.cpp.cxx`` when this process
    imported it (it may have been set), else torch's default."""
    if os.environ.get("CXX"):
        return os.environ["CXX"], "CXX"
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        cxx = config.cpp.cxx
        names = [c for c in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)) if c]
        if names:
            return names[0], "torch._inductor.config.cpp.cxx"
    return ("clang++" if sys.platform == "darwin" else "g++"), "torch's default"


def cxx_problem(cxx: str) -> str | None:
    """None when ``cxx`` builds a one-line shared library with inductor's OpenMP flag here, else
    what went wrong. A success is kept per machine, torch version and compiler binary (path, size,
    mtime) in ``$DOMINO_CACHE_DIR`` (:data:`CXX_CACHE_FILE`), so later runs only stat it."""
    path = shutil.which(cxx)
    if path is None:
        return "does not exist or is not executable" if os.sep in cxx else "is not on PATH"
    from domino.gemm_rate import machine
    from domino.utils import cache_root

    real = os.path.realpath(path)
    st = os.stat(real)
    key = f"{machine()} | torch {torch.__version__} | {real} {st.st_size} {st.st_mtime_ns}"
    cache = cache_root() / CXX_CACHE_FILE
    if read_cache(cache).get(key) is True:
        return None
    problem = _build_probe(path)
    if problem is None:
        update_cache(cache, key, True)  # (a read-only cache folder: checked again next time)
    return problem


def _build_probe(cxx: str) -> str | None:
    """Compile and link a one-line shared library with ``cxx`` (as inductor does on a CPU:
    ``-shared -fPIC``, ``-fopenmp`` on Linux); None when it wrote one, else what went wrong."""
    with tempfile.TemporaryDirectory(prefix="domino-cxx-") as tmp:
        src, lib = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w", encoding="utf-8") as f:
            f.write('extern "C" int domino_probe(int x) { return x + 1; }\n')
        omp = ["-fopenmp"] if sys.platform.startswith("linux") else []
        try:
            done = subprocess.run([cxx, "-shared", "-fPIC", *omp, src, "-o", lib],
                                  capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return "did not finish compiling a one-line file in 120 s"
        except OSError as err:
            return f"cannot be run ({err.strerror})"
        if done.returncode != 0:
            said = next((ln.strip() for ln in (done.stderr + done.stdout).splitlines()
                         if ln.strip()), "")
            return (f"failed to compile a one-line file (exit {done.returncode}"
                    f"{': ' + said[:200] if said else ''})")
        if not os.path.isfile(lib) or os.path.getsize(lib) == 0:
            return "exited 0 on a one-line file but wrote no library"
    return None


def resolve_runtime(config: Any, runtime: RuntimeConfig | None,
                    plan: Plan | None = None) -> RuntimeConfig:
    """What a model constructor runs: ``runtime``, else the config's seed-spelled default
    (``config.runtime()``); ``plan`` is a shortcut for ``runtime.replace(plan=plan)``."""
    if runtime is not None and not isinstance(runtime, RuntimeConfig):
        raise TypeError(f"runtime must be a domino.runtime.RuntimeConfig, got "
                        f"{type(runtime).__name__}.")
    if runtime is not None and plan is not None:
        raise ValueError("pass the plan inside runtime= (RuntimeConfig(plan=...)) or as plan=, "
                         "not both.")
    base = runtime if runtime is not None else config.runtime()
    return base if plan is None else base.replace(plan=plan)
