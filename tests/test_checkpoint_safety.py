"""Damaged and hostile checkpoints: a flipped byte, a truncated file, a malicious pickle in the
DCP metadata or in a tensor file, partial saves. Each must be refused with a clear error on
every rank, before anything runs or is half-loaded.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import flatshard as fs
import flatshard.checkpoint as ckpt
from flatshard.checkpoint import safety
from flatshard.checkpoint.reading import PICKLED
from parity_models import Block, TinyGPT


def case_save(path: str) -> None:
    torch.manual_seed(0)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 50, (2, 12))).sum().backward()
    opt.step()
    ckpt.save(path, model=model, optimizer=opt, extra={"step": 1})


def case_load_error(path: str) -> str | None:
    """The ValueError message load raises (None if it loads)."""
    torch.manual_seed(1)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_size(1500))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        ckpt.load(path, model=model, optimizer=opt)
    except ValueError as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def pristine(dist_pools, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("safety") / "ckpt"
    dist_pools(2).run(case_save, str(path))
    return path


def _reseal(path: Path, name: str) -> None:
    """Update the manifest entry of ``name`` as an attacker would (checksums are no signature)."""
    manifest = json.loads((path / "MANIFEST.json").read_text())
    manifest["files"][name] = safety.describe_file(path / name)
    (path / "MANIFEST.json").write_text(json.dumps(manifest))


def test_intact_checkpoint_loads(dist_pools, pristine):
    assert dist_pools(2).run(case_load_error, str(pristine)) == [None, None]


def test_flipped_byte_is_detected_on_every_rank(dist_pools, copy_of):
    target = copy_of / "__1_0.distcp"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    for message in dist_pools(2).run(case_load_error, str(copy_of)):
        assert "__1_0.distcp" in message and "corrupted" in message
    with pytest.raises(ValueError, match=r"__1_0\.distcp is corrupted"):
        ckpt.export_checkpoint(copy_of, copy_of.parent / "out.safetensors")
    assert not (copy_of.parent / "out.safetensors").exists()


def test_truncated_file_is_detected(dist_pools, copy_of):
    target = copy_of / "__0_0.distcp"
    target.write_bytes(target.read_bytes()[:-10])
    for message in dist_pools(2).run(case_load_error, str(copy_of)):
        assert "__0_0.distcp" in message and "truncated" in message


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_metadata_pickle_is_refused_and_never_runs(dist_pools, copy_of, tmp_path):
    marker = tmp_path / "pwned"
    (copy_of / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    _reseal(copy_of, ".metadata")
    for message in dist_pools(2).run(case_load_error, str(copy_of)):
        assert "refusing to load" in message and "system" in message
    with pytest.raises(ValueError, match="refusing to load"):
        ckpt.export_checkpoint(copy_of, tmp_path / "out.safetensors")
    assert not marker.exists()


def test_malicious_object_nested_in_real_metadata_is_refused(copy_of, tmp_path):
    marker = tmp_path / "pwned"
    data = (copy_of / ".metadata").read_bytes()
    metadata = safety.SafeUnpickler(io.BytesIO(data)).load()
    metadata.storage_meta.modules = [_Evil(marker)]
    (copy_of / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match=r"refusing to load.*not allowed"):
        files = {"__0_0.distcp", "__1_0.distcp"}
        safety.read_metadata(copy_of / ".metadata", files, allow_objects=PICKLED)
    assert not marker.exists()


def test_malicious_tensor_file_is_refused(copy_of, tmp_path):
    """A tensor entry whose bytes are a pickle of something else: DCP's reader uses
    ``torch.load(weights_only=True)``, so it is refused and never runs."""
    marker = tmp_path / "pwned"
    files = {"__0_0.distcp", "__1_0.distcp"}
    metadata = safety.read_metadata(copy_of / ".metadata", files, allow_objects=PICKLED)
    index, info = next(
        (i, s) for i, s in metadata.storage_data.items() if not i.fqn.startswith("optimizer.")
    )  # a model tensor, which the export reads
    path = copy_of / info.relative_path
    evil = _torch_save_bytes(_Evil(marker))
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(evil)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(evil))
    (copy_of / ".metadata").write_bytes(pickle.dumps(metadata))
    _reseal(copy_of, info.relative_path)
    _reseal(copy_of, ".metadata")
    with pytest.raises(ValueError, match=r"refusing to load.*posix.system"):
        ckpt.export_checkpoint(copy_of, tmp_path / "out.safetensors")
    assert not marker.exists()


def _torch_save_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_partial_saves_are_ignored(pristine, tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    assert ckpt.latest_checkpoint(root) is None
    for name in ("step1", "step2", "step3.tmp-0123abcd", "step4"):
        shutil.copytree(pristine, root / name)
    (root / "step3.tmp-0123abcd" / "MANIFEST.json").unlink()  # killed before the commit
    (root / "step4" / "MANIFEST.json").unlink()  # a directory that is no checkpoint
    manifest = json.loads((root / "step2" / "MANIFEST.json").read_text())
    manifest["created_ns"] += 10**9
    (root / "step2" / "MANIFEST.json").write_text(json.dumps(manifest))
    assert ckpt.latest_checkpoint(root) == root / "step2"
    for name in ("step3.tmp-0123abcd", "step4"):
        with pytest.raises(ValueError, match="not a complete flatshard checkpoint"):
            ckpt.loader.open_checkpoint(root / name)
    with pytest.raises(ValueError, match="does not exist"):
        ckpt.loader.open_checkpoint(root / "nope")


def case_mismatches(path: str) -> dict:
    out = {}
    model = fs.shard(TinyGPT(layers=2), policy=fs.wrap.by_type(Block))
    try:
        ckpt.load(path, model=model)
    except ValueError as err:
        out["model"] = str(err)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest}])
    try:
        ckpt.load(path, model=model, optimizer=opt)
    except ValueError as err:
        out["optimizer"] = str(err)
    return out


def test_loading_into_another_model_or_optimizer_is_refused(dist_pools, pristine):
    for r in dist_pools(2).run(case_mismatches, str(pristine)):
        assert "does not match the model" in r["model"] and "blocks.2" in r["model"]
        assert "1 param groups, this one 2" in r["optimizer"]


def test_pickled_entries_are_allowed_only_for_the_optimizer_param_groups(copy_of):
    """flatshard writes the param groups as pickled entries for torch's tools (and never reads
    them); any other pickled entry in its own checkpoint is refused."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    files = {"__0_0.distcp", "__1_0.distcp"}
    metadata = safety.read_metadata(copy_of / ".metadata", files, allow_objects=PICKLED)
    assert any(
        isinstance(md, BytesStorageMetadata) and k.startswith(PICKLED)
        for k, md in metadata.state_dict_metadata.items()
    )
    metadata.state_dict_metadata["emb.weight"] = BytesStorageMetadata()
    (copy_of / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match=r"'emb.weight' is a pickled object"):
        safety.read_metadata(copy_of / ".metadata", files, allow_objects=PICKLED)
