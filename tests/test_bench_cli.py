"""``flatshard bench``: the ratio arithmetic, and one tiny launch (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from flatshard.bench import ratio_table


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
    from flatshard.cli import main

    out = tmp_path / "bench.json"
    argv = ["bench", "--steps", "3", "--dim", "32", "--layers", "2", "--heads", "2"]
    assert main([*argv, "--vocab", "64", "--batch", "2", "--seq", "16", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["modes"]) == {"flatshard", "fsdp2", "ddp", "local"}
    assert len(data["ratios"]) == 4 and data["world"] == 2
    for mode in ("flatshard", "fsdp2"):  # same init and data as DDP: same losses
        assert data["modes"][mode]["max_loss_diff_vs_ddp"] < 1e-5
    assert data["flatshard_comm"]["steady"] and data["flatshard_comm"]["calls"]["all_gather"] > 0
    mem = data["flatshard_memory"]  # flatshard's own accounting, rank 0
    # AdamW: m and v per shard element, plus a 4-byte step counter per parameter
    assert mem["shard_bytes"] > 0 and 0 <= mem["optimizer_bytes"] - 2 * mem["shard_bytes"] < 4096
    assert mem["gathered_peak_bytes"] >= mem["gathered_now_bytes"] > 0  # pooled buffers kept
    assert "flatshard/fsdp2" in capsys.readouterr().out
