"""Reserved memory: what ``torch.cuda.max_memory_reserved`` reports for a step, from the replay's
live tensors (``memory.py``) plus what the caching allocator holds beyond them, for flatshard's
own step or for torchtitan's (FSDP2), whose streams differ (``runtime``).

[Note: reserved memory]
torchtitan logs ``max_reserved`` (``torchtitan/components/metrics.py``: ``memory_stats()``'s
``reserved_bytes.all.peak``), the segments torch's CUDA caching allocator holds. It is not the
live peak (``allocated``) the replay computes:

* The allocator caches freed blocks **per stream** and never hands one stream's block to
  another stream's allocation (``c10/cuda/CUDACachingAllocator.cpp``: a block pool is searched
  by (stream, size); with expandable segments, torchtitan's setting, one segment per stream).
  Nothing is returned to the driver
  without ``empty_cache`` (torchtitan does not call it), so a steady-state step's reserved peak
  is the *sum* of each stream's high-water mark, not the high-water mark of the sum.
* flatshard allocates every buffer a side stream touches on the compute stream
  (``core/streams.py``, [Note: streams and buffer lifetimes], rule 1): one pool, nothing
  stranded. FSDP2 does not, and torchtitan's published figures are FSDP2's:
* FSDP2 allocates the reduce-scatter output on its reduce-scatter stream and makes it the
  sharded ``.grad`` (``torch/distributed/_composable/fsdp/_fsdp_collectives.py``,
  ``foreach_reduce_scatter``: "The RS output is allocated in the RS stream"): every gradient
  shard of a step lives in that stream's pool, which the next step's activations (on the
  default stream) cannot reuse after ``zero_grad`` frees them.
* FSDP2 all-gathers into a flat buffer allocated on its all-gather copy-in stream, then copies
  out into the parameters on the default stream: that pool's high-water mark is the largest
  group gathered at once (torchtitan's root: embedding, final norm and output head).
* FSDP2 does not reshard the root after forward (``FSDPState._lazy_init``: the root's
  ``post_forward_mesh_info`` is ``None``), so its embedding stays gathered from the forward to
  the end of backward, where flatshard's lazy root (``units.py``) has released it.
* The loss: torchtitan computes ``cross_entropy(pred.float(), labels)`` and deletes ``pred``
  before ``loss.backward()`` (``train.py`` at 9dec370, "need to free to before bwd to avoid
  peaking memory"). The freed bf16 logits and their fp32 copy leave one hole; the fp32 gradient
  of the log-softmax fills only part of it (an fp32 tensor of the logits' shape), and the next
  fp32 tensor of that shape no longer fits: the bf16 logits' size stays reserved but unused at
  the loss backward (an assumption about the allocator's placement, not measured).
* Loss parallel (TP): DTensor's fused nll/log-softmax backward
  (``torch/distributed/tensor/parallel/loss.py``, ``_nll_loss_and_log_softmax_backward``)
  evaluates ``(grad_input + exp(x)) * grad_output`` with a zeros-like ``grad_input``: three
  fp32 tensors of the local logits' shape live at once besides the saved log-softmax, where
  the fused CUDA kernels of the replay's loss need two. This one is live memory, not cache.
* Vanilla (not async) TP: ProcessGroupNCCL ``recordStream``s its collectives' tensors, so a
  freed all-gather output is not reused until the NCCL stream has passed it; compiled TP keeps
  :data:`TP_RECORD_STREAM_BUFFERS` full-sequence activations reserved beyond the live ones.
  Async TP runs its collectives through symmetric memory, outside the caching allocator.

Not counted, because ``max_memory_reserved`` does not count them: the CUDA context (about 0.5
GiB) and NCCL's buffers, allocated outside the caching allocator. Left out as below 0.1 % at
these sizes: cuBLAS's workspaces (taken from the caching allocator, a few MiB per handle and
stream: ``CublasHandlePool.cpp``) and block rounding (512 bytes; 2 MiB above 1 MiB).
Compile's and float8's own buffers are not modelled (see docs).
"""

from __future__ import annotations

from dataclasses import dataclass

from flatshard.tools.estimate.activations import FP32
from flatshard.tools.estimate.cp_cost import cp_view
from flatshard.tools.estimate.memory import MemoryEstimate
from flatshard.tools.estimate.spec import Layout, ModelSpec, Precision, Workload
from flatshard.tools.estimate.tp_cost import local_spec
from flatshard.tools.estimate.units import plan_units

__all__ = [
    "FSDP2_GATHERS_IN_FLIGHT",
    "LOSS_PHASES",
    "RUNTIMES",
    "TP_RECORD_STREAM_BUFFERS",
    "Reserved",
    "estimate_reserved",
    "loss_extras",
]

FSDP2_GATHERS_IN_FLIGHT = 2
"""Blocks whose flat all-gather buffers the copy-in stream holds at once: the one computing and
the one prefetched (FSDP2's implicit forward prefetch and backward prefetch of one group)."""

TP_RECORD_STREAM_BUFFERS = 2
"""Full-sequence activations (``tokens x hidden``, compute dtype) that vanilla TP keeps reserved
beyond the live ones, the two all-gather outputs of a block (before attention and the MLP)
waiting on the NCCL stream. **Fitted** to torchtitan's Table 4 pair (70 B, FSDP 32 x TP 8: 71.9
GiB vanilla, 67.6 GiB async, 4.3 GiB apart, 2.1 such activations); no other published row has
vanilla TP with a memory figure to check it against."""

RUNTIMES = ("flatshard", "torchtitan")
"""Whose allocation pattern the estimate assumes: flatshard's (one pool) or torchtitan's FSDP2
(side-stream pools, the root held gathered)."""

LOSS_PHASES = ("loss", "loss backward")
"""The replay's phases at which the logits (and the loss's extra buffers) are alive."""


@dataclass(frozen=True)
class Reserved:
    """The estimated ``max_memory_reserved`` of a step (bytes), by part."""

    runtime: str
    """One of :data:`RUNTIMES`."""
    default_stream: int
    """High-water mark of the default stream's pool: the replay's live peak with the loss's
    extras and (torchtitan) the held root, without the gradient shards (in the reduce-scatter
    pool)."""
    loss_extra: dict[str, int]
    """Added at the loss phases: ``hole`` (the bf16 logits' block, cached but unused) and
    ``loss_parallel`` (DTensor's third fp32 logits-shaped temporary)."""
    reduce_scatter_pool: int
    """Every gradient shard of the step, fp32 (the sharded parameters' dtype)."""
    all_gather_pool: int
    """The largest flat all-gather buffer held at once."""
    tp_record_stream: int
    """Vanilla TP's collective buffers not yet reusable."""
    root_held: int = 0
    """FSDP2's root parameters gathered after the forward that flatshard's lazy root releases
    (in ``default_stream``)."""

    @property
    def total(self) -> int:
        return (self.default_stream + self.reduce_scatter_pool + self.all_gather_pool
                + self.tp_record_stream)  # fmt: skip

    @property
    def parts(self) -> dict[str, int]:
        return {"default_stream": self.default_stream,
                "reduce_scatter_pool": self.reduce_scatter_pool,
                "all_gather_pool": self.all_gather_pool,
                "tp_record_stream": self.tp_record_stream}  # fmt: skip


def loss_extras(spec: ModelSpec, layout: Layout, work: Workload) -> dict[str, int]:
    """The loss's bytes beyond the replay's at its phases (see [Note: reserved memory])."""
    layout, work = cp_view(layout, work)
    local, p = local_spec(spec, layout.tp), layout.precision
    logits = work.tokens * local.vocab  # elements of one GPU's logits
    # No hole without an fp32 copy: fp32 logits are the log-softmax's input, freed whole.
    hole = logits * p.act if p.act != FP32 else 0
    return {"hole": hole, "loss_parallel": logits * FP32 if layout.tp > 1 else 0}


def _pools(spec: ModelSpec, layout: Layout, mem: MemoryEstimate) -> tuple[int, int, int]:
    """FSDP2's extra bytes: its reduce-scatter stream's pool, its all-gather copy-in stream's,
    and the root it keeps gathered where flatshard's lazy root is released."""
    p, local = layout.precision, local_spec(spec, layout.tp)
    units = plan_units(spec, layout)
    held = units.root.numel * p.param if units.lazy_root else 0
    # FSDP2 casts a reduce-dtype output to the parameters' dtype on the same stream: the fp32
    # .grad of this rank's shards is what stays in the pool.
    grads = mem.parameters // Precision.master * Precision.grad
    gathered = max(local.root_params, FSDP2_GATHERS_IN_FLIGHT * local.block_params) * p.param
    return grads, gathered, held


def _default_stream(mem: MemoryEstimate, extra: int, held: int, fsdp2: bool) -> int:
    """The default stream's high-water mark: each phase's live bytes, the loss's extras at its
    phases, FSDP2's held root from the loss on, its gradient shards moved to their pool."""
    after_forward = False
    most = 0
    for phase in mem.phases:
        after_forward = after_forward or phase.name == "loss"
        total = phase.total + (extra if phase.name in LOSS_PHASES else 0)
        if fsdp2:
            total += (held if after_forward else 0) - phase.parts.get("gradients", 0)
        most = max(most, total)
    return most


def estimate_reserved(
    spec: ModelSpec,
    layout: Layout,
    work: Workload,
    mem: MemoryEstimate,
    runtime: str = "flatshard",
) -> Reserved:
    """``max_memory_reserved`` of a step run by ``runtime`` (see [Note: reserved memory]), from
    the replay ``mem`` of the same ``spec``, ``layout`` and ``work``."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r}: use one of {', '.join(RUNTIMES)}")
    extra = loss_extras(spec, layout, work)
    fsdp2 = runtime == "torchtitan"
    flat_layout, flat_work = cp_view(layout, work)  # FSDP over dp x cp, seq / cp
    grads, gathered, held = _pools(spec, flat_layout, mem) if fsdp2 else (0, 0, 0)
    default = _default_stream(mem, sum(extra.values()), held, fsdp2)
    vanilla_tp = layout.tp > 1 and not layout.async_tp
    act = flat_work.tokens * spec.hidden * layout.precision.act  # one full-sequence activation
    tp = TP_RECORD_STREAM_BUFFERS * act if vanilla_tp else 0
    return Reserved(runtime, default, extra, grads, gathered, tp, held)
