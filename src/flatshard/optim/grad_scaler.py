"""``fs.GradScaler``: dynamic loss scaling for fp16 training on sharded (or any) models.

Same API as ``torch.amp.GradScaler`` (``scale`` / ``unscale_`` / ``step`` / ``update`` /
``state_dict``), plus what a data-parallel fp16 run needs:

- **One decision for every rank.** Each rank checks only its own gradient shards for inf/NaN,
  so the found-inf flag is all-reduced (MAX) over the whole data-parallel mesh before
  ``step``: if any rank overflowed, every rank skips. A rank that skipped alone would hold other
  parameters than its peers from then on (and a different loss scale, hence different overflow
  decisions later) — silent divergence instead of training.
- **Hysteresis** (as DeepSpeed's ``delayed_shift`` with consecutive hysteresis): the scale backs
  off only after ``hysteresis`` overflowing steps in a row; each such step is still skipped.
- **A floor.** Overflowing at ``min_scale`` raises instead of shrinking the scale towards zero
  forever: at that point the model produces inf/NaN by itself, and loss scaling cannot help.

The gradients the optimizer sees are the 1-D fragments' ``.grad`` (plain tensors), so the check
is a local fused reduction per (device, dtype) and then one all-reduce of a single float.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from flatshard.comm.collectives import CommStats, all_reduce
from flatshard.comm.debug import OpChecker
from flatshard.core.switches import Switches

_FP32_MAX = torch.finfo(torch.float32).max
# state_dict key -> (attribute, type); the first five are torch.amp.GradScaler's
_FIELDS: dict[str, tuple[str, type]] = {
    "scale": ("_scale", float),
    "growth_factor": ("_growth_factor", float),
    "backoff_factor": ("_backoff_factor", float),
    "growth_interval": ("_growth_interval", int),
    "_growth_tracker": ("_growth_tracker", int),
    "hysteresis": ("_hysteresis", int),
    "min_scale": ("_min_scale", float),
    "_overflow_streak": ("_overflow_streak", int),
}
_TORCH_KEYS = tuple(_FIELDS)[:5]


class _Stage(enum.Enum):
    READY = "ready"  # nothing done to this optimizer's gradients since the last update()
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclass
class _Record:
    """What happened to one optimizer since the last ``update()``."""

    stage: _Stage = _Stage.READY
    found_inf: torch.Tensor | None = None  # local flag (> 0: this rank saw inf/NaN)
    synced: bool | None = None  # the all-reduced decision, once taken
    groups: list[dist.ProcessGroup] = field(default_factory=list)  # what the flag is reduced over


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0  # world: message


class GradScaler:
    """Dynamic loss scaling whose skip decision is shared by every data-parallel rank.

    Args:
        init_scale: the first loss scale (2**16 as torch and DeepSpeed).
        growth_factor: multiply the scale by this after ``growth_interval`` clean steps in a row.
        backoff_factor: multiply the scale by this when it backs off after an overflow.
        growth_interval: clean (non-overflowing) steps in a row before the scale grows.
        hysteresis: consecutive overflowing steps before the scale backs off (1: every time).
        min_scale: the floor. An overflow that would back off from ``min_scale`` raises.
        enabled: ``False`` turns every method into a pass-through (``step`` just steps).
        group: what the found-inf flag is all-reduced over: a ``ProcessGroup``, a
            ``DeviceMesh`` (all its dimensions), or a sequence of groups (reduced one after
            the other, which covers their union). Default: the mesh of every sharded model
            whose fragments the optimizer steps (each rank of it, whatever the strategy), so
            a model that is one stage of a pipeline never waits on the other stages; the
            default group for an optimizer of plain parameters; no collective when
            ``torch.distributed`` is not initialised.

    ``FLATSHARD_DEBUG`` (the cross-rank check before its collective) is the switch of the
    first sharded model whose fragments the optimizer steps, as that model's ``fs.shard``
    read it, taken at the scaler's first ``unscale_``/``step`` that meets one (so the scaler
    may be built before ``fs.shard``). Until then (an optimizer of plain parameters) it is
    read from the environment at that first step.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        enabled: bool = True,
        group: Any = None,
    ) -> None:
        _validate(init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale)
        self._scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._hysteresis = int(hysteresis)
        self._min_scale = float(min_scale)
        self._enabled = bool(enabled)
        if group is not None:
            _resolve_groups(group)  # a wrong type fails here, not at the first step
        self._group_arg = group
        self._growth_tracker = 0  # clean steps in a row
        self._overflow_streak = 0  # overflowing steps in a row
        self._records: dict[int, _Record] = {}
        self.last_step_skipped = False
        """Whether the step closed by the last ``update()`` was skipped (on every rank)."""
        self.stats = CommStats()
        """Collectives issued by this scaler (one found-inf all-reduce per optimizer step)."""
        self._switches_from: str | None = None  # "model" or "environment", once taken

    # ---- the torch.amp API -------------------------------------------------------------------

    def scale(self, outputs: Any) -> Any:
        """``outputs * scale`` (a tensor or nested lists/tuples of tensors).

        A low-precision loss is upcast to fp32 first (as DeepSpeed does), so the scaled loss
        itself stays finite. An fp16 loss still receives ``scale`` as its gradient, and 2**16
        is above fp16's maximum (65504): the first step overflows and is skipped (measured).
        Compute the loss in fp32 (``logits.float()``) and that does not happen.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if outputs.dtype in (torch.float16, torch.bfloat16):
                outputs = outputs.float()
            return outputs * self._scale
        if isinstance(outputs, list | tuple):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(
            f"GradScaler.scale(outputs) got a {type(outputs).__name__}; pass the loss tensor "
            "(or a list/tuple of tensors)"
        )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and record (locally) whether
        any is inf/NaN. Call it before ``fs.clip_grad_norm_``; at most once per step."""
        if not self._enabled:
            return
        record = self._records.setdefault(id(optimizer), _Record())
        if record.stage is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()"
            )
        if record.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step(); call update() first")
        record.found_inf = self._unscale_grads(optimizer)
        self._take_switches(optimizer)
        record.groups = self._groups(optimizer)
        record.stage = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless done), then ``optimizer.step(*args, **kwargs)`` unless some rank found
        inf/NaN, in which case every rank skips it and this returns ``None``."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("closure use is not supported by GradScaler.step")
        record = self._records.setdefault(id(optimizer), _Record())
        if record.stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update()")
        if record.stage is _Stage.READY:
            self.unscale_(optimizer)
        record.stage = _Stage.STEPPED
        if self._sync(record):
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Close the step: grow, keep or back off the scale (or set ``new_scale``)."""
        if not self._enabled:
            return
        if new_scale is not None:
            value = float(new_scale)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"new_scale={value} must be a positive finite number")
            self._scale = value
        else:
            records = [r for r in self._records.values() if r.found_inf is not None]
            if not records:
                raise RuntimeError(
                    "No inf checks were recorded prior to update(): call scaler.step(optimizer) "
                    "(or scaler.unscale_(optimizer)) before scaler.update()"
                )
            found = [self._sync(r) for r in records]  # every record synced on every rank
            self.last_step_skipped = any(found)
            self._apply_schedule(self.last_step_skipped)
        self._records.clear()

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled)."""
        return self._scale if self._enabled else 1.0

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """torch.amp.GradScaler's keys plus ``hysteresis``, ``min_scale``, ``_overflow_streak``;
        empty when disabled. Store it with ``fs.save(..., extra={"scaler": ...})``."""
        if not self._enabled:
            return {}
        return {key: getattr(self, attr) for key, (attr, _) in _FIELDS.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ours or a ``torch.amp.GradScaler`` state dict (keys it lacks keep their value)."""
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "GradScaler"
            )
        missing = [k for k in _TORCH_KEYS if k not in state_dict]
        if missing:
            raise ValueError(f"GradScaler state dict lacks {missing}; got keys {list(state_dict)}")
        for key, (attr, cast) in _FIELDS.items():
            if key in state_dict:
                setattr(self, attr, cast(state_dict[key]))
        self._overflow_streak = int(state_dict.get("_overflow_streak", 0))

    # ---- internals ---------------------------------------------------------------------------

    def _unscale_grads(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Unscale in place per (device, dtype) with torch's fused kernel (the one torch.amp
        uses); returns this rank's flag on the flag device."""
        by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("GradScaler supports dense gradients only (got a sparse one)")
                by_key.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        flag = torch.zeros((), dtype=torch.float32, device=_flag_device(optimizer))
        for (device, _), grads in by_key.items():
            found = torch.zeros((), dtype=torch.float32, device=device)
            inv_scale = torch.full((), 1.0 / self._scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
            flag += found.to(flag.device)
        return flag

    def _sync(self, record: _Record) -> bool:
        """The shared decision for ``record``: one MAX all-reduce, taken once per step."""
        if record.synced is None:
            assert record.found_inf is not None
            flag = record.found_inf
            for group in record.groups:
                all_reduce(flag, group, self.stats, op=dist.ReduceOp.MAX, name="found_inf")
            record.synced = bool(flag.item() > 0)
        return record.synced

    def _take_switches(self, optimizer: torch.optim.Optimizer) -> None:
        """``FLATSHARD_DEBUG`` from the first sharded model met, as its ``fs.shard`` read it;
        the environment's while no sharded model was met (see the class docstring)."""
        if self._switches_from == "model":
            return
        states = _sharded_states(optimizer)
        if states:
            switches, self._switches_from = states[0].switches, "model"
        elif self._switches_from is None:
            switches, self._switches_from = Switches.from_environ(), "environment"
        else:
            return
        self.stats.checker = OpChecker() if switches.debug else None

    def _groups(self, optimizer: torch.optim.Optimizer) -> list[dist.ProcessGroup]:
        """The groups to reduce over, resolved late (the scaler may exist before init)."""
        if self._group_arg is None:
            groups = _mesh_groups(optimizer) or _resolve_groups(None)
        else:
            groups = _resolve_groups(self._group_arg)
        return [g for g in groups if dist.get_world_size(g) > 1]

    def _apply_schedule(self, found_inf: bool) -> None:
        if not found_inf:
            self._overflow_streak = 0
            self._growth_tracker += 1
            if self._growth_tracker >= self._growth_interval:
                self._growth_tracker = 0
                grown = self._scale * self._growth_factor
                if grown <= _FP32_MAX:  # the scale multiplies fp32 losses: keep it finite
                    self._scale = grown
            return
        self._growth_tracker = 0
        self._overflow_streak += 1
        if self._overflow_streak < self._hysteresis:
            return
        if self._scale <= self._min_scale:
            raise RuntimeError(
                f"[flatshard rank {_rank()}] GradScaler: gradients are still inf/NaN at the "
                f"minimum loss scale (scale={self._scale:g}, min_scale={self._min_scale:g}). "
                "Loss scaling cannot fix this: the model itself produces inf/NaN (check the "
                "data, the learning rate, the loss for log(0) or division by zero), or fp16's "
                "range is too small for it — train in bf16 (no loss scaling needed), or lower "
                "min_scale"
            )
        self._scale = max(self._scale * self._backoff_factor, self._min_scale)


def _validate(
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
) -> None:
    if not (math.isfinite(min_scale) and min_scale > 0):
        raise ValueError(f"min_scale={min_scale} must be a positive finite number (e.g. 1.0)")
    if not (math.isfinite(init_scale) and init_scale >= min_scale):
        raise ValueError(f"init_scale={init_scale} must be finite and >= min_scale={min_scale}")
    if not growth_factor > 1.0:
        raise ValueError(f"growth_factor={growth_factor} must be > 1 (e.g. 2.0)")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor={backoff_factor} must be in (0, 1) (e.g. 0.5)")
    for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")


def _sharded_states(optimizer: torch.optim.Optimizer) -> list:
    """The states of the sharded models whose fragments ``optimizer`` steps, each once."""
    from flatshard.core.params import fragment_tag

    states: list = []
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            tag = fragment_tag(p)
            state = tag.state() if tag is not None else None
            if state is not None and all(s is not state for s in states):
                states.append(state)
    return states


def _mesh_groups(optimizer: torch.optim.Optimizer) -> list[dist.ProcessGroup]:
    """The mesh groups of the sharded models whose fragments ``optimizer`` steps."""
    groups: list[dist.ProcessGroup] = []
    for state in _sharded_states(optimizer):
        if all(g is not state.topology.mesh_group for g in groups):
            groups.append(state.topology.mesh_group)
    return groups


def _resolve_groups(group: Any) -> list[dist.ProcessGroup]:
    if group is None:
        if dist.is_available() and dist.is_initialized():
            return [dist.group.WORLD]  # world: plain parameters (no sharded model) only
        return []
    if isinstance(group, dist.ProcessGroup):
        return [group]
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        return [group.get_group(d) for d in range(group.ndim)]
    if isinstance(group, Sequence) and all(isinstance(g, dist.ProcessGroup) for g in group):
        return list(group)
    raise TypeError(
        f"GradScaler(group={group!r}): pass None (the whole default group), a ProcessGroup, a "
        "DeviceMesh or a list of ProcessGroups"
    )


def _flag_device(optimizer: torch.optim.Optimizer) -> torch.device:
    """Where the flag lives: the compute device of the sharded model the optimizer steps
    (collectives reduce device tensors, even with the parameters offloaded to the host or
    none on this rank); for plain parameters, theirs."""
    from flatshard.core.params import fragment_tag

    first = None
    for group in optimizer.param_groups:
        for p in group["params"]:
            tag = fragment_tag(p)
            state = tag.state() if tag is not None else None
            if state is not None:
                return state.device
            first = first or p.device
    return first or torch.device("cpu")
