"""``flatshard bench``: the ratio arithmetic, option forwarding, fp32 vs bf16 on a tiny model
in the worker pool, and one tiny launch (no timing asserted)."""

from __future__ import annotations

import json
import types

import pytest

from flatshard.tools import bench
from flatshard.tools.bench import ratio_table

TINY = ["--dim", "32", "--layers", "2", "--heads", "2", "--vocab", "64", "--batch", "2"]
TINY += ["--seq", "16"]


def test_ratio_table_drops_warmup_and_pairs_rounds():
    times = {
        "flatshard": [9.0, 9.0, 1.0, 2.0, 6.0],
        "fsdp2": [9.0, 9.0, 2.0, 2.0, 4.0],
        "local": [9.0, 9.0, 1.0, 1.0, 2.0],
    }
    r = ratio_table(times, warmup=2)
    assert set(r) == {"flatshard/fsdp2", "flatshard/local", "fsdp2/local"}  # no ddp: skipped
    assert r["flatshard/fsdp2"]["of_medians"] == pytest.approx(2.0 / 2.0)
    assert r["flatshard/fsdp2"]["paired_median"] == pytest.approx(1.0)  # median of .5, 1, 1.5
    assert r["flatshard/local"]["of_medians"] == pytest.approx(2.0 / 1.0)
    assert r["flatshard/local"]["paired_median"] == pytest.approx(2.0)  # median of 1, 2, 3


@pytest.mark.slow
def test_bench_cli_tiny_launch(tmp_path, capsys):
    """Two ranks under torchrun, a 2-block model, 3 rounds (~15 s on this box)."""
    from flatshard.tools.cli import main

    out = tmp_path / "bench.json"
    argv = ["bench", "--steps", "3", "--dim", "32", "--layers", "2", "--heads", "2"]
    assert main([*argv, "--vocab", "64", "--batch", "2", "--seq", "16", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["modes"]) == {"flatshard", "fsdp2", "ddp", "local"}
    assert len(data["ratios"]) == 4 and data["world"] == 2
    assert data["config"]["precision"] == "fp32"  # the default
    for mode in ("flatshard", "fsdp2"):  # same init and data as DDP: same losses
        assert data["modes"][mode]["max_loss_diff_vs_ddp"] < 1e-5
    assert data["flatshard_comm"]["steady"] and data["flatshard_comm"]["calls"]["all_gather"] > 0
    mem = data["flatshard_memory"]  # flatshard's own accounting, rank 0
    # AdamW: m and v per shard element, plus a 4-byte step counter per parameter
    assert mem["shard_bytes"] > 0 and 0 <= mem["optimizer_bytes"] - 2 * mem["shard_bytes"] < 4096
    # Two tiny blocks share one bucket, one unit with a private buffer (no staging, no
    # pool): between steps nothing stays gathered.
    assert mem["gathered_peak_bytes"] > mem["gathered_now_bytes"] == 0
    assert "flatshard/fsdp2" in capsys.readouterr().out


def _fake_run(launches: list[list[str]]):
    """Stands in for ``subprocess.run``: records the worker's argv, writes a minimal JSON."""

    def run(cmd, env, check):
        argv = cmd[cmd.index("flatshard.tools.bench") + 1 :]
        launches.append(argv)
        args = bench.parse_args(argv)
        times = [1.0] * args.steps
        mode = {"median_step_s": 1.0, "tokens_per_s_rank": 1.0, "times_s": times}
        out = {"config": vars(args), "world": args.nproc, "ratios": {}, "modes": {}}
        out["modes"] = {m: mode for m in (bench.MODES if args.mode == "all" else [args.mode])}
        out.update(rss_mb_ranks=[1.0, 1.0], rss_before_models_mb=[1.0, 1.0])
        with open(args.json, "w") as f:
            json.dump(out, f)

    return run


def test_every_option_reaches_every_launch(patched_attr, capsys):
    """The main launch and each ``--memory`` launch parse to the user's options."""
    launches: list[list[str]] = []
    argv = [*TINY, "--seed", "3", "--precision", "bf16", "--memory"]
    with patched_attr(bench, "subprocess", types.SimpleNamespace(run=_fake_run(launches))):
        assert bench.main(argv) == 0
    assert len(launches) == 1 + len(bench.MODES)
    given = vars(bench.parse_args(argv))
    per_launch = {"steps", "mode", "json", "memory", "worker", "quiet"}
    for argv_seen in launches:
        seen = vars(bench.parse_args(argv_seen))
        assert {k: v for k, v in seen.items() if k not in per_launch} == {
            k: v for k, v in given.items() if k not in per_launch
        }
    assert "precision=bf16" in capsys.readouterr().out


def case_fp32_and_bf16() -> dict:
    """The same tiny bench in fp32 and in bf16, in this pool's process group."""
    return {p: bench.run_bench(bench.parse_args([*TINY, "--steps", "4", "--precision", p]))
            for p in bench.PRECISIONS}  # fmt: skip


def test_bf16_computes_in_bf16_and_tracks_ddp(dist_pools):
    """bf16: every mode stays close to DDP under autocast, flatshard gathers bf16 (half the
    bytes) but reduces in fp32 and keeps fp32 shards and AdamW state."""
    runs = dist_pools(2).run(case_fp32_and_bf16)[0]
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert fp32["config"]["precision"] == "fp32" and bf16["config"]["precision"] == "bf16"
    for mode in ("flatshard", "fsdp2"):
        assert fp32["modes"][mode]["max_loss_diff_vs_ddp"] < 1e-5
        assert bf16["modes"][mode]["max_loss_diff_vs_ddp"] < 0.05
    for mode in bench.MODES:  # same weights and batch at step 0: only bf16 moved the loss
        shift = abs(bf16["modes"][mode]["losses"][0] - fp32["modes"][mode]["losses"][0])
        assert 0 < shift < 0.05, f"{mode}: first loss moved by {shift} in bf16"
    sent = {p: runs[p]["flatshard_comm"]["bytes"] for p in runs}
    assert sent["bf16"]["all_gather"] * 2 == sent["fp32"]["all_gather"]
    assert sent["bf16"]["reduce_scatter"] == sent["fp32"]["reduce_scatter"]  # fp32 reduce
    mem = {p: runs[p]["flatshard_memory"] for p in runs}
    # gathered parameters halve; the pooled scratch of the blocks' bucket (fp32 gradient
    # chunks, counted as gathered) does not
    assert mem["bf16"]["gathered_peak_bytes"] < mem["fp32"]["gathered_peak_bytes"]
    for key in ("shard_bytes", "optimizer_bytes"):  # fp32 master shards and AdamW state
        assert mem["bf16"][key] == mem["fp32"][key]
