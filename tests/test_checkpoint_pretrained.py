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
from patching import patched_attr


def _trained(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The HF test model ``name``, sharded, after one SGD step on this rank's rows."""
    case = CASES[name]
    torch.manual_seed(0)
    model = fs.shard(case.build(), policy=case.policy())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    world, rank = dist.get_world_size(), dist.get_rank()
    batch = case.batch(torch.Generator().manual_seed(1), 2 * world)
    case.loss(model, batch.chunk(world)[rank]).backward()
    opt.step()
    return model, opt


def case_save_pretrained(name: str, out: str, max_shard_size: str) -> dict | None:
    """Shard the HF model, take one SGD step, save_pretrained; rank 0: the sharded model's
    logits on a probe batch (every rank runs the forward)."""
    case = CASES[name]
    model, _ = _trained(name)
    written = fs.save_pretrained(model, out, max_shard_size=max_shard_size)
    probe = case.batch(torch.Generator().manual_seed(2), 2)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    return (
        {"logits": logits, "written": str(written), "probe": probe}
        if dist.get_rank() == 0
        else None
    )


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


def case_load_pretrained(name: str, path: str) -> dict:
    """fs.load of a save_pretrained directory into a fresh sharded model at this world size;
    the elements each rank read from the files, and how many its fragments hold."""
    from flatshard.checkpoint import sliced

    case = CASES[name]
    torch.manual_seed(7)  # other initial values: everything must come from the files
    model = fs.shard(case.build(), policy=case.policy())
    read: list[int] = []
    original = sliced._Files.read

    def counting(self, file, tensor_name, start, out):
        read.append(out.numel())
        return original(self, file, tensor_name, start, out)

    with patched_attr(sliced._Files, "read", counting):
        assert fs.load(path, model=model) == {}
    own = sum(
        end - start for start, end in (i.flat_range for i in fs.fragment_info(model).values())
    )
    persistent = model.state_dict().keys()  # non-persistent buffers are in no file
    buffers = sum(b.numel() for n, b in model.named_buffers() if n in persistent)
    return {"full": fs.full_state_dict(model), "read": sum(read), "own": own + buffers}


def test_each_rank_reads_only_its_own_fragments_of_a_pretrained_dir(dist_pools, tmp_path):
    out = tmp_path / "qwen2"
    dist_pools(2).run(case_save_pretrained, "hf_qwen2", str(out), "20KB")
    reference = None
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(out).state_dict()
    results = dist_pools(3).run(case_load_pretrained, "hf_qwen2", str(out))
    full = results[0]["full"]
    assert set(full) == set(reference)
    assert all(torch.equal(full[k], v) for k, v in reference.items())
    total = sum(v.numel() for k, v in reference.items() if k != "lm_head.weight")
    for r in results:  # exactly its own fragments: no rank reads the model
        assert r["read"] == r["own"] < total, (r["read"], r["own"], total)


def case_save_checkpoint(name: str, ckpt_dir: str, hf_dir: str) -> None:
    """The same trained model as case_save_pretrained, saved both ways."""
    model, opt = _trained(name)
    fs.save(ckpt_dir, model=model, optimizer=opt)
    fs.save_pretrained(model, hf_dir)


def test_flatshard_export_hf_writes_what_from_pretrained_loads(dist_pools, tmp_path):
    from transformers import AutoModelForCausalLM

    from flatshard.tools import cli

    ckpt_dir, hf_dir, out = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "exported"
    dist_pools(2).run(case_save_checkpoint, "hf_qwen2", str(ckpt_dir), str(hf_dir))
    args = ["export", str(ckpt_dir), str(out), "--hf", "--config", str(hf_dir)]
    assert cli.main([*args, "--max-shard-size", "20KB"]) == 0
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    probe = CASES["hf_qwen2"].batch(torch.Generator().manual_seed(2), 2)
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=probe).logits
        b = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(input_ids=probe).logits
    assert torch.equal(a, b)
    assert cli.main(["export", str(ckpt_dir), str(out), "--hf"]) == 2  # --config is required


def test_sliced_reads_refuse_damaged_safetensors_files(tmp_path):
    from safetensors.torch import save_file

    from flatshard.checkpoint import sliced

    good = tmp_path / "good.safetensors"
    save_file({"w": torch.arange(12.0).reshape(3, 4)}, str(good))
    with sliced._Files() as files:
        out = torch.empty(5, dtype=torch.float64)  # another dtype: read, then cast
        files.read(good, "w", 3, out)
        assert out.tolist() == [3.0, 4.0, 5.0, 6.0, 7.0]
    data = good.read_bytes()
    bad = {
        "truncated": data[:-8],
        "header length": (1 << 40).to_bytes(8, "little") + data[8:],
        "header json": data[:8] + b"{" * 8 + data[16:],
    }
    for what, raw in bad.items():
        path = tmp_path / f"{what}.safetensors"
        path.write_bytes(raw)
        with sliced._Files() as files, pytest.raises(ValueError, match=str(path)):
            files.read(path, "w", 0, torch.empty(12))


def test_sliced_reads_any_range_and_a_placed_block(tmp_path):
    """Every flat range of a 3-D tensor (read, then cast), and the fragment of a block at an
    offset of the stored tensor (a TP shard), hold the stored elements."""
    from safetensors.torch import save_file

    from flatshard.checkpoint import sliced

    whole = torch.arange(3 * 4 * 5, dtype=torch.float32).reshape(3, 4, 5)
    path = tmp_path / "w.safetensors"
    save_file({"w": whole}, str(path))
    flat = whole.reshape(-1)
    with sliced._Files() as files:
        for start in range(0, 60, 7):
            for end in (start, start + 1, min(start + 13, 60), 60):
                out = torch.full((end - start,), -1.0, dtype=torch.float64)  # read, then cast
                files.read(path, "w", start, out)
                assert torch.equal(out, flat[start:end].double()), (start, end)
        block = whole[1:3, 1:4, 2:5]  # a local block at origin (1, 1, 2)
        out = torch.zeros(block.numel() - 4)  # the fragment: the block's elements from 4 on
        info = sliced.ParamInfo("w", out, 4, block.numel(), whole.shape, block.shape, (1, 1, 2))
        sliced._read_placed(files, path, "w", info)
        assert torch.equal(out, block.reshape(-1)[4:])
