"""SIGKILL at random points of checkpoint saves: the previous checkpoint always survives, and
``latest_checkpoint`` never returns a partial one (issue 8, item 4).

    OMP_NUM_THREADS=1 .venv/bin/python bench/fault_save.py --trials 20

Each trial forks two ranks (world 2, Gloo, from this already-imported process: a trial costs
about a second, not a torch import) that save back to back: weights set to a known function of
the save number ``k``, then a save with ``extra={"step": k}``, rank 0 logging each ``k`` known to
be complete. Modes rotate: ``sync`` (the trainer's CheckpointManager: step_k, keep 2),
``async`` (the same, background saves), ``overwrite`` (fs.save to one path again and again).
After a random delay both ranks are SIGKILLed (a random one first). Then a fresh process loads
``latest_checkpoint`` at world 1 under another wrap plan and checks: it loads, every tensor
equals the weights of its ``k``, and ``k`` is not older than the newest logged as complete.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import time
import traceback
import zlib
from collections import Counter
from pathlib import Path

import fault_common as fc
import torch
from torch import nn

MODES = ("sync", "async", "overwrite")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    """Embedding, 3 blocks, head: ~60K parameters in 4 units."""

    def __init__(self, d: int = 48) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.blocks = nn.Sequential(*(Block(d) for _ in range(3)))
        self.head = nn.Linear(d, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(idx)))


def expected(name: str, shape: torch.Size, k: int) -> torch.Tensor:
    """The value of parameter ``name`` in save number ``k``."""
    base = zlib.crc32(name.encode()) % 97
    return (torch.arange(shape.numel(), dtype=torch.float32) * 1e-4 + k + 0.01 * base).view(shape)


def _join(root: Path, rank: int, world: int, store: str) -> None:
    import torch.distributed as dist

    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/{store}", rank=rank, world_size=world
    )


def saver(root: Path, rank: int, mode: str) -> None:
    """One rank of the saving job: save forever (until killed)."""
    import flatshard as fs
    from flatshard.tools.train.checkpointing import CheckpointManager

    _join(root, rank, 2, "store")
    model = fs.shard(Net(), policy=fs.wrap.by_type(Block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    opt.step()  # AdamW state exists: the saves hold optimizer shards too
    manager = CheckpointManager(
        root / "ckpt", every=1, keep=2, async_save=mode == "async", rank=rank
    )
    k = 0
    while True:
        k += 1
        with fs.summon_full_params(model), torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(expected(name, p.shape, k))
        if mode == "overwrite":
            fs.save(root / "ckpt" / "latest", model=model, optimizer=opt, extra={"step": k})
        else:
            manager.save(k, model, opt, {"step": k})
        complete = k - 1 if mode == "async" else k  # an async save k is still in flight
        if rank == 0 and complete > 0:
            with open(root / "done.log", "a") as f:
                f.write(f"{complete}\n")
                f.flush()
                os.fsync(f.fileno())


def verify(root: Path) -> dict:
    """Load the newest complete checkpoint at world 1 under another wrap plan and check it."""
    import flatshard as fs
    from flatshard.checkpoint import latest_checkpoint

    _join(root, 0, 1, "verify_store")
    latest = latest_checkpoint(root / "ckpt")
    if latest is None:
        return {"ok": False, "why": "latest_checkpoint found nothing"}
    model = fs.shard(Net(), policy=fs.wrap.by_size(10_000))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    extra = fs.load(latest, model=model, optimizer=opt)
    k = int(extra["step"])
    state = fs.full_state_dict(model)
    bad = [n for n, t in state.items() if not torch.equal(t, expected(n, t.shape, k))]
    return {"ok": not bad, "step": k, "path": latest.name, "why": f"differs: {bad[:3]}"}


def _fork(fn, *args) -> int:
    """Run ``fn(*args)`` in a forked child; its result (or traceback) goes to a JSON file."""
    pid = os.fork()
    if pid:
        return pid
    root = args[0]
    try:
        result = fn(*args)
        code = 0
    except BaseException:
        result, code = {"ok": False, "why": traceback.format_exc()[-1500:]}, 1
    (root / f"result_{os.getpid()}.json").write_text(json.dumps(result))
    os._exit(code)


def _interrupted(ckpt: Path) -> str:
    """What the kill interrupted, from the partial directory it left (if any)."""
    partial = [p for p in ckpt.glob("*.tmp-*") if p.is_dir()] if ckpt.is_dir() else []
    if not partial:
        return "between saves or in pruning"
    names = {p.name for p in partial[0].iterdir()}
    if "MANIFEST.json" in names:
        return "after the manifest, before the rename"
    if "flatshard.json" in names:
        return "after the description, before the manifest"
    if any(n.endswith(".distcp") for n in names):
        return "writing data files"
    return "before any file"


def _done(root: Path) -> int:
    log = root / "done.log"
    return max((int(x) for x in log.read_text().split()), default=0) if log.exists() else 0


def trial(base: Path, index: int, rng: random.Random, window_s: float) -> dict:
    root = base / f"trial{index}"
    root.mkdir()
    mode = MODES[index % len(MODES)]
    pids = [_fork(saver, root, rank, mode) for rank in (0, 1)]
    deadline = time.monotonic() + 120
    while _done(root) < 2:  # two saves complete: there is a previous checkpoint to lose
        if time.monotonic() > deadline or any(os.waitpid(p, os.WNOHANG)[0] for p in pids):
            raise RuntimeError(f"trial {index}: the savers failed: {list(root.glob('result_*'))}")
        time.sleep(0.01)
    time.sleep(rng.uniform(0, window_s))
    victim = rng.randrange(2)
    os.kill(pids[victim], signal.SIGKILL)
    time.sleep(rng.uniform(0, 0.02))
    os.kill(pids[1 - victim], signal.SIGKILL)
    for pid in pids:
        os.waitpid(pid, 0)
    done = _done(root)
    where = _interrupted(root / "ckpt")
    checker = _fork(verify, root)
    os.waitpid(checker, 0)
    result = json.loads((root / f"result_{checker}.json").read_text())
    newest_ok = done <= result.get("step", -1) <= done + 2
    return {"mode": mode, "killed_rank_first": victim, "complete_before_kill": done,
            "interrupted": where, **result, "survived": result["ok"] and newest_ok}  # fmt: skip


def _warm_up() -> None:
    """Import and run once here what every forked rank needs (a first AdamW step alone imports
    ~1 s of modules): each fork then starts warm."""
    import flatshard.checkpoint
    import flatshard.tools.train.checkpointing  # noqa: F401

    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randint(0, 256, (2, 8))).sum().backward()
    opt.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window-s", type=float, default=0.4, help="kill within this after 2 saves")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = p.parse_args()
    _warm_up()

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="fault_save_") as tmp:
        results = [trial(Path(tmp), i, rng, args.window_s) for i in range(args.trials)]
    summary = {
        "trials": len(results),
        "survived": sum(r["survived"] for r in results),
        "interrupted": dict(Counter(r["interrupted"] for r in results)),
    }
    fc.report(results, summary, as_json=args.json)


if __name__ == "__main__":
    main()
