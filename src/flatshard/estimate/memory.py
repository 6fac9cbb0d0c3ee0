"""Per-rank memory: a phase-by-phase replay of flatshard's schedule for one training step.

[Note: the replay]
The step is replayed at the moments where memory can peak (each block's forward, the loss, its
backward, each block's MLP backward and post-backward, the root's post-backward, the end of
backward, the optimizer step). At each moment the live bytes are summed by category from what
flatshard holds then: gathered units (the root and the last block from their forward to their
backward; under full_shard the current block and those ``fs.Prefetch`` gathers ahead, whose
low-precision send copies live until waited on; under shard_grad_op and no_shard every block not
yet reduced), the saved
activations still alive, the gradient of the unit being reduced (per-parameter autograd
gradients, their casts, the flat copy), up to ``max_inflight_reduces`` flat gradients in flight,
and the gradient shards produced so far (in the reduce dtype until the end of backward casts
them into the fp32 ``.grad``). Steady state: the optimizer state exists and ``.grad`` was set
to ``None`` after the previous step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..comm.gloo_p2p import MAX_P2P_WORLD
from ..engine.flat_group import PIECES_MIN_BYTES
from .activations import FP32, Activations, activations
from .spec import Layout, ModelSpec, Workload

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
    """Element counts of the root and block units for a layout, and the byte widths."""

    spec: ModelSpec
    layout: Layout
    act: Activations
    kept: int  # bytes a finished block keeps until its backward

    @property
    def L(self) -> int:
        return self.spec.layers

    def pad(self, root: bool) -> int:
        return self.layout.padded(self.spec.root_params if root else self.spec.block_params)

    def shard(self, root: bool) -> int:
        return self.pad(root) // self.layout.shard_world

    @property
    def shards(self) -> int:
        return self.shard(True) + self.L * self.shard(False)

    @property
    def used(self) -> int:
        """Parameter elements in rank 0's shards (padding excluded)."""
        s = self.spec
        return min(s.root_params, self.shard(True)) + self.L * min(
            s.block_params, self.shard(False)
        )

    @property
    def sharded(self) -> bool:
        return self.layout.shard_world > 1

    def reduces_pieces(self, root: bool) -> bool:
        """Reduced straight from the per-parameter gradients, without a flat copy (flatshard's
        Gloo point-to-point path: ``FlatGroup.reduces_pieces``). Reductions in flight then hold
        those gradients instead of a flat copy: the same bytes."""
        lay = self.layout
        p2p = lay.backend == "gloo" and 2 <= lay.shard_world <= MAX_P2P_WORLD
        return p2p and self.pad(root) * lay.precision.flat >= PIECES_MIN_BYTES

    @property
    def cast_grads(self) -> bool:
        """Gradients are reduced in another dtype than the fp32 ``.grad`` they end up in."""
        return self.layout.precision.flat != self.layout.precision.grad

    def gathered(self, blocks: int, ahead: int = 0) -> Parts:
        """The root and ``blocks`` gathered block units; ``ahead`` of them still in flight keep
        their low-precision send copy of the shard."""
        p = self.layout.precision
        if not self.sharded and p.param == p.master:
            return {"gathered": 0}  # no_shard in fp32: the parameters are used in place
        sends = ahead * self.shard(False) * p.param if self.sharded and p.param != p.master else 0
        return {"gathered": (self.pad(True) + blocks * self.pad(False)) * p.param,
                "gather_inputs": sends}  # fmt: skip

    def reducing(self, done: int, root: bool) -> Parts:
        """Post-backward of a unit after ``done`` blocks were reduced: per-parameter gradients
        are cast (if needed) and concatenated (the casts are freed before the new gradient
        shard is allocated), the flat gradient launched, the oldest reduction waited for beyond
        ``max_inflight_reduces``. no_shard: the flat gradient is the gradient shard."""
        p, numel = self.layout.precision, self.spec.root_params if root else self.spec.block_params
        casts = numel * p.flat if p.flat != p.param else 0
        if not self.sharded:
            return {"gradients": (done * self.pad(False) + self.pad(root)) * p.flat,
                    "flat_grads": casts}  # fmt: skip
        older = min(self.layout.max_inflight_reduces, done)
        current = 0 if self.reduces_pieces(root) else self.pad(root)  # the flat copy
        flats = (older * self.pad(False) + current) * p.flat
        new = self.shard(root) * p.flat  # the larger of the two is the moment's peak
        return {"gradients": done * self.shard(False) * p.flat + (new if new >= casts else 0),
                "flat_grads": flats + (casts if casts > new else 0)}  # fmt: skip

    @property
    def keep_all(self) -> bool:
        """Blocks stay gathered from their forward to their backward (no reshard)."""
        return self.layout.strategy in ("shard_grad_op", "no_shard")

    def final_grads(self) -> int:
        """``.grad`` after backward: views of the gradient shards, or fp32 copies of the
        fragments (no padding) when they were reduced in another dtype."""
        p = self.layout.precision
        return self.used * p.grad if self.cast_grads else self.shards * p.grad


def estimate_memory(spec: ModelSpec, layout: Layout, work: Workload) -> MemoryEstimate:
    """Replay one training step (see [Note: the replay]) and report the components and peak."""
    act = activations(spec, layout, work)
    step = _Step(spec, layout, act, act.block_input if work.act_ckpt else act.block)
    static = _static(step)
    parts = [*_forward(step, work), *_backward(step), *_finish(step)]
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
        "parameters": step.shards * layout.precision.master,
        "optimizer": step.used * layout.optimizer_bytes + step_bytes,
        "buffers": spec.max_seq * (spec.hidden // spec.heads) * FP32,
    }


def _forward(step: _Step, work: Workload) -> Iterator[tuple[str, Parts]]:
    """Each block's forward (current + prefetched units), then the loss."""
    L, act, ahead = step.L, step.act, step.layout.prefetch_forward
    keep_all = step.keep_all
    current = act.block_input + act.mlp_workspace if work.act_ckpt else act.block  # rough if ckpt
    for i in range(L):
        early = min(ahead, L - 1 - i)
        blocks = i + 1 + early if keep_all else 1 + early
        acts = i * step.kept + current + act.fixed
        yield f"forward block {i}", {**step.gathered(blocks, early), "activations": acts}
    saved = L * step.kept + act.head + act.fixed
    # The last block of the forward stays gathered into the backward (its backward comes first).
    last = L if keep_all else 1
    yield "loss", {**step.gathered(last), "activations": saved, "workspace": act.logits}
    yield "loss backward", {**step.gathered(last), "activations": saved,
                            "workspace": act.logits_grads}  # fmt: skip


def _backward(step: _Step) -> Iterator[tuple[str, Parts]]:
    """Two moments per block, last block first (its MLP backward, its post-backward), then
    the root's post-backward."""
    spec, p, act, L = step.spec, step.layout.precision, step.act, step.L
    held_root = (spec.vocab * spec.hidden + spec.hidden) * p.param  # lm_head + norm grads
    keep_all = step.keep_all
    for i in reversed(range(L)):
        done = L - 1 - i  # blocks already reduced
        early = int(step.layout.prefetch_backward == "pre" and i > 0 and not keep_all)
        gathered = step.gathered(i + 1 if keep_all else 1 + early, early)
        older = min(step.layout.max_inflight_reduces, done) if step.sharded else 0
        yield (
            f"backward block {i} mlp",
            {
                **gathered,
                "gradients": done * step.shard(False) * p.flat,
                "activations": i * step.kept + act.block + act.fixed,
                "workspace": act.mlp_workspace,
                "unit_grads": held_root + spec.hidden * spec.ffn * p.param,  # + down_proj's
                "flat_grads": older * step.pad(False) * p.flat,
            },
        )
        yield (
            f"backward block {i} end",
            {
                **gathered,
                "activations": i * step.kept + act.fixed,
                "workspace": act.grad_input,
                "unit_grads": held_root + spec.block_params * p.param,
                **step.reducing(done, root=False),
            },
        )
    root_grads = (2 * spec.vocab * spec.hidden + spec.hidden) * p.param  # head + embedding
    yield "backward root", {**step.gathered(0), "activations": act.fixed,
                            "unit_grads": root_grads, **step.reducing(L, root=True)}  # fmt: skip


def _finish(step: _Step) -> Iterator[tuple[str, Parts]]:
    """End of backward (gradient shards cast into ``.grad``) and the optimizer step."""
    p = step.layout.precision
    if step.cast_grads:
        yield "end of backward", {"gradients": step.shards * p.flat + step.final_grads()}
    yield "optimizer step", {"gradients": step.final_grads(), "optimizer_temp": _opt_temp(step)}


def _opt_temp(step: _Step) -> int:
    """AdamW's temporary sqrt(v)/bias-correction: foreach for the whole shard at once, the
    for-loop version two tensors of the largest fragment of rank 0; SGD none."""
    layout = step.layout
    if layout.optimizer != "adamw" or layout.optimizer_impl == "fused":
        return 0
    if layout.optimizer_impl == "foreach":
        return step.shards * FP32
    largest = max(_largest_fragment(step.spec.root_sizes, step.shard(True)),
                  _largest_fragment(step.spec.block_sizes, step.shard(False)))  # fmt: skip
    return 2 * largest * FP32


def _largest_fragment(sizes: list[int], shard: int) -> int:
    """Largest piece of one parameter among the first ``shard`` flat elements (rank 0)."""
    best, offset = 0, 0
    for n in sizes:
        best = max(best, min(offset + n, shard) - min(offset, shard))
        offset += n
    return best
