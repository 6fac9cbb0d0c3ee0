"""Published training runs, each with its exact configuration and source, and the estimate of
each under the same model of the step (``tests/test_estimate_published.py``, the table in
``docs/estimate.md``).

Throughput is torchtitan's tokens/s per GPU (its ``tps``: a data-parallel rank's tokens over
its GPUs); memory is its ``max_reserved`` GiB (``torch.cuda.max_memory_reserved``), compared
with the estimate's reserved memory (``reserved.py``: the replay's live peak plus what the
caching allocator holds beyond it), never with the live peak itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flatshard.tools.estimate.accumulate import (
    accumulated_grad_bytes,
    accumulated_peak,
    accumulated_step,
)
from flatshard.tools.estimate.bubble import bubble_fraction
from flatshard.tools.estimate.devices import DEVICES
from flatshard.tools.estimate.memory import estimate_memory
from flatshard.tools.estimate.reserved import estimate_reserved
from flatshard.tools.estimate.spec import Layout, ModelSpec, Precision, Workload
from flatshard.tools.estimate.stage_memory import every_rank
from flatshard.tools.estimate.steptime import estimate_time

__all__ = ["KNOWN_GAPS", "PUBLISHED", "Estimate", "PublishedRun", "estimate_run"]

TT = "https://github.com/pytorch/torchtitan/blob/main/"
H100_2412 = TT + "benchmarks/llama3_h100_202412_torchtitan.md"
ASYNC_TP_2506 = TT + "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
A100_DOC = TT + "docs/performance.md"
# NeMo's performance summary as the NeMo repository held it for container 24.07 (DGX-H100,
# FP8), the figures docs.nvidia.com shows in its 24.09 user guide.
NEMO_2407 = ("https://github.com/NVIDIA/NeMo/blob/8e3d65dcfe3504689bfc5b6e67d502780aacad41/"
             "docs/source/performance/performance_summary.md")  # fmt: skip

# Llama 3.1 (torchtitan's flavours: untied 128,256-token vocabulary, sequence 8192).
LLAMA_8B = ModelSpec("llama3.1-8b", 32, 4096, 32, 8, 128256, 14336, max_seq=8192)
LLAMA_70B = ModelSpec("llama3.1-70b", 80, 8192, 64, 8, 128256, 28672, max_seq=8192)
LLAMA_405B = ModelSpec("llama3.1-405b", 126, 16384, 128, 8, 128256, 53248, max_seq=8192)
# torchtitan's FSDP default: bf16 parameters, fp32 gradient reduction.
TORCHTITAN_MP = Precision("bf16", "fp32")


@dataclass(frozen=True)
class PublishedRun:
    """One published row: the run as configured, what was published, where."""

    name: str
    source: str
    """URL of the page, and the table or row."""
    spec: ModelSpec
    layout: Layout
    work: Workload
    gpu: str
    tokens_per_s: float
    """Published tokens/s per GPU."""
    memory_gib: float | None = None
    """Published peak reserved memory per GPU (GiB), if any."""
    pp: int = 1
    schedule: str = "1F1B"
    microbatches: int = 1
    stages_per_rank: int = 1
    grad_accum: int = 1
    """Micro-batches of ``work`` per optimizer step, each regathering the parameters and the
    sum reduced once (``accumulate.py``: ``fs.no_sync(keep="unsharded")``; under PP they are
    the schedule's microbatches, ``fs.pipeline_step``)."""
    keep_gathered: bool = False
    """Under PP with ``grad_accum``: the stages kept gathered for the step
    (``fs.pipeline_step(schedule, keep_gathered=True)``), one gather per unit per step."""
    note: str = ""
    memory_note: str = ""
    """Why the memory estimate misses the published figure by more than 10 %, if it does
    (``tests/test_estimate_published.py`` keeps such a row outside the band)."""


@dataclass(frozen=True)
class Estimate:
    """The estimator's figures for a run."""

    tokens_per_s: float
    peak_gib: float | None
    """Allocated peak: live tensors (under pipeline parallelism the highest over the pp ranks,
    from the stage model of ``stage_memory.py``)."""
    parts: dict[str, float] = field(default_factory=dict)
    """Step seconds by part: compute, exposed dp, tp and cp communication, bubble."""
    reserved_gib: float | None = None
    """Reserved (est.): what ``torch.cuda.max_memory_reserved`` would report, the figure
    torchtitan publishes (under pipeline parallelism the highest over the pp ranks, as the
    benchmark takes "the maximum across all GPUs")."""


def estimate_run(run: PublishedRun) -> Estimate:
    """The estimate of ``run`` with the shared model of the step (no per-row factor)."""
    if run.grad_accum > 1:
        return _accumulated_run(run)
    device = DEVICES[run.gpu]
    t = estimate_time(run.spec, run.layout, run.work, device)
    parts = {"compute": t.compute_s, "dp": t.exposed_comm_s, "tp": t.tp_exposed_s,
             "cp": t.cp_exposed_s}  # fmt: skip
    if run.pp == 1:
        mem = estimate_memory(run.spec, run.layout, run.work)
        reserved = estimate_reserved(run.spec, run.layout, run.work, mem, "torchtitan").total
        return Estimate(t.tokens_per_s, mem.peak / 2**30, parts, reserved / 2**30)
    # A pp rank runs 1/pp of the blocks for every microbatch, stretched by the bubble
    # (pipeline_report.py's model, the whole local batch's tokens over the pp ranks).
    bubble = bubble_fraction(run.schedule, run.pp, run.microbatches, run.stages_per_rank)
    step = t.step_s / run.pp / (1 - bubble)
    parts = {k: v / run.pp for k, v in parts.items()} | {"bubble": step * bubble}
    gpus = run.layout.tp * run.layout.cp * run.pp
    # The benchmark's footnote: "Different PP ranks can have different peak memory usages. We
    # take the maximum across all GPUs." So every pp rank is replayed and the highest kept.
    ranks = every_rank(run.spec, run.layout, run.work, run.schedule, run.pp, run.microbatches,
                       run.stages_per_rank)  # fmt: skip
    peak = max(s.peak for s in ranks)
    reserved = max(s.reserved for s in ranks)
    return Estimate(run.work.tokens / step / gpus, peak / 2**30, parts, reserved / 2**30)


def _accumulated_run(run: PublishedRun) -> Estimate:
    """A run of ``run.grad_accum`` micro-batches per step as flatshard would run it: each
    regathers the parameters, the sum is reduced once (``accumulate.py``). No reserved
    estimate: ``reserved.py`` models torchtitan's allocator, and these rows publish none."""
    acc = accumulated_step(
        run.spec, run.layout, run.work, DEVICES[run.gpu], run.grad_accum, run.keep_gathered
    )
    compute = run.grad_accum * acc.last.compute_s
    parts = {"compute": compute, "exposed": acc.step_s - compute}  # dp, tp and cp together
    if run.pp == 1:
        mem = estimate_memory(run.spec, run.layout, run.work)
        held = accumulated_grad_bytes(run.spec, run.layout, run.work)
        return Estimate(acc.tokens_per_s, accumulated_peak(mem, held) / 2**30, parts)
    if run.microbatches != run.grad_accum:
        raise ValueError(f"{run.name}: under PP the schedule's microbatches are the "
                         "accumulation (microbatches must equal grad_accum)")  # fmt: skip
    # The pipeline model of estimate_run, per microbatch: a pp rank runs 1/pp of the blocks.
    bubble = bubble_fraction(run.schedule, run.pp, run.microbatches, run.stages_per_rank)
    step = acc.step_s / run.pp / (1 - bubble)
    parts = {k: v / run.pp for k, v in parts.items()} | {"bubble": step * bubble}
    tokens = run.grad_accum * run.work.tokens / step / (run.layout.tp * run.layout.cp * run.pp)
    return Estimate(tokens, None, parts)


def _tt(batch: int, seq: int = 8192, **kw: object) -> Workload:
    """torchtitan's workload: ``batch`` sequences per data-parallel rank, fused RMSNorm."""
    return Workload(batch, seq, fused_norm=True, **kw)  # type: ignore[arg-type]


def _lay(world: int, **kw: object) -> Layout:
    """torchtitan's FSDP: full_shard, bf16 parameters, fp32 reduction."""
    return Layout(world, precision=TORCHTITAN_MP, **kw)  # type: ignore[arg-type]


SAC, FULL = {"selective_ac": True}, {"act_ckpt": True}
C, C8 = {"compile": True}, {"compile": True, "float8": True}
PP_405B = 8  # torchtitan's default: microbatches = pp degree


def _cp_row(cp: int, seq: int, tps: float, memory: float, note: str = "") -> PublishedRun:
    """torchtitan's Table 2: 8 GPUs, FSDP 8/cp x CP cp, local batch 1, full AC, compile,
    float8."""
    name = f"8B, 8 H100, FSDP {8 // cp} x CP {cp}, seq {seq}, full AC, compile, float8"
    return PublishedRun(name, f"{H100_2412} Table 2, FSDP {8 // cp}, CP {cp}", LLAMA_8B,
                        _lay(8 // cp, cp=cp), _tt(1, seq, **FULL, **C8), "h100-gt", tps, memory,
                        note=note)  # fmt: skip


PUBLISHED: tuple[PublishedRun, ...] = (
    PublishedRun("8B, 8 H100, FSDP 8, selective op AC", f"{H100_2412} Table 1, FSDP",
                 LLAMA_8B, _lay(8), _tt(2, **SAC), "h100-gt", 5762, 82.4),
    PublishedRun("8B, 8 H100, FSDP 8, selective op AC, compile",
                 f"{H100_2412} Table 1, FSDP + torch.compile", LLAMA_8B, _lay(8),
                 _tt(2, **SAC, **C), "h100-gt", 6667, 77.0),
    PublishedRun("8B, 8 H100, FSDP 8, selective op AC, compile, float8",
                 f"{H100_2412} Table 1, FSDP + torch.compile + Float8", LLAMA_8B, _lay(8),
                 _tt(2, **SAC, **C8), "h100-gt", 8532, 76.8),
    PublishedRun("8B, 128 H100, FSDP 128, selective op AC", f"{H100_2412} Table 3, FSDP",
                 LLAMA_8B, _lay(128), _tt(2, **SAC), "h100-gt", 5605, 67.0),
    PublishedRun("8B, 128 H100, FSDP 128, selective op AC, compile",
                 f"{H100_2412} Table 3, FSDP + torch.compile", LLAMA_8B, _lay(128),
                 _tt(2, **SAC, **C), "h100-gt", 6514, 62.0),
    PublishedRun("8B, 128 H100, FSDP 128, selective op AC, compile, float8",
                 f"{H100_2412} Table 3, FSDP + torch.compile + Float8", LLAMA_8B, _lay(128),
                 _tt(2, **SAC, **C8), "h100-gt", 8380, 61.8),
    _cp_row(1, 32768, 3890, 83.9),
    _cp_row(2, 65536, 2540, 84.2),
    PublishedRun("70B, 256 H100, FSDP 32 x TP 8, full AC, compile",
                 f"{ASYNC_TP_2506} (70B table, bfloat16, vanilla TP)", LLAMA_70B,
                 _lay(32, tp=8), _tt(16, **FULL, **C), "h100-gt", 597.3),
    PublishedRun("70B, 256 H100, FSDP 32 x TP 8, full AC, compile, async TP",
                 f"{ASYNC_TP_2506} (70B table, bfloat16, async TP)", LLAMA_70B,
                 _lay(32, tp=8, async_tp=True), _tt(16, **FULL, **C), "h100-gt", 652.4),
    PublishedRun("70B, 256 H100, FSDP 32 x TP 8, full AC, compile, float8",
                 f"{H100_2412} Table 4, 2D", LLAMA_70B, _lay(32, tp=8),
                 _tt(16, **FULL, **C8), "h100-gt", 829, 71.9),
    PublishedRun("70B, 256 H100, FSDP 32 x TP 8, full AC, compile, float8, async TP",
                 f"{H100_2412} Table 4, 2D + AsyncTP", LLAMA_70B,
                 _lay(32, tp=8, async_tp=True), _tt(16, **FULL, **C8), "h100-gt", 876, 67.6),
    PublishedRun("8B, 64 H100, FSDP 8 x TP 8, selective op AC, compile",
                 f"{ASYNC_TP_2506} (8B table, bfloat16, vanilla TP)", LLAMA_8B, _lay(8, tp=8),
                 _tt(12, **SAC, **C), "h100-gt", 4378),
    PublishedRun("405B, 512 H100, FSDP 8 x TP 8 x PP 8 (1F1B), full AC, compile, float8, "
                 "async TP", f"{H100_2412} Table 5, 1F1B", LLAMA_405B,
                 _lay(8, tp=8, async_tp=True), _tt(32, **FULL, **C8), "h100-gt", 100, 82.5,
                 schedule="1F1B", pp=PP_405B, microbatches=PP_405B),
    PublishedRun("405B, 512 H100, FSDP 8 x TP 8 x PP 8 (interleaved 1F1B, 2 stages per "
                 "rank), full AC, compile, float8, async TP",
                 f"{H100_2412} Table 5, Interleaved 1F1B", LLAMA_405B,
                 _lay(8, tp=8, async_tp=True), _tt(32, **FULL, **C8), "h100-gt", 128, 72.7,
                 schedule="Interleaved1F1B", stages_per_rank=2, pp=PP_405B, microbatches=PP_405B),
    PublishedRun("70B, 64 A100, FSDP 64, full AC", f"{A100_DOC} (Llama 3, 70B, full)",
                 LLAMA_70B, _lay(64), _tt(1, **FULL), "a100", 331),
    PublishedRun("8B, 64 A100, FSDP 64, selective op AC",
                 f"{A100_DOC} (Llama 3, 8B, selective op)", LLAMA_8B, _lay(64),
                 _tt(1, **SAC), "a100", 2973),
)  # fmt: skip
"""The rows of docs/estimate.md's table of published runs: each within 20 %."""

# NeMo's rows, run as flatshard would run them: FSDP over the data-parallel x cp ranks (where
# Megatron keeps bf16 parameters replicated and shards the optimizer state), torchao float8
# under torch.compile for Transformer Engine's FP8 (torchao's float8 training is meant to be
# compiled; the estimator's --float8 factor comes from its compiled figures), fp32 gradient
# reduction (the accumulated sum, as Megatron's fp32 main_grad), no activation checkpointing
# (the page names none, and flatshard's step fits without it), the micro-batches accumulated
# with fs.no_sync(keep="unsharded") (accumulate.py). GA = GBS / (MBS x DP), DP = GPUs / (TP x
# PP x CP); the 24.07 table has no GA column.
NEMO_MP = Precision("bf16", "fp32")
NEMO_8B = PublishedRun(
    "8B, 8 H100, FSDP 4 x CP 2, GA 32, no AC, compile, float8",
    f"{NEMO_2407} (Pretraining; NeMo 24.07, DGX-H100, FP8: LLAMA3-8B, 8 GPUs, GBS 128, "
    "MBS 1, seq 8192, TP 1, PP 1, CP 2, VP 1)", LLAMA_8B, Layout(4, cp=2, precision=NEMO_MP),
    Workload(1, 8192, fused_norm=True, compile=True, float8=True), "h100", 12273,
    grad_accum=32)  # fmt: skip
PUBLISHED = (*PUBLISHED, NEMO_8B)

BEYOND_CP2 = ("the published attention costs about twice the load-balanced causal FLOPs "
              "beyond cp 2 (docs/estimate.md)")  # fmt: skip
NEMO_70B = PublishedRun(
    "70B, 64 H100, FSDP 2 x CP 2 x TP 4 x PP 4 (interleaved 1F1B, 5 stages per rank), "
    "64 microbatches, stages kept gathered, no AC, compile, float8",
    f"{NEMO_2407} (Pretraining; NeMo 24.07, DGX-H100, FP8: LLAMA3-70B, 64 GPUs, GBS 128, "
    "MBS 1, seq 8192, TP 4, PP 4, CP 2, VP 5)", LLAMA_70B,
    Layout(2, tp=4, cp=2, precision=NEMO_MP),
    Workload(1, 8192, fused_norm=True, compile=True, float8=True), "h100", 1524, pp=4,
    schedule="Interleaved1F1B", microbatches=64, stages_per_rank=5, grad_accum=64,
    keep_gathered=True)  # fmt: skip
PUBLISHED = (*PUBLISHED, NEMO_70B)  # fs.pipeline_step(keep_gathered=True), as the trainer runs

KNOWN_GAPS: tuple[PublishedRun, ...] = (
    _cp_row(4, 131072, 1071, 84.0, BEYOND_CP2),
    _cp_row(8, 262144, 548, 84.5, BEYOND_CP2),
)  # fmt: skip
"""Published rows the model misses by more than 20 % (either way), each with the reason.
``tests/test_estimate_published.py`` keeps them there: a model that closes a gap must
move the row into :data:`PUBLISHED`."""


def _axes(run: PublishedRun) -> str:
    lay = run.layout
    axes = [f"FSDP {lay.world}"] + [f"{k} {v}" for k, v in (("CP", lay.cp), ("TP", lay.tp),
                                                            ("PP", run.pp)) if v > 1]  # fmt: skip
    return " x ".join(axes)


def _settings(run: PublishedRun) -> str:
    w = run.work
    ac = "full AC" if w.act_ckpt else "selective op AC" if w.selective_ac else "no AC"
    extra = [n for n, on in (("compile", w.compile), ("float8", w.float8),
                             ("async TP", run.layout.async_tp)) if on]  # fmt: skip
    pipe = f", {run.schedule} ({run.microbatches} microbatches)" if run.pp > 1 else ""
    if run.grad_accum > 1:  # accumulate.py: regathered every micro-batch, reduced once
        kept = "kept gathered" if run.keep_gathered else "each regathered"
        pipe += f", {kept}" if run.pp > 1 else f", GA {run.grad_accum} (fs.no_sync)"
    return ", ".join([f"batch {w.batch} x {w.seq}", ac, *extra]) + pipe


def markdown_table(rows: tuple[PublishedRun, ...] = PUBLISHED) -> str:
    """The table of docs/estimate.md: each row's configuration, source, published and
    estimated figures (``tests/test_estimate_published.py`` checks the doc holds it)."""
    lines = [
        "| model, GPUs | axes | settings | source | published tok/s/GPU | estimate | diff "
        "| published memory (reserved) | estimate: allocated peak | estimate: reserved (est.) "
        "| memory diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in rows:
        est = estimate_run(run)
        diff = est.tokens_per_s / run.tokens_per_s - 1
        mem = f"{run.memory_gib} GiB" if run.memory_gib else "—"
        live = f"{est.peak_gib:.1f} GiB" if est.peak_gib is not None else "— (pipeline)"
        res = f"{est.reserved_gib:.1f} GiB" if est.reserved_gib is not None else "—"
        mdiff = "—"
        if run.memory_gib and est.reserved_gib is not None:
            mdiff = f"{est.reserved_gib / run.memory_gib - 1:+.1%}"
            mdiff += " (known gap)" if run.memory_note else ""
        page, _, where = run.source.partition(" ")
        name = page.rsplit("/", 1)[-1]
        lines.append(
            f"| {run.spec.name}, {run.layout.gpus * run.pp} {run.gpu} | {_axes(run)} | "
            f"{_settings(run)} | [{name}]({page}) {where} | {run.tokens_per_s:,g} | "
            f"{est.tokens_per_s:,.0f} | {diff:+.1%} | {mem} | {live} | {res} | {mdiff} |"
        )
    return "\n".join(lines)
