"""fs.save at world 2, fs.load at world 3: fs.optim.Muon and fs.optim.Adafactor continue as the
unsharded torch optimizers do.

Muon's state (``momentum_buffer``) is fragment-shaped, so the checkpoint reshards it like a
parameter; Adafactor's ``row_var``/``col_var`` are whole on every rank (torch's shapes), stored
once, and loaded whole at any world size; its 1-D ``variance`` is fragment-shaped. The unsharded
reference's own state travels with ``torch.save`` beside the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import flatshard as fs
from test_optim_whole_param import RUNS
from whole_param_parity import build_run, report, train

ROWS = 6  # a global batch both worlds split evenly
MODEL = "gpt_tied"


def _run(label: str):
    make, make_ref, select, handoff = RUNS[label]
    return build_run(MODEL, "full_shard", make, make_ref, select), handoff


def case_save(root: str) -> None:
    for label in ("muon", "adafactor"):
        run, handoff = _run(label)
        train(run, range(2), handoff, ROWS)
        path = Path(root) / label
        fs.save(path, model=run.model, optimizer=run.opt)
        if dist.get_rank() == 0:
            torch.save(
                {"ref": run.ref.state_dict(), "ref_opt": run.ref_opt.state_dict()},
                Path(root) / f"{label}.ref.pt",
            )
        dist.barrier()


def case_resume(root: str) -> dict:
    out = {}
    for label in ("muon", "adafactor"):
        run, handoff = _run(label)
        fs.load(Path(root) / label, model=run.model, optimizer=run.opt)
        saved = torch.load(Path(root) / f"{label}.ref.pt", weights_only=True)
        run.ref.load_state_dict(saved["ref"])
        run.ref_opt.load_state_dict(saved["ref_opt"])
        loaded = report(run)  # the loaded state alone, before any step
        train(run, range(2, 4), handoff, ROWS)
        out[label] = dict(loaded=loaded, after=report(run))
    return out


def test_save_at_world_2_load_at_world_3_continues_like_torch(dist_pools, tmp_path):
    dist_pools(2).run(case_save, str(tmp_path))
    results = dist_pools(3).run(case_resume, str(tmp_path))
    print()
    for label, r in results[0].items():
        for when in ("loaded", "after"):
            e = r[when]
            print(f"  {label:10s} {when:7s} params {e['sd_err']:.1e} state {e['state_err']:.1e}")
            assert e["sd_err"] <= 1e-5 and e["state_err"] <= 1e-5, (label, when, e)
    assert any(r["muon"]["after"]["empty"] for r in results), "no empty matrix fragment"


def _combined(model: torch.nn.Module) -> fs.optim.Combined:
    matrices, others = fs.optim.muon_split(model)
    adamw = torch.optim.AdamW(others, lr=1e-3)
    return fs.optim.Combined(adamw, fs.optim.Muon(matrices, lr=0.02))


def test_combined_is_one_optimizer_for_schedulers_and_state_dicts():
    from parity_models import TinyGPT

    torch.manual_seed(0)
    model, twin = TinyGPT(layers=1), TinyGPT(layers=1)
    twin.load_state_dict(model.state_dict())
    opt, twin_opt = _combined(model), _combined(twin)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5)
    assert [g["lr"] for g in opt.param_groups] == [5e-4, 0.01]  # the parts' own groups
    x = torch.randint(0, 53, (2, 6))
    for m, o in ((model, opt), (twin, twin_opt)):
        m(x).sum().backward()
        o.step()
    sched.step()
    twin_opt.load_state_dict(opt.state_dict())
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert set(opt.state[p]) == set(twin_opt.state[q])
        for key, value in opt.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(twin_opt.state[q][key]))
    assert [g["lr"] for g in twin_opt.param_groups] == [g["lr"] for g in opt.param_groups]
