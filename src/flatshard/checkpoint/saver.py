"""``fs.save``: every rank writes its own shards through DCP, rank 0 commits atomically.

[Note: asynchronous saves]
``async_=True`` snapshots what is saved (fragments, buffers, optimizer state) into CPU copies on
the calling thread, so training may change the originals at once, then writes and commits from
a background thread. That thread runs collectives (DCP's planning, the manifest gather, the
commit broadcast); they go over a Gloo group of their own, created on the first asynchronous
save of the model (every rank calls ``save``, so every rank creates it, in the same order), so
they never interleave with the training collectives on the model's group. One save per model
is in flight: the next ``save`` (or ``load``) waits for the previous one first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh

from flatshard.checkpoint import agree, commit, jsonable, parts, residuals
from flatshard.checkpoint.contents import (
    describe_model,
    model_items,
    model_layout,
    optimizer_entries,
)
from flatshard.checkpoint.digest_writer import DigestWriter
from flatshard.checkpoint.planner import FlatSavePlanner, Item, Pickled, Sharded
from flatshard.core.state import get_state

SESSION_ATTR = "_flatshard_checkpoint"


class SaveHandle:
    """A checkpoint save in progress (or done). ``wait()`` returns the checkpoint path once it
    is committed on every rank, or raises the error that stopped it."""

    def __init__(self, path: Path, future: Future) -> None:
        self.path = path
        self._future = future
        self.observed = False  # wait() was called: its outcome reached the caller

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Path:
        try:
            self._future.result(timeout)  # the save's error, or TimeoutError if still running
        finally:
            self.observed = self._future.done()
        return self.path


class _Session:
    """Per-model checkpoint state: the save in flight and the background Gloo group."""

    def __init__(self) -> None:
        self.pending: SaveHandle | None = None
        self.async_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}  # by ranks

    def __deepcopy__(self, memo: dict) -> _Session:
        return _Session()  # a copied model starts with no save in flight (and no group)

    def wait_pending(self) -> None:
        """Wait for the save in flight; re-raise its error unless ``wait()`` already did."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.wait()
        except BaseException:
            if not pending.observed:
                raise


def session_of(model: nn.Module) -> _Session:
    session = model.__dict__.get(SESSION_ATTR)
    if session is None:
        session = _Session()
        model.__dict__[SESSION_ATTR] = session  # plain attribute: not a module/parameter
    return session


def save(
    path: str | os.PathLike,
    *,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    extra: dict | None = None,
    async_: bool = False,
    before_commit: Callable[[], None] | None = None,
    across: dist.ProcessGroup | DeviceMesh | None = None,
) -> SaveHandle:
    """Save ``model`` (and ``optimizer``'s state, and ``extra``) to the directory ``path``.

    Every rank must call it. Each rank writes only its own shards; the result loads at any
    world size and wrap policy (``fs.load``). ``extra``: small user state as JSON values and
    tensors (step, RNG states, data position); rank 0's copy is saved. ``path`` appears
    atomically when the save is complete; an existing checkpoint there is replaced. With
    ``async_=True`` the call returns once a CPU snapshot is taken; ``.wait()`` on the returned
    handle (or the next save/load) waits for the files. ``before_commit``: called on rank 0
    once every file is written, just before the checkpoint is committed (tests interrupt a
    save there).

    Pipeline stages: ``model`` may be the list of this rank's stage modules (``optimizer``
    then one optimizer per stage), and ``across`` the pipeline's group or 1-D mesh (``mesh
    ["pp"]``): every rank of the pipeline writes into one checkpoint of the whole model, which
    loads with or without a pipeline ([Note: checkpoints across pipeline stages], parts.py).
    """
    models, optimizers = parts.model_parts(model, optimizer)
    for part in models:
        session_of(part).wait_pending()
    path = Path(path)
    group = parts.checkpoint_group(models, across)
    in_parts = len(models) > 1 or across is not None
    try:
        items, description, error = *_describe(models, optimizers, extra, group, in_parts), None
    except (ValueError, TypeError) as err:
        items, description, error = {}, {}, err
    if in_parts:
        description = parts.agree_on_parts(items, description, error, group)
    else:
        _check_ranks_agree(items, description, error, group)
    tmp = _make_tmp_dir(path, group)
    future: Future = Future()
    handle = SaveHandle(path, future)
    if async_:
        snapshot = {key: _to_cpu_copy(item) for key, item in items.items()}
        args = (future, snapshot, description, tmp, path)
        _start_in_background(handle, models[0], group, args, before_commit)
    else:
        _run(future, items, description, tmp, path, group, before_commit)
        handle.wait()
    return handle


def _start_in_background(handle, model, group, args: tuple, before_commit) -> None:
    """``fs.save(async_=True)``: write the CPU snapshot (in ``args``) from a thread, over the
    session's own group for these ranks, and remember the handle (the next save or load
    waits for it)."""
    session = session_of(model)
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in session.async_groups:
        session.async_groups[ranks] = _async_group(group, get_state(model).timeout)
    run_args = (*args, session.async_groups[ranks], before_commit)
    thread = threading.Thread(target=_run, args=run_args, name="flatshard-save")
    thread.start()  # not a daemon: a save in flight finishes before the interpreter exits
    session.pending = handle


def _async_group(group: dist.ProcessGroup, timeout) -> dist.ProcessGroup:
    """A Gloo group over the same ranks for a save that runs in a thread beside training (its
    collectives must not interleave with the training ones). Only the mesh's ranks make it."""
    if group is dist.group.WORLD:  # world: the mesh spans every rank (they all make it)
        return dist.new_group(backend="gloo", timeout=timeout)
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)


def _make_tmp_dir(path: Path, group) -> Path:
    """Rank 0 creates ``<path>.tmp-<id>``; every rank gets its name (or rank 0's error)."""
    made: tuple[str | None, str | None] = (None, None)
    if dist.get_rank(group) == 0:
        try:
            made = (str(commit.new_tmp_dir(path)), None)
        except OSError as err:
            made = (None, f"cannot create a directory next to {path}: {err}")
    name, error = agree.from_rank0(made, group)
    agree.raise_if(error)
    return Path(name)


def _to_cpu_copy(item: Item) -> Item:
    if isinstance(item, Pickled):
        return item
    if isinstance(item, Sharded):
        return dataclasses.replace(item, local=item.local.to("cpu", copy=True))
    return item.to("cpu", copy=True)


def _describe(
    models: list[nn.Module],
    optimizers: list[torch.optim.Optimizer | None],
    extra: dict | None,
    group: dist.ProcessGroup,
    in_parts: bool,
) -> tuple[dict[str, Item], dict]:
    """This rank's DCP items and the JSON description of the checkpoint (of this rank's
    parts only when ``in_parts``: parts.agree_on_parts merges the ranks' descriptions)."""
    layout = parts.merged_layout(models) if in_parts else model_layout(models[0])
    items = model_items(layout)
    items.update(residuals.checkpoint_items(models, layout, in_parts))  # collective
    description = {"format": commit.FORMAT, "version": commit.VERSION}
    description["model"] = describe_model(layout)
    description["optimizer"] = None
    for optimizer in optimizers:
        if optimizer is None:
            continue
        optim_items, desc = optimizer_entries(optimizer, layout, flat_groups=in_parts)
        items.update(optim_items)
        description["optimizer"] = parts.add_optimizer(description["optimizer"], desc)
    description["world_size"] = dist.get_world_size(group)  # the ranks of the model's mesh
    description["extra"] = jsonable.encode(extra if extra is not None else {})
    return items, description


def _check_ranks_agree(
    items: dict[str, Item], description: dict, error: Exception | None, group
) -> None:
    """Raise a local error on every rank, and refuse to save when ranks describe different
    entries (DCP would fail obscurely or mix them). ``extra`` may differ: rank 0's is saved."""
    kinds = sorted((k, type(v).__name__) for k, v in items.items())
    shared = {k: v for k, v in description.items() if k != "extra"}
    text = json.dumps([kinds, shared], sort_keys=True, default=str)
    mine = (hashlib.sha256(text.encode()).hexdigest(), error and f"{error}", type(error).__name__)
    gathered = [mine] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    rank_now = dist.get_rank()  # world: the global rank names this process in messages
    for rank, (_, message, kind) in enumerate(gathered):
        if message is not None:
            exc_type = TypeError if kind == "TypeError" else ValueError
            source = dist.get_global_rank(group, rank)  # the group's rank as a global one
            raise exc_type(f"[flatshard rank {rank_now}] rank {source}: {message}")
    if len({digest for digest, _, _ in gathered}) > 1:
        raise ValueError(
            f"[flatshard rank {rank_now}] ranks disagree on what to save (model, "
            "optimizer state keys or param groups differ); every rank must save the same "
            "model and an optimizer built the same way"
        )


def _run(future: Future, items, description, tmp: Path, path: Path, group, before_commit) -> None:
    try:
        _write_and_commit(items, description, tmp, path, group, before_commit)
    except BaseException as err:  # reported through the handle, raised by wait()
        future.set_exception(err)
    else:
        future.set_result(path)


def _write_and_commit(
    items, description: dict, tmp: Path, path: Path, group, before_commit=None
) -> None:
    rank = dist.get_rank(group)
    writer = DigestWriter(tmp)  # hashes the data files as it writes them
    try:
        with torch.no_grad():
            dcp.save(items, storage_writer=writer, planner=FlatSavePlanner(), process_group=group)
    except CheckpointException as err:
        raise agree.dcp_error(err, f"writing {tmp}") from None
    try:
        mine, error = writer.data_files(tmp, rank), None
    except OSError as err:
        mine, error = {}, f"hashing the files written in {tmp}: {err}"
    gathered = [None] * dist.get_world_size(group)
    dst = dist.get_global_rank(group, 0)
    dist.gather_object((mine, error), gathered if rank == 0 else None, dst=dst, group=group)
    outcome = None
    if rank == 0:
        errors = [e for _, e in gathered if e is not None]
        outcome = errors[0] if errors else None
        if outcome is None:
            files = {name: d for files, _ in gathered for name, d in files.items()}
            try:
                commit.commit(tmp, path, files, description, before_commit)
            except OSError as err:
                outcome = f"committing {tmp} to {path}: {err}"
    agree.raise_if(agree.from_rank0(outcome, group), RuntimeError)
