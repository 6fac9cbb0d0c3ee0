"""``fs.save_pretrained`` on real transformers models: ``from_pretrained`` loads the directory
and computes the same logits as the sharded model; large models split into indexed files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import flatshard as fs
from flatshard.checkpoint.pretrained import parse_size
from parity_models import CASES


def case_save_pretrained(name: str, out: str, max_shard_size: str) -> dict | None:
    """Shard the HF model, take one SGD step, save_pretrained; rank 0: the sharded model's
    logits on a probe batch (every rank runs the forward)."""
    case = CASES[name]
    torch.manual_seed(0)
    model = fs.shard(case.build(), policy=case.policy())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    world, rank = dist.get_world_size(), dist.get_rank()
    batch = case.batch(torch.Generator().manual_seed(1), 2 * world)
    case.loss(model, batch.chunk(world)[rank]).backward()
    opt.step()
    written = fs.save_pretrained(model, out, max_shard_size=max_shard_size)
    probe = case.batch(torch.Generator().manual_seed(2), 2)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    return {"logits": logits, "written": str(written), "probe": probe} if rank == 0 else None


@pytest.mark.parametrize(
    ("name", "world", "max_shard_size"),
    [("hf_llama", 2, "5GB"), ("hf_qwen2", 3, "20KB")],  # qwen2: tied, and split into files
)
def test_from_pretrained_loads_what_save_pretrained_wrote(
    dist_pools, tmp_path, name, world, max_shard_size
):
    from transformers import AutoModelForCausalLM

    out = tmp_path / name
    r = dist_pools(world).run(case_save_pretrained, name, str(out), max_shard_size)[0]
    assert r["written"] == str(out)
    assert (out / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = loaded(input_ids=r["probe"]).logits
    assert torch.equal(logits, r["logits"])
    files = sorted(p.name for p in out.glob("*.safetensors"))
    if max_shard_size == "5GB":
        assert (
            files == ["model.safetensors"] and not (out / "model.safetensors.index.json").exists()
        )
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(files) > 1 and set(index["weight_map"].values()) == set(files)
        assert "lm_head.weight" not in index["weight_map"]  # tied: stored once
        assert (
            index["metadata"]["total_size"]
            == sum(p.numel() * p.element_size() for p in loaded.state_dict().values())
            - loaded.lm_head.weight.numel() * 4
        )


def test_shard_sizes_parse_like_transformers():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("5GiB") == 5 * 2**30
    assert parse_size("500MB") == 500 * 10**6 and parse_size(1234) == 1234
    for bad in ("5 parsecs", "0", -1):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def test_save_pretrained_needs_a_transformers_model(dist_pools):
    assert all(dist_pools(2).run(case_not_transformers))


def case_not_transformers() -> bool:
    model = fs.shard(torch.nn.Sequential(torch.nn.Linear(3, 3)))
    try:
        fs.save_pretrained(model, "/nonexistent")
    except TypeError as e:
        return "export_safetensors" in str(e)
    return False


def test_written_file_metadata_is_pt(tmp_path, dist_pools):
    from safetensors import safe_open

    out = tmp_path / "m"
    dist_pools(2).run(case_save_pretrained, "hf_llama", str(out), "5GB")
    with safe_open(str(Path(out) / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
