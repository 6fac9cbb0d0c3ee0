"""Periodic checkpoints in OUT/checkpoints/step_NNNNNN and resuming from the newest one.

The tensors (sharded model and optimizer state) are written by :mod:`flatshard.checkpoint`, which
makes each checkpoint directory appear atomically. This module decides *when* to save, what goes
into ``extra`` besides the tensors, which old checkpoints to delete, and restores the rest of
the run's state on resume.

[Note: what a resumed run needs to continue the same curve]
A resumed run's losses equal an uninterrupted run's (fp32, same world size) only if every piece
of state that the next step reads is restored exactly:
* weights and AdamW moments/step counts -> the checkpoint's tensors;
* the data position -> the sampler's ``state_dict`` (epoch and bins consumed in the global,
  world-size independent bin order);
* the learning rate -> the scheduler's ``state_dict`` (``last_epoch``) -- and the same schedule,
  so ``optim.decay_steps`` must not change (it defaults to ``steps``: set it explicitly when a run
  will be extended);
* dropout -> every rank's torch RNG state;
* the curve itself -> step, tokens seen and elapsed time (metrics.jsonl is cut back to the step).
Gradient clipping has no state; gradients are zero at a step boundary.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointManager",
    "existing_checkpoints",
    "refuse_to_mix",
    "rng_state",
    "set_rng_state",
]

_NAME = re.compile(r"^step_(\d+)$")


def _api() -> tuple[Any, Any, Any]:
    """flatshard.checkpoint's save/load/latest_checkpoint (imported on first use)."""
    from flatshard.checkpoint import latest_checkpoint, load, save

    return save, load, latest_checkpoint


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's torch RNG states (CPU, and the current GPU's when on one)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def existing_checkpoints(directory: Path) -> list[Path]:
    """The ``step_NNNNNN`` checkpoints under ``directory``, oldest step first (partial saves have
    other names until they are complete)."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _NAME.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def refuse_to_mix(directory: Path) -> None:
    """A fresh run must not write into another run's checkpoints (resume would pick the newest
    of either): ``ValueError`` with the fix."""
    found = existing_checkpoints(directory)
    if found:
        raise ValueError(
            f"{directory} already holds checkpoints (newest {found[-1].name}); pass --resume to "
            "continue that run, or choose another --out (or delete the old run)"
        )


class CheckpointManager:
    """Saves every ``every`` steps and after the last, keeps the newest ``keep``."""

    def __init__(
        self, directory: Path, *, every: int, keep: int, async_save: bool, rank: int
    ) -> None:
        self.directory, self.every, self.keep = directory, every, keep
        self.async_save, self.rank = async_save, rank
        self._pending: Any = None  # the in-flight async save, if any

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` lives."""
        return self.directory / f"step_{step:06d}"

    def due(self, step: int, last_step: int) -> bool:
        """Save after this step?"""
        return step == last_step or (self.every > 0 and step % self.every == 0)

    def existing(self) -> list[Path]:
        """Complete checkpoints (renamed into place), oldest first."""
        return existing_checkpoints(self.directory)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        if not self.directory.is_dir():
            return None
        return _api()[2](self.directory)

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, Any],
        across: Any = None,
    ) -> Path:
        """Write the checkpoint of ``step`` (collective: every rank calls it), then prune.
        Pipeline stages: ``model``/``optimizer`` are this rank's lists and ``across`` the pp
        mesh (one checkpoint of the whole model)."""
        save, _, _ = _api()
        self.wait()  # at most one save in flight: its buffers are still being written
        path = self.path(step)
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
        handle = save(
            path, model=model, optimizer=optimizer, extra=extra, async_=self.async_save,
            across=across,
        )  # fmt: skip
        if self.async_save:
            self._pending = handle
        self._prune()
        return path

    def wait(self) -> None:
        """Block until an in-flight async save is on disk (before the next save and at exit)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()  # flatshard.checkpoint.SaveHandle
            self._prune()  # now that it is complete, the oldest one can go

    def _prune(self) -> None:
        """Rank 0 deletes all but the newest ``keep`` complete checkpoints (an async save still
        in flight is not complete yet: it briefly makes ``keep + 1``)."""
        if self.rank != 0:
            return
        complete = self.existing()
        for old in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

    def load(
        self,
        path: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        across: Any = None,
    ) -> dict[str, Any]:
        """Load the tensors of ``path`` into ``model``/``optimizer`` (lists and ``across`` as
        for :meth:`save`); returns ``extra``."""
        _, load, _ = _api()
        return load(path, model=model, optimizer=optimizer, across=across)
