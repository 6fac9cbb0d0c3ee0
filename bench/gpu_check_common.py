"""What every part of ``bench/gpu_check.py`` shares: the process group, the report lines, the
base model and batches (``Ctx``), the one-step parity comparison (``step_parity``) and the
running of checks (``run_check``: pass, fail or skip with the reason, never an exception)."""

from __future__ import annotations

import copy
import datetime
import os
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import flatshard as fs
from flatshard.models import GPT, Block, GPTConfig

TOL = 1e-5
NOISE_FLOOR = 1e-5  # AdamW amplifies gradients at the rounding-noise level (docs/engine.md)
LINES: list[str] = []
WRAPPER_PREFIX = "_checkpoint_wrapped_module."  # torch's CheckpointWrapper inserts it in names


def say(line: str = "") -> None:
    """Print ``line`` and keep it for gpu_check.txt."""
    print(line, flush=True)
    LINES.append(line)


def setup() -> torch.device:
    """One process: NCCL on the GPU (TF32 off), else Gloo on the CPU."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(key, value)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12) if b.numel() else 0.0


def tokens(vocab: int, batch: int, seq: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)


def lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x[:, :-1], labels=x[:, 1:])


def train(model: nn.Module, opt: torch.optim.Optimizer, *batches: torch.Tensor) -> list[float]:
    losses = []
    for x in batches:
        loss = lm_loss(model, x)
        loss.backward()
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses


Loss = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def step_parity(
    model: nn.Module, ref: nn.Module, x: torch.Tensor, x2: torch.Tensor, loss_fn: Loss = lm_loss
) -> dict:
    """One AdamW step of both on ``x``, then a loss on ``x2``: the worst relative errors.
    At world 1 a fragment is the whole flattened parameter."""
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    loss, ref_loss = loss_fn(model, x), loss_fn(ref, x)
    loss.backward(), ref_loss.backward()
    params = {n.replace(WRAPPER_PREFIX, ""): p for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    assert params.keys() == ref_params.keys(), "parameter names differ"
    out = {"loss": rel_err(loss, ref_loss), "grad": 0.0, "params": 0.0, "noisy": 0}
    keep = {}
    for name, q in ref_params.items():
        g = q.grad.reshape(-1)
        out["grad"] = max(out["grad"], rel_err(params[name].grad, g))
        mag = g.abs()  # elements at the noise floor: left out of the parameter comparison
        keep[name] = ~((mag > 0) & (mag <= NOISE_FLOOR * mag.max()))
        out["noisy"] += int((~keep[name]).sum())
    opt.step(), ref_opt.step()
    for name, q in ref_params.items():
        mine = params[name][keep[name].to(params[name].device)]
        out["params"] = max(out["params"], rel_err(mine, q.reshape(-1)[keep[name]]))
    with torch.no_grad():
        out["next_loss"] = rel_err(loss_fn(model, x2), loss_fn(ref, x2))
    out["ok"] = all(out[k] <= TOL for k in ("loss", "grad", "params", "next_loss"))
    return out


class Ctx:
    """What every check needs: the device, a seeded base model on the CPU, two batches."""

    def __init__(self, device: torch.device, preset: str, batch: int, seq: int) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.cfg = GPTConfig.preset(preset, max_seq_len=seq)
        self.batch, self.seq = batch, seq
        torch.manual_seed(0)
        self.base = GPT(self.cfg)
        self.x, self.x2 = (tokens(self.cfg.vocab_size, batch, seq, s, device) for s in (1, 2))

    def ref(self) -> nn.Module:
        return copy.deepcopy(self.base).to(self.device)

    def sharded(self, before: Callable[[nn.Module], None] | None = None, **kwargs) -> nn.Module:
        """A sharded copy of the base model; ``before`` changes the copy first."""
        model = copy.deepcopy(self.base)
        if before is not None:
            before(model)
        return fs.shard(model, policy=fs.wrap.by_type(Block), **kwargs)


def run_check(fn, c) -> dict:
    """``fn(c)`` with its ``status`` (pass, fail, or skip when it returns ``skipped``: why) and
    its seconds; an exception is a failure with its traceback."""
    t0 = time.perf_counter()
    try:
        r = fn(c)
    except Exception:  # report it and go on with the other checks
        r = {"ok": False, "error": traceback.format_exc()}
    if "skipped" in r:
        r["ok"], r["status"] = None, "skip"
    else:
        r["status"] = "pass" if r["ok"] else "fail"
    r["seconds"] = time.perf_counter() - t0
    return r


def _brief(value) -> str:
    if isinstance(value, float):
        return f"{value:.2e}"
    if isinstance(value, list) and value and isinstance(value[0], float):
        return "[" + ",".join(f"{v:.4g}" for v in value) + "]"
    return str(value).replace(" ", "")


def run_checks(checks, c) -> dict:
    """Each of ``checks`` (``run_check``), one line each: name -> result."""
    results, quiet = {}, ("ok", "status", "error", "seconds", "skipped")
    for fn in checks:
        name = fn.__name__.removeprefix("check_")
        r = results[name] = run_check(fn, c)
        brief = " ".join(f"{k}={_brief(v)}" for k, v in r.items() if k not in quiet)
        say(f"{r['status'].upper():<4}  {name:<26}{r['seconds']:6.1f}s  {r.get('skipped', brief)}")
        if "error" in r:
            say(r["error"])
    return results


def status_of(results: dict) -> str:
    """A group of results: fail if one failed, else pass if one passed, else skip."""
    statuses = {r.get("status") for r in results.values() if isinstance(r, dict)}
    return "fail" if "fail" in statuses else "pass" if "pass" in statuses else "skip"
