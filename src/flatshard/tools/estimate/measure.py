"""Measure what flatshard really holds in one training step, to validate the estimate.

On CPU there is no allocator counter, so memory is counted as *live tensor bytes*:

- static (exact, from the tensors): sharded parameters, optimizer state, buffers;
- gradients: the distinct storages behind ``.grad`` after backward;
- activations: the bytes allocated during the step and still alive when forward returns
  (what autograd saved, checkpointed blocks' inputs, the batch), gathered buffers excluded;
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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from flatshard.comm.shutdown import end_process_group
from flatshard.core.state import get_state

__all__ = ["LiveBytes", "build", "measure_step", "spawn_measure"]


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
        # A storage can become excluded after its creation (a gather buffer the pool made,
        # then handed out): count it once, as gathered.
        for key in set(self.live) & (self.exclude() if excluded is None else excluded):
            self._free(key)
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


def build(
    model_name: str,
    *,
    strategy: str = "full_shard",
    act_ckpt: bool = False,
    prefetch: tuple[int, str] = (1, "pre"),
    precision: str = "fp32",
    reduce: str | None = None,
    coalesce: bool = True,
    split_root: bool = True,
    layers: int | None = None,
    seed: int = 0,
) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """The reference GPT preset ``model_name`` sharded one unit per ``Block`` (optionally
    ``fs.checkpoint_activations`` on every block; ``precision="bf16"``:
    ``fs.MixedPrecision(param_dtype=bf16, reduce_dtype=reduce or bf16)``), its AdamW, its vocab.
    ``coalesce``/``split_root``: ``False`` is passed to ``fs.shard``; otherwise its defaults.
    ``layers``: the preset with that many blocks instead."""
    import flatshard as fs
    from flatshard.models import GPT, Block, GPTConfig

    torch.manual_seed(seed)
    cfg = GPTConfig.preset(model_name, **({"n_layers": layers} if layers else {}))
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    mp = None
    if precision != "fp32":
        mp = fs.MixedPrecision(
            param_dtype=dtypes[precision], reduce_dtype=dtypes[reduce or precision]
        )
    off = {name: False for name, on in (("coalesce", coalesce), ("split_root", split_root))
           if not on}  # fmt: skip
    model = fs.shard(GPT(cfg), policy=fs.wrap.by_type(Block), strategy=strategy,
                     prefetch=fs.Prefetch(*prefetch), mixed_precision=mp, **off)  # fmt: skip
    if act_ckpt:
        fs.checkpoint_activations(model, fs.wrap.by_type(Block))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg.vocab_size


def measure_step(
    model_name: str, *, batch: int, seq: int, seed: int = 0, **options: Any
) -> dict[str, int]:
    """:func:`build` (``options``), run two warm-up steps, then measure one step of ``batch``
    random sequences of ``seq`` tokens. Call on every rank; returns this rank's bytes."""
    model, opt, vocab = build(model_name, seed=seed, **options)
    gen = torch.Generator().manual_seed(seed + 1 + dist.get_rank())  # world: a tool
    seen: dict[str, int] = {}

    def step(after_forward: Callable[[], None] = lambda: None) -> None:
        x = torch.randint(0, vocab, (batch, seq + 1), generator=gen)  # [B, T+1]
        loss = model(x[:, :-1], labels=x[:, 1:])
        after_forward()
        loss.backward()
        seen["gradients"] = _bytes(p.grad for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    step()  # steady state: the first step records the order; from the second, prefetch and buckets
    state_tensors = [v for s in opt.state.values() for v in s.values()]
    static = {"parameters": _bytes(model.parameters()), "optimizer": _bytes(state_tensors),
              "buffers": _bytes(model.buffers())}  # fmt: skip
    counted = [*model.parameters(), *state_tensors, *model.buffers()]  # in ``static``
    static_ptrs = {t.untyped_storage().data_ptr() for t in counted}
    fulls = get_state(model).gathered_buffers
    tracker = LiveBytes(
        exclude=lambda: static_ptrs | {f.untyped_storage().data_ptr() for f in fulls()},
        extra=lambda: sum(f.untyped_storage().nbytes() for f in fulls()),  # gathered now
    )
    with tracker:
        step(lambda: seen.__setitem__("activations", tracker.current))
    peak = sum(static.values()) + tracker.peak
    return {**static, "gradients": seen["gradients"], "activations": seen["activations"],
            "gathered_peak": tracker.peak_extra, "peak": peak}  # fmt: skip


def _worker(rank: int, world: int, port: int, out_dir: str, kwargs: dict) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = measure_step(**kwargs)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_process_group()


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
