"""A tensor-parallel model built on the meta device is initialised with the numbers of the same
model without tensor parallelism (``core/meta_init.py``: a TP parameter is drawn whole, then cut
to its TP-local block).

Drawn as DTensors on a CPU mesh, every tp rank drew its block from the same generator state:
the blocks were copies of one another (a symmetric start that training never breaks) and the
numbers depended on the tp degree. Checked on every rank, for a transformers Llama (its own
``_init_weights``) and for torch's ``parallelize_module`` plan on plain linears
(``reset_parameters``): at world 2 (tp 2 against dp 2) and world 4 (dp 2 x tp 2 against dp 4).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn


class Stack(nn.Module):
    """Two colwise / rowwise linear pairs (Megatron's MLP layout) and a replicated norm."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(8, 16) for _ in range(2))
        self.down = nn.ModuleList(nn.Linear(16, 8) for _ in range(2))
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.up, self.down, strict=True):
            x = x + down(torch.relu(up(x)))
        return self.norm(x)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _stack() -> nn.Module:
    with torch.device("meta"):
        return Stack()


def _tp_stack(model: nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {f"up.{i}": ColwiseParallel() for i in range(2)}
    plan |= {f"down.{i}": RowwiseParallel() for i in range(2)}
    parallelize_module(model, tp_mesh, plan)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole tensor, on every rank."""
    import flatshard as fs

    with fs.summon_full_params(model, writeback=False):
        return {
            name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()
        }


def case_tp_meta_init_equals_plain(tp: int) -> dict:
    """{model: [names whose whole tensor differs between tp and no tp, and whether the TP
    blocks of the first tp-sharded weight (cut along its shard dim) are copies of each other]}
    on this rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import flatshard as fs
    from flatshard.models.tensor_parallel import parallelize_hf
    from flatshard.parallel.tensor import tp_parameters

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    builds = {"llama": (_llama, lambda m: parallelize_hf(m, mesh["tp"])),
              "stack": (_stack, lambda m: _tp_stack(m, mesh["tp"]))}  # fmt: skip
    out = {}
    for name, (build, make_tp) in builds.items():
        torch.manual_seed(0)
        plain = build()
        fs.shard(plain)  # data parallel over the whole world, no TP
        torch.manual_seed(0)
        parallel = build()
        make_tp(parallel)
        split, dim = next((n, pl.dim) for n, spec in tp_parameters(parallel).items()
                          for pl in spec.placements if pl.is_shard())  # fmt: skip
        fs.shard(parallel, mesh=mesh)  # dp x tp: flatshard shards over dp
        want, got = _full_params(plain), _full_params(parallel)
        halves = got[split].chunk(tp, dim=dim)
        out[name] = {
            "differ": [k for k in want if not torch.equal(want[k], got[k])],
            "blocks_equal": all(torch.equal(halves[0], h) for h in halves[1:]),
        }
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_tp_meta_model_starts_from_the_plain_models_numbers(dist_pools, world):
    pytest.importorskip("transformers")
    ranks = dist_pools(world).run(case_tp_meta_init_equals_plain, 2)
    assert len(ranks) == world
    for rank, result in enumerate(ranks):
        assert set(result) == {"llama", "stack"}
        for model, found in result.items():
            assert found["differ"] == [], (rank, model, found["differ"])
            assert not found["blocks_equal"], (rank, model)
