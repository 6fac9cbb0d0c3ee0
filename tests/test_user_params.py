"""Shape-aware user code: fragment introspection, weight-decay groups, and the optimizer guard.

After ``fs.shard`` parameters are 1-D fragments. These tests pin what flatshard gives back
(``fs.full_shape``, ``fs.fragment_info``, ``fs.optim.param_groups``) and what it refuses early
(optimizers that need whole parameters, the ``p.dim() >= 2`` weight-decay trap).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

import flatshard as fs
from parity_models import Block, TinyGPT


def _sharded_gpt() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = TinyGPT(layers=2)
    model = TinyGPT(layers=2)
    model.load_state_dict(ref.state_dict())
    return ref, fs.shard(model, policy=fs.wrap.by_type(Block))


def case_fragment_info() -> dict:
    """Each rank's reported ranges; the gathered ranges must tile every full parameter."""
    ref, model = _sharded_gpt()
    info = fs.fragment_info(model)
    shapes = {n: tuple(i.full_shape) for n, i in info.items()}
    ranges = {n: i.flat_range for n, i in info.items()}
    values_ok = all(
        torch.equal(
            i.fragment.detach(), dict(ref.named_parameters())[n].reshape(-1)[slice(*i.flat_range)]
        )
        for n, i in info.items()
    )
    return {
        "shapes": shapes,
        "ref_shapes": {n: tuple(p.shape) for n, p in ref.named_parameters()},
        "full_shape_fn": {n: tuple(fs.full_shape(p)) for n, p in model.named_parameters()},
        "ranges": ranges,
        "values_ok": values_ok,
        "fragment_numel_ok": all(
            i.fragment.numel() == i.flat_range[1] - i.flat_range[0] for i in info.values()
        ),
        "plain": tuple(fs.full_shape(torch.zeros(2, 3))),
    }


def test_fragment_info_reports_names_full_shapes_and_ranges(dist_pools):
    results = dist_pools(3).run(case_fragment_info)
    r0 = results[0]
    assert r0["shapes"] == r0["ref_shapes"] == r0["full_shape_fn"]
    assert r0["plain"] == (2, 3)
    for name, shape in r0["ref_shapes"].items():
        pieces = sorted(r["ranges"][name] for r in results)
        covered = [p for p in pieces if p[1] > p[0]]
        assert covered[0][0] == 0 and covered[-1][1] == torch.Size(shape).numel(), (name, pieces)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered)), (name, pieces)
    assert all(r["values_ok"] and r["fragment_numel_ok"] for r in results)
    assert any(p[1] == p[0] for r in results for p in r["ranges"].values()), "no empty fragment"


def case_param_groups() -> dict:
    ref, model = _sharded_gpt()
    names = {id(p): n for n, p in model.named_parameters()}
    ref_names = {id(p): n for n, p in ref.named_parameters()}
    groups = fs.optim.param_groups(model, 0.1, lr=1e-3)
    ref_groups = fs.optim.param_groups(ref, 0.1, lr=1e-3)
    nano = fs.optim.param_groups(model, 0.1, decay_embeddings=True)
    return {
        "decay": sorted(names[id(p)] for p in groups[0]["params"]),
        "no_decay": sorted(names[id(p)] for p in groups[1]["params"]),
        "ref_decay": sorted(ref_names[id(p)] for p in ref_groups[0]["params"]),
        "options": (groups[0]["lr"], groups[0]["weight_decay"], groups[1]["weight_decay"]),
        "nano_decay": sorted(names[id(p)] for p in nano[0]["params"]),
        "dim_decay": [n for n, p in ref.named_parameters() if p.dim() >= 2],
    }


def test_param_groups_follow_the_full_shapes(dist_pools):
    r = dist_pools(2).run(case_param_groups)[0]
    assert r["decay"] == r["ref_decay"]  # the same on the sharded and the plain model
    assert r["options"] == (1e-3, 0.1, 0.0)
    assert "emb.weight" in r["no_decay"] and "blocks.0.qkv.weight" in r["decay"]
    assert all(("ln" in n or "bias" in n or "emb" in n or "pos" in n) for n in r["no_decay"])
    # decay_embeddings=True is nanoGPT's rule: every tensor with 2+ dimensions decays
    assert r["nano_decay"] == sorted(r["dim_decay"])


def _first_step_error(make, closure=None) -> str:
    _, model = _sharded_gpt()
    try:
        opt = make(model)
    except (TypeError, ValueError) as e:
        return f"construction: {type(e).__name__}: {e}"
    x = torch.randint(0, 50, (2, 9))

    def loss_fn():
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    loss_fn()
    try:
        opt.step(loss_fn) if closure else opt.step()
    except (TypeError, ValueError) as e:
        return f"step: {type(e).__name__}: {e}"
    return "accepted"


def _nanogpt_groups(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3)


def case_optimizer_guard() -> dict[str, str]:
    out = {
        "Adafactor": _first_step_error(lambda m: torch.optim.Adafactor(m.parameters())),
        "LBFGS": _first_step_error(lambda m: torch.optim.LBFGS(m.parameters()), closure=True),
        "SparseAdam": _first_step_error(lambda m: torch.optim.SparseAdam(list(m.parameters()))),
        "nanogpt_groups": _first_step_error(_nanogpt_groups),
        "AdamW": _first_step_error(lambda m: torch.optim.AdamW(m.parameters())),
        "helper_groups": _first_step_error(
            lambda m: torch.optim.AdamW(fs.optim.param_groups(m, 0.1), lr=1e-3)
        ),
    }
    if hasattr(torch.optim, "Muon"):
        out["Muon"] = _first_step_error(lambda m: torch.optim.Muon(m.parameters()))
    # An optimizer of an unsharded model in the same process is left alone.
    plain = nn.Linear(3, 3)
    plain(torch.randn(2, 3)).sum().backward()
    torch.optim.Adafactor(plain.parameters()).step()
    return out


def test_whole_parameter_optimizers_are_refused_before_their_first_step(dist_pools):
    r = dist_pools(2).run(case_optimizer_guard)[0]
    for name in ("Adafactor", "LBFGS", "SparseAdam"):
        assert r[name].startswith(f"step: TypeError: torch.optim.{name} cannot step"), r[name]
        assert "AdamW" in r[name]  # says what to use instead
    if "Muon" in r:  # torch itself refuses 1-D parameters, at construction
        assert r["Muon"].startswith("construction: ValueError") and "Muon" in r["Muon"]
    assert r["AdamW"] == "accepted" and r["helper_groups"] == "accepted"


def test_grouping_by_p_dim_fails_loudly_with_the_fix(dist_pools):
    r = dist_pools(2).run(case_optimizer_guard)[0]
    message = r["nanogpt_groups"]
    assert message.startswith("step: ValueError: optimizer param group 0"), message
    assert "fs.optim.param_groups" in message and "p.dim()" in message


def test_param_groups_on_a_plain_model_match_nanogpt_rule():
    model = TinyGPT(layers=1)
    decay, _ = fs.optim.param_groups(model, 0.1, decay_embeddings=True)
    assert [id(p) for p in decay["params"]] == [id(p) for p in model.parameters() if p.dim() >= 2]


def case_clip_rejects_plain_tensors() -> str:
    _sharded_gpt()
    try:
        fs.clip_grad_norm_([torch.zeros(3, requires_grad=True)], 1.0)
    except ValueError as e:
        return str(e)
    return ""


def test_clip_grad_norm_rejects_tensors_that_are_not_fragments(dist_pools):
    message = dist_pools(2).run(case_clip_rejects_plain_tensors)[0]
    assert "not a fragment of a sharded model" in message and "parameter 0" in message


def test_the_nanogpt_port_example_runs():
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    example = Path(__file__).resolve().parents[1] / "examples" / "port_nanogpt_optimizer.py"
    env = {**os.environ, "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    done = subprocess.run(
        [sys.executable, str(example)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "15 matrices decayed, as on the unsharded model" in done.stdout, done.stdout
