"""The trainer's configuration: one frozen dataclass per section, validated on construction.

``TrainConfig`` holds the run-level fields (``steps``, ``seed``, ``out``) and the sections
``model``, ``data``, ``parallel`` (also spelt ``parallelism``, torchtitan's name: see
``SECTION_ALIASES``), ``precision``, ``comm``, ``optim``, ``checkpoint`` and ``log``. TOML files
mirror that shape (top-level keys, then one ``[section]`` table each); ``config_io`` reads, writes
and overrides them. Values a TOML file cannot spell as "unset" (it has no null) use ``0`` or
``"auto"``, resolved at run time by :func:`flatshard.tools.train.resolve.resolve` (and written out
resolved).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "SECTIONS",
    "SECTION_ALIASES",
    "CheckpointConfig",
    "CommConfig",
    "DataConfig",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "TrainConfig",
]

DTYPES = ("fp32", "bf16", "fp16")
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")
NONFINITE = ("error", "skip")
OPTIMIZERS = ("adamw", "muon", "adafactor")
SCHEDULES = (
    "GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
    "DualPipeV",
)  # fmt: skip
"""torch.distributed.pipelining's schedule names (``get_schedule_class``)."""


def _fail(where: str, value: object, rule: str, fix: str) -> ValueError:
    return ValueError(f"{where}={value!r} {rule}; {fix}")


def _int(where: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}={value!r} must be an integer, e.g. --{where} {max(minimum, 1)}")
    if value < minimum:
        raise _fail(where, value, f"must be >= {minimum}", f"e.g. --{where} {max(minimum, 1)}")


def _float(
    where: str, value: float, low: float, high: float = math.inf, open_low: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(f"{where}={value!r} must be a number")
    if (value <= low if open_low else value < low) or value > high:
        lo = "(" if open_low else "["
        raise _fail(where, value, f"is outside {lo}{low}, {high}]", "pass a value in that range")


def _choice(where: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise _fail(where, value, "is not supported", f"use one of: {', '.join(choices)}")


@dataclass(frozen=True)
class ModelConfig:
    """The reference GPT (``flatshard.models``): a named preset, optionally reshaped; or any
    transformers causal LM (``hf``)."""

    preset: str = "tiny"
    """GPT preset: tiny (CPU demo), small, medium, large, 1b (see docs/data_and_model.md)."""
    d_model: int = 0
    """Width of the residual stream; 0 = the preset's."""
    n_layers: int = 0
    """Transformer blocks; 0 = the preset's."""
    n_heads: int = 0
    """Attention heads (must divide d_model); 0 = the preset's."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 = the preset's."""
    d_ff: int = 0
    """MLP hidden width; 0 = the preset's (8/3 d_model rounded to 64 for SwiGLU)."""
    dropout: float = 0.0
    """Dropout on embeddings and residual branches (0 = off, the usual for pre-training)."""
    tie_embeddings: bool = True
    """Share the embedding matrix with the output head (the GPT's default). Pipeline
    parallelism puts them on different stages: pass false with --parallelism.pp > 1."""
    experts: int = 0
    """Experts per layer: 0 = the dense GPT; E > 0 = a Mixture-of-Experts GPT
    (flatshard.models.moe: every block's MLP is E SwiGLU experts of width d_ff, top_k routed)."""
    top_k: int = 2
    """With experts > 0: experts each token is routed to (at most experts)."""
    hf: str = ""
    """A transformers causal LM instead of the GPT: a directory with a config.json (random
    init) or a save_pretrained directory (its weights); "" = the GPT. Local files only. The
    GPT's shape fields are then ignored (see docs/trainer.md)."""
    float8: bool = False
    """torchao float8 training (``pip install 'flatshard[float8]'``) of the GPT blocks' linears,
    their weights gathered in float8 (docs/float8.md); emulated on the CPU."""

    def __post_init__(self) -> None:
        from flatshard.models import PRESETS  # light: no torch work at import

        _choice("model.preset", self.preset, tuple(PRESETS))
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
            _int(f"model.{name}", getattr(self, name), 0)
        _float("model.dropout", self.dropout, 0.0, 0.99)
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(f"model.tie_embeddings={self.tie_embeddings!r} must be true or false")
        _int("model.experts", self.experts, 0)
        _int("model.top_k", self.top_k, 1)
        if self.experts and self.top_k > self.experts:
            raise _fail("model.top_k", self.top_k, f"exceeds model.experts={self.experts}",
                        f"pass a --model.top_k of at most {self.experts}")  # fmt: skip
        if not isinstance(self.float8, bool):
            raise TypeError(f"model.float8={self.float8!r} must be true or false")
        if not isinstance(self.hf, str):
            raise TypeError(f"model.hf={self.hf!r} must be a directory path (a string)")


@dataclass(frozen=True)
class DataConfig:
    """What to train on and how it is batched (packed rows of ``seq_len`` byte tokens)."""

    path: str = ""
    """A .txt/.jsonl file or a directory of them; "" = the corpus embedded in Python itself."""
    seq_len: int = 256
    """Tokens per packed row; longer documents are cut into pieces of this length."""
    rows: int = 4
    """Packed rows per micro-batch per rank (the micro-batch is [rows, seq_len])."""
    micro_batches: int = 1
    """Micro-batches per rank per optimizer step (gradient accumulation)."""
    packing: bool = True
    """Pack several documents per row (true) or one document piece per padded row (false)."""
    algorithm: str = "bfd"
    """Bin-packing algorithm: bfd, ffd, greedy, shuffle_ff (see docs/packing.md)."""
    val_fraction: float = 0.01
    """Share of documents held out for validation (chosen by a hash of their text)."""

    def __post_init__(self) -> None:
        from flatshard.packing import ALGORITHMS

        if not isinstance(self.path, str):
            raise TypeError(f"data.path={self.path!r} must be a string path")
        _int("data.seq_len", self.seq_len, 2)
        _int("data.rows", self.rows, 1)
        _int("data.micro_batches", self.micro_batches, 1)
        _choice("data.algorithm", self.algorithm, tuple(ALGORITHMS))
        _float("data.val_fraction", self.val_fraction, 0.0, 0.5)


CP_ATTENTIONS = ("auto", "ring", "allgather", "torch")  # parallel.cp_attention (cp_plan.py)


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes, on what, and how the model is sharded across them."""

    nproc: int = 0
    """Local worker processes to launch; 0 = one per GPU, or 2 on CPU. Ignored under
    torchrun/srun, which start the workers themselves."""
    strategy: str = "full_shard"
    """Sharding strategy: full_shard (ZeRO-3), shard_grad_op (ZeRO-2), no_shard, hybrid_shard."""
    backend: str = "auto"
    """Process-group backend: auto (nccl on GPUs, gloo on CPU), nccl or gloo."""
    timeout_s: float = 600.0
    """Seconds any rank waits on a peer before failing with an error (never a silent hang).
    Passed to init_process_group and fs.shard; a dead worker is detected sooner by the launcher."""
    max_restarts: int = 0
    """Restart the local workers this many times after a failure (like torchrun
    --max-restarts); a restarted group resumes from the newest checkpoint."""
    tp: int = 1
    """Tensor-parallel degree (--parallelism.tp N): each group of N consecutive ranks splits
    every layer (torch tensor parallelism, sequence parallelism on) and reads the same data;
    fs.shard shards over the world/N data-parallel ranks. Must divide the world size and
    data.seq_len; the model's heads, kv heads, MLP width and vocabulary must divide by it."""
    loss_parallel: bool = False
    """With tp > 1: keep the logits split over the vocabulary and compute the loss with
    torch's loss_parallel (no gathered [rows, seq_len, vocab] logits). The GPT only."""
    pp: int = 1
    """Pipeline-parallel degree (--parallelism.pp N): the GPT's blocks are cut into stages over
    N groups of world/N ranks (torch.distributed.pipelining); fs.shard shards each stage over
    its world/N data-parallel ranks ([Note: the trainer's (pp, dp) layout],
    tools/train/pipeline.py)."""
    schedule: str = "1F1B"
    """The pipeline schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
    ZBVZeroBubble or DualPipeV (the last five hold several stages per rank)."""
    microbatches: int = 0
    """Pipeline microbatches per step per data-parallel rank; 0 = one row each (data.rows x
    data.micro_batches, the rows a step feeds the pipeline). Must divide those rows."""
    stages_per_rank: int = 0
    """Stages each pp rank holds; 0 = 1 for GPipe and 1F1B, 2 for the others (the V-shaped
    ZBVZeroBubble and DualPipeV need exactly 2)."""
    pp_keep_gathered: bool = True
    """With pp: keep each stage's parameters gathered for the whole step
    (fs.pipeline_step(keep_gathered=True): one all-gather per unit per step, as torchtitan's
    FSDP2 stages); false releases and regathers them per microbatch (less memory, more
    all-gathers)."""
    ep: int = 1
    """Expert-parallel degree (with model.experts > 0): each group of ep consecutive ranks
    splits every layer's experts (all-to-all dispatch); each expert is sharded over the
    world/ep ranks holding it. Must divide the world size and model.experts."""
    cp: int = 1
    """Context-parallel degree (--parallelism.cp N): each group of N consecutive ranks reads
    the same rows and splits every row's tokens over its ranks, head-tail balanced (chunks r
    and 2N-1-r of 2N); attention spans the group (parallel.cp_attention), masked by global
    positions and documents. fs.shard shards over all ranks (dp x cp). The GPT only, without
    tp, pp or ep; data.seq_len must divide by 2N (docs/parallelism.md)."""
    cp_attention: str = "auto"
    """How keys and values cross the cp group: torch (torch's own context parallelism:
    FlexAttention under its _ContextParallel style, compiled; accelerators only, rows a
    multiple of cp * 128), ring (flatshard's: one peer's at a time, passed around the group
    while the previous block computes: memory that does not grow with the row), allgather (the
    whole row's at once: fewer, larger messages), or auto (torch on CUDA where the row allows
    it, else ring)."""

    def __post_init__(self) -> None:
        _int("parallel.nproc", self.nproc, 0)
        _choice("parallel.strategy", self.strategy, STRATEGIES)
        _choice("parallel.backend", self.backend, ("auto", "nccl", "gloo"))
        _float("parallel.timeout_s", self.timeout_s, 0.0, open_low=True)
        _int("parallel.max_restarts", self.max_restarts, 0)
        _int("parallel.tp", self.tp, 1)
        _int("parallel.pp", self.pp, 1)
        _choice("parallel.schedule", self.schedule, SCHEDULES)
        _int("parallel.microbatches", self.microbatches, 0)
        _int("parallel.stages_per_rank", self.stages_per_rank, 0)
        _int("parallel.ep", self.ep, 1)
        _int("parallel.cp", self.cp, 1)
        _choice("parallel.cp_attention", self.cp_attention, CP_ATTENTIONS)
        if not isinstance(self.pp_keep_gathered, bool):
            raise TypeError(
                f"parallel.pp_keep_gathered={self.pp_keep_gathered!r} must be true or false"
            )
        if not isinstance(self.loss_parallel, bool):
            raise TypeError(f"parallel.loss_parallel={self.loss_parallel!r} must be true or false")


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed precision: the dtype of the gathered parameters/compute and of gradient reduction."""

    param_dtype: str = "auto"
    """Compute dtype: auto (bf16, on CPU too, unless the GPU lacks bf16), fp32, bf16 or fp16.
    The sharded master weights and the optimizer stay fp32 either way."""
    reduce_dtype: str = "fp32"
    """Dtype of the gradient reduce-scatter: fp32, bf16 or fp16."""

    def __post_init__(self) -> None:
        _choice("precision.param_dtype", self.param_dtype, ("auto", *DTYPES))
        _choice("precision.reduce_dtype", self.reduce_dtype, DTYPES)


@dataclass(frozen=True)
class CommConfig:
    """How gradients travel in the reduction, and parameters in the all-gather (fs.Comm,
    docs/low_precision.md)."""

    reduce: str = "fp32"
    """Gradient wire format: fp32 (the reduce-scatter in precision.reduce_dtype), bf16 (an
    all-to-all in bf16, summed in fp32), int8 or fp8 (quantized in 256-element blocks with one
    fp32 scale each, summed in fp32)."""
    error_feedback: bool = False
    """With comm.reduce int8/fp8: carry each rank's quantization error into the next step
    (checkpointed with the model)."""

    gather: str = "none"
    """Parameter all-gather wire format: none (the compute dtype), bf16 (sent as bf16 where
    the compute dtype is fp32), int8 or fp8 (quantized in 256-element blocks with one fp32
    scale each, dequantized into the compute dtype where they arrive)."""

    def __post_init__(self) -> None:
        _choice("comm.reduce", self.reduce, ("fp32", "bf16", "fp8", "int8"))
        _choice("comm.gather", self.gather, ("none", "bf16", "fp8", "int8"))
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"comm.error_feedback={self.error_feedback!r} must be true or false")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW (or Muon, Adafactor) with linear warm-up then cosine decay, and global
    gradient-norm clipping."""

    lr: float = 3e-3
    """Peak learning rate (reached at the end of warm-up)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr`` (end of the cosine)."""
    warmup_steps: int = 20
    """Steps of linear warm-up from lr/warmup_steps to lr."""
    decay_steps: int = 0
    """Step at which the cosine reaches its floor; 0 = ``steps``. Set it explicitly when a run
    may later be extended with --resume and a larger --steps (else the schedule changes)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norms or biases)."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    name: str = "adamw"
    """The optimizer: adamw; muon (fs.optim.Muon for the blocks' matrices, AdamW with the
    settings above for embeddings, head and 1-D parameters); or adafactor (fs.optim.Adafactor
    for everything, lr as its maximal relative step, weight_decay as above). docs/optimizers.md"""
    muon_lr: float = 0.02
    """Muon's peak learning rate (the blocks' matrices; same warm-up and decay as lr)."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 = no clipping (the norm is still logged)."""
    nonfinite: str = "error"
    """A step whose loss or gradient norm is NaN/inf: error (stop, naming the step) or skip
    (no optimizer update on any rank; counted as skipped_steps in metrics.jsonl)."""

    def __post_init__(self) -> None:
        _float("optim.lr", self.lr, 0.0, open_low=True)
        _float("optim.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _int("optim.warmup_steps", self.warmup_steps, 0)
        _int("optim.decay_steps", self.decay_steps, 0)
        _float("optim.weight_decay", self.weight_decay, 0.0)
        _float("optim.beta1", self.beta1, 0.0, 0.999999)
        _float("optim.beta2", self.beta2, 0.0, 0.999999)
        _float("optim.eps", self.eps, 0.0, open_low=True)
        _float("optim.grad_clip", self.grad_clip, 0.0)
        _choice("optim.nonfinite", self.nonfinite, NONFINITE)
        _choice("optim.name", self.name, OPTIMIZERS)
        _float("optim.muon_lr", self.muon_lr, 0.0, open_low=True)
        _float("optim.muon_momentum", self.muon_momentum, 0.0, 0.999999)


@dataclass(frozen=True)
class CheckpointConfig:
    """Periodic checkpoints in OUT/checkpoints/step_NNNNNN (atomic, the last ``keep`` kept)."""

    every: int = 100
    """Save every this many steps (and always after the last step); 0 = only after the last."""
    keep: int = 2
    """How many of the newest checkpoints to keep; older ones are deleted."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    enabled: bool = True
    """Write checkpoints at all (false: none, and --resume is impossible)."""

    def __post_init__(self) -> None:
        _int("checkpoint.every", self.every, 0)
        _int("checkpoint.keep", self.keep, 1)


@dataclass(frozen=True)
class LogConfig:
    """What is printed and written while training."""

    every: int = 10
    """Print a log line every this many steps (metrics.jsonl gets every step)."""
    val_every: int = 50
    """Evaluate the validation loss every this many steps (and after the last); 0 = only then."""
    val_batches: int = 4
    """Packed validation micro-batches per rank per evaluation (the same count on every rank)."""
    plot_every: int = 50
    """Redraw OUT/loss.png and OUT/memory.png every this many steps (and at the end)."""
    progress_bar: bool = True
    """Show a progress bar on rank 0 when its stderr is a terminal."""
    tensorboard: bool = False
    """Also write TensorBoard event files to OUT/tensorboard (needs the tensorboard package)."""
    sample_tokens: int = 200
    """Length of the text sample printed at the end; 0 = no sample."""
    sample_prompt: str = "Return the "
    """Prompt of the final text sample."""

    def __post_init__(self) -> None:
        for name in ("every", "val_every", "val_batches", "plot_every", "sample_tokens"):
            _int(f"log.{name}", getattr(self, name), 0 if name != "every" else 1)
        if not isinstance(self.sample_prompt, str) or not self.sample_prompt:
            raise _fail(
                "log.sample_prompt",
                self.sample_prompt,
                "must be a non-empty string",
                'e.g. --log.sample_prompt "The "',
            )


@dataclass(frozen=True)
class TrainConfig:
    """A whole training run: run-level fields and one sub-config per section."""

    steps: int = 300
    """Optimizer steps to train for (in total, counting steps before a --resume)."""
    seed: int = 0
    """Seed of the model initialisation, the data order and dropout."""
    out: str = "runs/tiny"
    """Output directory: metrics.jsonl, loss.png, memory.png, config.toml, checkpoints/."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data and batching."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Processes and sharding."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Mixed precision."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Gradient wire format."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    log: LogConfig = field(default_factory=LogConfig)
    """Logging, plots, samples."""

    def __post_init__(self) -> None:
        _int("steps", self.steps, 1)
        _int("seed", self.seed, 0)
        if not isinstance(self.out, str) or not self.out:
            raise _fail("out", self.out, "must be a non-empty directory path", "e.g. --out runs/x")
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"{name} must be a {cls.__name__}, got {getattr(self, name)!r}")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "parallel": ParallelConfig,
    "precision": PrecisionConfig,
    "comm": CommConfig,
    "optim": OptimConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
}
"""Section name -> its dataclass, in the order config files list them."""

SECTION_ALIASES: dict[str, str] = {"parallelism": "parallel"}
"""Other spellings of a section, on the command line (``--parallelism.tp 2``) and in TOML
files (``[parallelism]``); configs are always written with the section's own name."""
