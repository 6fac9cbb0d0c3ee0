"""``--grad-accum``: an optimizer step of several micro-batches under
``fs.no_sync(keep="unsharded")`` (``tools/estimate/accumulate.py``), each figure by hand, and
NeMo's rows that use it (``published.py``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flatshard.tools.estimate import DEVICES, Layout, Phase, Precision, Workload, main
from flatshard.tools.estimate.accumulate import (
    accumulated_grad_bytes,
    accumulated_peak,
    accumulated_step,
    check_grad_accum,
)
from flatshard.tools.estimate.memory import estimate_memory
from flatshard.tools.estimate.published import (
    LLAMA_8B,
    NEMO_8B,
    NEMO_70B,
    PUBLISHED,
    estimate_run,
)
from flatshard.tools.estimate.steptime import estimate_time

H100 = DEVICES["h100"]
MP = Precision("bf16", "fp32")
LAY = Layout(4, cp=2, precision=MP)  # NeMo's LLAMA3-8B row: 8 GPUs, DP 4 x CP 2
WORK = Workload(1, 8192, fused_norm=True, compile=True, float8=True)
# Llama 3 8B's units, none padded over 8 ranks: the embedding, the final norm + head, a block
# (q, k, v, o: 4096 x (4096 + 1024 + 1024 + 4096); w1, w2, w3: 3 x 4096 x 14336; two norms).
ROOT, TAIL = 128256 * 4096, 4096 + 128256 * 4096
BLOCK = 4096 * 10240 + 3 * 4096 * 14336 + 2 * 4096
FLAT = ROOT + TAIL + 32 * BLOCK


def test_unit_sizes_by_hand():
    assert (ROOT, TAIL, BLOCK, FLAT) == (525_336_576, 525_340_672, 218_112_000, 8_030_261_248)
    assert LLAMA_8B.params == FLAT


def test_an_accumulating_micro_batch_gathers_and_reduces_nothing():
    """Inside no_sync every unit is still gathered in forward and backward (full_shard
    reshards whatever the mode); the reduce-scatter runs once, in the last micro-batch."""
    last = estimate_time(LLAMA_8B, LAY, WORK, H100)
    accum = estimate_time(LLAMA_8B, LAY, WORK, H100, reduce=False)
    assert accum.all_gather_bytes == last.all_gather_bytes > 0
    assert accum.compute_s == last.compute_s and accum.cp_exposed_s == last.cp_exposed_s
    assert accum.reduce_scatter_bytes == 0 and accum.all_reduce_bytes == 0
    assert last.reduce_scatter_bytes == pytest.approx(FLAT * 4 * 7 / 8)  # fp32, 8 ranks
    assert last.reduce_scatter_bytes == pytest.approx(28_105_914_368)


def test_the_reduction_is_paid_once_per_step():
    """The 8 GPUs are one node (360 GB/s): the root's and the tail's reduce-scatters are
    exposed (10.21 ms), 90 % of the rest (67.86 ms) hides under 355 ms of compute; so the last
    micro-batch is 10.21 + 6.79 = 17.0 ms longer than an accumulating one, and a step of 32 is
    31 accumulating micro-batches and one last."""
    last = estimate_time(LLAMA_8B, LAY, WORK, H100)
    accum = estimate_time(LLAMA_8B, LAY, WORK, H100, reduce=False)
    exposed = (ROOT + TAIL) * 4 * 7 / 8 / 360e9
    rest = FLAT * 4 * 7 / 8 / 360e9 - exposed
    assert exposed == pytest.approx(0.010215, rel=1e-4) and rest == pytest.approx(0.067857, 1e-4)
    assert last.comm_s < last.compute_s  # the overlap fits: only (1 - 0.9) of the rest shows
    assert last.step_s - accum.step_s == pytest.approx(exposed + 0.1 * rest)
    step = accumulated_step(LLAMA_8B, LAY, WORK, H100, 32)
    assert step.step_s == pytest.approx(31 * accum.step_s + last.step_s)
    assert step.tokens_per_s == pytest.approx(32 * 8192 / step.step_s / 2)  # cp 2 GPUs
    assert step.tokens_per_s > last.tokens_per_s  # one reduction instead of 32
    assert accumulated_step(LLAMA_8B, LAY, WORK, H100, 1).step_s == last.step_s


def test_the_accumulated_gradients_stay_beside_every_phase_but_the_optimizer_step():
    """keep="unsharded" holds every unit's flat gradient in the reduce dtype (fp32): the
    whole model's, 8,030,261,248 x 4 bytes = 29.92 GiB per GPU."""
    held = accumulated_grad_bytes(LLAMA_8B, LAY, WORK)
    assert held == FLAT * 4 == 32_121_044_992
    mem = estimate_memory(LLAMA_8B, LAY, WORK)
    assert mem.peak_phase != "optimizer step"
    assert accumulated_peak(mem, held) == mem.peak + held
    assert accumulated_peak(mem, held) / 2**30 == pytest.approx(69.09, abs=0.01)
    # at the optimizer step the reductions have freed them
    opt = Phase("optimizer step", {"x": 10 * held})
    top = dataclasses.replace(mem, phases=(*mem.phases, opt))
    assert accumulated_peak(top, held) == 10 * held
    bf16 = Layout(4, cp=2, precision=Precision("bf16"))  # flatshard's default reduce dtype
    assert accumulated_grad_bytes(LLAMA_8B, bf16, WORK) == FLAT * 2


def test_tp_holds_its_share():
    tp = Layout(2, tp=4, precision=MP)
    held = accumulated_grad_bytes(LLAMA_8B, tp, Workload(1, 8192))
    assert held == pytest.approx(FLAT * 4 / 4, rel=1e-4)  # norms replicated: a few KiB more


def test_nemo_8b_row_by_hand():
    """NeMo 24.07, DGX-H100: LLAMA3-8B on 8 GPUs, GBS 128, MBS 1, CP 2: DP 4, GA 128/4 = 32."""
    assert NEMO_8B in PUBLISHED and NEMO_8B.grad_accum == 128 // (1 * 4)
    assert NEMO_8B.layout.gpus == 8 and NEMO_8B.tokens_per_s == 12273
    last = estimate_time(LLAMA_8B, LAY, WORK, H100)
    accum = estimate_time(LLAMA_8B, LAY, WORK, H100, reduce=False)
    est = estimate_run(NEMO_8B)
    assert est.tokens_per_s == pytest.approx(32 * 8192 / (31 * accum.step_s + last.step_s) / 2)
    assert est.tokens_per_s == pytest.approx(11_122, abs=1)  # -9.4 %
    assert est.peak_gib == pytest.approx(69.09, abs=0.01) and est.reserved_gib is None


def test_nemo_70b_pipeline_kept_gathered_and_regathered():
    """LLAMA3-70B on 64 GPUs: TP 4, PP 4, CP 2, VP 5, so DP 2 and 128 / 2 = 64 microbatches
    through an interleaved schedule of 5 stages per rank: bubble (3/5) / (64 + 3/5). As the
    trainer runs it (fs.pipeline_step(keep_gathered=True)) only the last microbatch gathers;
    regathering every microbatch over dp x cp = 4 ranks on two nodes is comm-bound."""
    run = NEMO_70B
    assert run in PUBLISHED and run.keep_gathered
    assert run.microbatches == run.grad_accum == 128 // 2 and run.stages_per_rank == 5
    assert run.layout.gpus * run.pp == 64
    lay, work = run.layout, run.work
    last = estimate_time(run.spec, lay, work, H100)
    kept = estimate_time(run.spec, lay, work, H100, reduce=False, gather=False)
    regathered = estimate_time(run.spec, lay, work, H100, reduce=False)
    assert kept.exposed_comm_s == 0 and kept.compute_s == regathered.compute_s
    assert regathered.exposed_comm_s > regathered.compute_s / 2  # gathers across nodes
    bubble = (3 / 5) / (64 + 3 / 5)

    def tokens(accum) -> float:
        step = (63 * accum.step_s + last.step_s) / 4 / (1 - bubble)
        return 64 * 8192 / step / 32

    assert estimate_run(run).tokens_per_s == pytest.approx(tokens(kept))
    assert tokens(kept) == pytest.approx(1274, abs=1)  # -16.4 % of 1,524
    regather = dataclasses.replace(run, keep_gathered=False)
    assert estimate_run(regather).tokens_per_s == pytest.approx(tokens(regathered))
    assert tokens(regathered) == pytest.approx(830, abs=1)  # -45.5 %


def test_refusals():
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="--grad-accum"):
            check_grad_accum(bad)
    assert check_grad_accum(3) == 3


M8 = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--ffn",
      "14336", "--vocab", "128256", "--seq", "8192", "--world", "4", "--cp", "2",
      "--compile", "--float8", "--reduce-dtype", "fp32", "--gpu", "h100"]  # fmt: skip


def test_cli_grad_accum_gives_the_row(capsys):
    assert main([*M8, "--grad-accum", "32", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    acc = data["grad_accum"]
    assert acc["microbatches"] == 32 and acc["tokens_per_s"] == pytest.approx(
        estimate_run(NEMO_8B).tokens_per_s
    )
    assert acc["accumulated_grad_bytes"] == FLAT * 4
    assert acc["peak"] == data["memory_bytes"]["peak"] + FLAT * 4
    assert main([*M8, "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["grad_accum"] is None
    assert main([*M8, "--grad-accum", "32"]) == 0
    out = capsys.readouterr().out
    assert 'fs.no_sync(keep="unsharded")' in out
    assert "fit: allocated peak with the accumulated gradients 69.1 GiB fits" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--grad-accum", "0"], "--grad-accum 0: give the micro-batches per optimizer step"),
        (["--grad-accum", "2", "--pp", "2", "--batch", "2"], "the schedule's --microbatches"),
    ],
)
def test_cli_refuses(capsys, extra, message):
    with pytest.raises(SystemExit):
        main(["--model", "1b", *extra])
    assert message in capsys.readouterr().err
