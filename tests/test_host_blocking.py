"""Nothing blocks the host in a steady-state step on a device backend (issue 34, goal 2).

Under ``strict_async`` (flatshard's NCCL path on the CPU) and the virtual compute device,
``flatshard.testing.host_sync.HostSyncs`` counts per step what would block the host under
NCCL: collectives on Gloo side groups, host reads of compute-device tensors, blocking copies
either way, ``wait(timeout)`` and CUDA synchronizes made by flatshard's code. From the second
step on there must be none, in every configuration; the first step may have some (first-step
planning). What a feature needs as torch's own equivalent does (fs.GradScaler's found-inf
check, ``error_if_nonfinite``, the CPU offload's wait for the gradients' copies, the usage read
of a rank that did not use a parameter) is counted apart, and pinned here per configuration.

The usage semantics on that path: a parameter unused on every rank keeps ``.grad is None``,
one used on some ranks gets the average, an MoE whose experts change from rank to rank and
step to step matches one process on the global batch (``case_usage``).
"""

from __future__ import annotations

import pytest

from host_blocking_cases import Config, config_dicts
from nccl_pool import run_cases, strict_pools  # noqa: F401 (the fixture)

MODEL = "the model's own code"
USAGE = "usage read"
OFFLOAD = "offload: the host waits"
OFFLOAD_CLIP = "offload clip"
SCALER = "fs.GradScaler's found-inf check"
NONFINITE = "clip error_if_nonfinite"
OFFLOAD_ADAFACTOR = "offload Adafactor"

CONFIGS = [
    Config("full_shard"),
    Config("shard_grad_op", strategy="shard_grad_op"),
    Config("no_shard", strategy="no_shard"),
    Config("hybrid_shard", world=4, strategy="hybrid_shard"),
    Config("full_shard world 3", world=3),
    Config("bf16", precision="bf16"),
    Config("fp16 GradScaler", precision="fp16", expect=(SCALER,)),
    Config("offload", offload=True, expect=(OFFLOAD,)),
    Config("offload bf16 clip", model="lora", offload=True, precision="bf16", clip="clip",
           expect=(OFFLOAD, OFFLOAD_CLIP)),
    Config("offload adafactor", model="unused", offload=True, optimizer="adafactor",
           expect=(OFFLOAD, OFFLOAD_ADAFACTOR, OFFLOAD_ADAFACTOR, USAGE)),
    Config("prefetch 0", prefetch=(0, "none"), coalesce=False),
    Config("prefetch 2 post", prefetch=(2, "post"), coalesce=False),
    Config("activation checkpointing", recompute=True),
    Config("no_sync unsharded", micro=2),
    Config("no_sync sharded", micro=2, keep="sharded", strategy="shard_grad_op"),
    Config("not coalesced", coalesce=False),
    Config("nested units", model="gpt_nested_units"),
    Config("reused unit", model="reused_unit"),
    Config("muon", optimizer="muon"),
    Config("adafactor", optimizer="adafactor"),
    Config("adafactor hybrid", world=4, strategy="hybrid_shard", optimizer="adafactor"),
    Config("clip", clip="clip"),
    Config("clip error_if_nonfinite", clip="nonfinite", expect=(NONFINITE,)),
    Config("unused parameters", model="unused", expect=(USAGE,)),
    Config("MoE expert parallel", world=4, model="moe_ep", clip="clip", allow=(MODEL,)),
    Config("pipeline 1F1B", world=4, model="pp", clip="clip"),
    Config("tensor parallel", world=4, model="tp", clip="clip"),
    Config("compiled blocks", compiled=True),
]  # fmt: skip
WORLDS = sorted({c.world for c in CONFIGS})


USAGE_RUNS = {2: "full_shard", 4: "hybrid_shard"}  # case_usage per world


@pytest.fixture(scope="module")
def steps(strict_pools):  # noqa: F811
    """Per world, every rank's results of that world's configurations and usage case."""
    done: dict[int, list] = {}

    def get(world: int) -> list:
        if world not in done:
            mine = config_dicts([c for c in CONFIGS if c.world == world])
            job = [(c["label"], "host_blocking_cases", "case_steps", (c,)) for c in mine]
            if world in USAGE_RUNS:
                job.append(("usage", "host_blocking_cases", "case_usage", (USAGE_RUNS[world],)))
            done[world] = strict_pools(world).run(run_cases, job)
        return done[world]

    return get


def _ran(per_rank: list[dict], label: str) -> list[dict]:
    out = []
    for rank, r in enumerate(per_rank):
        got = r[label]
        assert got["error"] is None, f"{label} rank {rank}:\n{got['error']}"
        assert got["report"]["violations"] == [], got["report"]["violations"]
        assert got["report"]["never_waited"] == [], got["report"]["never_waited"]
        out.append(got["result"])
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=[c.label for c in CONFIGS])
def test_nothing_blocks_the_host_after_the_first_step(steps, config):
    for rank, result in enumerate(_ran(steps(config.world), config.label)):
        for n, step in enumerate(result["steps"][1:], start=2):
            assert step["blocking"] == [], f"{config.label} rank {rank} step {n}: {step}"
            for reason in set(config.expect):  # counted apart: as often as listed
                hits = sum(v for k, v in step["separate"].items() if reason in k)
                assert hits == config.expect.count(reason), (config.label, rank, n, reason, step)
            known = (*config.expect, *config.allow)
            unexpected = [k for k in step["separate"] if not any(e in k for e in known)]
            assert unexpected == [], (config.label, rank, n, step)


# ---- the usage semantics on the device path ------------------------------------------------------
def _usage(steps, world: int) -> list[dict]:
    return _ran(steps(world), "usage")


def _reads(record: dict) -> int:
    return sum(v for k, v in record["separate"].items() if USAGE in k)


@pytest.mark.parametrize("world", sorted(USAGE_RUNS))
def test_usage_is_exact_on_the_device_path(steps, world):
    """Unused everywhere -> None; used on one rank -> the average (the reference's gradient
    of the mean loss); MoE experts that change by rank and step -> as one process."""
    for rank, result in enumerate(_usage(steps, world)):
        for model, run in result.items():
            for n, step in enumerate(run["steps"]):
                where = f"{model} rank {rank} step {n}"
                assert step["none_mismatch"] == [], f"{where}: None-ness {step}"
                assert step["err"] <= 1e-5, f"{where}: {step}"  # house tolerance
        for n, step in enumerate(result["branches"]["steps"]):
            nones = {name.split(".")[0] for name in step["none"]}
            assert nones == ({"never", "odd"} if n % 2 == 0 else {"never"}), (rank, n, step)


def test_moe_experts_change_by_rank_and_step(steps):
    per_rank = [r["moe"]["steps"] for r in _usage(steps, 2)]
    used = [[set(s["experts"]) for s in run] for run in per_rank]  # [rank][step]
    assert any(used[0][n] != used[1][n] for n in range(len(used[0]))), used
    assert any(u[0] != u[1] for u in used), used
    one_rank = [(used[0][n] ^ used[1][n]) for n in range(len(used[0]))]
    assert any(one_rank), f"no expert used on one rank only: {used}"
    nobody = [s["none"] for s in per_rank[0]]
    assert all(nobody), f"no expert unused everywhere: {used}"


@pytest.mark.parametrize("world", sorted(USAGE_RUNS))
def test_only_a_rank_that_left_a_parameter_unused_reads_the_flags(steps, world):
    """Nothing blocking on the usage path; one read per step on a rank with a parameter it
    did not use, none on a rank that used them all (all_branches, odd steps, rank 0)."""
    for rank, result in enumerate(_usage(steps, world)):
        for model, run in result.items():
            assert all(s["blocking"] == [] for s in run["syncs"]), (model, rank, run["syncs"])
        reads = [_reads(s) for s in result["all_branches"]["syncs"]]
        assert reads == ([1, 0, 1] if rank == 0 else [1, 1, 1]), (rank, reads)
        assert [_reads(s) for s in result["branches"]["syncs"]] == [1, 1, 1], rank
