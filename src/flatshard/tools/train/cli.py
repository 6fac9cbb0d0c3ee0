"""``flatshard train``: parse the command line, check it, start (or become) the workers.

    flatshard train [--config FILE.toml] [--steps N] [--nproc N] [--out DIR] [--resume]
                    [--data PATH] [--seed N] [--max-restarts N] [--section.key VALUE ...]
                    [--print-config]

Settings are applied in this order: the defaults, the ``--config`` file, then the command-line
options from left to right. Config and data mistakes are reported here, before any worker
starts, as one line naming the setting and the fix (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from flatshard.tools.train.config import SECTION_ALIASES, SECTIONS, TrainConfig
from flatshard.tools.train.config_io import apply_overrides, field_docs, load_toml, to_toml

__all__ = ["main", "parse_config", "run"]

_SHORTCUTS = {
    "steps": "steps",
    "nproc": "parallel.nproc",
    "out": "out",
    "data": "data.path",
    "seed": "seed",
    "max_restarts": "parallel.max_restarts",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flatshard train",
        description="Train a GPT with flatshard (default: the tiny GPT on the corpus embedded in "
        "Python, 2 CPU ranks or one rank per GPU).",
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE.toml", help="settings file (e.g. OUT/config.toml)")
    p.add_argument("--steps", metavar="N", help="optimizer steps in total (= --steps N)")
    p.add_argument("--nproc", metavar="N", help="local workers (= --parallel.nproc N)")
    p.add_argument("--out", metavar="DIR", help="output directory (= --out DIR)")
    p.add_argument("--data", metavar="PATH", help=".txt/.jsonl file or directory (= --data.path)")
    p.add_argument("--seed", metavar="N", help="model init and data order seed")
    p.add_argument(
        "--max-restarts",
        metavar="N",
        help="restart the workers up to N times after a failure, resuming from the newest "
        "checkpoint (= --parallel.max_restarts N)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in OUT/checkpoints (if any)",
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the resulting config as TOML and exit"
    )
    return p


def _settings_help() -> str:
    lines = ["settings (--section.key VALUE; the same names in a --config TOML file):"]
    for name, cls in SECTIONS.items():
        docs = field_docs(cls)
        for key, value in vars(cls()).items():
            text = " ".join(docs.get(key, "").split())
            lines.append(f"  --{name}.{key} (default {value!r}): {text}")
    for alias, name in SECTION_ALIASES.items():
        lines.append(f"  --{alias}.KEY is --{name}.KEY (e.g. --{alias}.tp 2)")
    return "\n".join(lines)


def _overrides(rest: list[str]) -> list[tuple[str, str]]:
    """``["--optim.lr", "1e-3", "--log.every=5"]`` -> ``[("optim.lr", "1e-3"), ...]``."""
    pairs, i = [], 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ValueError(
                f"unrecognised argument {arg!r}; settings are --section.key VALUE "
                f"with sections {', '.join(SECTIONS)} (see --help)"
            )
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(rest):
            key, value = arg[2:], rest[i + 1]
            i += 2
        else:
            raise ValueError(f"{arg} needs a value, e.g. {arg} VALUE")
        pairs.append((key, value))
    return pairs


def parse_config(argv: list[str]) -> tuple[TrainConfig, argparse.Namespace]:
    """The config the command line describes; ``ValueError``/``TypeError`` on mistakes."""
    args, rest = _parser().parse_known_args(argv)
    cfg = load_toml(args.config) if args.config else TrainConfig()
    shortcuts = [
        (dotted, getattr(args, name))
        for name, dotted in _SHORTCUTS.items()
        if getattr(args, name) is not None
    ]
    return apply_overrides(cfg, shortcuts + _overrides(rest)), args


def _precheck(cfg: TrainConfig, resume: bool) -> None:
    """Fail before spawning anything: user data that cannot be read, a missing optional
    package, a fresh run into old checkpoints. The workers would find the same, on every rank,
    after seconds of start-up."""
    import importlib.util
    from pathlib import Path

    from flatshard.tools.train.checkpointing import refuse_to_mix
    from flatshard.tools.train.data import read_documents
    from flatshard.tools.train.resolve import gpt_config, mixed_precision

    _precheck_tp(cfg)
    if cfg.model.hf:  # a missing directory or config.json: one clear line, before any spawn
        from flatshard.tools.train.hf_model import check_hf_dir

        check_hf_dir(cfg.model.hf)
    else:
        gpt_config(cfg)  # a shape the GPT cannot build (n_heads not dividing d_model, ...)
    if resume and not cfg.checkpoint.enabled:
        raise ValueError("--resume needs checkpoints, but checkpoint.enabled=false; enable them")
    if cfg.checkpoint.enabled and not resume:
        refuse_to_mix(Path(cfg.out) / "checkpoints")
    if cfg.data.path:
        read_documents(cfg.data)
    if cfg.log.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ImportError(
            "log.tensorboard=true needs the tensorboard package: "
            "pip install tensorboard (or --log.tensorboard false)"
        )
    if cfg.precision.param_dtype not in ("auto", "fp32"):
        mixed_precision(cfg)  # raises if this flatshard has no MixedPrecision yet


def _precheck_tp(cfg: TrainConfig) -> None:
    """A tp, pp or ep layout the local workers cannot form; loss_parallel without tp (no
    effect)."""
    from flatshard.tools.train.job_layout import check_layout
    from flatshard.tools.train.resolve import default_nproc

    check_layout(cfg, cfg.parallel.nproc or default_nproc())
    if cfg.parallel.loss_parallel and cfg.parallel.tp == 1:
        print(
            "flatshard train: note: parallel.loss_parallel has no effect with parallel.tp=1",
            file=sys.stderr,
        )


def _launch(cfg: TrainConfig, resume: bool) -> int:
    """Start the local workers with torch's elastic launcher and wait for them."""
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from flatshard.tools.train.launcher import failure_report, launch_local
    from flatshard.tools.train.resolve import default_nproc
    from flatshard.tools.train.session import worker_main

    nproc = cfg.parallel.nproc or default_nproc()
    cpu = not torch.cuda.is_available() or cfg.parallel.backend == "gloo"
    try:
        launch_local(
            nproc, worker_main, cfg, resume, cpu=cpu, max_restarts=cfg.parallel.max_restarts
        )
    except (KeyboardInterrupt, SignalException) as e:  # the workers are stopped by now
        sig = getattr(e, "sigval", signal.SIGINT)
        print(
            f"flatshard train: stopped by {signal.Signals(sig).name}; continue with the same "
            "command and --resume (from the newest checkpoint)",
            file=sys.stderr,
        )
        return 128 + int(sig)
    except ChildFailedError as e:
        text, status = failure_report(e.failures)
        print(text, file=sys.stderr)
        return status
    return 0


def run(cfg: TrainConfig, *, resume: bool = False) -> int:
    """Train with ``cfg``: launch local workers, or be a worker under torchrun/srun.

    The programmatic form of ``flatshard train`` (call it under ``if __name__ == "__main__":``:
    workers are spawned processes that import the caller's main module). Returns the exit status.
    """
    from flatshard.tools.train.launcher import launched_externally, slurm_environment

    mode = launched_externally(os.environ)
    if mode is None:
        try:
            _precheck(cfg, resume)
        except (ValueError, TypeError, FileNotFoundError, ImportError) as e:
            print(f"flatshard train: error: {e}", file=sys.stderr)
            return 2
        return _launch(cfg, resume)
    if mode == "srun":
        os.environ.update(slurm_environment(os.environ))
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if cfg.parallel.nproc and local and cfg.parallel.nproc != int(local) and _rank0():
        print(
            f"flatshard train: note: parallel.nproc={cfg.parallel.nproc} has no effect under "
            f"{mode}, which started {local} workers here",
            file=sys.stderr,
        )
    if cfg.parallel.max_restarts and _rank0():
        print(
            f"flatshard train: note: parallel.max_restarts has no effect under {mode}; use "
            "torchrun --max-restarts (a restarted worker resumes from the newest checkpoint)",
            file=sys.stderr,
        )
    return _run_here(cfg, resume)


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def main(argv: list[str]) -> int:
    """``flatshard train ...``; returns the exit status."""
    try:
        cfg, args = parse_config(argv)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"flatshard train: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    return run(cfg, resume=args.resume)


def _run_here(cfg: TrainConfig, resume: bool) -> int:
    """Under torchrun/srun this process is one of the workers."""
    from flatshard.tools.train.session import worker_main

    try:
        worker_main(cfg, resume)
    except SystemExit as e:
        return int(e.code or 0)
    return 0
