"""``flatshard train``: config, launcher, training loop, metrics, plots and checkpoints.

See ``docs/trainer.md``. Nothing here is imported by ``import flatshard``; matplotlib and tqdm
are imported only when a plot is drawn or a progress bar shown.

| module | what |
|---|---|
| ``config.py``, ``config_io.py`` | per-section frozen dataclasses; TOML; overrides |
| ``resolve.py`` | "auto" values made concrete for this machine; the GPT shape |
| ``cli.py`` / ``launcher.py`` | the command; local elastic launch, torchrun, srun |
| ``session.py`` | one worker's session: setup, resume, train, report |
| ``build.py`` | process group, sharded model, AdamW, warm-up + cosine |
| ``data.py`` | documents -> packed, rank-balanced micro-batches |
| ``trainer.py`` | the step, the loop, validation, the text sample |
| ``metrics.py`` / ``plots.py`` | metrics.jsonl, log lines, progress bar; loss.png, memory.png |
| ``checkpointing.py`` | when to save, what goes in ``extra``, keep-last-K, resume state |
"""

from flatshard.tools.train.cli import run
from flatshard.tools.train.config import (
    CheckpointConfig,
    DataConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "TrainConfig",
    "run",
]
