"""``flatshard estimate --pp/--schedule/--microbatches`` and ``--experts/--top-k/--ep``: every
expectation follows from the formulas of ``tools/estimate/bubble.py`` (its Note), none is a
recorded output."""

from __future__ import annotations

import json

import pytest

from flatshard.tools.estimate import main
from flatshard.tools.estimate.bubble import bubble_fraction, expert_traffic, held_microbatches


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_bubble_of_gpipe_and_1f1b_is_p_minus_1_over_m_plus_p_minus_1(schedule):
    assert bubble_fraction(schedule, 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(schedule, 8, 32) == pytest.approx(7 / 39)
    assert bubble_fraction(schedule, 1, 4) == 0.0
    # more microbatches, smaller bubble
    assert bubble_fraction(schedule, 4, 16) < bubble_fraction(schedule, 4, 8)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS"])
def test_interleaving_divides_the_fill_by_the_stages_per_rank(schedule):
    assert bubble_fraction(schedule, 4, 8, 2) == pytest.approx(1.5 / 9.5)
    assert bubble_fraction(schedule, 4, 8, 1) == bubble_fraction("1F1B", 4, 8)
    assert bubble_fraction(schedule, 4, 8, 4) < bubble_fraction(schedule, 4, 8, 2)


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_zero_bubble_schedules_fill_the_bubble_once_m_reaches_p(schedule):
    assert bubble_fraction(schedule, 4, 8, 2) == 0.0
    assert bubble_fraction(schedule, 4, 4, 2) == 0.0
    assert bubble_fraction(schedule, 4, 2, 2) > 0.0  # too few microbatches to fill with


def test_1f1b_holds_fewer_activations_than_gpipe():
    assert held_microbatches("GPipe", 4, 16) == 16
    assert held_microbatches("1F1B", 4, 16) == 4
    assert held_microbatches("1F1B", 4, 2) == held_microbatches("GPipe", 4, 2) == 2
    # interleaving holds (p - 1) / v microbatches more than 1F1B
    assert held_microbatches("Interleaved1F1B", 4, 16, 2) == pytest.approx(4 + 1.5)


def test_expert_traffic_scales_with_top_k_and_vanishes_without_ep():
    kw = {"tokens": 4096, "hidden": 1024, "act_bytes": 2, "moe_layers": 8}
    one = expert_traffic(top_k=1, ep=4, **kw)
    two = expert_traffic(top_k=2, ep=4, **kw)
    assert two.bus_bytes == pytest.approx(2 * one.bus_bytes)
    assert one.all_to_alls == 8 * 4  # dispatch + combine, forward and backward
    assert one.bus_bytes == pytest.approx(32 * 4096 * 1024 * 2 * 3 / 4)
    assert expert_traffic(top_k=2, ep=1, **kw).bus_bytes == 0.0
    assert expert_traffic(top_k=1, ep=4, act_ckpt=True, **kw).all_to_alls == 8 * 6


def _json(args: list[str], capsys) -> dict:
    assert main([*args, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_pipeline_section(capsys):
    base = ["--model", "1b", "--world", "4", "--batch", "8"]
    plain = _json(base, capsys)
    out = _json([*base, "--pp", "4", "--microbatches", "8", "--schedule", "1F1B"], capsys)
    p = out["pipeline_and_experts"]["pipeline"]
    assert p["bubble"] == pytest.approx(3 / 11)
    assert p["step_s"] == pytest.approx(plain["time"]["step_s"] / 4 / (1 - 3 / 11))
    assert p["stage_activations"] == pytest.approx(plain["memory_bytes"]["activations"] / 4 / 8 * 4)
    gpipe = _json([*base, "--pp", "4", "--microbatches", "8", "--schedule", "GPipe"], capsys)
    assert gpipe["pipeline_and_experts"]["pipeline"]["stage_activations"] > p["stage_activations"]
    assert main([*base, "--pp", "4", "--microbatches", "8"]) == 0
    assert "bubble" in capsys.readouterr().out


def test_cli_expert_traffic_adds_to_the_step(capsys):
    base = ["--model", "small", "--world", "8", "--experts", "8"]
    k1 = _json([*base, "--top-k", "1", "--ep", "4"], capsys)["pipeline_and_experts"]
    k2 = _json([*base, "--top-k", "2", "--ep", "4"], capsys)["pipeline_and_experts"]
    assert k2["experts"]["bus_bytes"] == pytest.approx(2 * k1["experts"]["bus_bytes"])
    assert k2["step_s"] > k1["step_s"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pp", "4", "--microbatches", "3", "--batch", "8"], "--microbatches 3 does not divide"),
        (["--ep", "2"], "--ep 2 needs --experts"),
        (["--experts", "6", "--ep", "4"], "--ep 4 must divide --experts 6"),
        (["--pp", "64"], "needs at least 64 layers"),
    ],
)
def test_cli_refuses_bad_layouts(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "small", "--world", "2", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
