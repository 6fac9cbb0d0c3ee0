"""The ``flatshard`` command: dispatches subcommands to the modules that implement them.

Each subcommand lives in its own module with a ``main(argv: list[str]) -> int``; they are
imported only when used, so ``flatshard --help`` stays fast and light.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "train": (
        "flatshard.tools.train.cli",
        "train a model (default: the tiny GPT on the embedded corpus)",
    ),
    "estimate": (
        "flatshard.tools.estimate",
        "per-rank memory and step time for a model and layout",
    ),
    "bench": ("flatshard.tools.bench", "flatshard vs torch FSDP2 vs DDP vs an unsharded step"),
    "export": ("flatshard.tools.export", "a sharded checkpoint -> one safetensors file"),
}


def _usage() -> str:
    lines = ["usage: flatshard <command> [options]", "", "commands:"]
    lines += [f"  {name:10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines.append("\n`flatshard <command> --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"flatshard: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
