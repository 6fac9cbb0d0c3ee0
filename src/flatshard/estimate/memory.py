"""Per-rank memory: activation formulas and a phase-by-phase replay of flatshard's schedule.

[Note: the replay]
The step is replayed at the moments where memory can peak (end of each block's forward, the
loss, its backward, the MLP backward and the end of each block's backward, the root's backward,
the optimizer step). At each moment the live bytes are summed by category from what flatshard
holds then: which units are gathered (root always; the current unit and the prefetched next one
under full_shard; everything not yet reduced under shard_grad_op), which saved activations are
still alive, the gradient of the unit being reduced (per-parameter autograd gradients + the
flat copy), up to ``max_inflight_reduces`` flat gradients in flight, and the sharded gradients
produced so far. Steady state: the optimizer state exists, ``.grad`` was set to ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .spec import Layout, ModelSpec, Workload

__all__ = ["Activations", "MemoryEstimate", "Phase", "activations", "estimate_memory"]

INT64 = 8
FP32 = 4


@dataclass(frozen=True)
class Activations:
    """Bytes saved for backward (and the transients of backward) for one micro-batch."""

    block: int
    """One block without checkpointing."""
    block_input: int
    """The block's input, all a checkpointed block keeps."""
    head: int
    """Final norm, ``lm_head`` input and the fp32 log-softmax."""
    fixed: int
    """Token ids and labels (int64) and the RoPE cos/sin of this batch."""
    mlp_workspace: int
    """Extra bytes live in a block's MLP backward beyond its saved tensors."""
    grad_input: int
    """The gradient flowing between blocks."""
    logits: int
    """The logits (compute dtype), alive while the loss is computed."""
    logits_grads: int
    """Gradients of the log-softmax and of the logits during the loss backward."""


def activations(spec: ModelSpec, layout: Layout, work: Workload) -> Activations:
    """Saved-tensor bytes of the reference GPT block, counted tensor by tensor (see docs).

    Per token and block, in compute-dtype elements: each norm keeps its input, ``x*rstd``
    (composite RMSNorm only) and its output; attention keeps q, k, v and its output; SwiGLU keeps
    gate, up, silu(gate) and their product (GELU: up and gelu(up)). fp32 extras: one rstd per
    norm and one log-sum-exp per head. ``math`` attention also keeps the T x T probabilities.
    """
    n, c, f, ab = work.tokens, spec.hidden, spec.ffn, layout.precision.act
    norm = (2 if work.fused_norm else 3) * c
    mlp = (4 if spec.mlp == "swiglu" else 2) * f
    block = n * (ab * (2 * norm + 2 * c + 2 * spec.kv_width + mlp) + FP32 * (spec.heads + 2))
    if work.attention == "math":
        block += ab * work.batch * spec.heads * work.seq * work.seq
    head_dim = c // spec.heads
    logits = n * spec.vocab * ab + (n * spec.vocab * FP32 if ab != FP32 else 0)  # + fp32 copy
    return Activations(
        block=block,
        block_input=n * c * ab,
        head=n * (ab * norm + FP32 + FP32 * spec.vocab),
        fixed=2 * n * INT64 + 2 * work.seq * (head_dim // 2) * FP32,
        mlp_workspace=n * ab * (c + (2 if spec.mlp == "swiglu" else 1) * f),
        grad_input=n * c * ab,
        logits=logits,
        logits_grads=2 * n * spec.vocab * FP32,
    )


@dataclass(frozen=True)
class Phase:
    """Live bytes by category at one moment of the step."""

    name: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank memory (rank 0, which holds no padding); all figures in bytes."""

    parameters: int
    """Sharded parameter storage (fp32 master)."""
    gradients: int
    """Sharded gradients at the end of backward."""
    optimizer: int
    """Optimizer state of this rank's shard (plus AdamW's 4-byte ``step`` per tensor)."""
    buffers: int
    """Replicated buffers (RoPE tables)."""
    gathered_peak: int
    """Most bytes of gathered (full) unit buffers at once."""
    activations: int
    """Saved for backward at the end of forward (blocks, head, ids)."""
    peak: int
    """Largest total over the replayed phases."""
    peak_phase: str
    phases: tuple[Phase, ...] = field(repr=False)

    @property
    def model_states(self) -> int:
        """Parameters + gradients + optimizer state: ZeRO's (2 + 2 + K)Ψ/Nd."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def peak_parts(self) -> dict[str, int]:
        return next(p.parts for p in self.phases if p.name == self.peak_phase)


@dataclass(frozen=True)
class _Units:
    """Element counts of the root and of one block unit for a layout."""

    root: int
    block: int
    pad_root: int
    pad_block: int
    shard_root: int
    shard_block: int

    @classmethod
    def of(cls, spec: ModelSpec, layout: Layout) -> _Units:
        w = layout.shard_world
        pr, pb = layout.padded(spec.root_params), layout.padded(spec.block_params)
        return cls(spec.root_params, spec.block_params, pr, pb, pr // w, pb // w)


def _static(spec: ModelSpec, layout: Layout, u: _Units) -> dict[str, int]:
    """What every phase holds: sharded parameters, optimizer state, buffers."""
    used = min(u.root, u.shard_root) + spec.layers * min(u.block, u.shard_block)
    steps = spec.root_tensors + spec.layers * spec.block_tensors
    step_bytes = FP32 * steps if layout.optimizer == "adamw" else 0
    return {
        "parameters": (u.shard_root + spec.layers * u.shard_block) * layout.precision.master,
        "optimizer": used * layout.optimizer_bytes + step_bytes,
        "buffers": spec.max_seq * (spec.hidden // spec.heads) * FP32,
    }


def estimate_memory(spec: ModelSpec, layout: Layout, work: Workload) -> MemoryEstimate:
    """Replay one training step (see [Note: the replay]) and report the components and peak."""
    u = _Units.of(spec, layout)
    act = activations(spec, layout, work)
    static = _static(spec, layout, u)
    phases = [Phase(name, {**static, **parts}) for name, parts in _schedule(spec, layout, u, act, work)]
    peak = max(phases, key=lambda p: p.total)
    saved = spec.layers * _kept(act, work) + act.head + act.fixed
    return MemoryEstimate(
        parameters=static["parameters"],
        gradients=(u.shard_root + spec.layers * u.shard_block) * _grad_bytes(layout),
        optimizer=static["optimizer"],
        buffers=static["buffers"],
        gathered_peak=max(p.parts.get("gathered", 0) for p in phases),
        activations=saved,
        peak=peak.total,
        peak_phase=peak.name,
        phases=tuple(phases),
    )


def _kept(act: Activations, work: Workload) -> int:
    """Bytes a finished block keeps until its backward."""
    return act.block_input if work.act_ckpt else act.block


def _grad_bytes(layout: Layout) -> int:
    # no_shard: the all-reduced flat gradient itself is the gradient.
    return layout.precision.grad if layout.shard_world > 1 else layout.precision.flat


def _schedule(spec: ModelSpec, layout: Layout, u: _Units, act: Activations, work: Workload):
    """Yield ``(phase name, parts)`` in step order (parts exclude the static ones)."""
    L, p, kept = spec.layers, layout.precision, _kept(act, work)
    keep_all = layout.strategy == "shard_grad_op"  # no reshard after forward
    for i in range(L):
        blocks = min(i + 2, L) if keep_all else min(2, L - i)  # + the prefetched next block
        yield f"forward block {i}", {
            "gathered": _gathered(layout, u, blocks),
            "activations": i * kept + act.block + act.fixed,
        }
    saved = L * kept + act.head + act.fixed
    yield "loss", {"gathered": _gathered(layout, u, L if keep_all else 0),
                   "activations": saved, "workspace": act.logits}  # fmt: skip
    yield "loss backward", {"gathered": _gathered(layout, u, L if keep_all else 1),
                            "activations": saved, "workspace": act.logits_grads}  # fmt: skip
    yield from _backward_blocks(spec, layout, u, act, work)
    yield "backward root", {
        "gathered": _gathered(layout, u, 0),
        "activations": act.fixed,
        "unit_grads": (2 * spec.vocab * spec.hidden + spec.hidden) * p.param,
        **_reducing(layout, u, L, u.pad_root, u.shard_root),
    }
    shard = u.shard_root + L * u.shard_block
    temp = shard * FP32 if layout.optimizer == "adamw" else 0  # foreach AdamW's sqrt(v)
    yield "optimizer step", {"gradients": shard * _grad_bytes(layout), "optimizer_temp": temp}


def _backward_blocks(spec: ModelSpec, layout: Layout, u: _Units, act: Activations, work: Workload):
    """Two moments per block, last block first: its MLP backward and its post-backward."""
    L, p, kept = spec.layers, layout.precision, _kept(act, work)
    held_root = (spec.vocab * spec.hidden + spec.hidden) * p.param  # lm_head + norm grads
    for i in reversed(range(L)):
        done = L - 1 - i  # blocks already reduced
        blocks = i + 1 if layout.strategy == "shard_grad_op" else min(2, i + 1)
        common = {"gathered": _gathered(layout, u, blocks)}
        inflight = min(layout.max_inflight_reduces, done) * _inflight_block(layout, u)
        yield f"backward block {i} mlp", {
            **common,
            "gradients": done * u.shard_block * _grad_bytes(layout),
            "activations": i * kept + act.block + act.fixed,
            "workspace": act.mlp_workspace,
            "unit_grads": held_root + spec.hidden * spec.ffn * p.param,  # + down_proj's
            "flat_grads": inflight,
        }
        yield f"backward block {i} end", {
            **common,
            "activations": i * kept + act.fixed,
            "workspace": act.grad_input,
            "unit_grads": held_root + u.block * p.param,
            **_reducing(layout, u, done, u.pad_block, u.shard_block),
        }


def _reducing(layout: Layout, u: _Units, done: int, pad: int, shard: int) -> dict[str, int]:
    """Post-backward of a unit after ``done`` block units: its flat gradient is built and
    launched, its gradient shard allocated, and the oldest reduction waited for if more than
    ``max_inflight_reduces`` are in flight (Gloo then makes its temporary copy)."""
    p, grad = layout.precision, _grad_bytes(layout)
    if layout.shard_world == 1:  # no_shard: the flat gradient becomes the gradient
        return {"gradients": done * u.shard_block * grad + pad * p.flat}
    older = min(layout.max_inflight_reduces, done)
    waits = older + 1 > layout.max_inflight_reduces
    temp = u.pad_block * p.flat if waits and layout.backend == "gloo" else 0
    return {
        "gradients": done * u.shard_block * grad + shard * grad,
        "flat_grads": older * u.pad_block * p.flat + pad * p.flat + temp,
    }


def _gathered(layout: Layout, u: _Units, blocks: int) -> int:
    """Bytes of gathered buffers: the root (always gathered from its forward to its backward)
    and ``blocks`` block units."""
    p = layout.precision
    if layout.shard_world == 1 and p.param == p.master:
        return 0  # no_shard in fp32: the parameters are used in place
    return (u.pad_root + u.pad_block * blocks) * p.param


def _inflight_block(layout: Layout, u: _Units) -> int:
    """Extra bytes of one block's flat gradient in flight (none for no_shard: it is the grad)."""
    return u.pad_block * layout.precision.flat if layout.shard_world > 1 else 0
