"""What a run measures and where it goes: OUT/metrics.jsonl, log lines, progress bar, TensorBoard.

Only rank 0 writes (:class:`MetricsLog`); every rank measures (:func:`peak_memory_mb`) because the
trainer reduces the figures over ranks first. One JSON object per step in ``metrics.jsonl``:
``step``, ``loss``, ``grad_norm``, ``lr``, ``tokens`` (global real tokens of the step),
``tokens_per_s`` (global), ``step_time_s``, ``peak_mem_mb`` (max over ranks), ``mfu`` (only where
the accelerator's peak FLOPs is known) and ``val_loss`` on steps that evaluated.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["MetricsLog", "format_line", "peak_flops", "peak_memory_mb", "read_metrics"]

# Dense bf16 tensor-core peak per device (FLOP/s), by a substring of the CUDA device name. MFU is
# reported against these (also for fp32 runs: "how much of the chip did we use").
_PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s, or None where unknown (CPUs, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in _PEAK_BF16_FLOPS if key in name), None)


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory: max allocated on a GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # macOS: bytes, Linux: KiB


def read_metrics(path: Path, upto: int | None = None) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (those with ``step <= upto`` if given; torn lines skipped)."""
    rows = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if upto is None or row.get("step", 0) <= upto:
                rows.append(row)
    return rows


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def format_line(row: dict[str, Any], eta_s: float | None = None) -> str:
    """One log line, torchtitan-style: loss, grad norm, lr, tokens/s, MFU, memory, ETA."""
    parts = [
        f"step {row['step']:5d}",
        f"loss {row['loss']:7.4f}",
        f"grad_norm {row['grad_norm']:6.3f}",
        f"lr {row['lr']:.2e}",
        f"tok/s {row['tokens_per_s']:9,.0f}",
    ]
    if row.get("mfu") is not None:
        parts.append(f"mfu {100 * row['mfu']:5.2f}%")
    parts.append(f"mem {row['peak_mem_mb']:6,.0f} MB")
    if row.get("val_loss") is not None:
        parts.append(f"val_loss {row['val_loss']:.4f}")
    if eta_s is not None:
        parts.append(f"eta {_duration(eta_s)}")
    return " | ".join(parts)


class MetricsLog:
    """Rank 0's sink for per-step rows: the JSONL file, log lines, progress bar, TensorBoard."""

    def __init__(
        self,
        out: Path,
        *,
        first_step: int,
        total_steps: int,
        log_every: int,
        progress_bar: bool,
        tensorboard: bool,
        history: list[dict[str, Any]],
    ) -> None:
        self.rows = history  # rows before first_step (a resumed run's curve so far)
        self.path = out / "metrics.jsonl"
        # rewrite, not append: a crashed run may have logged steps after its last checkpoint
        self.path.write_text("".join(json.dumps(r) + "\n" for r in history), encoding="utf-8")
        self._file = self.path.open("a", encoding="utf-8")
        self.total_steps, self.log_every = total_steps, log_every
        self._start, self._first_step = time.perf_counter(), first_step
        self._bar = self._progress_bar(first_step, total_steps) if progress_bar else None
        self._tb = self._tensorboard(out) if tensorboard else None

    @staticmethod
    def _progress_bar(first_step: int, total: int) -> Any:
        if not sys.stderr.isatty():  # CI logs: the log lines alone stay readable
            return None
        try:
            from tqdm import tqdm  # imported only when a bar is shown
        except ImportError:  # the [train] extra; a bar is not worth failing a run for
            return None
        return tqdm(total=total, initial=first_step, unit="step", dynamic_ncols=True, desc="train")

    @staticmethod
    def _tensorboard(out: Path) -> Any:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        return SummaryWriter(log_dir=str(out / "tensorboard"))

    def eta_s(self, step: int) -> float:
        """Seconds left at the mean pace of this session's steps."""
        done = step - self._first_step
        pace = (time.perf_counter() - self._start) / max(1, done)
        return pace * (self.total_steps - step)

    def record(self, row: dict[str, Any]) -> None:
        """Write the row; print a line on logging steps (first, every ``log_every``, last)."""
        self.rows.append(row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        step = row["step"]
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and value is not None:
                    self._tb.add_scalar(key, value, step)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}")
            self._bar.update(1)
        if (
            step % self.log_every == 0
            or step in (self._first_step + 1, self.total_steps)
            or (row.get("val_loss") is not None)
        ):
            self.print(format_line(row, self.eta_s(step)))

    def print(self, text: str) -> None:
        """Print above the progress bar (or plainly without one)."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def end_progress(self) -> None:
        """Remove the progress bar (the end-of-run report prints below it)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        """Flush and close everything (idempotent)."""
        self.end_progress()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if not self._file.closed:
            self._file.close()
