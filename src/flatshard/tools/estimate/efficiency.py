"""The compute side of a step: which FLOPs run, and how fast each kind runs.

[Note: the estimator's efficiency model]
One model of the step serves every row of the published table (``published.py``); nothing in
it is per row. Per GPU, a step executes

* ``linear``: the block matmuls, ``6 x params x tokens`` (forward 2, backward 4), plus what
  activation checkpointing recomputes: full AC the whole forward again (``2 x``), torchtitan's
  per-op selective AC the matmuls it does not save (wk, wo, w3: every second one);
* ``head``: the output projection, ``6 x vocab x hidden x tokens`` (never recomputed: it is
  outside the checkpointed blocks);
* ``attention``: PaLM's ``12 x layers x q_width x seq`` per token (Chowdhery et al. 2022,
  app. B: the score and value matmuls, counted *without* the causal mask, as torchtitan's and
  Megatron's MFU count them), ``x 4/3`` with full AC (the forward again; selective AC saves
  attention's output).

and takes ``(linear x gemm_slowdown / FLOAT8_LINEAR_SPEEDUP? + head + attention /
attention_speed) / (peak x mfu) / COMPILE_SPEEDUP?``. The factors, and where each comes from:

* ``mfu`` (``Device.mfu``): the share of the dense bf16 peak that the executed FLOPs reach in
  an eager step of large Llama matmuls, everything that is not a matmul (norms, RoPE, SwiGLU's
  elementwise ops, the loss) folded in. Per device (``devices.py``, each value's source there).
* ``gemm_slowdown``: a matmul below the device's ``peak / HBM bandwidth`` arithmetic
  intensity is memory-bound (NVIDIA's "Matrix Multiplication Background User's Guide";
  ``Device.hbm_tbps`` from the datasheets). It matters where TP narrows the matmuls.
* ``Device.attention_speed``: attention's FLOPs, counted as above, run this much faster than the
  matmuls: flash attention skips the masked half of a causal score matrix, so it executes half
  the counted FLOPs, at somewhat less than a large GEMM's share of peak (FlashAttention-2, Dao
  2023: forward+backward at 50-73 % of A100 peak, "close to the efficiency of GEMM"). We take
  3/4 of the GEMM rate: 2 x 0.75 = 1.5.
* ``COMPILE_SPEEDUP``: ``torch.compile`` of the blocks fuses the elementwise ops; torchtitan
  measured 1.157 x on Llama 3.1 8B, 8 H100s (5,762 -> 6,667 tok/s) and 1.162 x on 128
  (5,605 -> 6,514) (``benchmarks/llama3_h100_202412_torchtitan.md``, Tables 1 and 3).
* ``FLOAT8_LINEAR_SPEEDUP``: the block linears in float8 (torchao, tensorwise). torchao's
  ``torchao/float8/README.md`` (pytorch/ao): a float8 linear's GEMM approaches 2 x as M, K, N
  grow, less the scaling casts; its large-shape example (M, K, N = 4096, 8192, 16384) gives
  1.39 x, our M is 16K-131K tokens; "up to 1.5 x" end to end on 128-GPU Llama 3 70B. 1.5. The
  head stays bf16 (torchtitan's converter filters out ``output``).
* Async TP (``Layout.async_tp``) hides the TP collectives under the matmuls they feed: a
  collective matmul splits each into tp chunks and moves one while computing another, so
  ``(tp-1)/tp`` of the bytes hide (torchtitan's 2025-06 table: 1.09 x on 70B, 1.10 x on
  8B). Vanilla TP under compile overlaps its backward's collectives with the weight-gradient
  matmuls (``tp_cost.backward_share``); eager, nothing hides.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatshard.tools.estimate.devices import Device
from flatshard.tools.estimate.spec import Layout, ModelSpec, Workload
from flatshard.tools.estimate.tp_cost import backward_share

__all__ = [
    "COMPILE_SPEEDUP",
    "FLOAT8_LINEAR_SPEEDUP",
    "StepFlops",
    "attention_seconds",
    "compute_seconds",
    "gemm_slowdown",
    "step_flops",
    "tp_hidden_share",
]

COMPILE_SPEEDUP = 1.157
"""torchtitan, Llama 3.1 8B on 8 H100s: 6,667 / 5,762 tok/s with and without compile."""
FLOAT8_LINEAR_SPEEDUP = 1.5
"""torchao Float8Linear (tensorwise) over bf16 nn.Linear, forward + backward (see Note)."""


@dataclass(frozen=True)
class StepFlops:
    """FLOPs one GPU executes in one step, by kind (see [Note: the estimator's efficiency
    model])."""

    linear: float
    """Block matmuls, recomputation included."""
    head: float
    """The output projection (forward and backward)."""
    attention: float
    """Attention's score and value matmuls, PaLM's count, recomputation included."""
    model: float
    """PaLM's model FLOPs (no recomputation): what MFU divides."""

    @property
    def executed(self) -> float:
        return self.linear + self.head + self.attention


def step_flops(spec: ModelSpec, layout: Layout, work: Workload) -> StepFlops:
    """The step's FLOPs per GPU: a data-parallel rank's tokens shared by its ``cp x tp`` GPUs
    (tp splits every matrix, cp the tokens; a query still attends to the whole sequence)."""
    gpus = layout.cp * layout.tp
    tokens = work.tokens / gpus
    linear = 6 * spec.layers * spec.block_params * tokens  # PaLM's 6N (norm weights too)
    head = 6 * spec.vocab * spec.hidden * tokens
    attention = 12 * spec.layers * spec.q_width * work.seq * tokens
    model = linear + head + attention + 6 * spec.hidden * tokens  # + PaLM's final-norm term
    if work.act_ckpt:
        linear, attention = linear * 4 / 3, attention * 4 / 3
    elif work.selective_ac:  # every second matmul recomputed: wk, wo, w3 (forward only)
        c, q, kv, f = spec.hidden, spec.q_width, spec.kv_width, spec.ffn
        linear += 2 * spec.layers * (c * kv + q * c + c * f) * tokens
    return StepFlops(linear, head, attention, model)


def _peak(layout: Layout, device: Device, mfu: float) -> float:
    return device.flops[layout.precision.name] * mfu


def _block_matmuls(spec: ModelSpec, layout: Layout) -> list[tuple[int, int]]:
    """(K, N) of one GPU's block matmuls: wq, wk, wv, wo, then the MLP's (tp splits N of the
    colwise ones and K of the rowwise ones)."""
    c, t = spec.hidden, layout.tp
    q, kv, f = spec.q_width // t, spec.kv_width // t, spec.ffn // t
    mlp = [(c, f), (c, f), (f, c)] if spec.mlp == "swiglu" else [(c, f), (f, c)]
    return [(c, q), (c, kv), (c, kv), (q, c), *mlp]


def gemm_slowdown(spec: ModelSpec, layout: Layout, work: Workload, device: Device) -> float:
    """How much slower the block matmuls run than compute-bound ones, FLOP-weighted: a matmul
    whose arithmetic intensity ``2MKN / (2 (MK + KN + MN))`` (bf16 bytes) is below the
    device's ``peak / HBM bandwidth`` is memory-bound by their ratio (NVIDIA's "Matrix
    Multiplication Background User's Guide": math- vs memory-limited). ``M``: the tokens a
    matmul sees (a data-parallel rank's over cp; with sequence parallelism the gathered
    sequence). Its backward matmuls have the same three sizes, hence the same intensity."""
    if device.hbm_tbps is None:
        return 1.0
    ridge = device.flops["bf16"] / (device.hbm_tbps * 1e12)
    m = work.tokens // layout.cp
    total = slowed = 0.0
    for k, n in _block_matmuls(spec, layout):
        intensity = m * k * n / (m * k + k * n + m * n)
        total += k * n
        slowed += k * n * max(1.0, ridge / intensity)
    return slowed / total


def compute_seconds(flops: StepFlops, spec: ModelSpec, layout: Layout, work: Workload,
                    device: Device, mfu: float) -> float:  # fmt: skip
    """Compute time of the step's FLOPs on ``device`` (see the Note for each factor)."""
    linear = flops.linear * gemm_slowdown(spec, layout, work, device)
    linear /= FLOAT8_LINEAR_SPEEDUP if work.float8 else 1
    effective = linear + flops.head + flops.attention / device.attention_speed
    return effective / _peak(layout, device, mfu) / (COMPILE_SPEEDUP if work.compile else 1)


def attention_seconds(flops: StepFlops, layout: Layout, work: Workload, device: Device,
                      mfu: float) -> float:  # fmt: skip
    """The attention share of :func:`compute_seconds` (what the cp ring hides under)."""
    seconds = flops.attention / device.attention_speed / _peak(layout, device, mfu)
    return seconds / (COMPILE_SPEEDUP if work.compile else 1)


def tp_hidden_share(layout: Layout, work: Workload) -> float:
    """Share of the TP collectives off the critical path: async TP's, else compile's."""
    if layout.tp == 1:
        return 0.0
    if layout.async_tp:
        # Collective matmuls: each matmul split into tp chunks, one sent while the next is
        # computed; all but one chunk's transfer hides.
        return (layout.tp - 1) / layout.tp
    # Compiled, a backward collective's wait moves past the independent weight-gradient
    # matmul; forward collectives feed the very next matmul, eager ones are waited at once.
    return backward_share(work) if work.compile else 0.0
