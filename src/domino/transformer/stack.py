"""DominoTransformer: a stack of layers run by a Domino schedule (a :class:`~domino.plan.Plan`).

How the stack runs is a :class:`~domino.runtime.RuntimeConfig` (plan, sequence parallelism,
recomputation) passed in at construction. What a forward reads of it changes only through
:meth:`DominoTransformer.set_runtime` (:meth:`~DominoTransformer.set_plan` for the plan) or, for
every stack of a model at once, :func:`set_plan` and the :func:`using_plan` and
:func:`using_runtime` context managers (which put the previous ones back).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from domino.config import TransformerConfig
from domino.context_parallel import SequenceMask
from domino.enums import AttnMaskType, LayerType
from domino.megatron_compat import resolve
from domino.parallel_state import ParallelState
from domino.plan import SYNC, Plan
from domino.precision import set_compute_dtype
from domino.runtime import RuntimeConfig, check_compile, resolve_runtime
from domino.transformer.attention import SelfAttention
from domino.transformer.backward import BackwardPass
from domino.transformer.context import BackwardContext
from domino.transformer.edge import EdgeContext
from domino.transformer.executor import Executor
from domino.transformer.forward import ForwardPass
from domino.transformer.kernels import Kernels
from domino.transformer.layer import Block, TransformerLayer
from domino.transformer.microbatch import InferenceParams, MicroBatch, Prologue, split_batch
from domino.transformer.norms import build_norm
from domino.transformer.param_units import NO_UNITS, ParamUnits
from domino.utils import init_scope

# What a stack builds in from its runtime: a later set_runtime may not change it.
_BUILT_IN = ("compute_dtype", "compile", "compile_backend", "cp_comm_type")


class _ScheduledStack(torch.autograd.Function):
    """The stack as one autograd node whose backward is the schedule's explicit backward.

    Parameters are inputs only so that the output requires grad whenever they do; their
    gradients are accumulated into ``.grad`` by the schedule itself.
    """

    @staticmethod
    def forward(ctx, context, executor, mbs, prologue, x, memory, *params):
        with torch.enable_grad():
            y, record = ForwardPass(executor, mbs, graph=True, prologue=prologue).run(x)
        ctx.context, ctx.executor, ctx.record = context, executor, record
        ctx.num_params = len(params)
        return y.detach()

    @staticmethod
    def backward(ctx, grad_y):
        if ctx.record is None:
            raise RuntimeError("DominoTransformer: backward through the same forward twice is "
                               "not supported (the schedule frees its graph as it goes).")
        # Grad mode stays as autograd set it (off): the schedule's own work here (deferred
        # weight-gradient GEMMs, gradient sums) must not be recorded, or param.grad would carry a
        # graph holding every micro-batch's activations. Running the recorded pieces' backward
        # needs no grad mode.
        grad_x, grad_mem = BackwardPass(ctx.executor, ctx.record, grad_y.contiguous(),
                                        ctx.context).run()
        ctx.record = None
        return (None, None, None, None, grad_x, grad_mem) + (None,) * ctx.num_params


class DominoTransformer(nn.Module):
    """Transformer stack whose TP all-reduces overlap with computation (the Domino schedule).

    ``runtime`` is how it runs (default: ``config.runtime()``, the seed API's keywords); ``plan``
    is a shortcut for ``runtime.replace(plan=plan)``, and :meth:`set_plan` swaps the plan
    (same weights, another schedule). Input and output are [s, b, h]; with sequence
    parallelism (:meth:`sequence_parallel_active`) this rank's sequence shard [s/tp, b, h] of
    each, and of ``encoder_output`` (masks and RoPE angles still cover the whole sequence).
    """

    def __init__(self, config: TransformerConfig, parallel_state: ParallelState | None = None,
                 layer_type: LayerType = LayerType.encoder,
                 self_attn_mask_type: AttnMaskType = AttnMaskType.padding,
                 pre_process: bool = True, post_process: bool = True,
                 num_layers: int | None = None, device: torch.device | str | None = None, *,
                 runtime: RuntimeConfig | None = None, plan: Plan | None = None,
                 layer_offset: int = 0) -> None:
        super().__init__()
        state = resolve(parallel_state)
        runtime = resolve_runtime(config, runtime, plan)
        config.validate_parallel(state.tp.size)
        runtime.check(config, state.tp.size)
        device = torch.device(device) if device is not None else state.device
        check_compile(runtime.compile, runtime.compile_backend, device.type)
        self.config, self.state = config, state
        self.layer_type, self.self_attn_mask_type = layer_type, self_attn_mask_type
        self.pre_process, self.post_process = pre_process, post_process
        n = num_layers if num_layers is not None else (
            config.decoder_num_layers if layer_type == LayerType.decoder else config.num_layers)
        # A pipeline stage holds layers layer_offset .. layer_offset + n - 1 of the model: their
        # numbers (KV-cache keys) and their weights are the full model's.
        self.layer_offset = layer_offset
        # Who owns the blocks' parameters while the passes run (param_units.py); a fully
        # sharded data-parallel run sets its own (training.fsdp).
        self.param_units: ParamUnits = NO_UNITS
        # One set of piece functions for every layer: compiled, they share their graphs.
        self.kernels = Kernels.of(runtime.compile, runtime.compile_backend,
                                  runtime.attention_paths)
        layers = []
        for i in range(layer_offset, layer_offset + n):
            with init_scope(f"{layer_type.name}.layer{i}"):
                layers.append(TransformerLayer(
                    config, state, i + 1, layer_type, device,
                    recompute_attention=runtime.recompute_granularity == "selective",
                    kernels=self.kernels, cp_kind=runtime.cp_kind))
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = (build_norm(config, device)
                                if post_process and config.final_layernorm else None)
        self._runtime, self._force = runtime, False
        self.set_plan(runtime.plan)  # its checks
        set_compute_dtype(self, runtime.compute_dtype)
        self.input_tensor: torch.Tensor | None = None

    @property
    def runtime(self) -> RuntimeConfig:
        """How this stack runs (its plan as :meth:`set_plan` last set it)."""
        return self._runtime

    @property
    def plan(self) -> Plan:
        """The schedule this stack was given (see :meth:`effective_plan` for the one it runs)."""
        return self._runtime.plan

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism asked for (see :meth:`sequence_parallel_active`)."""
        return self._runtime.sequence_parallel

    def set_plan(self, plan: Plan, *, force: bool = False) -> None:
        """Run later forwards (and their backwards) under ``plan``. ``force`` runs it even
        with a single TP rank (see :meth:`effective_plan`): what measures the split's cost."""
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a domino.plan.Plan, got {type(plan).__name__}; "
                            "build one with Plan(...) or Plan.parse('m2:cross').")
        plan.check_width(self.config.hidden_size, what="the plan's column_chunks")
        self._runtime, self._force = self._runtime.replace(plan=plan), bool(force)

    def set_runtime(self, runtime: RuntimeConfig) -> None:
        """Run later forwards under ``runtime``: the same weights computed another way. Only
        what a forward reads may differ from the runtime the stack was built with (the plan,
        sequence parallelism, full recomputation or none); the rest is built in."""
        fixed = [f for f in _BUILT_IN if getattr(runtime, f) != getattr(self._runtime, f)]
        if (runtime.recompute_granularity == "selective") != (
                self._runtime.recompute_granularity == "selective"):
            fixed.append("selective recomputation")
        if fixed:
            raise ValueError(
                f"set_runtime changes what a forward reads (plan, sequence_parallel, "
                f"recompute_granularity None or 'full'), not {', '.join(fixed)}: those are "
                "built into the stack; build another one.")
        self.set_plan(runtime.plan, force=self._force)
        self._runtime = runtime

    @property
    def ring_overlap(self) -> bool:
        """Does ring context parallelism run each K/V transfer under compute (the default;
        see :meth:`set_ring_overlap`)?"""
        return all(a.cp_overlap for a in self.modules() if isinstance(a, SelfAttention))

    def set_ring_overlap(self, on: bool) -> None:
        """Whether ring context parallelism runs each K/V transfer under the compute of the
        block before (``on``, the default) or waits for it first (the benchmark's sync
        baseline, what the overlap is measured against)."""
        for attn in self.modules():
            if isinstance(attn, SelfAttention):
                attn.cp_overlap = bool(on)

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """Pipeline stages without pre-processing receive their input here."""
        self.input_tensor = input_tensor

    def effective_plan(self) -> Plan:
        """The schedule the stack runs: :attr:`plan`, except where there is no communication
        to hide (a single TP rank, no MoE layer with expert parallelism, no ring context
        parallelism), where splitting would only cost (kernel launches, smaller GEMMs), so
        the stack runs unsplit (unless the plan was set with ``force``)."""
        if self.state.tp.size > 1 or self._force:
            return self.plan
        if self.state.cp.size > 1 and self._runtime.cp_kind == "ring":
            return self.plan  # a micro-batch's ring transfers run under the others' compute
        moe = self.state.ep.size > 1 and any(
            getattr(op, "is_moe", False) for op in (b.op for b in self.blocks()))
        return self.plan if moe else SYNC

    def sequence_parallel_active(self, inference_params: InferenceParams | None = None) -> bool:
        """Does a forward run sequence parallel: its input and output [s/tp, b, h] this rank's
        sequence shard? When :attr:`sequence_parallel` is set (the runtime's) and TP > 1,
        except with a KV cache (incremental decoding feeds a token at a time). What feeds the
        stack and what reads its output (embedding, LM head, pooler, pipeline) ask the same."""
        return (self.sequence_parallel and self.state.tp.size > 1
                and inference_params is None)

    def _micro_batches(self, batch: int, attention_mask, encoder_output, enc_dec_attn_mask,
                       inference_params, rotary_pos_emb, training: bool,
                       context: BackwardContext | None) -> list[MicroBatch]:
        if training:
            # The configured count must fit the batch even where it is not used (TP=1), so a
            # config that fails at TP=2 fails the same way in a single-process test.
            self.plan.check_fits(batch)
        count = self.effective_plan().micro_batches
        if not training:
            # Inference on small batches (e.g. generation): the split only changes speed, so cap
            # it. Training keeps the configured count and rejects a batch that is too small.
            count = min(count, batch)
        mbs = []
        for m, (b0, b1) in enumerate(split_batch(batch, count)):
            rot = rotary_pos_emb
            if rot is not None and rot.shape[1] > 1:
                rot = rot[:, b0:b1]
            mbs.append(MicroBatch(
                index=m, batch_start=b0, batch_size=b1 - b0, self_mask=attention_mask,
                causal=self.self_attn_mask_type == AttnMaskType.causal,
                cross_mask=enc_dec_attn_mask,
                rotary=rot, memory=None if encoder_output is None else encoder_output[:, b0:b1],
                inference_params=inference_params, context=context))
        return mbs

    def forward(self, hidden_states: torch.Tensor | None, attention_mask: torch.Tensor | None,
                encoder_output: torch.Tensor | None = None,
                enc_dec_attn_mask: torch.Tensor | None = None,
                inference_params: InferenceParams | None = None,
                rotary_pos_emb: torch.Tensor | None = None, *,
                prologue: Prologue | None = None,
                context: BackwardContext | None = None) -> torch.Tensor:
        """``prologue`` (instead of ``hidden_states``): what produces the input, run inside the
        schedule (the embedding, whose all-reduce then overlaps the first block).
        ``context``: the step's :class:`BackwardContext` (late work, W-pass sink, final-block
        callback, the auxiliary losses' scale) that this forward's backward uses; default: a
        fresh one."""
        if not self.pre_process:
            hidden_states = self.input_tensor
        sp = self.sequence_parallel_active(inference_params)
        s, b = self._input_shape(hidden_states, prologue, sp, attention_mask, rotary_pos_emb)
        self._check_masks(attention_mask, enc_dec_attn_mask, encoder_output, b,
                          inference_params)
        params = [p for p in self.parameters() if p.requires_grad]
        if prologue is not None:
            params += [p for p in prologue.parameters() if p.requires_grad]
        needs_graph = torch.is_grad_enabled() and (
            (hidden_states is not None and hidden_states.requires_grad) or bool(params)
            or (encoder_output is not None and encoder_output.requires_grad))
        if needs_graph and context is None:
            context = BackwardContext()
        mbs = self._micro_batches(b, attention_mask, self._whole_memory(encoder_output, sp),
                                  enc_dec_attn_mask, inference_params, rotary_pos_emb,
                                  needs_graph, context if needs_graph else None)
        edges = EdgeContext.of(self.state, sequence_parallel=sp,
                               kv_cache=inference_params is not None)
        executor = Executor(self.blocks(), self.final_layernorm, edges, self.effective_plan(),
                            recompute=self._runtime.recompute_granularity == "full",
                            kernels=self.kernels, units=self.param_units)
        if not needs_graph:
            return ForwardPass(executor, mbs, graph=False, prologue=prologue).run(
                hidden_states)[0]
        return _ScheduledStack.apply(context, executor, mbs, prologue, hidden_states,
                                     encoder_output, *params)

    def _input_shape(self, hidden_states: torch.Tensor | None, prologue: Prologue | None,
                     sp: bool, attention_mask, rotary_pos_emb) -> tuple[int, int]:
        """(s, b) of the input (``hidden_states`` or what ``prologue`` produces), checked:
        exactly one of them; under sequence parallelism (``sp``) a sequence the TP ranks
        split, and what else covers the sequence covering all of it."""
        tp = self.state.tp.size
        if prologue is not None:
            if hidden_states is not None:
                raise ValueError("pass hidden_states or a prologue, not both.")
            s, b = prologue.shape
            if sp and s % tp:
                raise ValueError(
                    f"sequence parallelism splits the sequence over the {tp} TP ranks: a "
                    f"sequence of {s} tokens is not divisible by {tp}; pad it to a multiple of "
                    f"{tp} (or build the model with sequence_parallel=False).")
            return s, b
        if hidden_states is None:
            raise ValueError("DominoTransformer got no input: pass hidden_states, or call "
                             "set_input_tensor() on a stage built with pre_process=False.")
        s, b, _ = hidden_states.shape
        if sp:  # a shard [s/tp, b, h]: what else covers the sequence must say s * tp
            for name, t, dim in (("attention_mask", attention_mask, -2),
                                 ("rotary_pos_emb", rotary_pos_emb, 0)):
                if isinstance(t, torch.Tensor) and t.shape[dim] not in (1, s * tp):
                    raise ValueError(
                        f"sequence parallelism: hidden_states are this rank's sequence "
                        f"shard [s/{tp}, b, h], {s} positions, so {name} must cover "
                        f"{s * tp} positions, but its dim {dim} is {t.shape[dim]}; pass "
                        "the shard (state.tp.seq_shard(x)) or turn sequence_parallel off.")
        return s, b

    def _check_masks(self, attention_mask, enc_dec_attn_mask, encoder_output, batch: int,
                     inference_params: InferenceParams | None) -> None:
        """The masks fit a batch of ``batch`` and the parallelism; a decoder has its memory."""
        check_mask(attention_mask, batch, "attention_mask")
        if self.state.cp.size > 1 and inference_params is None \
                and isinstance(attention_mask, torch.Tensor):
            raise ValueError(
                "with context parallelism (context_parallel_size > 1) the attention_mask is a "
                "domino.context_parallel.SequenceMask (document ids, key padding per token), "
                "not a dense [b, 1, s, s] mask: each rank holds only a shard of the queries.")
        check_mask(enc_dec_attn_mask, batch, "enc_dec_attn_mask")
        if self.layer_type == LayerType.decoder and encoder_output is None:
            raise ValueError("a decoder needs encoder_output for its cross attention.")

    def _whole_memory(self, encoder_output: torch.Tensor | None,
                      sp: bool) -> torch.Tensor | None:
        """What cross attention reads: the whole encoder output. Under sequence parallelism
        it is gathered once for every layer (its gradient comes back as this rank's shard,
        see BackwardPass.run)."""
        if sp and encoder_output is not None:
            return self.state.tp.all_gather_seq(encoder_output.detach(),
                                                name="fwd ag memory")[0]
        return encoder_output

    def blocks(self) -> list[Block]:
        """The stack's blocks in forward order (a backward makes them final in reverse)."""
        return [blk for layer in self.layers for blk in layer.blocks()]


def check_mask(mask: torch.Tensor | SequenceMask | None, batch: int, name: str) -> None:
    """Masks are bool, True = masked out, broadcastable to [b, 1, s_q, s_k]; or per token, a
    :class:`~domino.context_parallel.SequenceMask` of ``batch`` samples."""
    if mask is None:
        return
    if isinstance(mask, SequenceMask):
        if mask.batch not in (None, batch):
            raise ValueError(f"{name} is a SequenceMask of {mask.batch} samples for a batch of "
                             f"{batch}.")
        return
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} has dtype {mask.dtype}; it must be torch.bool with True = "
                         "masked out (convert with `mask < 0.5` for a 1 = keep mask).")
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[1] != 1:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}; it must broadcast to "
                         f"[b={batch}, 1, s_q, s_k] with a batch dim of 1 or {batch}.")


def stacks_of(model: nn.Module) -> list[DominoTransformer]:
    """Every DominoTransformer in ``model`` (ValueError when there is none)."""
    stacks = [m for m in model.modules() if isinstance(m, DominoTransformer)]
    if not stacks:
        raise ValueError(f"{type(model).__name__} has no DominoTransformer to schedule.")
    return stacks


def compile_cost(*models: nn.Module) -> list:
    """[forward graphs, seconds] the compiled pieces of ``models`` have cost so far
    (``RuntimeConfig.compile``; [0, 0.0] for eager models)."""
    logs = [stack.kernels.log for model in models for stack in stacks_of(model)]
    return [sum(g.graphs for g in logs), sum(g.seconds for g in logs)]


def set_plan(model: nn.Module, plan: Plan, *, force: bool = False) -> None:
    """Put every DominoTransformer of ``model`` on ``plan`` (``force``: see
    :meth:`DominoTransformer.set_plan`)."""
    for stack in stacks_of(model):
        stack.set_plan(plan, force=force)


@contextlib.contextmanager
def using_plan(model: nn.Module, plan: Plan, *, force: bool = False) -> Iterator[None]:
    """Run the enclosed code with every DominoTransformer of ``model`` on ``plan``; their own
    plans are back afterwards, also when the code raises."""
    stacks = stacks_of(model)
    saved = [(s.plan, s._force) for s in stacks]
    try:
        for s in stacks:
            s.set_plan(plan, force=force)
        yield
    finally:
        for s, (p, f) in zip(stacks, saved, strict=True):
            s.set_plan(p, force=f)


@contextlib.contextmanager
def using_runtime(model: nn.Module, **changes) -> Iterator[None]:
    """Run the enclosed code with every DominoTransformer of ``model`` on its runtime with
    ``changes`` (e.g. ``sequence_parallel=False``; what :meth:`DominoTransformer.set_runtime`
    accepts); their own runtimes are back afterwards, also when the code raises."""
    stacks = stacks_of(model)
    saved = [s.runtime for s in stacks]
    try:
        for s in stacks:
            s.set_runtime(s.runtime.replace(**changes))
        yield
    finally:
        for s, before in zip(stacks, saved, strict=True):
            s.set_runtime(before)


def plan_of(model: nn.Module) -> Plan:
    """The plan ``model``'s stacks were given (:func:`set_plan` keeps them alike)."""
    return stacks_of(model)[0].plan
