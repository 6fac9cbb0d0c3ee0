"""Full export (checkpoint or live model -> one safetensors file) and import (a full file ->
sharded model), checked against ``fs.full_state_dict`` and a plain ``load_state_dict``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import flatshard as fs
import flatshard.checkpoint as ckpt
from flatshard.tools import cli
from parity_models import Block, LoRALinear, LoRAModel, TinyGPT


def _train(model, opt, steps: int) -> None:
    for step in range(steps):
        x = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(step))
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()


def case_save_and_export(root: str) -> dict | None:
    torch.manual_seed(0)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    ckpt.save(f"{root}/ckpt", model=model, optimizer=opt)
    written = ckpt.export_safetensors(model, f"{root}/live.safetensors")
    full = fs.full_state_dict(model)
    return {"full": full, "written": str(written)} if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def exported(dist_pools, tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("export")
    result = dist_pools(2).run(case_save_and_export, str(root))[0]
    assert result["written"] == str(root / "live.safetensors")
    return root, result["full"]


def test_export_cli_loads_into_a_plain_model_and_equals_full_state_dict(exported):
    root, full = exported
    assert cli.main(["export", str(root / "ckpt"), str(root / "cli.safetensors")]) == 0
    for name in ("cli.safetensors", "live.safetensors"):
        sd = load_file(root / name)
        assert list(sd) == list(full) or set(sd) == set(full)
        plain = TinyGPT()
        plain.load_state_dict(sd)  # strict: every key, full shapes, tied names included
        assert plain.head.proj.weight is plain.emb.weight
        for key, value in plain.state_dict().items():
            assert torch.equal(value, full[key]), (name, key)
    assert not list(root.glob("*.tmp-*"))


def test_export_in_small_batches_gives_the_same_tensors(exported):
    root, full = exported
    out = ckpt.export_checkpoint(root / "ckpt", root / "small.safetensors", batch_bytes=1)
    sd = load_file(out)
    assert all(torch.equal(sd[k], full[k]) for k in full)


def test_export_cli_reports_a_missing_checkpoint(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path / "nope"), str(tmp_path / "x.safetensors")]) == 1
    assert "does not exist" in capsys.readouterr().err


def case_import(path: str, how: str = "from_file") -> dict | None:
    torch.manual_seed(9)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_size(1500))
    if how == "old_order":  # the pre-0.2 spelling keeps working, with a DeprecationWarning
        with pytest.warns(DeprecationWarning, match="path first"):
            ckpt.load_full_state_dict_from_file(model, path)
    elif how == "fs_load":  # fs.load recognises a state-dict file
        assert fs.load(path, model=model) == {}
    else:
        ckpt.load_full_state_dict_from_file(path, model=model)
    full = fs.full_state_dict(model)
    return full if dist.get_rank() == 0 else None


def test_import_from_safetensors_and_torch_files_at_world_3(dist_pools, exported):
    root, full = exported
    plain = {k: v for k, v in full.items() if k != "head.proj.weight"}  # tied key left out
    torch.save(plain, root / "plain.pt")
    ways = [("live.safetensors", "from_file"), ("plain.pt", "from_file"), ("plain.pt", "old_order")]
    ways += [("live.safetensors", "fs_load"), ("plain.pt", "fs_load")]
    for name, how in ways:
        loaded = dist_pools(3).run(case_import, str(root / name), how)[0]
        assert set(loaded) == set(full)
        assert all(torch.equal(loaded[k], full[k]) for k in full), name


def case_import_error(path: str) -> str:
    model = fs.shard(TinyGPT(layers=2), policy=fs.wrap.by_type(Block))
    try:
        ckpt.load_full_state_dict_from_file(path, model=model)
    except ValueError as err:
        return str(err)
    return "no error"


def test_import_errors_are_raised_on_every_rank(dist_pools, exported, tmp_path):
    root, _ = exported
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    for message in dist_pools(2).run(case_import_error, str(root / "live.safetensors")):
        assert "unexpected" in message or "blocks.2" in message
    for message in dist_pools(2).run(case_import_error, str(bad)):
        assert "cannot read" in message and "bad.safetensors" in message


def case_lora_round_trip(root: str, save: bool) -> dict | None:
    """Frozen parameters are saved and loaded like the others; the optimizer holds only the
    trainable ones and its state follows them."""
    torch.manual_seed(0 if save else 4)
    model = fs.shard(LoRAModel(), policy=fs.wrap.by_type(LoRALinear))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if save:
        for step in range(2):
            x = torch.randn(4, 19, generator=torch.Generator().manual_seed(step))
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        ckpt.save(f"{root}/lora", model=model, optimizer=opt)
    else:
        ckpt.load(f"{root}/lora", model=model, optimizer=opt)
    full = fs.full_state_dict(model)
    steps = sorted({float(s["step"]) for s in opt.state.values()})
    return {"full": full, "steps": steps} if dist.get_rank() == 0 else None


def test_frozen_parameters_round_trip(dist_pools, tmp_path):
    saved = dist_pools(2).run(case_lora_round_trip, str(tmp_path), True)[0]
    loaded = dist_pools(3).run(case_lora_round_trip, str(tmp_path), False)[0]
    assert loaded["steps"] == saved["steps"] == [2.0]
    assert all(torch.equal(loaded["full"][k], v) for k, v in saved["full"].items())
