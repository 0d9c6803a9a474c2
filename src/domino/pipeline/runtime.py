"""The pipeline runtime: one training step of this rank's chunks under a schedule.

Activations and their gradients cross stages as point-to-point messages on the pipeline group
(``CommGroup.isend`` / ``irecv``: gloo on CPU, NCCL on CUDA). Shapes are known ahead ([s, b, h]
of the run), so receives are posted before they are needed (``lookahead`` actions ahead, in the
order the schedule consumes them: the order the sender sends them, as NCCL requires) and waited
for only when the data is used; sends are waited for at the end of the step (their buffers are
the activations kept for the backward anyway). Each pipeline micro-batch runs through the
stage's Domino schedule as any batch would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from domino.pipeline.model import PipelineModel
from domino.pipeline.schedules import Action, build
from domino.tensor_parallel.comm import Handle
from domino.transformer import BackwardContext
from domino.transformer.moe.op import micro_batch_tokens, moe_ops


def _tag(kind: str, vstage: int, mb: int) -> int:
    """A message's tag: what it is (activation / gradient), whose, of which micro-batch."""
    return ((mb * 4096 + vstage) * 2 + (kind == "grad")) % (2**31 - 1)


@dataclass
class StepStats:
    """What one step did on this rank: pipeline micro-batches held at most (activations kept
    for a backward or a W), and the time spent waiting on receives."""

    peak_held: int = 0
    recv_wait_s: float = 0.0
    spans: list[tuple[str, float, float]] = field(default_factory=list)


class PipelineRunner:
    """Runs a training step of ``model`` (this rank's chunks) under ``schedule``."""

    def __init__(self, model: PipelineModel, schedule: str, micro_batches: int,
                 seq_length: int, micro_batch_size: int, lookahead: int = 2,
                 record: bool = False) -> None:
        self.model, self.state = model, model.state
        layout = model.layout
        self.stages, self.chunks = layout.stages, layout.chunks
        self.last = layout.virtual_stages - 1
        self.schedule, self.micro_batches = schedule, micro_batches
        self.actions = build(schedule, self.stages, micro_batches, self.chunks)[
            self.state.pp.rank]
        self.zero_bubble = schedule == "zero_bubble"
        # Each chunk's micro-batch of its last backward: its forward gets a DP reducer's
        # backward context (see step).
        self._last_backward = {a.chunk: a.mb for a in self.actions if a.kind == "B"}
        # What crosses a stage boundary: the stack's input/output, the rank's share of the
        # sequence: its CP shard, split again over TP under sequence parallelism.
        seq_length //= self.state.cp.size
        if model.sequence_parallel_active():
            seq_length //= self.state.tp.size
        self.shape = (seq_length, micro_batch_size, model.config.hidden_size)
        self.dtype = model.activation_dtype
        self.lookahead = lookahead
        self.record = record  # keep (action, start, end) spans of the last step
        self.experts = [moe_ops(chunk) for chunk in model.chunks]  # each chunk's MoE ops
        config = model.config
        # Does any stage hold an MoE layer (then every stage joins the router metrics' sum)?
        self.has_moe = any(config.is_moe_layer(i) for i in range(config.num_layers))

    # -- messages -------------------------------------------------------------------------
    def _vstage(self, a: Action) -> int:
        return a.chunk * self.stages + self.state.pp.rank

    def _needs(self, a: Action) -> tuple[str, int, int, int] | None:
        """(kind, sender's virtual stage, micro-batch, sender rank) that ``a`` receives."""
        k = self._vstage(a)
        if a.kind == "F" and k > 0:
            return ("act", k - 1, a.mb, (k - 1) % self.stages)
        if a.kind == "B" and k < self.last:
            return ("grad", k + 1, a.mb, (k + 1) % self.stages)
        return None

    def _post(self, index: int, posted: dict) -> None:
        for a in self.actions[index:index + 1 + self.lookahead]:
            need = self._needs(a)
            if need is None or need[:3] in posted:
                continue
            kind, vstage, mb, src = need
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.state.device)
            posted[need[:3]] = (buf, self.state.pp.irecv(buf, src, tag=_tag(kind, vstage, mb),
                                                         name=f"recv {kind}",
                                                         tags={"mb": mb, "stage": vstage}))

    def _take(self, a: Action, posted: dict, stats: StepStats) -> torch.Tensor:
        buf, handle = posted.pop(self._needs(a)[:3])
        before = self.state.pp.stats.wait_s
        handle.wait()
        stats.recv_wait_s += self.state.pp.stats.wait_s - before
        return buf

    def _send(self, tensor: torch.Tensor, kind: str, vstage: int, mb: int, dst_vstage: int,
              sends: list) -> None:
        # Untraced: gloo only knows a send is done when it is waited for, at the step's end.
        handle = self.state.pp.isend(tensor, dst_vstage % self.stages,
                                     tag=_tag(kind, vstage, mb), traced=False)
        sends.append((tensor, handle))

    # -- one step -----------------------------------------------------------------------------
    @property
    def overlaps_dp(self) -> bool:
        """Can a DP reducer launch its buckets during this schedule's backwards? Not under
        zero-bubble: its W passes finish the weight gradients after the last backward."""
        return not self.zero_bubble

    def step(self, batches: list[dict[str, torch.Tensor]], loss_scale: float,
             reducer=None) -> tuple[torch.Tensor, StepStats]:
        """Forward and backward of every pipeline micro-batch (``batches``, this DP rank's);
        gradients accumulate in ``.grad``, the loss being summed over tokens and multiplied by
        ``loss_scale`` before its backward (the auxiliary losses of MoE layers by ``loss_scale``
        x the micro-batch's loss tokens: their share of the step). With ``reducer`` (a begun
        ``GradReducer``; needs :attr:`overlaps_dp`) each chunk's last backward launches the DP
        buckets of the blocks it finishes. Returns (the step's summed loss, on every pipeline
        rank; this rank's stats)."""
        if reducer is not None and not self.overlaps_dp:
            raise ValueError("zero-bubble's W passes finish the weight gradients after the "
                             "backwards: reduce DP after the step instead")
        if len(batches) != self.micro_batches:
            raise ValueError(f"the pipeline was built for {self.micro_batches} pipeline "
                             f"micro-batches per step, got {len(batches)}")
        run = _StepRun(self, batches, loss_scale, reducer)
        for chunk in self.model.chunks:  # (a sharded run's units may be gathered from here)
            chunk.language_model.encoder.param_units.pipeline_step()
        for i, a in enumerate(self.actions):
            self._post(i, run.posted)
            if a.kind == "F":
                run.forward(a)
            elif a.kind == "B":
                run.backward(a)
            else:
                run.weights(a)
        return run.finish()


class _StepRun:
    """One step of a :class:`PipelineRunner`: its messages in flight and what each pipeline
    micro-batch keeps from its forward to its backward (and W)."""

    def __init__(self, runner: PipelineRunner, batches: list[dict[str, torch.Tensor]],
                 loss_scale: float, reducer) -> None:
        self.runner, self.batches, self.loss_scale, self.reducer = (runner, batches,
                                                                    loss_scale, reducer)
        self.stats = StepStats()
        self.posted: dict[tuple, tuple[torch.Tensor, Handle]] = {}
        self.sends: list[tuple[torch.Tensor, Handle]] = []
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.deferred: dict[tuple[int, int], list] = {}
        self.contexts: dict[tuple[int, int], BackwardContext] = {}  # of the forwards not yet B
        self.loss = torch.zeros(1, dtype=torch.float64, device=runner.state.device)
        self.held = 0
        # Each micro-batch's auxiliary losses weigh as much as its loss tokens, as without a
        # pipeline: every stage has the batches (one host sync per step).
        self.tokens = (micro_batch_tokens(batches, runner.state.cp) if any(runner.experts)
                       else [])

    def forward(self, a: Action) -> None:
        """F: the chunk's forward of micro-batch ``a.mb`` on what the stage before sent (or the
        tokens), then its output sent on (the last stage: the loss, kept for the B)."""
        r, key, k = self.runner, (a.chunk, a.mb), self.runner._vstage(a)
        chunk, batch = r.model.chunks[a.chunk], self.batches[a.mb]
        x = None
        if k > 0:
            x = r._take(a, self.posted, self.stats).requires_grad_()
            chunk.set_input_tensor(x)
        t0 = time.perf_counter()  # a pass's span starts once its input is here
        is_last = k == r.last
        context = self.contexts[key] = self.context(a)
        out = chunk(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                    labels=batch["labels"] if is_last else None, context=context)
        chunk.set_input_tensor(None)
        if is_last:
            lsum = (out.float() * batch["loss_mask"]).sum()
            self.loss += lsum.detach().double()
            out = lsum * self.loss_scale
        else:
            r._send(out.detach().contiguous(), "act", k, a.mb, k + 1, self.sends)
        self.inputs[key], self.outputs[key] = x, out
        self.held += 1
        self.stats.peak_held = max(self.stats.peak_held, self.held)
        self.span(a, t0)

    def context(self, a: Action) -> BackwardContext:
        """The step context of F ``a``'s forward, for its backward: under zero-bubble it leaves
        its weight gradients for W; a chunk's last backward launches its blocks' DP buckets
        (with a reducer), and every backward does when the reducer shards the gradients
        (``accumulate``: each micro-batch's are reduce-scattered and freed as they are final);
        an MoE chunk's auxiliary losses get the micro-batch's share."""
        r = self.runner
        if r.zero_bubble:
            context = BackwardContext(sink=[])
        elif self.reducer is not None and (r._last_backward[a.chunk] == a.mb
                                           or self.reducer.accumulate):
            context = self.reducer.context()
        else:
            context = BackwardContext()
        if r.experts[a.chunk]:
            context.aux_loss_scale = self.tokens[a.mb] * self.loss_scale
        return context

    def backward(self, a: Action) -> None:
        """B: the backward of F ``a``'s output from the gradient the stage after sent (the
        last stage: from the loss), then its input's gradient sent back."""
        r, key, k = self.runner, (a.chunk, a.mb), self.runner._vstage(a)
        grad = None if k == r.last else r._take(a, self.posted, self.stats)
        t0 = time.perf_counter()
        units = r.model.chunks[a.chunk].language_model.encoder.param_units
        units.pipeline_backward(r._last_backward[a.chunk] == a.mb)
        torch.autograd.backward(self.outputs.pop(key), grad)
        context = self.contexts.pop(key)
        if r.zero_bubble:
            self.deferred[key] = context.sink
        else:
            self.held -= 1
        x = self.inputs.pop(key)
        if k > 0:
            r._send(x.grad, "grad", k, a.mb, k - 1, self.sends)
        self.span(a, t0)

    def weights(self, a: Action) -> None:
        """W: the weight-gradient GEMMs the B of this micro-batch left."""
        t0 = time.perf_counter()
        for work in self.deferred.pop((a.chunk, a.mb)):
            work.run()
        self.held -= 1
        self.span(a, t0)

    def span(self, a: Action, t0: float) -> None:
        if self.runner.record:
            self.stats.spans.append((str(a), t0, time.perf_counter()))

    def finish(self) -> tuple[torch.Tensor, StepStats]:
        """Every send waited for; the loss broadcast from the last stage."""
        for _tensor, handle in self.sends:
            handle.wait()
        assert not self.posted and not self.outputs and not self.deferred \
            and not self.contexts, "schedule left work undone"
        r = self.runner
        r.state.pp.broadcast(self.loss, r.last % r.stages)
        return self.loss, self.stats
