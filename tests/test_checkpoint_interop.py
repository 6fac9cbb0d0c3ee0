"""flatshard checkpoints are standard DCP checkpoints: torch's own tools read them.

- ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` on an ``fs.save`` directory
  gives the unsharded model's tensors (same keys, full shapes, same values);
- a torch FSDP2 model (``fully_shard``) at another world size loads it with ``dcp.load`` +
  ``set_model_state_dict`` and holds exactly the saved parameters (the tied embedding/head
  included: a tied parameter is stored under each of its names, as torch's DCP does);
- checkpoints written in the version-1 layout (each parameter a 1-D tensor of its numel) still
  load into flatshard.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import flatshard as fs
import flatshard.checkpoint as ckpt
from flatshard.checkpoint import commit, planner
from flatshard.checkpoint import contents as layout
from parity_models import CASES, Block, TinyGPT, named_param_groups
from patching import patched_attr

_loss = CASES["gpt_tied"].loss


def _trained(world_rows: int = 6) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_type(Block))
    opt = torch.optim.AdamW(named_param_groups(model), lr=1e-2)
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in range(2):
        batch = CASES["gpt_tied"].batch(torch.Generator().manual_seed(step), world_rows)
        _loss(model, batch.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def case_save(path: str, version: int) -> dict:
    """Save after two steps (``version=1``: in the old 1-D layout). Per rank: the full state
    dict (rank 0, else {}) and each parameter's exp_avg fragment with its flat range."""
    model, opt = _trained()
    if version == 1:
        flat_chunks = planner.Sharded.chunks
        v1_key = functools.partial(layout.optim_key, version=1)
        with (
            patched_attr(layout, "optim_key", lambda name, key, version=2: v1_key(name, key)),
            patched_attr(
                planner.Sharded, "chunks", lambda self, flat=False: flat_chunks(self, True)
            ),
            patched_attr(planner.Sharded, "global_size", property(lambda s: torch.Size([s.numel]))),
            patched_attr(commit, "VERSION", 1),
        ):
            ckpt.save(path, model=model, optimizer=opt)
    else:
        ckpt.save(path, model=model, optimizer=opt)
    info = fs.fragment_info(model)
    moments = {n: (i.flat_range, opt.state[i.fragment]["exp_avg"].clone()) for n, i in info.items()}
    return {"full": fs.full_state_dict(model), "moments": moments}


def _assemble(results: list[dict], shapes: dict) -> dict[str, torch.Tensor]:
    """Full exp_avg per parameter from every rank's fragments."""
    out = {}
    for name, shape in shapes.items():
        full = torch.zeros(shape).reshape(-1)
        for r in results:
            (start, end), piece = r["moments"][name]
            full[start:end] = piece
        out[name] = full.view(shape)
    return out


@pytest.fixture(scope="module")
def saved(dist_pools, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("interop")
    out = {}
    for version in (1, 2):
        path = str(root / f"v{version}")
        results = dist_pools(2).run(case_save, path, version)
        full = results[0]["full"]
        moments = _assemble(results, {n: full[n].shape for n in results[0]["moments"]})
        out[version] = (path, full, moments)
    return out


def test_torch_dcp_to_torch_save_reads_the_unsharded_state_dict(saved, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, reference, moments = saved[2]
    dcp_to_torch_save(path, tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    model_keys = {k: v for k, v in plain.items() if not k.startswith("optimizer.")}
    assert set(model_keys) == set(reference)
    for key, value in reference.items():
        assert model_keys[key].shape == value.shape and torch.equal(model_keys[key], value), key
    exp_avg = plain["optimizer.state.blocks.0.qkv.weight.exp_avg"]
    assert torch.equal(exp_avg, moments["blocks.0.qkv.weight"])
    assert plain["optimizer.param_groups.0.lr"] == 1e-2


def case_fsdp2_load(path: str) -> dict | None:
    """A torch FSDP2 model and its AdamW at this world size read the flatshard checkpoint
    (model FQNs at the top level and ``optimizer.*``: torchtitan's layout)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(5)  # other initial values: everything must come from the checkpoint
    model = TinyGPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(named_param_groups(model), lr=0.5)  # lr comes from the file
    sd = {**get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, sd.pop("optimizer"))
    set_model_state_dict(model, sd)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_full = get_model_state_dict(model, options=full)  # rank 0 holds it, others {}
    optim_full = get_optimizer_state_dict(model, opt, options=full)
    lrs = [g["lr"] for g in opt.param_groups]
    if dist.get_rank() != 0:
        return None
    return {"model": model_full, "optim": optim_full["state"], "lr": lrs}


@pytest.mark.parametrize("world", [1, 3])
def test_torch_fsdp2_loads_a_flatshard_checkpoint(dist_pools, saved, world):
    path, reference, moments = saved[2]
    r = dist_pools(world).run(case_fsdp2_load, path)[0]
    assert set(r["model"]) == set(reference)
    for key, value in reference.items():
        assert torch.equal(r["model"][key], value), key
    for name, exp_avg in moments.items():  # the optimizer state too, by FQN
        assert torch.equal(r["optim"][name]["exp_avg"], exp_avg), name
    assert r["lr"] == [1e-2, 1e-2]  # the param groups' hyperparameters from the checkpoint


def case_flatshard_load(path: str) -> dict | None:
    torch.manual_seed(5)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_size(1500))
    opt = torch.optim.AdamW(named_param_groups(model), lr=1e-2)
    ckpt.load(path, model=model, optimizer=opt)
    full = fs.full_state_dict(model)
    return full if dist.get_rank() == 0 else None


@pytest.mark.parametrize("version", [1, 2])
def test_both_layouts_load_into_flatshard_at_another_world_and_plan(dist_pools, saved, version):
    path, reference, _ = saved[version]
    full = dist_pools(3).run(case_flatshard_load, path)[0]
    assert all(torch.equal(full[k], v) for k, v in reference.items())


@pytest.mark.harness
def test_the_version_1_checkpoint_really_is_the_old_layout(saved):
    from flatshard.checkpoint.reading import open_checkpoint

    shapes = {}
    for version in (1, 2):
        opened = open_checkpoint(saved[version][0])
        shapes[version] = opened.metadata.state_dict_metadata["blocks.0.qkv.weight"].size
    assert shapes[1] == torch.Size([shapes[2].numel()]) and len(shapes[2]) == 2


# ---- others' checkpoints into flatshard -------------------------------------------------------


def case_fsdp2_save(root: str) -> dict | None:
    """A torch FSDP2 run (2 AdamW steps at this world size) saved the three usual ways; rank
    0 returns the full model and optimizer state as torch reports them."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    world, rank = dist.get_world_size(), dist.get_rank()
    for step in range(2):
        batch = CASES["gpt_tied"].batch(torch.Generator().manual_seed(step), 6)
        _loss(model, batch.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=f"{root}/nested")  # torch docs
    dcp.save({**msd, "optimizer": osd}, checkpoint_id=f"{root}/flat")  # torchtitan's layout
    dcp.save({"model": msd}, checkpoint_id=f"{root}/accelerate/pytorch_model_fsdp_0")
    dcp.save({"optimizer": osd}, checkpoint_id=f"{root}/accelerate/optimizer_0")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_full = get_model_state_dict(model, options=full)
    optim_full = get_optimizer_state_dict(model, opt, options=full)
    return {"model": model_full, "optim": optim_full["state"]} if rank == 0 else None


def case_load_foreign(path: str) -> dict:
    """fs.load of a foreign directory at this world size; per rank: the full state dict
    (rank 0), and each parameter's exp_avg fragment with its flat range."""
    torch.manual_seed(5)
    model = fs.shard(TinyGPT(), policy=fs.wrap.by_size(1500))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match="without checksums"):
        extra = ckpt.load(path, model=model, optimizer=opt)
    info = fs.fragment_info(model)
    moments = {n: (i.flat_range, opt.state[i.fragment]["exp_avg"].clone()) for n, i in info.items()}
    steps = {float(s["step"]) for s in opt.state.values()}
    return {"full": fs.full_state_dict(model), "moments": moments, "steps": steps, "extra": extra}


@pytest.fixture(scope="module")
def fsdp2_saved(dist_pools, tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("fsdp2"))
    return root, dist_pools(2).run(case_fsdp2_save, root)[0]


@pytest.mark.parametrize(
    ("layout", "world"), [("nested", 3), ("flat", 3), ("accelerate", 3), ("nested", 1), ("flat", 2)]
)
def test_fsdp2_torchtitan_and_accelerate_checkpoints_load_into_flatshard(
    dist_pools, fsdp2_saved, layout, world
):
    root, reference = fsdp2_saved
    results = dist_pools(world).run(case_load_foreign, f"{root}/{layout}")
    full = results[0]["full"]
    assert set(full) == set(reference["model"])
    for key, value in reference["model"].items():
        assert torch.equal(full[key], value), key
    for name in reference["model"]:
        if name == "head.proj.weight":  # tied to emb.weight: one parameter, one state
            continue
        want = reference["optim"][name]["exp_avg"].reshape(-1)
        got = torch.zeros_like(want)
        for r in results:
            (start, end), piece = r["moments"][name]
            got[start:end] = piece
        assert torch.equal(got, want), name
    assert all(r["steps"] == {2.0} and r["extra"] == {} for r in results)
