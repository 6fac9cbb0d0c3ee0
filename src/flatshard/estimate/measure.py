"""Measure what flatshard really holds in one training step, to validate the estimate.

On CPU there is no allocator counter, so memory is counted as *live tensor bytes*:

- static (exact, from the tensors): sharded parameters, optimizer state, buffers;
- gradients: the distinct storages behind ``.grad`` after backward;
- activations: the distinct storages saved for backward at the end of forward
  (``torch.autograd.graph.saved_tensors_hooks``), parameters and gathered buffers excluded;
- gathered: the bytes of every unit's full buffer, sampled at every op;
- peak: static + the peak over ops of (bytes allocated during the step and still alive + gathered).
  "Allocated and alive" is tracked by a ``TorchDispatchMode`` that sees every op's outputs and
  a ``weakref.finalize`` on each new storage; Gloo's own internal buffers are not tensors and
  are not counted.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "measure_step", "spawn_measure"]


class LiveBytes(TorchDispatchMode):
    """Tracks bytes of storages created by ops while active, and their peak (plus ``extra()``)."""

    def __init__(self, exclude: Callable[[], set[int]], extra: Callable[[], int]) -> None:
        super().__init__()
        self.exclude, self.extra = exclude, extra
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.peak_extra = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        excluded = None
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if not key or key in self.live:
                continue
            excluded = self.exclude() if excluded is None else excluded
            if key not in excluded:
                self.live[key] = storage.nbytes()
                self.current += storage.nbytes()
                weakref.finalize(storage, self._free, key)
        extra = self.extra()
        self.peak = max(self.peak, self.current + extra)
        self.peak_extra = max(self.peak_extra, extra)
        return out


def _bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _full_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    state = model._flatshard_state  # type: ignore[attr-defined]
    # no_shard: ``full`` is the shard itself (nothing is gathered); leave those out.
    return [g.full for unit in state.units for g in unit.groups if g.full is not g.shard]


def measure_step(
    model_name: str, *, batch: int, seq: int, strategy: str = "full_shard", seed: int = 0
) -> dict[str, int]:
    """Shard the reference GPT preset ``model_name`` (one unit per ``Block``) with AdamW, run one
    warm-up step, then measure one step. Call on every rank; returns this rank's bytes."""
    import flatshard as fs
    from flatshard.models import GPT, Block, GPTConfig

    torch.manual_seed(seed)
    cfg = GPTConfig.preset(model_name)
    model = fs.shard(GPT(cfg), policy=fs.wrap.by_type(Block), strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fulls = _full_buffers(model)
    gen = torch.Generator().manual_seed(seed + 1 + dist.get_rank())

    def step(saved: dict[int, int] | None = None) -> int:
        x = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)  # [B, T+1]
        hooks = _saved_hooks(saved, fulls) if saved is not None else _null()
        with hooks:
            loss = model(x[:, :-1], labels=x[:, 1:])
        loss.backward()
        grads = _bytes(p.grad for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return grads

    step()
    state_tensors = [v for s in opt.state.values() for v in s.values()]
    static = {
        "parameters": _bytes(model.parameters()),
        "optimizer": _bytes(state_tensors),
        "buffers": _bytes(model.buffers()),
    }
    static_ptrs = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *state_tensors]}

    def gathered() -> int:
        return sum(f.untyped_storage().nbytes() for f in fulls)

    def exclude() -> set[int]:
        return static_ptrs | {f.untyped_storage().data_ptr() for f in fulls}

    saved: dict[int, int] = {}
    tracker = LiveBytes(exclude, gathered)
    with tracker:
        grads = step(saved)
    return {
        **static,
        "gradients": grads,
        "activations": sum(saved.values()),
        "gathered_peak": tracker.peak_extra,
        "peak": sum(static.values()) + tracker.peak,
    }


def _null():
    import contextlib

    return contextlib.nullcontext()


def _saved_hooks(saved: dict[int, int], fulls: list[torch.Tensor]):
    """Record the distinct storages autograd saves, except parameters (gathered buffers)."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in {f.untyped_storage().data_ptr() for f in fulls}:
            saved[key] = storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _worker(rank: int, world: int, port: int, out_dir: str, kwargs: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = measure_step(**kwargs)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_measure(world: int, **kwargs: object) -> list[dict[str, int]]:
    """Run :func:`measure_step` on ``world`` local Gloo ranks; returns each rank's result."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, port, out_dir, kwargs), nprocs=world)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
