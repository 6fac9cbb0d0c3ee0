"""Per-rank memory: a phase-by-phase replay of flatshard's schedule for one training step.

[Note: the replay]
The step is replayed at the moments where memory can peak (each block's forward, the loss, its
backward, the head's backward when the lazy root is regathered for it, each block's MLP
backward and post-backward, the root's and the tail's post-backward, the end of backward, the
optimizer step). At each moment the live bytes are summed by category from what flatshard
holds then: gathered units and the buffers of gathers in flight (``schedule.py``, from the
units of ``units.py``), the saved activations still alive, the gradient of the unit being
reduced (per-parameter autograd gradients, their casts, the flat copy), the flat gradients
in flight and the gradient shards produced so far
(``reductions.py``; in the reduce dtype until the end of backward casts them into the fp32
``.grad``). Steady state: the optimizer state exists and ``.grad`` was set to ``None`` after
the previous step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from flatshard.tools.estimate.activations import FP32, Activations, activations
from flatshard.tools.estimate.cp_cost import cp_view
from flatshard.tools.estimate.reductions import Reductions, larger, largest_piece
from flatshard.tools.estimate.schedule import gathers
from flatshard.tools.estimate.spec import Layout, ModelSpec, Workload
from flatshard.tools.estimate.tp_cost import local_spec, seq_shards
from flatshard.tools.estimate.units import Units, plan_units

__all__ = ["MemoryEstimate", "Phase", "estimate_memory"]

Parts = dict[str, int]


@dataclass(frozen=True)
class Phase:
    """Live bytes by category at one moment of the step."""

    name: str
    parts: Parts

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank memory (rank 0, which holds no padding); all figures in bytes."""

    parameters: int
    """Sharded parameter storage (fp32 master)."""
    gradients: int
    """``.grad`` of this rank's fragments at the end of backward."""
    optimizer: int
    """Optimizer state of this rank's shard (plus AdamW's 4-byte ``step`` per tensor)."""
    buffers: int
    """Replicated buffers (RoPE tables)."""
    gathered_peak: int
    """Most bytes of gathered (full) unit buffers at once."""
    activations: int
    """Alive at the end of forward (saved tensors, checkpointed inputs, ids)."""
    peak: int
    """Largest total over the replayed phases."""
    peak_phase: str
    phases: tuple[Phase, ...] = field(repr=False)

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer state: ZeRO's (2 + 2 + K)Ψ/Nd."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def peak_parts(self) -> Parts:
        return next(p.parts for p in self.phases if p.name == self.peak_phase)


@dataclass(frozen=True)
class _Step:
    """The units of a layout, what is gathered when, and the byte widths."""

    spec: ModelSpec  # one TP rank's share (tensor_parallel.local_spec)
    layout: Layout
    work: Workload
    act: Activations
    kept: int  # bytes a finished block keeps until its backward
    units: Units
    moments: dict[str, Parts]  # gathered bytes per moment (schedule.gathers)

    @property
    def L(self) -> int:
        return self.spec.layers

    def gathered(self, moment: str) -> Parts:
        return self.moments[moment]

    @property
    def cast_grads(self) -> bool:
        """Gradients are reduced in another dtype than the fp32 ``.grad`` they end up in."""
        return self.layout.precision.flat != self.layout.precision.grad

    def final_grads(self) -> int:
        """``.grad`` after backward: views of the gradient shards, or fp32 copies of the
        fragments (no padding) when they were reduced in another dtype."""
        p, units = self.layout.precision, self.units
        return units.used * p.grad if self.cast_grads else units.shards * p.grad


def estimate_memory(spec: ModelSpec, layout: Layout, work: Workload) -> MemoryEstimate:
    """Replay one training step (see [Note: the replay]) and report the components and peak."""
    layout, work = cp_view(layout, work)  # one GPU of a cp group: FSDP over dp x cp, seq/cp
    act = activations(spec, layout, work)  # validates the TP layout
    units = plan_units(spec, layout)
    kept = act.block_input if work.act_ckpt else act.block
    if work.selective_ac:
        kept = act.block_selective
    local = local_spec(spec, layout.tp)  # what one GPU holds (see tp_cost.py)
    step = _Step(local, layout, work, act, kept, units, gathers(units, layout))
    static = _static(step)
    grads = Reductions(units, layout)
    parts = [*_forward(step, work), *_backward(step, grads), *_finish(step, grads)]
    phases = tuple(Phase(name, {**static, **part}) for name, part in parts)
    peak = max(phases, key=lambda p: p.total)
    return MemoryEstimate(
        parameters=static["parameters"],
        gradients=step.final_grads(),
        optimizer=static["optimizer"],
        buffers=static["buffers"],
        gathered_peak=max(p.parts.get("gathered", 0) for p in phases),
        activations=spec.layers * step.kept + act.head + act.fixed,
        peak=peak.total,
        peak_phase=peak.name,
        phases=phases,
    )


def _static(step: _Step) -> Parts:
    """What every phase holds: sharded parameters, optimizer state, buffers."""
    spec, layout = step.spec, step.layout
    tensors = spec.root_tensors + spec.layers * spec.block_tensors
    step_bytes = FP32 * tensors if layout.optimizer == "adamw" else 0
    return {
        "parameters": step.units.shards * layout.precision.master,
        "optimizer": step.units.used * layout.optimizer_bytes + step_bytes,
        "buffers": spec.max_seq * spec.head_size * FP32,
    }


def _forward(step: _Step, work: Workload) -> Iterator[tuple[str, Parts]]:
    """Each block's forward, the loss, its backward and (lazy root, tied head) the head's."""
    L, act = step.L, step.act
    current = act.block_input + act.mlp_workspace if work.act_ckpt else act.block  # rough if ckpt
    # At the block's last matmul, besides what it saves (measured on CPU, fp32 and bf16 alike):
    # that matmul's output and the block's output, and in bf16 also the block's input and
    # residual in bf16, which the composite norms saved as fp32 upcasts only.
    # (With sequence parallelism the block's output is a sequence shard, the matmul's whole.)
    outputs = work.tokens + work.tokens // seq_shards(step.layout)
    ending = 0 if work.act_ckpt else outputs * step.spec.hidden * FP32
    for i in range(L):
        before = i * step.kept + act.block_input + act.fixed  # block i's input is alive
        yield f"forward block {i} gather", {**step.gathered(f"forward block {i} gather"),
                                            "activations": before}  # fmt: skip
        acts = i * step.kept + current + act.fixed
        yield f"forward block {i}", {**step.gathered(f"forward block {i}"), "activations": acts,
                                     "workspace": ending}  # fmt: skip
    saved = L * step.kept + act.head + act.fixed
    yield "loss", {**step.gathered("loss"), "activations": saved, "workspace": act.logits}
    yield "loss backward", {**step.gathered("loss backward"), "activations": saved,
                            "workspace": act.logits_grads}  # fmt: skip
    if step.units.root_regathered:
        yield "head backward", _head_backward(step, saved)


def _head_backward(step: _Step, saved: int) -> Parts:
    """``lm_head``'s backward, where the lazy root is regathered for its tied weight: the
    fp32 log-softmax was freed by its backward; the logits' gradient, the head's input
    gradient and its weight gradient are alive."""
    spec, p, n = step.spec, step.layout.precision, step.work.tokens
    return {
        **step.gathered("head backward"),
        "activations": saved - n * spec.vocab * FP32,
        "workspace": n * (spec.vocab + spec.hidden) * p.act,
        "unit_grads": spec.vocab * spec.hidden * p.param,
    }


def _backward(step: _Step, grads: Reductions) -> Iterator[tuple[str, Parts]]:
    """Each block's backward, last block first, then the root's post-backward and the tail's
    (last: see [Note: the gather replay])."""
    spec, p, act, units = step.spec, step.layout.precision, step.act, step.units
    # The head's and the final norm's gradients wait for the root's and the tail's reduction.
    held_root = (spec.vocab * spec.hidden + spec.hidden) * p.param
    for i in reversed(range(step.L)):
        yield from _block_backward(step, grads, i, held_root)
    root_grads = (2 * spec.vocab * spec.hidden + spec.hidden) * p.param  # head + embedding
    root = grads.post_backward(units.root)
    yield "backward root", {**step.gathered("backward root"), "activations": act.fixed,
                            "unit_grads": root_grads, **root}  # fmt: skip
    if units.tail is not None:
        yield "backward tail", {**step.gathered("backward tail"), "activations": act.fixed,
                                "unit_grads": units.tail.numel * p.param,
                                **grads.post_backward(units.tail)}  # fmt: skip


def _block_backward(
    step: _Step, grads: Reductions, i: int, held_root: int
) -> Iterator[tuple[str, Parts]]:
    """Block ``i``'s pre-backward (before its gather is waited for), its MLP backward and its
    post-backward (``grads`` moves on to the next reduction there)."""
    spec, p, act = step.spec, step.layout.precision, step.act
    bucket = step.units.bucket_of(i)
    # A bucket's blocks' parameter gradients wait in its node until its first block is done.
    waiting = 1 if bucket is None else bucket[-1] - i + 1
    yield (
        f"backward block {i} gather",
        {
            **step.gathered(f"backward block {i} gather"),
            **grads.between(),
            "activations": (i + 1) * step.kept + act.fixed,  # the head's were freed
            "workspace": act.grad_input,
            "unit_grads": held_root + (waiting - 1) * spec.block_params * p.param,
        },
    )
    gathered = step.gathered(f"backward block {i}")
    yield (
        f"backward block {i} mlp",
        {
            **gathered,
            **grads.between(),
            "activations": i * step.kept + act.block + act.fixed,
            "workspace": act.mlp_workspace,
            "unit_grads": held_root  # + down_proj's
            + (waiting - 1) * spec.block_params * p.param
            + spec.hidden * spec.ffn * p.param,
        },
    )
    yield (
        f"backward block {i} end",
        {
            **step.gathered(f"backward block {i} end"),
            "activations": i * step.kept + act.fixed,
            "workspace": act.grad_input,
            "unit_grads": held_root + waiting * spec.block_params * p.param,
            **(
                grads.post_backward(step.units.unit_of(bucket or i))
                if bucket is None or i == bucket[0]
                else grads.between()
            ),
        },
    )


def _finish(step: _Step, grads: Reductions) -> Iterator[tuple[str, Parts]]:
    """End of backward (the last reductions in flight; then, waited for, the gradient shards
    cast into ``.grad``) and the optimizer step; the gather pool's free buffers are still
    there."""
    p = step.layout.precision
    shards = step.units.shards * p.flat
    casts = step.final_grads() if step.cast_grads else 0
    end = larger(grads.between(), {"gradients": shards + casts})
    yield "end of backward", {**step.gathered("end of backward"), **end}
    yield "optimizer step", {**step.gathered("optimizer step"), "gradients": step.final_grads(),
                             "optimizer_temp": _opt_temp(step)}  # fmt: skip


def _opt_temp(step: _Step) -> int:
    """AdamW's temporary sqrt(v)/bias-correction: foreach for the whole shard at once, the
    for-loop version two tensors of the largest fragment of rank 0; SGD none."""
    layout = step.layout
    if layout.optimizer != "adamw" or layout.optimizer_impl == "fused":
        return 0
    if layout.optimizer_impl == "foreach":
        return step.units.shards * FP32
    return 2 * max(largest_piece(u.sizes, u.shard) for u in step.units.all) * FP32
