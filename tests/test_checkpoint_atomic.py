"""Atomic saves (kill -9 in the middle of a save), overwriting, and asynchronous saves."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import flatshard as fs
import flatshard.checkpoint as ckpt
from parity_models import Block, TinyGPT, rel_err

TESTS = str(Path(__file__).parent)


def _step(model, opt, seed: int) -> None:
    x = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(seed))
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()


def child_main(root: str) -> None:
    """Run in a fresh 1-process job: save a checkpoint, export its weights as the reference,
    then overwrite it with a save that pauses before its commit (the parent kills it there)."""
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1)
    torch.manual_seed(0)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, 0)
    ckpt.save(f"{root}/ckpt/step", model=model, optimizer=opt, extra={"step": 1})
    ckpt.export_safetensors(model, f"{root}/reference.safetensors")
    _step(model, opt, 1)
    Path(root, "second_save_started").touch()  # the first save's .tmp- dir is gone by now
    pause = functools.partial(time.sleep, 120)
    ckpt.save(
        f"{root}/ckpt/step", model=model, optimizer=opt, extra={"step": 2}, before_commit=pause
    )
    raise AssertionError("the parent should have killed this save")


def _wait_for(pattern: str, root: Path, proc: subprocess.Popen, timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(root.glob(pattern))
        if found:
            return found[0]
        if proc.poll() is not None:
            raise AssertionError(f"child exited early:\n{proc.stderr.read().decode()}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"{pattern} never appeared")


def case_load_and_compare(path: str, reference: str) -> dict:
    """Load at another world size and plan; compare with the reference weights; save again."""
    torch.manual_seed(5)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_size(1500))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = ckpt.load(path, model=model, optimizer=opt)
    full = fs.full_state_dict(model)
    err = 0.0
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        ref = load_file(reference)
        err = max(rel_err(full[k], ref[k]) for k in ref) if set(ref) == set(full) else 1.0
    ckpt.save(path, model=model, optimizer=opt, extra=extra)  # clears the partial save
    return {"extra": extra, "err": err}


def test_kill_9_during_a_save_leaves_the_previous_checkpoint(dist_pools, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=TESTS)
    code = f"import test_checkpoint_atomic as t; t.child_main({str(tmp_path)!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
    _wait_for("second_save_started", tmp_path, proc)
    partial = _wait_for("ckpt/step.tmp-*/flatshard.json", tmp_path, proc)
    os.kill(proc.pid, signal.SIGKILL)  # data files written, manifest not yet: mid-commit
    proc.wait()
    assert partial.parent.exists() and not (partial.parent / "MANIFEST.json").exists()
    assert ckpt.latest_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / "step"
    results = dist_pools(2).run(
        case_load_and_compare,
        str(tmp_path / "ckpt" / "step"),
        str(tmp_path / "reference.safetensors"),
    )
    assert all(r["extra"] == {"step": 1} for r in results)  # the old one, intact
    assert results[0]["err"] == 0.0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step"]


def case_async(root: str) -> dict:
    torch.manual_seed(0)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, 0)
    before = fs.full_state_dict(model)
    linger = functools.partial(time.sleep, 0.5)  # rank 0's commit lingers: still in flight
    handle = ckpt.save(
        f"{root}/a", model=model, optimizer=opt, extra={"n": 1}, async_=True, before_commit=linger
    )
    in_flight = not handle.done()
    for seed in (1, 2):  # training goes on, changing the parameters being saved
        _step(model, opt, seed)
    handle.wait()
    second = ckpt.save(f"{root}/b", model=model, optimizer=opt, async_=True)
    ckpt.save(f"{root}/c", model=model, optimizer=opt)  # waits for the previous one first
    done_before_third = second.done()
    torch.manual_seed(3)
    fresh = fs.shard(TinyGPT(), policy=fs.wrap.by_size(1500))
    extra = ckpt.load(f"{root}/a", model=fresh)
    loaded = fs.full_state_dict(fresh)
    same = all(torch.equal(loaded[k], before[k]) for k in before) if before else True
    return {"in_flight": in_flight, "same": same, "extra": extra, "ordered": done_before_third}


def test_async_save_snapshots_and_lets_training_continue(dist_pools, tmp_path):
    for r in dist_pools(2).run(case_async, str(tmp_path)):
        assert r["in_flight"]  # save returned before the files were committed
        assert r["same"] and r["extra"] == {"n": 1} and r["ordered"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "c"


def case_bad_extra() -> str:
    torch.manual_seed(0)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block))
    extra = {"ok": 1} if dist.get_rank() == 0 else {"bad": object()}
    try:
        ckpt.save("/nonexistent/never-written", model=model, extra=extra)
    except TypeError as err:
        return str(err)
    return "no error"


def test_bad_extra_on_one_rank_raises_everywhere(dist_pools):
    for message in dist_pools(2).run(case_bad_extra):
        assert "rank 1" in message and "extra['bad'] has type object" in message
