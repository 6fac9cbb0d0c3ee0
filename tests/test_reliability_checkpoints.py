"""Issue 8, items 4 and 5: interrupted saves and bad checkpoints.

4. SIGKILL at random points of back-to-back saves (``bench/fault_save.py``, a few trials here,
   20 in docs/reliability.md): the previous checkpoint survives every time and
   ``latest_checkpoint`` returns one that loads and holds exactly what was saved. An overwrite
   killed between its two renames leaves the old copy, which ``latest_checkpoint`` then returns.
5. Damaged checkpoints (beyond tests/test_checkpoint_safety.py): a missing shard file, each kind
   of file truncated, a flipped byte in the metadata, another model (other shapes): each is a
   ``ValueError`` on every rank that names the file or the parameter.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flatshard as fs
import flatshard.checkpoint as ckpt
from parity_models import Block, TinyGPT

BENCH = Path(__file__).parents[1] / "bench"
CI_TRIALS = 6  # two per mode; bench/fault_save.py --trials 20 for the full figure


def test_killed_saves_never_lose_the_previous_checkpoint():
    cmd = [sys.executable, str(BENCH / "fault_save.py"), "--trials", str(CI_TRIALS), "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    failed = [r for r in report["results"] if not r["survived"]]
    assert not failed, failed
    assert report["summary"]["survived"] == CI_TRIALS


def case_save(path: str, step: int, dim: int = 24) -> None:
    torch.manual_seed(step)
    model = fs.shard(TinyGPT(d=dim), policy=fs.wrap.by_type(Block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 50, (2, 12))).sum().backward()
    opt.step()
    ckpt.save(path, model=model, optimizer=opt, extra={"step": step})


def case_load(path: str, dim: int = 24) -> str | dict:
    """``extra`` if ``path`` loads into a TinyGPT of width ``dim``, else the error message."""
    model = fs.shard(TinyGPT(d=dim), policy=fs.wrap.by_size(1500))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        return ckpt.load(path, model=model, optimizer=opt)
    except ValueError as err:
        return str(err)


@pytest.fixture(scope="module")
def pristine(dist_pools, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reliability_ckpt") / "ckpt"
    dist_pools(2).run(case_save, str(path), 1)
    return path


def test_overwrite_killed_between_its_renames_keeps_the_previous(dist_pools, tmp_path, pristine):
    root = tmp_path / "checkpoints"
    root.mkdir()
    # the state commit() leaves when killed between os.replace(path, old) and
    # os.replace(tmp, path): the previous checkpoint set aside, the new one complete in .tmp-
    shutil.copytree(pristine, root / "latest.old-0123abcd")
    dist_pools(2).run(case_save, str(tmp_path / "new"), 2)
    os.replace(tmp_path / "new", root / "latest.tmp-4567ef01")
    assert ckpt.latest_checkpoint(root) == root / "latest.old-0123abcd"
    assert dist_pools(2).run(case_load, str(root / "latest.old-0123abcd")) == [{"step": 1}] * 2
    dist_pools(2).run(case_save, str(root / "latest"), 3)  # the next save cleans up
    assert sorted(p.name for p in root.iterdir()) == ["latest"]
    assert ckpt.latest_checkpoint(root) == root / "latest"


def test_missing_shard_file_is_named(dist_pools, copy_of):
    (copy_of / "__1_0.distcp").unlink()
    for message in dist_pools(2).run(case_load, str(copy_of)):
        assert "__1_0.distcp is missing" in message, message


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("__0_0.distcp", "has {n} bytes, the manifest says"),
        (".metadata", "has {n} bytes, the manifest says"),
        ("flatshard.json", "has {n} bytes, the manifest says"),
        ("MANIFEST.json", "is unreadable"),
    ],
)
def test_truncated_files_are_named(dist_pools, copy_of, name, expected):
    target = copy_of / name
    data = target.read_bytes()
    target.write_bytes(data[: len(data) // 2])
    for message in dist_pools(2).run(case_load, str(copy_of)):
        assert f"{name} {expected.format(n=len(data) // 2)}" in message, message


def test_flipped_byte_in_the_metadata_is_named(dist_pools, copy_of):
    target = copy_of / ".metadata"
    data = bytearray(target.read_bytes())
    data[len(data) // 3] ^= 0x10
    target.write_bytes(bytes(data))
    for message in dist_pools(2).run(case_load, str(copy_of)):
        assert ".metadata is corrupted" in message, message


def test_another_model_names_the_parameter(dist_pools, pristine):
    for message in dist_pools(2).run(case_load, str(pristine), 32):  # saved with d=24
        assert "'emb.weight' has shape [53, 24] in the checkpoint, [53, 32] here" in message, (
            message
        )
